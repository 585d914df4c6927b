"""SD3 / SD3.5 (ComfyUI's MMDiT, `OpenAISignatureMMDITWrapper`): what is split for sequence parallelism, tensor
parallel and PipeFusion."""
from .adapter import FamilyAdapter
from ..tp import Colwise, Divide, Rowwise
from ..plan import Attention, BlockList, FamilyPlan, GatherOutput, PipelinePlan, SplitInput

# ComfyUI's own MMDiT (comfy/ldm/modules/diffusionmodules/mmdit.py). Patch embedding and the cropped
# position table need the whole latent, so the image tokens are split where they enter the first
# joint block (JointBlock.forward(context, x, ...)) and gathered after the final layer, before
# unpatchify; the text (context, registers included) is split there too and never gathered (the last
# block drops it). `_block_mixing` puts the text first in the joint attention; SD3.5's extra image-only
# attention (attn2) runs in the same block, and its text length is read as 0.
def _self_attentions(block) -> int:
    """A joint block's self-attention calls: the joint attention, and SD3.5's image-only attn2 where the block has
    one (x_block_self_attn)."""
    return 1 + bool(getattr(block.x_block, "x_block_self_attn", False))


COMFY_PLAN = FamilyPlan(
    family="sd3",
    model_class="OpenAISignatureMMDITWrapper",
    batch_inputs=("x", "timesteps", "context", "y", "control"),
    sequence={
        "joint_blocks.0": [SplitInput("x", dim=1, position=1), SplitInput("context", dim=1, position=0, text=True)],
        "final_layer": [GatherOutput(dim=1)],
    },
    attention={"joint_blocks.*": Attention(text_first=True, seam="comfy", calls=_self_attentions)},
    # Megatron placement on ComfyUI's joint blocks (context_block and x_block alike; SD3.5's attn2 too):
    # fused qkv column sharded per head, proj row sharded; the MLP (GELU fc1/fc2 or SwiGLU w1/w3, w2) likewise.
    tp={
        **{f"joint_blocks.*.*.{a}.qkv": Colwise(3) for a in ("attn", "attn2")},
        **{f"joint_blocks.*.*.{a}.proj": Rowwise() for a in ("attn", "attn2")},
        **{f"joint_blocks.*.*.{a}": Divide(("num_heads",)) for a in ("attn", "attn2")},
        "joint_blocks.*.*.mlp.fc1": Colwise(), "joint_blocks.*.*.mlp.fc2": Rowwise(),
        "joint_blocks.*.*.mlp.w1": Colwise(), "joint_blocks.*.*.mlp.w3": Colwise(),
        "joint_blocks.*.*.mlp.w2": Rowwise(),
    },
    heads_attr="num_heads",
    # PipeFusion: JointBlock.forward(*args) takes (context, x) by position and returns (context, x)
    pipeline=PipelinePlan((BlockList("joint_blocks", streams=(("x", 1), ("context", 0)), returns=("context", "x")),),
                          "image"),
    comfy=True,
)

ADAPTER = FamilyAdapter(
    family="sd3", title="SD3/3.5", comfy_plan=COMFY_PLAN,
    comfy_module="comfy.ldm.modules.diffusionmodules.mmdit",
)
