"""ERNIE-Image (ComfyUI's `ErnieImageModel`, comfy/ldm/ernie/model.py): what is split.

A single-stream DiT: `forward` joins [image, text] into one stream with one rotary table and runs every layer on
that whole stream - full self-attention (no mask) and per-token modulation shared by all layers. Every token is
alike to the layers, so the stream itself is the split sequence: cut where it enters the first layer, every layer
takes its rows of the rotary table, and the last layer's output is gathered before the final norm and the crop of
the image tokens. Its attention calls ComfyUI's `optimized_attention` without transformer_options (so not through
ComfyUI's override seam): under sequence parallelism the workers run ComfyUI's pytorch kernel, whose
scaled_dot_product_attention call the plan swaps inside the declared modules (as for PixArt).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput

COMFY_PLAN = FamilyPlan(
    family="ernie",
    model_class="ErnieImageModel",
    batch_inputs=("x", "timesteps", "context"),
    sequence={  # (order matters: the stream is split at layers.0 before the per-layer entries read its split)
        "layers.0": [SplitInput("x", dim=1, position=0)],
        "layers.*": [SplitInput("rotary_pos_emb", dim=1, position=1, only_full=True)],
        "layers.-1": [GatherOutput(dim=1)],
    },
    attention={"layers.*.self_attention": Attention(seam="sdpa")},
    heads_attr="heads",
    tp_refusal="tensor parallel is not declared for ERNIE-Image; use ulysses/ring/cfg degrees",
    pipeline_refusal="PipeFusion on ERNIE-Image is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="ernie", title="ERNIE-Image", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.ernie.model")
