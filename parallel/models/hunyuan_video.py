"""HunyuanVideo 1.0 / 1.5 (and HunyuanImage 2.1, same class: ComfyUI's `HunyuanVideo`,
comfy/ldm/hunyuan_video/model.py): what is split.

`forward_orig` embeds the latent with a (3-D) patch convolution into (frame, row, col)-flattened tokens, refines
the text with its own small transformer (text-only attention: replicated, nothing split), joins CLIP-vision
features and ByT5 glyph tokens to the text (1.5), builds one RoPE table over the joint ids and runs Flux's double
blocks and then single blocks over one joint stream, every one of them in the same order as the table.

Which order depends on ComfyUI's code. Up to ComfyUI 0.3.x the stream is [image, text]: the table is built over
[image ids, text ids], the double blocks are Flux's with `flipped_img_txt=True` (image first in q/k/v), the single
blocks run [image, text] and the image is cropped from the front. ComfyUI 0.33 removed `flipped_img_txt` from
Flux's blocks and put the text first everywhere ([text ids, image ids], [text, image], the image cropped behind the
text, like Flux). The order is read from the model when the plan is applied (`_text_first`): the double blocks'
`flipped_img_txt` flag where the class still has it - never a version number. One answer serves both kinds of
block: the double and single blocks share one RoPE table, so ComfyUI itself must keep their order the same.

So the image tokens are split at the patch embedding's output and their ids at `forward_orig`'s input (the RoPE
table then comes out as [text, local image], or [local image, text]); the joint attention runs through ComfyUI's
seam with the replicated text on the side the model puts it; the crop before the final layer takes the local image
(ComfyUI measures it after the split); the final layer's output is gathered before the unpatchify reshape.
Image-to-video in 1.5 joins the start image's latent and mask as input channels (split with the latent like any
channel).

Three inputs address the *whole* image sequence and are refused under ulysses/ring with what to do instead
(`sequence_refusals`): a text attention mask (a key mask over the joint stream), HunyuanVideo 1.0 I2V's guiding
frame (per-token modulation ranges) and its reference latent (prepended image tokens).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput, SplitOutput

_SP = "use cfg/dp degrees, or ulysses/ring degree 1, for this conditioning"


def _text_first(model) -> bool:
    """Whether this ComfyUI's HunyuanVideo puts the text before the image in its joint stream: not where its double
    blocks are built flipped (`flipped_img_txt`, ComfyUI up to 0.3.x), yes where they are not or the class has no
    such flag (ComfyUI 0.33 on: Flux's joint order)."""
    return not any(getattr(b, "flipped_img_txt", False) for b in getattr(model, "double_blocks", ()))


COMFY_PLAN = FamilyPlan(
    family="hunyuan_video",
    model_class="HunyuanVideo",
    batch_inputs=("x", "timestep", "context", "y", "txt_byt5", "clip_fea", "guidance", "attention_mask", "control"),
    sequence={
        ":forward_orig": [SplitInput("img_ids", dim=1, position=1)],
        "img_in": [SplitOutput(dim=1)],
        "final_layer": [GatherOutput(dim=1)],
    },
    attention={
        "double_blocks.*": Attention(text_first=_text_first, seam="comfy"),
        "single_blocks.*": Attention(text_first=_text_first, seam="comfy"),
    },
    tp_refusal="tensor parallel is not declared for HunyuanVideo; use ulysses/ring/cfg degrees",
    heads_attr="num_heads",
    pipeline_refusal="PipeFusion on HunyuanVideo is not implemented; use ulysses/ring/cfg degrees",
    sequence_refusals={
        "attention_mask": "the text conditioning carries an attention mask (padded prompt tokens), which "
                          "sequence-parallel attention does not apply; " + _SP,
        "guiding_frame_index": "HunyuanVideo 1.0 image-to-video's guiding frame modulates token ranges of the whole "
                               "sequence; " + _SP,
        "ref_latent": "HunyuanVideo 1.0 image-to-video's reference latent is prepended to the image tokens; " + _SP,
    },
    comfy=True,
)

ADAPTER = FamilyAdapter(family="hunyuan_video", title="HunyuanVideo 1.0 / 1.5", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.hunyuan_video.model")
