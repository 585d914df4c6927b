"""Flux.1 / Flux.2 (ComfyUI's `Flux`): what is split for sequence parallelism, tensor parallel and PipeFusion."""
from .adapter import FamilyAdapter
from ..plan import Attention, BlockList, FamilyPlan, GatherOutput, PipelinePlan, SplitInput
from ..tp import Colwise, Divide, Rowwise


def _mlp_in_blocks(linear, mlp):
    """A double block's MLP input layer: two halves (value, gate) under a gated SiLU MLP (Flux.2-style
    `mlp_silu_act`, chunked in SiLUActivation), one block otherwise."""
    return 2 if type(mlp[1]).__name__ == "SiLUActivation" else 1


def _single_in_blocks(linear, block):
    """A single block's `linear1` output: [q, k, v, MLP] (the MLP twice as wide under a gated SiLU)."""
    h, m, first = block.hidden_size, block.mlp_hidden_dim, block.mlp_hidden_dim_first
    return (h, h, h) + ((m, first - m) if first != m else (m,))


def _comfy_tp_layout() -> dict:
    """Megatron placement on ComfyUI's Flux blocks: fused qkv and MLP-in column sharded by head / hidden
    slice, the attention projection and MLP-out row sharded; the single blocks' packed linear1 / linear2
    split per block. The modulation, embedders and final layer stay replicated."""
    layout = {}
    for s in ("img", "txt"):
        layout[f"double_blocks.*.{s}_attn.qkv"] = Colwise(3)
        layout[f"double_blocks.*.{s}_attn.proj"] = Rowwise()
        layout[f"double_blocks.*.{s}_mlp.0"] = Colwise(_mlp_in_blocks)
        layout[f"double_blocks.*.{s}_mlp.2"] = Rowwise()
    layout["double_blocks.*"] = Divide(("num_heads",))
    layout["single_blocks.*.linear1"] = Colwise(_single_in_blocks)
    layout["single_blocks.*.linear2"] = Rowwise(lambda linear, block: (block.hidden_size, block.mlp_hidden_dim))
    layout["single_blocks.*"] = Divide(("num_heads", "hidden_size", "mlp_hidden_dim", "mlp_hidden_dim_first"))
    return layout


def _timestep_zero_refusal(method):
    """ComfyUI 0.33's "index_timestep_zero" reference method (Edit Model Reference Method node) modulates the image
    tokens and the references' by token ranges, and in the single blocks extends the range at position 0 over the
    text: on a rank whose image shard starts inside the references, its share of the text would take t = 0's
    modulation. Refused under ulysses/ring (cfg/dp split only the batch and run it exactly); other methods split."""
    if method != "index_timestep_zero":
        return None
    return ("the index_timestep_zero reference method modulates [text, image, references] by token ranges that a "
            "sequence split does not carry; use cfg/dp degrees (ulysses/ring degree 1), or another reference method")


# ComfyUI's own Flux (comfy/ldm/flux/model.py, class Flux; also Chroma-style subclasses that keep
# forward_orig). `_forward` patchifies the latent (padding odd sizes circularly) and builds the RoPE
# ids, then calls forward_orig(img, img_ids, txt, txt_ids, ...): splitting img and img_ids there (and
# txt with txt_ids) makes the RoPE table, the double blocks and the [txt, img] single stream all local;
# the single blocks drop the local text by its local length, and the final layer's output is gathered
# before `_forward` unpatchifies (a PipeFusion patch is cut at the same place: its band of img rows). Double and single blocks run joint attention
# with the text first, through ComfyUI's attention seam.
COMFY_PLAN = FamilyPlan(
    family="flux",
    model_class="Flux",
    batch_inputs=("x", "timestep", "context", "y", "guidance", "ref_latents", "control"),
    sequence={
        ":forward_orig": [SplitInput("img", dim=1, position=0), SplitInput("img_ids", dim=1, position=1),
                          SplitInput("txt", dim=1, position=2, text=True),
                          SplitInput("txt_ids", dim=1, position=3, text=True)],
        "final_layer": [GatherOutput(dim=1)],
    },
    attention={
        "double_blocks.*": Attention(text_first=True, seam="comfy"),
        "single_blocks.*": Attention(text_first=True, seam="comfy"),
    },
    tp=_comfy_tp_layout(),
    heads_attr="num_heads",
    # PipeFusion: the double blocks take and return (img, txt) by keyword, the single blocks one [txt, img] stream
    # x; a stage that starts at a single block receives (img, txt) from the last double block and joins them
    # itself (parallel/pipefusion/stage.py), and a patch cuts img / img_ids at forward_orig
    pipeline=PipelinePlan((BlockList("double_blocks", streams=("img", "txt"), returns=("img", "txt")),
                           BlockList("single_blocks", streams=(("x", 0),), returns=("x",))), "image"),
    pipeline_refusals={"ref_latents": "reference images (Flux Kontext, Flux.2 edits) join the image tokens, which "
                                      "PipeFusion cuts into bands of rows; use ulysses/ring/cfg degrees with them"},
    sequence_refusals={"ref_latents_method": _timestep_zero_refusal},
    comfy=True,
)

ADAPTER = FamilyAdapter(
    family="flux", title="Flux.1 / Flux.2", comfy_plan=COMFY_PLAN, comfy_module="comfy.ldm.flux.model",
)
