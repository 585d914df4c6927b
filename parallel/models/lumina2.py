"""Lumina 2 and Z-Image (ComfyUI's `NextDiT`, comfy/ldm/lumina/model.py): what is split.

NextDiT is a single-stream DiT. `patchify_and_embed` embeds the image tokens (padded to a multiple of 32 for
Z-Image), refines the caption alone (`context_refiner`, text-only attention with the caption mask: replicated,
nothing split) and the image alone (`noise_refiner`, image self-attention over the image part of one RoPE table),
then joins [caption, image] into one stream for the main `layers`, which all see the whole [caption, image] table.

So the image tokens are split where they enter the first noise-refiner block, each noise-refiner block takes its
shard of the image table, each main layer keeps the caption part of the full table and takes its shard of the
image part (`after_prefix`: the caption is whatever precedes the image sequence), and the final layer's
[caption, local image] output is gathered behind one copy of the caption before `unpatchify` cuts the image out.
Attention: the noise refiner's is image-only, the main layers' joint with the replicated caption first; both go
through ComfyUI's seam (`optimized_attention_masked`, no mask on these two).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput

COMFY_PLAN = FamilyPlan(
    family="lumina2",
    model_class="NextDiT",
    batch_inputs=("x", "timesteps", "context", "attention_mask", "control"),
    sequence={
        "noise_refiner.0": [SplitInput("x", dim=1, position=0)],
        "noise_refiner.*": [SplitInput("freqs_cis", dim=1, position=2)],
        "layers.*": [SplitInput("freqs_cis", dim=1, position=2, after_prefix=True)],
        "final_layer": [GatherOutput(dim=1, after_prefix=True)],
    },
    attention={
        "noise_refiner.*.attention": Attention(seam="comfy"),
        "layers.*.attention": Attention(text_first=True, seam="comfy"),
    },
    tp_refusal="tensor parallel is not declared for Lumina 2 / Z-Image; use ulysses/ring/cfg degrees",
    heads_attr="n_heads",
    pipeline_refusal="PipeFusion on Lumina 2 / Z-Image is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="lumina2", title="Lumina 2 / Z-Image", comfy_plan=COMFY_PLAN, plan=None)
