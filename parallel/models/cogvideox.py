"""CogVideoX 1.0 / 1.5 (ComfyUI's `CogVideoXTransformer3DModel`, comfy/ldm/cogvideo/model.py): what is split.

`_forward` embeds the text and the video patches together (their positional embedding, sinusoidal or learned,
added there), then hands every block the video stream, the text stream and - with rotary embeddings - one
(cos, sin) table over the video tokens. Each block joins [text, video] for its attention and feed-forward and
splits them again: all per token but the attention. So the video and the text are split where they enter the first
block (each rank projects its share of the text, as for Qwen-Image), every block takes its rows of the rotary table,
and the output projection's result is gathered before the unpatchify. The joint attention (text first) goes through
ComfyUI's seam. The image-to-video and inpaint variants join their conditioning to the latent's channels before the
model: the same plan.
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput

COMFY_PLAN = FamilyPlan(
    family="cogvideox",
    model_class="CogVideoXTransformer3DModel",
    batch_inputs=("x", "timestep", "context", "ofs"),
    sequence={
        "blocks.0": [SplitInput("hidden_states", dim=1), SplitInput("encoder_hidden_states", dim=1, text=True)],
        "blocks.*": [SplitInput("image_rotary_emb", dim=0, item=0, only_full=True),
                     SplitInput("image_rotary_emb", dim=0, item=1, only_full=True)],
        "proj_out": [GatherOutput(dim=1)],
    },
    attention={"blocks.*": Attention(text_first=True, seam="comfy")},
    tp_refusal="tensor parallel is not declared for CogVideoX; use ulysses/ring/cfg degrees",
    pipeline_refusal="PipeFusion on CogVideoX is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

# comfy_module: diffusers' class of the same name is another model (its own layout), not this plan's
ADAPTER = FamilyAdapter(family="cogvideox", title="CogVideoX", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.cogvideo.model")
