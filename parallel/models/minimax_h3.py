"""MiniMax H3 (ComfyUI's `MiniMaxH3Model`, comfy/ldm/minimax/model.py; ComfyUI 0.30+): what is split.

MiniMax H3 denoises a video latent and a stereo audio latent together in ONE packed stream: `_forward` lays out
[text, condition / reference rows, audio, video] rows (`PackedLayout`), embeds each kind, and runs every block on
the whole stream - full self-attention (no mask) over all rows with one 3-axis RoPE table, and a modulation that
differs per *segment* of rows (text, audio and video rows take different timesteps' scale / shift / gate:
`mod_segments`, (start, stop, row) over the stream, a row per token where a denoise mask makes it per token). The
two streams are not separate attentions: audio and video attend to each other inside the one self-attention. So the
packed stream itself is the split sequence, whatever mix of text, audio and video rows a rank's shard holds: it is
cut where it enters the first block, each block takes its rows of the RoPE table (`rope_freqs`, (1, S, 1, d/2, 2, 2))
and its part of the segment table rebased to its shard (`SequenceSegments`), and the last block's output is gathered
before the final layer, which reads the audio and video segments at their global positions. Attention goes through
ComfyUI's seam (q / k / v arrive as (1, heads, S, d) containers, taken by ComfyUI's wrapper before the override).

The latent is ComfyUI's NestedTensor: the model gets `x = [video, audio]` and returns both (the pool carries each
stream as a tensor). ComfyUI runs it with batch 1 (the model refuses more), so cfg and data parallel have no batch
to split: each rank computes the whole call, correct but not faster - sequence parallel is what splits it.
`minimax_payload.layout` is a per-run cache object the model rebuilds from the same inputs when absent: not sent.
The video / audio sigma shifts that ModelSamplingMiniMaxH3 sets in transformer_options travel with each call (the
model derives the audio stream's timestep from them).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SequenceSegments, SplitInput

COMFY_PLAN = FamilyPlan(
    family="minimax_h3",
    model_class="MiniMaxH3Model",
    batch_inputs=("x", "timestep", "context"),
    sequence={  # DiTBlock.forward(x, t_emb, mod_segments, rope_freqs): the stream is rows (S, hidden), no batch dim
        "blocks.0": [SplitInput("x", dim=0, position=0)],
        "blocks.*": [SequenceSegments("mod_segments", position=2),
                     SplitInput("rope_freqs", dim=1, position=3, only_full=True)],
        "blocks.-1": [GatherOutput(dim=0)],
    },
    other_inputs=("minimax_payload", "denoise_mask", "audio_denoise_mask"),
    attention={"blocks.*.attn": Attention(seam="comfy")},
    heads_attr="heads",
    tp_refusal="tensor parallel is not declared for MiniMax H3; use ulysses/ring/cfg degrees",
    pipeline_refusal="PipeFusion on MiniMax H3 is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="minimax_h3", title="MiniMax H3", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.minimax.model", rebuilt_inputs=("minimax_payload.layout",),
                        carried_options=("minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio"))
