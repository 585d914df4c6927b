"""PixArt-alpha / Sigma (`PixArtTransformer2DModel`): what is split for sequence parallelism.

Split after `pos_embed` (it needs the full latent), gather after `proj_out`.
Only the image self-attention (`attn1`) is distributed; the cross-attention to
the text (`attn2`) has local image queries and full text K/V already.
"""
from .adapter import FamilyAdapter
from ..plan import Attention, BlockList, FamilyPlan, GatherOutput, PipelinePlan, SplitInput, SplitOutput
from ..tp import Colwise, Divide, Rowwise

PLAN = FamilyPlan(
    family="pixart",
    model_class="PixArtTransformer2DModel",
    batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "added_cond_kwargs",
                  "attention_mask", "encoder_attention_mask"),
    sequence={
        "pos_embed": [SplitOutput(dim=1)],
        "proj_out": [GatherOutput(dim=1)],
    },
    attention={"transformer_blocks.*.attn1": Attention()},
    tp={
        **{f"transformer_blocks.*.{a}.{n}": "colwise" for a in ("attn1", "attn2") for n in ("to_q", "to_k", "to_v")},
        "transformer_blocks.*.attn1.to_out.0": "rowwise",
        "transformer_blocks.*.attn2.to_out.0": "rowwise",
        "transformer_blocks.*.ff.net.0.proj": "colwise",
        "transformer_blocks.*.ff.net.2": "rowwise",
    },
    pipeline=PipelinePlan((BlockList("transformer_blocks"),), "image"),
)


# ComfyUI's own PixArtMS (comfy/ldm/pixart/pixartms.py): the position table is computed for the whole
# latent, so the tokens are split where they enter the first block and gathered after the final
# layer. Its self-attention calls ComfyUI's attention without transformer_options (no seam), so the
# worker runs ComfyUI's pytorch kernel and the SDPA call inside `blocks.*.attn` is swapped.
COMFY_PLAN = FamilyPlan(
    family="pixart",
    model_class="PixArtMS",
    batch_inputs=("x", "timesteps", "context", "c_size", "c_ar"),
    sequence={
        "blocks.0": [SplitInput("x", dim=1, position=0)],
        "final_layer": [GatherOutput(dim=1)],
    },
    attention={"blocks.*.attn": Attention(seam="sdpa")},
    # Megatron placement on ComfyUI's PixArt blocks: the self-attention's fused qkv and the cross-attention's q and
    # packed kv column sharded per head, their projections row sharded, the MLP likewise. Both attentions read the
    # model width from their input (B, N, C = x.shape) to lay out the heads: they are shown the local width.
    tp={
        "blocks.*.attn.qkv": Colwise(3), "blocks.*.attn.proj": Rowwise(),
        "blocks.*.cross_attn.q_linear": Colwise(), "blocks.*.cross_attn.kv_linear": Colwise(2),
        "blocks.*.cross_attn.proj": Rowwise(),
        "blocks.*.attn": Divide(("num_heads",), input_width=True),
        "blocks.*.cross_attn": Divide(("num_heads",), input_width=True),
        "blocks.*.mlp.fc1": Colwise(), "blocks.*.mlp.fc2": Rowwise(),
    },
    heads_attr="num_heads",
    pipeline=PipelinePlan((BlockList("blocks", streams=("x",), returns=("x",)),), "image"),
    comfy=True,
)

ADAPTER = FamilyAdapter(
    family="pixart", title="PixArt-α/Σ", comfy_plan=COMFY_PLAN, plan=PLAN, comfy_module="comfy.ldm.pixart.pixartms",
)
