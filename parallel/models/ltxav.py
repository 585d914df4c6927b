"""LTX-2 / LTX-2.3 (ComfyUI's `LTXAVModel`, comfy/ldm/lightricks/av_model.py): what is split for sequence parallelism.

LTX-2 denoises two streams in one call: video tokens (LTX-Video's patch-size-1 latent voxels) and audio tokens (one
per audio latent frame), each with its own width, heads, RoPE and modulation. Every block
(`BasicAVTransformerBlock`) runs, per stream, self-attention and cross-attention to its half of the text, then two
cross-modal attentions - audio-to-video (queries video, keys / values audio) and video-to-audio (queries audio,
keys / values video) - and a feed-forward. Everything but the attentions is per token.

What is split, and why that is exact:

* The video tokens - nearly all of the work (a 5 s clip is thousands of video tokens, ~125 audio tokens) - are split
  over the sp ranks where they enter the first block (`x` = (video, audio), its video item). Each block takes its
  rows of the video RoPE tables (`v_pe`; `v_cross_pe`, the temporal one of the cross-modal attentions) and of the
  video modulations. Those are ComfyUI's `CompressedTimestep`: one row per latent frame (expanded to the frame's
  tokens inside the block) or per token under a spatial noise mask, or one row for all tokens; `_timestep_rows` hands
  each rank the rows of its own tokens (`SequenceRows`), as a plain per-token tensor the block reads the same way.
  The video is gathered at `norm_out` (a LayerNorm without weights, per token) as in LTX-Video, before the final
  modulation, keyframe scatter and unpatchify, which then see the whole video.
* The audio stream stays whole on every rank: it is a few percent of the tokens, and left whole it needs no
  communication for its own self-attention, its text attention, its feed-forward, its per-token timestep (an audio
  noise mask), ID-LoRA's reference audio tokens (`ref_audio`, prepended to it) or its output layer.
* Video self-attention (`attn1`) is USP attention over the video shards, through ComfyUI's seam.
* Audio-to-video attention has this rank's video queries and the whole audio as keys: plain cross-attention from
  local queries, like the text attention - nothing to do.
* Video-to-audio attention has the whole audio as queries and this rank's video shard as keys / values: its k and v
  (projected, normed and rotated per token on each rank) are gathered along the video sequence before ComfyUI's
  kernel runs (`Attention(gather_kv=True)`), so every rank computes the audio's attention over the whole video.

Without an audio latent (ComfyUI runs video-only LTX-2: the latent is one stream) the audio stream is empty, the
block skips every audio and cross-modal path, and only the video split acts.

Refused under ulysses / ring: LTXVAddGuide's guide attention mask (`guide_attention_entries` of strength other than
1 or with a pixel mask), a self-attention mask over the whole video sequence, as for LTX-Video.
"""
import torch

from .adapter import FamilyAdapter
from .ltxv import _guide_mask_refusal
from ..plan import Attention, FamilyPlan, GatherOutput, SequenceRows, SplitInput


def _timestep_rows(ts, start: int, stop: int, n: int):
    """This rank's video tokens [start, stop) of a modulation over the whole video (n tokens): ComfyUI 0.33's
    `CompressedTimestep` (duck-typed: `data` (B, rows, F) with `patches_per_frame` tokens per row) or a plain
    (B, rows, F) tensor. One row for all tokens is returned unchanged (broadcast); per-frame or per-token rows become
    the plain per-token rows of this rank's tokens, which the block's `get_ada_values` reads as it would the
    expanded ones (the same table + row sums, element for element)."""
    if isinstance(ts, torch.Tensor):
        data, per = ts, 1
    elif hasattr(ts, "expand_for_computation") and isinstance(getattr(ts, "data", None), torch.Tensor):
        data, per = ts.data, int(ts.patches_per_frame)
    else:
        return ts
    if data.ndim != 3:
        return ts
    rows = data.shape[1]
    if rows * per != n:
        if rows == 1:
            return ts
        raise RuntimeError(f"an LTX-2 video modulation holds {rows} rows of {per} tokens for a video of {n} tokens: "
                           f"the family plan is inconsistent")
    if per == 1:
        return data[:, start:stop]
    return data.index_select(1, torch.arange(start, stop, device=data.device) // per)


_VIDEO_ROWS = ("v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep")

COMFY_PLAN = FamilyPlan(
    family="ltxav",
    model_class="LTXAVModel",
    batch_inputs=("x", "timestep", "context", "attention_mask", "keyframe_idxs", "control", "denoise_mask",
                  "audio_denoise_mask"),
    sequence={  # BasicAVTransformerBlock.forward(x=(video, audio), v_context=..., ...): all but x by keyword
        "transformer_blocks.0": [SplitInput("x", dim=1, position=0, item=0)],
        "transformer_blocks.*": [SplitInput("v_pe", dim=1, item=0), SplitInput("v_cross_pe", dim=1, item=0),
                                 *(SequenceRows(name, _timestep_rows) for name in _VIDEO_ROWS)],
        "norm_out": [GatherOutput(dim=1)],
    },
    other_inputs=("generated_keyframes", "frame_rate", "ref_audio"),
    sequence_refusals={"guide_attention_entries": _guide_mask_refusal},
    attention={"transformer_blocks.*.attn1": Attention(seam="comfy"),
               "transformer_blocks.*.video_to_audio_attn": Attention(seam="comfy", gather_kv=True)},
    tp_refusal="tensor parallel is not declared for LTX-2; use ulysses/ring/cfg degrees",
    heads_attr="heads",
    pipeline_refusal="PipeFusion on LTX-2 is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="ltxav", title="LTX-2", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.lightricks.av_model")
