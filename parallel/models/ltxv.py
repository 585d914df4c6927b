"""LTX-Video (ComfyUI's `LTXVModel`, comfy/ldm/lightricks/model.py): what is split for sequence parallelism.

LTXV patchifies with patch size 1: every latent voxel (frame, row, col) is one token, and text enters by
cross-attention (`attn2`, nothing to split). `_forward` computes the RoPE table (`pe`, tokens on dim 2) for the whole
video from the pixel coordinates (keyframe indices already applied) and hands it and the modulation to every block.
So the tokens are split where they enter the first block, each block takes its rows of `pe` and, when the timestep is
per token (a noise mask: image-to-video, inpainting; ComfyUI's process_timestep), its rows of the modulation. The
sequence is gathered at `norm_out`, a LayerNorm without weights (per token, so gathering its output equals
normalising the gathered tokens), before the final modulation, whose per-token rows then meet the whole sequence.
Self-attention goes through ComfyUI's seam (`optimized_attention` with transformer_options).

ComfyUI 0.33 hands the blocks the RoPE table as a tuple `(rotation matrix (B, tokens, heads, d, 2, 2), split_mode)`
where older ComfyUIs hand a tensor (B, 1, tokens, d/2, 2, 2): one declaration each, the one that does not match the
argument's form does nothing. It also adds keyframe conditioning (LTXVAddGuide): `keyframe_idxs` with the noise mask
(`denoise_mask`) drop and reposition guide tokens, `generated_keyframes` marks keyframe tokens - all before the first
block, on the whole sequence, so the split sees the final tokens. A guide of strength other than 1 (or with a pixel
mask) makes `guide_attention_entries` build a self-attention mask over the whole sequence, which sequence-parallel
attention does not apply: refused under ulysses/ring (strength 1 builds none and runs).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput


def _guide_mask_refusal(entries):
    """ComfyUI 0.33's LTXVModel._build_guide_self_attention_mask builds a mask when a guide's strength is not 1 or it
    carries a pixel mask: refused then; otherwise the guides are plain tokens the split carries."""
    if not any(e.get("strength", 1.0) != 1.0 or e.get("pixel_mask") is not None for e in entries
               if isinstance(e, dict)):
        return None
    return ("an LTXV guide (LTXVAddGuide) of strength other than 1, or with an attention mask, weights the attention "
            "between the video and the guide tokens with a mask over the whole sequence, which sequence-parallel "
            "attention does not apply; use cfg/dp degrees (ulysses/ring degree 1), or guide strength 1")

COMFY_PLAN = FamilyPlan(
    family="ltxv",
    model_class="LTXVModel",
    batch_inputs=("x", "timestep", "context", "attention_mask", "keyframe_idxs", "control", "denoise_mask"),
    sequence={
        "transformer_blocks.0": [SplitInput("x", dim=1, position=0)],
        "transformer_blocks.*": [SplitInput("pe", dim=2), SplitInput("pe", dim=1, item=0),
                                 SplitInput("timestep", dim=1, only_full=True)],
        "norm_out": [GatherOutput(dim=1)],
    },
    other_inputs=("generated_keyframes",),
    sequence_refusals={"guide_attention_entries": _guide_mask_refusal},
    attention={"transformer_blocks.*.attn1": Attention(seam="comfy")},
    tp_refusal="tensor parallel is not declared for LTX-Video; use ulysses/ring/cfg degrees",
    heads_attr="heads",
    pipeline_refusal="PipeFusion on LTX-Video is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="ltxv", title="LTX-Video", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.lightricks.model")
