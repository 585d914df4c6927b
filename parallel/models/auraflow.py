"""AuraFlow (ComfyUI's `MMDiT` in comfy/ldm/aura/mmdit.py - not SD3's class of the same name): what is split.

`_forward` patchifies the latent and adds the learned position table cropped (or interpolated) to the image's
grid, so both need the whole latent: the image tokens are split where they enter the first double (joint) layer,
`layer(c, x, global_cond)`. The text - the prompt projected, with 8 register tokens in front - stays whole on every
rank: a double layer's attention joins [text, local image] (text first), the single layers run on one [text, local
image] stream and drop the text by its (whole) length, so the image stays local to the end. `final_linear`'s output
is gathered before the unpatchify. Both attentions go through ComfyUI's seam (`optimized_attention` with
transformer_options); the text length is what q holds beyond the local image shard.
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput

COMFY_PLAN = FamilyPlan(
    family="auraflow",
    model_class="MMDiT",
    batch_inputs=("x", "timestep", "context", "control"),
    sequence={
        "double_layers.0": [SplitInput("x", dim=1, position=1)],
        "final_linear": [GatherOutput(dim=1)],
    },
    attention={
        "double_layers.*.attn": Attention(text_first=True, seam="comfy"),
        "single_layers.*.attn": Attention(text_first=True, seam="comfy"),
    },
    tp_refusal="tensor parallel is not declared for AuraFlow; use ulysses/ring/cfg degrees",
    heads_attr="n_heads",
    pipeline_refusal="PipeFusion on AuraFlow is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="auraflow", title="AuraFlow", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.aura.mmdit")
