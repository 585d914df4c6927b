"""The joint text stream split over the sequence ranks, on ComfyUI's own model classes (in-process gloo worlds).

Why: under ulysses/ring each rank used to project the *whole* text through every block - at a few image tokens
per text token that is most of the serial work on every rank (the demo model: 8 text tokens, 16 image). The
SD3, Flux and Qwen-Image plans now split the text like the image (`SplitInput(..., text=True)`) and attention
treats [text shard, image shard] as one sharded sequence. What can go wrong, and is checked here against the
serial forward of the same module: text lengths that do not divide the degree, a text shorter than the degree
(it must stay whole: a rank without text could not tell a joint attention from SD3.5's image-only attn2 in
the same block), SD3.5's dual attention, Flux's single blocks (which drop the text by its *local* length) and
its RoPE table over [text ids, image ids]. The rows each rank's first text projection sees show the split
happened (and its share), not only that the output is right.
"""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig, split_sizes
from dist_harness import context_for

pytestmark = pytest.mark.dist

_models = {}


def _comfy_model(family: str):
    """ComfyUI's own MMDiT (its SD3 wrapper class; SD3.5-style: qk norm, image-only attn2 in block 0) or Flux class, small, with the
    tiny checkpoints' seeded weights (every rank builds the same)."""
    if family in _models:
        return _models[family]
    from comfy_env import setup_comfy
    setup_comfy()
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    ops = tiny._ops()
    if family == "sd35":
        from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
        model = OpenAISignatureMMDITWrapper(in_channels=16, patch_size=2, out_channels=16, depth=2, input_size=None, adm_in_channels=24,
                      context_embedder_config={"target": "torch.nn.Linear",
                                               "params": {"in_features": 32, "out_features": 128}},
                      num_patches=16 ** 2, pos_embed_max_size=16, qk_norm="rms",
                      x_block_self_attn_layers=[0], operations=ops, device="meta")
    else:
        from comfy.ldm.flux.model import Flux, FluxParams
        model = Flux(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=24, context_in_dim=32,
                     hidden_size=128, mlp_ratio=2.0, num_heads=4, depth=1, depth_single_blocks=2,
                     axes_dim=[8, 12, 12], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True,
                     operations=ops, device="meta", **tiny.detected(FluxParams, txt_ids_dims=[]))
    model.load_state_dict(tiny._random_state_dict(model, 5, torch.float32), assign=True)
    _models[family] = model.eval()
    return _models[family]


def _inputs(family, seed, text, h, w, batch=2):
    g = torch.Generator().manual_seed(seed)
    kw = {"x": torch.randn(batch, 16, h, w, generator=g), "context": torch.randn(batch, text, 32, generator=g),
          "y": torch.randn(batch, 24, generator=g), "transformer_options": {}}
    if family == "flux":
        return dict(kw, timestep=torch.rand(batch, generator=g), guidance=torch.full((batch,), 3.5))
    return dict(kw, timesteps=torch.rand(batch, generator=g) * 1000)


def _body(family, degrees, seed, text, h, w):
    from comfyui_hybrid_parallel.parallel.models import adapter_for
    from comfyui_hybrid_parallel.parallel.plan import apply_plan, remove_plan
    ctx = context_for(ParallelConfig(**degrees))
    ctx.stats.reset()
    model = _comfy_model(family)
    kw = _inputs(family, seed, text, h, w)
    with torch.no_grad():
        serial = model(**kw)
        first = model.joint_blocks[0].context_block.attn.qkv if family == "sd35" else model.double_blocks[0].txt_attn.qkv
        rows = []
        handle = first.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[1]))
        apply_plan(model, adapter_for(model).comfy_plan, ctx)
        try:
            par = model(**kw)
        finally:
            remove_plan(model)
            handle.remove()
    err = ((par - serial).norm() / serial.norm()).item()
    return err, rows, ctx.sp.rank, ctx.stats.snapshot()


@pytest.mark.parametrize("family", ["sd35", "flux"])
@pytest.mark.parametrize("degrees", [dict(ulysses_degree=2), dict(ring_degree=2), dict(ulysses_degree=2, ring_degree=2)],
                         ids=lambda d: ParallelConfig(**d).describe())
@pytest.mark.parametrize("text", [7, 4, 1], ids=lambda t: f"text{t}")
def test_text_split_equals_serial(dist_pools, family, degrees, text):
    n = degrees.get("ulysses_degree", 1) * degrees.get("ring_degree", 1)
    for h, w in ((9, 13), (8, 8)):
        res = dist_pools(n).run(_body, family, degrees, 1000 * text + h, text, h, w)
        for err, rows, rank, stats in res:
            assert err <= 1e-5, (h, w, rank, err)
            # text >= degree: each rank projects only its shard; shorter: every rank the whole text
            assert rows == [split_sizes(text, n)[rank] if text >= n else text], (rank, rows)
            if degrees.get("ulysses_degree", 1) > 1 and text >= n:
                # no replicated text output to all-gather: the only all-gather left is the final image output
                assert stats["all_gather"]["calls"] == 1, stats
