"""Chroma (ComfyUI's `Chroma`, comfy/ldm/chroma/model.py): Flux's double and single blocks driven by a distilled
guidance network instead of per-block modulation. Its `_forward` / `forward_orig(img, img_ids, txt, txt_ids,
...)` / `final_layer` have Flux's shape, so what is split is Flux's: the image tokens and their RoPE ids at
forward_orig, the joint [text, image] attention through ComfyUI's seam, the final layer gathered. Tensor
parallel is not declared (its blocks carry no modulation Linears; the Flux layout is untested on them).
"""
from dataclasses import replace

from . import flux
from .adapter import FamilyAdapter

COMFY_PLAN = replace(flux.COMFY_PLAN, family="chroma", model_class="Chroma",
                     batch_inputs=("x", "timestep", "context", "guidance", "ref_latents", "control"),
                     tp=None, tp_refusal="tensor parallel is not declared for Chroma; use ulysses/ring/cfg degrees",
                     pipeline_refusal="PipeFusion on Chroma is not implemented; use ulysses/ring/cfg degrees")

ADAPTER = FamilyAdapter(family="chroma", title="Chroma", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.chroma.model")
