"""SD3 / SD3.5 (`SD3Transformer2DModel`): what is split for sequence parallelism.

The patch embedding needs the whole latent (its positional table is cropped to
the latent size), so the sequence is split right after `pos_embed` and gathered
after `proj_out`, before unpatchify. Joint attention puts the text *after* the
image; SD3.5's extra image-only self-attention (`attn2`) has no text.
"""
from ..plan import Attention, FamilyPlan, GatherOutput, SplitOutput

PLAN = FamilyPlan(
    family="sd3",
    model_class="SD3Transformer2DModel",
    batch_inputs=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
    sequence={
        "pos_embed": [SplitOutput(dim=1)],
        "proj_out": [GatherOutput(dim=1)],
    },
    attention={
        "transformer_blocks.*.attn": Attention(text_arg="encoder_hidden_states", text_first=False),
        "transformer_blocks.*.attn2": Attention(),
    },
    tp={
        **{f"transformer_blocks.*.attn.{n}": "colwise"
           for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")},
        "transformer_blocks.*.attn.to_out.0": "rowwise",
        "transformer_blocks.*.attn.to_add_out": "rowwise",
        **{f"transformer_blocks.*.attn2.{n}": "colwise" for n in ("to_q", "to_k", "to_v")},
        "transformer_blocks.*.attn2.to_out.0": "rowwise",
        "transformer_blocks.*.ff.net.0.proj": "colwise",
        "transformer_blocks.*.ff.net.2": "rowwise",
        "transformer_blocks.*.ff_context.net.0.proj": "colwise",
        "transformer_blocks.*.ff_context.net.2": "rowwise",
    },
)
