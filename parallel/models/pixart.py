"""PixArt-α / Σ (ComfyUI's `PixArtMS`): what is split for sequence parallelism, tensor parallel and PipeFusion."""
from .adapter import FamilyAdapter
from ..plan import Attention, BlockList, FamilyPlan, GatherOutput, PipelinePlan, SplitInput
from ..tp import Colwise, Divide, Rowwise

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
    family="pixart", title="PixArt-α/Σ", comfy_plan=COMFY_PLAN, comfy_module="comfy.ldm.pixart.pixartms",
)
