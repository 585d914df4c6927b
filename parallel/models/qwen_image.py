"""Qwen-Image (ComfyUI's `QwenImageTransformer2DModel`, comfy/ldm/qwen_image/model.py): what is split.

ComfyUI's `_forward` patchifies the latent (reference latents of the edit variant are appended to the image
tokens), computes one RoPE table over [text, image] ids and hands every block the image stream, the text
stream and that table. The image tokens (references included: they join the sequence) and the text are split
where they enter the first block; each block takes its shard of the table's text part and of its image part;
the output projection is gathered before `_forward` drops the reference tokens and unpatchifies (the text is
never gathered: the output does not hold it). The blocks' joint attention concatenates [text, image] and
calls ComfyUI's attention seam, whose override runs USP over the joint shards.

Qwen-Image-Edit-2511 (ComfyUI 0.33: `default_ref_method` "index_timestep_zero", detected from the checkpoint, or
the conditioning's `ref_latents_method`) modulates the image's tokens with the timestep and the references' tokens
after them with t = 0, split at `timestep_zero_index` - the image's token count, a position in the whole
[image, references] sequence. Each block gets that position in its own shard (`SequenceIndex`), so a rank applies
the rule to exactly its tokens.
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SequenceIndex, SplitInput

COMFY_PLAN = FamilyPlan(
    family="qwen_image",
    model_class="QwenImageTransformer2DModel",
    batch_inputs=("x", "timestep", "context", "attention_mask", "guidance", "ref_latents", "control"),
    sequence={
        "transformer_blocks.0": [SplitInput("hidden_states", dim=1),
                                 SplitInput("encoder_hidden_states", dim=1, text=True)],
        "transformer_blocks.*": [SplitInput("image_rotary_emb", dim=2, prefix_from="encoder_hidden_states"),
                                 SequenceIndex("timestep_zero_index")],
        "proj_out": [GatherOutput(dim=1)],
    },
    attention={"transformer_blocks.*.attn": Attention(text_first=True, seam="comfy")},
    heads_attr="heads",
    pipeline_refusal=("PipeFusion on Qwen-Image is not implemented: use ulysses/ring/cfg degrees"),
    comfy=True,
)

ADAPTER = FamilyAdapter(family="qwen_image", title="Qwen-Image", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.qwen_image.model")
