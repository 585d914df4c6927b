"""The workers' step cache (parallel/stepcache.py) makes exactly ComfyUI's EasyCache decisions.

ComfyUI's own wrapper (comfy_extras/nodes_easycache.py easycache_forward_wrapper, with its EasyCacheHolder) and
StepCache are driven side by side through the same sequence of model calls - a fake model whose output drifts
between calls by random amounts, cond/uncond batches in either order, a sigma window - and must skip the same
steps and return the same outputs, bit for bit. Also: a batch slice other than the first, the window edges, and
a full run that really skips.
"""
import pytest
import torch

from comfy_env import setup_comfy

pytestmark = pytest.mark.comfy


def _run_both(seed, threshold, start_sigma, end_sigma, chunks, first, steps=14):
    setup_comfy()
    from comfy_extras.nodes_easycache import EasyCacheHolder, easycache_forward_wrapper
    from comfyui_hybrid_parallel.parallel.stepcache import StepCache, StepCacheSpec, cached_step

    g = torch.Generator().manual_seed(seed)
    holder = EasyCacheHolder(threshold, 0.0, 1.0, subsample_factor=4, offload_cache_diff=False, output_channels=4)
    holder.start_t, holder.end_t = start_sigma, end_sigma
    uuids = ["cond", "uncond"][:chunks]
    if first == 1:
        uuids = uuids[::-1]  # ComfyUI's first chunk is the uncond one
    # our loop orders the batch [cond, uncond]; `first` names ComfyUI's first chunk in that order
    ours = StepCache(StepCacheSpec(threshold, start_sigma, end_sigma, subsample=4, channels=4,
                                   first=first, chunks=chunks))
    sigmas = torch.linspace(1.0, 0.05, steps)
    x = torch.randn(chunks, 6, 9, 11, generator=g)  # 6 channels: 2 concat channels beyond the output's 4
    w = torch.randn(4, 6, generator=g)
    skipped_c, skipped_o = [], []
    for i, sigma in enumerate(sigmas):
        x = x + 0.05 * torch.randn(x.shape, generator=g) * (1 + (i % 3))
        drift = torch.randn(chunks, 4, 9, 11, generator=g) * 0.01

        def model(*args, **kwargs):
            return torch.einsum("oc,bchw->bohw", w, args[0]) * float(sigma) + drift
        calls = []

        class Executor:
            def __call__(self, *args, **kwargs):
                calls.append(1)
                return model(*args, **kwargs)
        opts = {"easycache": holder, "sigmas": sigma.reshape(1), "uuids": uuids}
        holder.skip_current_step = False
        ref = easycache_forward_wrapper(Executor(), x.clone(), sigma.reshape(1), opts)
        skipped_c.append(not calls)
        # ours sees the batch in [cond, uncond] order, with ComfyUI's first chunk named by `first`
        xo = x if first == 0 or chunks == 1 else x.flip(0)
        ran = []

        def compute():  # the same model on each chunk: ComfyUI's order in, ours out
            ran.append(1)
            out = model(x)
            return out if first == 0 or chunks == 1 else out.flip(0)
        out = cached_step(ours, sigma, xo, compute)
        skipped_o.append(not ran)
        out = out if first == 0 or chunks == 1 else out.flip(0)
        assert torch.equal(out, ref), (i, (out - ref).abs().max())
    return skipped_c, skipped_o, holder.total_steps_skipped, ours.skipped


@pytest.mark.parametrize("chunks, first", [(1, 0), (2, 0), (2, 1)])
def test_step_cache_makes_easycache_decisions(chunks, first):
    for seed, threshold in ((1, 0.3), (2, 1.5), (3, 0.05)):
        sc, so, nc, no = _run_both(seed, threshold, start_sigma=0.9, end_sigma=0.1, chunks=chunks, first=first)
        print(f"chunks {chunks} first {first} threshold {threshold}: ComfyUI skipped {nc} {sc}, ours {no}")
        assert sc == so and nc == no
        if threshold >= 1.5:
            assert nc > 0  # the comparison covers skipping, not only computing
