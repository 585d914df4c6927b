"""Wan 2.1 / 2.2 (`WanTransformer3DModel`): what is split for sequence parallelism.

Tokens are (frame, row, col)-flattened video patches. The RoPE module computes
the rotary table for the full video, so its outputs are split; the patchified
tokens are split at the first block's input; per-token timesteps (Wan 2.2
TI2V, 2-D `timestep`) are split at the model input. Cross-attention to the
text (`attn2`) needs no communication.
"""
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput, SplitOutput

PLAN = FamilyPlan(
    family="wan",
    model_class="WanTransformer3DModel",
    batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "encoder_hidden_states_image"),
    sequence={
        "": [SplitInput("timestep", dim=1, only_ndim=2)],
        "rope": [SplitOutput(dim=1)],
        "blocks.0": [SplitInput("hidden_states", dim=1, position=0)],
        "proj_out": [GatherOutput(dim=1)],
    },
    attention={"blocks.*.attn1": Attention()},
    tp=None,
    tp_refusal=("Wan normalises q and k over all heads together (qk_norm='rms_norm_across_heads'), which "
                "column-sharded heads cannot compute locally; use ulysses_degree/ring_degree for Wan instead"),
)
