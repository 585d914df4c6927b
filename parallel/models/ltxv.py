"""LTX-Video (ComfyUI's `LTXVModel`, comfy/ldm/lightricks/model.py): what is split for sequence parallelism.

LTXV patchifies with patch size 1: every latent voxel (frame, row, col) is one token, and text enters by
cross-attention (`attn2`, nothing to split). `_forward` computes the RoPE table (`pe`, tokens on dim 2) for the whole
video from the pixel coordinates (keyframe indices already applied) and hands it and the modulation to every block.
So the tokens are split where they enter the first block, each block takes its rows of `pe` and, when the timestep is
per token (a noise mask: image-to-video, inpainting; ComfyUI's process_timestep), its rows of the modulation. The
sequence is gathered at `norm_out`, a LayerNorm without weights (per token, so gathering its output equals
normalising the gathered tokens), before the final modulation, whose per-token rows then meet the whole sequence.
Self-attention goes through ComfyUI's seam (`optimized_attention` with transformer_options).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput

COMFY_PLAN = FamilyPlan(
    family="ltxv",
    model_class="LTXVModel",
    batch_inputs=("x", "timestep", "context", "attention_mask", "keyframe_idxs", "control"),
    sequence={
        "transformer_blocks.0": [SplitInput("x", dim=1, position=0)],
        "transformer_blocks.*": [SplitInput("pe", dim=2), SplitInput("timestep", dim=1, only_full=True)],
        "norm_out": [GatherOutput(dim=1)],
    },
    attention={"transformer_blocks.*.attn1": Attention(seam="comfy")},
    tp_refusal="tensor parallel is not declared for LTX-Video; use ulysses/ring/cfg degrees",
    heads_attr="heads",
    pipeline_refusal="PipeFusion on LTX-Video is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="ltxv", title="LTX-Video", comfy_plan=COMFY_PLAN, plan=None)
