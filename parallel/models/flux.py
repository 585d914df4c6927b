"""Flux.1 (`FluxTransformer2DModel`): what is split for sequence parallelism.

Inputs are the 2x2-packed image tokens plus per-token RoPE ids; splitting
`img_ids` with the tokens makes diffusers' own RoPE module produce the rotary
embedding of exactly the local tokens. The text stream is replicated on every
rank (it is short next to the image) and joins attention at the front.
"""
from diffusers import FluxTransformer2DModel

from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput

PLAN = FamilyPlan(
    family="flux",
    model_class="FluxTransformer2DModel",
    batch_inputs=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
    sequence={
        "": [SplitInput("hidden_states", dim=1), SplitInput("img_ids", dim=-2)],
        "proj_out": [GatherOutput(dim=1)],
    },
    attention={
        # double-stream blocks pass the text to attention as encoder_hidden_states
        "transformer_blocks.*.attn": Attention(text_arg="encoder_hidden_states", text_first=True),
        # single-stream blocks concatenate [text, image] before attention: read the text length at the block
        "single_transformer_blocks.*": Attention(text_arg="encoder_hidden_states", text_first=True),
    },
    # diffusers ships Flux's tensor-parallel plan; use it rather than restating it
    tp=dict(getattr(FluxTransformer2DModel, "_tp_plan", None) or {}) or None,
    tp_refusal="this diffusers version has no _tp_plan for Flux",
)
