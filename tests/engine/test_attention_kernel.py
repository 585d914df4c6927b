"""Ulysses ranks run the attention kernel the user picked in ComfyUI, on ComfyUI's own model classes.

Why: degree 1 runs ComfyUI's kernel (sage, flash, sub-quadratic, split, pytorch - whatever ComfyUI picked), and
a Ulysses rank's attention is that computation on a share of the heads over the whole sequence. Running torch's
SDPA there instead would make the parallel output differ from one device's by the kernels' rounding (sage is
approximate) and lose the kernel's speed. Ring attention needs each partial result's log-sum-exp, which
ComfyUI's kernels do not return, so it keeps parallel/attention.py's kernels - checked too.

Checked against the serial forward with the *same* kernel (ComfyUI's override seam calling it), fresh random
inputs, sizes that do and do not divide: the kernel is called once per attention with this rank's heads and the
whole sequence, and a kernel that computes something else changes the output (the result really comes from it).
"""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig, split_sizes
from dist_harness import context_for
from test_text_split import _comfy_model, _inputs

pytestmark = pytest.mark.dist

ATTENTIONS = {"sd35": 3, "flux": 3}  # attention calls per forward: SD3.5 2 joint + block 0's image-only attn2;
                                     # Flux 1 double + 2 single blocks
HEADS = {"sd35": 2, "flux": 4}       # the test_text_split models' heads (SD3: one per block of depth)


def _kernel(name):
    import comfy.ldm.modules.attention as attention
    fn = attention.get_attention_function(name)
    return getattr(fn, "__wrapped__", fn)


def _body(family, degrees, seed, text, h, w, name, scale_out):
    from comfyui_hybrid_parallel.parallel.models import adapter_for
    from comfyui_hybrid_parallel.parallel.plan import apply_plan, remove_plan
    ctx = context_for(ParallelConfig(**degrees))
    model = _comfy_model(family)
    raw = _kernel(name)
    kw = _inputs(family, seed, text, h, w)
    calls = []

    def kernel(q, k, v, heads, **rest):
        calls.append((tuple(q.shape), heads, rest.get("skip_reshape"), rest.get("skip_output_reshape")))
        return raw(q, k, v, heads, **rest) * scale_out

    def serial_override(func, *args, **kwargs):  # one device with ComfyUI's `name` kernel
        kwargs.pop("transformer_options", None)
        return raw(*args, **kwargs)
    with torch.no_grad():
        serial = model(**dict(kw, transformer_options={"optimized_attention_override": serial_override}))
        apply_plan(model, adapter_for(model).comfy_plan, ctx, kernel=kernel)
        try:
            par = model(**kw)
        finally:
            remove_plan(model)
    err = ((par - serial).norm() / serial.norm()).item()
    return err, calls, ctx.ulysses.rank


@pytest.mark.parametrize("family", ["sd35", "flux"])
@pytest.mark.parametrize("name", ["split", "sub_quad"])
def test_ulysses_runs_comfyuis_kernel(dist_pools, family, name):
    text = 7
    for h, w in ((9, 13), (8, 8)):
        tokens = text + (h // 2 + h % 2) * (w // 2 + w % 2)
        for err, calls, rank in dist_pools(2).run(_body, family, dict(ulysses_degree=2), 7 * h + w, text, h, w,
                                                  name, 1.0):
            assert err <= 1e-5, (h, w, rank, err)
            assert len(calls) == ATTENTIONS[family], calls
            share = split_sizes(HEADS[family], 2)[rank]
            for shape, hs, skip_in, skip_out in calls:
                # this rank's heads, the whole sequence (the joint one, or the image alone in SD3.5's attn2)
                assert shape[1] == hs == share and shape[2] in (tokens, tokens - text), (shape, hs, tokens)
                assert skip_in and skip_out
        # the output really is the kernel's: a kernel that scales its result changes it
        for err, _, _ in dist_pools(2).run(_body, family, dict(ulysses_degree=2), 5, text, h, w, name, 1.5):
            assert err > 1e-2, err


def test_ring_keeps_lse_kernels(dist_pools):
    """Ring (and Ulysses x Ring) merge partial results by their log-sum-exp: ComfyUI's kernel is not called,
    and the output still equals the serial one with that kernel."""
    for degrees in (dict(ring_degree=2), dict(ulysses_degree=2, ring_degree=2)):
        n = degrees.get("ulysses_degree", 1) * degrees["ring_degree"]
        for err, calls, rank in dist_pools(n).run(_body, "flux", degrees, 3, 5, 9, 13, "split", 1.5):
            assert err <= 1e-5, (degrees, rank, err)
            assert calls == [], calls
