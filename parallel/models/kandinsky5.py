"""Kandinsky 5 (ComfyUI's `Kandinsky5`, comfy/ldm/kandinsky5/model.py; video Lite / Pro and Image Lite): what is split.

`forward_orig` refines the text alone (`text_transformer_blocks`: text self-attention, replicated - nothing
split), patch-embeds the video (or image: a one-frame video) into (B, T, H, W, dim), flattens it to one token
sequence and runs the visual blocks: self-attention over the tokens with a per-token RoPE table (`freqs`, the
whole sequence's, handed to every block), cross-attention from the tokens to the whole text, a feed-forward - all
per token, modulated per sample. So the tokens are split where they enter the first visual block, every visual
block takes its rows of the RoPE table, and the last one's output is gathered before `forward_orig` reshapes it to
the patch grid for the output layer. Only the visual self-attention is sequence-parallel (through ComfyUI's seam,
image only); the cross-attention reads the whole text from local queries, which needs no communication.

The image-to-video inputs (`time_dim_replace`: the first latent frames written over x; the concat mask ComfyUI
joins to x's channels) act on the latent before the split; `attention_mask` is accepted and unused by the model.
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput

COMFY_PLAN = FamilyPlan(
    family="kandinsky5",
    model_class="Kandinsky5",
    batch_inputs=("x", "timestep", "context", "y", "time_dim_replace", "attention_mask"),
    sequence={
        "visual_transformer_blocks.0": [SplitInput("visual_embed", dim=1, position=0)],
        "visual_transformer_blocks.*": [SplitInput("freqs", dim=1, position=3, only_full=True)],
        "visual_transformer_blocks.-1": [GatherOutput(dim=1)],
    },
    attention={"visual_transformer_blocks.*.self_attention": Attention(seam="comfy")},
    heads_attr="num_heads",
    tp_refusal="tensor parallel is not declared for Kandinsky 5; use ulysses/ring/cfg degrees",
    pipeline_refusal="PipeFusion on Kandinsky 5 is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="kandinsky5", title="Kandinsky 5", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.kandinsky5.model")
