"""Lumina 2 and Z-Image (ComfyUI's `NextDiT`, comfy/ldm/lumina/model.py): what is split.

NextDiT is a single-stream DiT. `patchify_and_embed` embeds the image tokens (padded to a multiple of 32 for
Z-Image), refines the caption alone (`context_refiner`, text-only attention with the caption mask: replicated,
nothing split) and the image alone (`noise_refiner`, image self-attention over the image part of one RoPE table),
then joins [caption, image] into one stream for the main `layers`, which all see the whole [caption, image] table.

So the image tokens are split where they enter the first noise-refiner block (each noise-refiner block takes its
shard of the image table), gathered where the noise refiner ends, and split again where the joined
[caption, image] stream enters the first main layer (`after_prefix`: the caption is whatever precedes the image
sequence, kept whole on every rank); each main layer keeps the caption part of the full table and takes its shard
of the image part, and the final layer's [caption, local image] output is gathered behind one copy of the caption
before `unpatchify` cuts the image out. Attention: the noise refiner's is image-only, the main layers' joint with
the replicated caption first; both go through ComfyUI's seam (`optimized_attention_masked`, no mask on these two).

Why gather between the refiner and the main layers (one all-gather of the image tokens per step): `patchify_and_embed`
computes positions from the joined stream's length between them - ComfyUI 0.33's caption length for `unpatchify`
(the stream's length minus the image's) and, in Omni / edit mode, the token ranges that take the real timestep's
modulation. Computed on the whole stream they are ComfyUI's own; computed on a rank's shard they would be wrong
(the cut would start short of the image, the ranges would name other tokens).

ComfyUI 0.33's Omni / edit mode (Z-Image Omni: `ref_latents`, with `ref_contexts` and `siglip_feats`) joins the
reference images' tokens in front of the image sequence, refines the SigLIP features apart (replicated, like the
caption) and marks which tokens take the real timestep's modulation and which t = 0's with index ranges
(`timestep_zero_index`): over the image sequence in the noise refiner, over the joined stream in the main layers and
the final layer. Each rank gets those ranges cut to its own tokens (`SequenceRanges`); the references' tokens are
split with the image's.
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SequenceRanges, SplitInput

COMFY_PLAN = FamilyPlan(
    family="lumina2",
    model_class="NextDiT",
    batch_inputs=("x", "timesteps", "context", "attention_mask", "control", "clip_text_pooled", "ref_latents",
                  "ref_contexts", "siglip_feats"),
    sequence={  # (order matters: the joined stream is split at layers.0 before the per-layer entries read it)
        "noise_refiner.0": [SplitInput("x", dim=1, position=0)],
        "noise_refiner.*": [SplitInput("freqs_cis", dim=1, position=2), SequenceRanges("timestep_zero_index")],
        "noise_refiner.-1": [GatherOutput(dim=1)],
        "layers.0": [SplitInput("x", dim=1, position=0, after_prefix=True)],
        "layers.*": [SplitInput("freqs_cis", dim=1, position=2, after_prefix=True),
                     SequenceRanges("timestep_zero_index", after_prefix=True)],
        "final_layer": [SequenceRanges("timestep_zero_index", after_prefix=True), GatherOutput(dim=1, after_prefix=True)],
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

ADAPTER = FamilyAdapter(family="lumina2", title="Lumina 2 / Z-Image", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.lumina.model")
