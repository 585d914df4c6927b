"""transformer_options that hold a sampler's state in ComfyUI's process are refused, never dropped silently.

ComfyUI 0.33's ar_video sampler (Wan 2.1 Causal AR, `CausalWanModel`) puts the model's KV caches and its frame
position in transformer_options["ar_state"] for every model call; the pool's proxy sends only the options that can
travel (`portable_options`), so without this refusal each worker would run the plain bidirectional forward on the
current frames alone - a wrong video with no error. Found by reading ComfyUI 0.33's classes the pack has no adapter
for (docs/how-it-works.md)."""
import pytest

from comfyui_hybrid_parallel.nodes.native import NotCarried, STATEFUL_OPTIONS, portable_options


def test_ar_state_is_refused_with_the_fix():
    with pytest.raises(NotCarried, match="without Parallel Model") as e:
        portable_options({"ar_state": {"start_frame": 3, "kv_caches": [], "crossattn_caches": []},
                          "rope_options": {"shift_t": 1.0}})
    assert "causal autoregressive" in str(e.value)


def test_the_options_that_travel_are_unchanged():
    opts = {"rope_options": {"shift_t": 1.0}, "ar_state": None, "cond_or_uncond": [1, 0], "sigmas": object()}
    out = portable_options(opts, carried=("minimax_h3_sigma_shift_video",))
    assert set(out) == {"rope_options"} and "ar_state" in STATEFUL_OPTIONS
