"""Krea 2 (ComfyUI's `SingleStreamDiT`, comfy/ldm/krea2/model.py): what is split.

Krea 2 is a single-stream DiT: `_forward` fuses the text encoder's layers into one caption (`txtfusion`, text-only
attention: replicated, nothing split), patch-embeds the image (reference images' tokens appended after it), joins
[caption, image, references] into one stream with one RoPE table and runs every block on that whole stream:
full self-attention (no mask) and per-token modulation. Every token of the joined stream is alike to the blocks, so
the stream itself is the split sequence: it is cut where it enters the first block, every block takes its rows of
the RoPE table, and the last block's output is gathered before the output layer and the crop of the image tokens.
Attention goes through ComfyUI's seam (self-attention over the shards, the grouped K/V heads already repeated).

The `index_timestep_zero` reference method (ComfyUI 0.33, the Edit Model Reference Method node) modulates the tokens
from `timestep_zero_index` on (the references, a position in the joined stream) with t = 0: each block gets that
position in its own shard (`SequenceIndex`).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SequenceIndex, SplitInput

COMFY_PLAN = FamilyPlan(
    family="krea2",
    model_class="SingleStreamDiT",
    batch_inputs=("x", "timesteps", "context", "attention_mask", "ref_latents"),
    sequence={  # (order matters: the stream is split at blocks.0 before the per-block entries read its split)
        "blocks.0": [SplitInput("x", dim=1, position=0)],
        "blocks.*": [SplitInput("freqs", dim=2, position=2, only_full=True), SequenceIndex("timestep_zero_index")],
        "blocks.-1": [GatherOutput(dim=1)],
    },
    attention={"blocks.*.attn": Attention(seam="comfy")},
    heads_attr="heads",
    tp_refusal="tensor parallel is not declared for Krea 2; use ulysses/ring/cfg degrees",
    pipeline_refusal="PipeFusion on Krea 2 is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="krea2", title="Krea 2", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.krea2.model")
