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

Where `unpatchify` cuts: `patchify_and_embed` returns the caption's length, which ComfyUI up to 0.3.x takes from the
caption itself but ComfyUI 0.33 computes as the joined stream's length minus the image's length - the stream holding
the *local* image after the split, the image length the whole one - so the cut would start short of the image.
`unpatchify`'s `cap_size` is therefore set to the prefix the final gather kept (`PrefixLength`): the caption's
length whichever way ComfyUI computed it, no version read.

ComfyUI 0.33's Omni / edit mode (Z-Image Omni: `ref_latents`, with `ref_contexts` and `siglip_feats`) joins the
reference images' tokens to the image sequence and marks the real image's and caption's tokens with index ranges
over the whole stream (`timestep_zero_index`: which tokens take the real timestep's modulation, which t = 0's),
computed partly before the split (global positions, applied to local tokens) and partly after it (from the local
length); its caption length also counts the references. Under ulysses/ring a call with reference latents is
refused before the model runs (`sequence_refusals`), naming cfg/dp, which split only the batch and run it exactly
(its list inputs are batch inputs, as is NewBie's pooled `clip_text_pooled`).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, PrefixLength, SplitInput

COMFY_PLAN = FamilyPlan(
    family="lumina2",
    model_class="NextDiT",
    batch_inputs=("x", "timesteps", "context", "attention_mask", "control", "clip_text_pooled", "ref_latents",
                  "ref_contexts", "siglip_feats"),
    sequence={
        "noise_refiner.0": [SplitInput("x", dim=1, position=0)],
        "noise_refiner.*": [SplitInput("freqs_cis", dim=1, position=2)],
        "layers.*": [SplitInput("freqs_cis", dim=1, position=2, after_prefix=True)],
        "final_layer": [GatherOutput(dim=1, after_prefix=True)],
        ":unpatchify": [PrefixLength("cap_size", position=2)],
    },
    attention={
        "noise_refiner.*.attention": Attention(seam="comfy"),
        "layers.*.attention": Attention(text_first=True, seam="comfy"),
    },
    tp_refusal="tensor parallel is not declared for Lumina 2 / Z-Image; use ulysses/ring/cfg degrees",
    heads_attr="n_heads",
    pipeline_refusal="PipeFusion on Lumina 2 / Z-Image is not implemented; use ulysses/ring/cfg degrees",
    sequence_refusals={
        "ref_latents": "Z-Image Omni / edit reference latents join the image sequence and mark token ranges of the "
                       "whole stream (which tokens take the real timestep), which a sequence split does not carry; "
                       "use cfg/dp degrees, or ulysses/ring degree 1, with reference images",
    },
    comfy=True,
)

ADAPTER = FamilyAdapter(family="lumina2", title="Lumina 2 / Z-Image", comfy_plan=COMFY_PLAN, plan=None)
