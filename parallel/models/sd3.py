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
)
