"""transformer_options that hold a sampler's state in ComfyUI's process are refused, never dropped silently.

ComfyUI 0.33's ar_video sampler (Wan 2.1 Causal AR, `CausalWanModel`) puts the model's KV caches and its frame
position in transformer_options["ar_state"] for every model call; the pool's proxy sends only the options that can
travel (workers/bridge/carry.call_options), so without this refusal each worker would run the plain bidirectional
forward on the current frames alone - a wrong video with no error. Found by reading ComfyUI 0.33's classes the pack has
no adapter for (docs/how-it-works.md). Any other entry the pack does not know is refused the same way (fail closed)."""
import pytest

from comfyui_hybrid_parallel.workers.bridge.capture import NotCarried
from comfyui_hybrid_parallel.workers.bridge.carry import call_options


def test_ar_state_is_refused_with_the_fix():
    with pytest.raises(NotCarried, match="without Parallel Model") as e:
        call_options({"ar_state": {"start_frame": 3, "kv_caches": [], "crossattn_caches": []},
                      "rope_options": {"shift_t": 1.0}})
    assert "causal autoregressive" in str(e.value)


def test_the_options_that_travel_are_unchanged():
    opts = {"rope_options": {"shift_t": 1.0}, "ar_state": None, "cond_or_uncond": [1, 0], "sigmas": object(),
            "minimax_h3_sigma_shift_video": 2.0}
    out = call_options(opts, carried=("minimax_h3_sigma_shift_video",))
    assert set(out) == {"rope_options", "minimax_h3_sigma_shift_video"}


def test_an_unknown_entry_is_refused_not_dropped():
    with pytest.raises(NotCarried, match="some_pack_state"):
        call_options({"some_pack_state": {"a": 1}})
