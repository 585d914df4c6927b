"""Cosmos Predict2 (ComfyUI's `MiniTrainDIT`, comfy/ldm/cosmos/predict2.py) and Anima (its subclass `Anima`,
comfy/ldm/anima/model.py: the same DiT behind an LLM adapter for the text): what is split.

`_forward` patch-embeds the latent into a token *grid* (B, T, H, W, D) (`prepare_embedded_sequence`), builds the
RoPE table for the whole grid (`rope_emb_L_1_1_D`, (1, T*H*W, 1, d/2, 2, 2), rows in (t h w) order) and runs every
block on the grid: self-attention over the flattened (t h w) tokens, cross-attention from the tokens to the whole
text, an MLP - all per token, modulated per *frame* (B, T, 1, 1, D: one row unless a video's noise mask gives
per-frame timesteps). The blocks never see a flat sequence, so the split is along the grid's rows (`SplitGrid`):
every rank holds rows [h0, h1) of every frame (so the per-frame modulation broadcasts unchanged), the RoPE table and
the optional per-block absolute embedding (B, T, H, W, D; no checkpoint ComfyUI 0.33 detects has it) are cut to the
same tokens, and the last block's output is gathered along the rows before `final_layer` (per token) and
`unpatchify`. Where T > 1 a rank's tokens are one run per frame, not one run of the flattened sequence: attention
has no mask here, so it is equivariant to the tokens' order - the shard only has to be the same tokens in q, k, v
and RoPE. Only the self-attention (`blocks.*.self_attn`, through ComfyUI's seam) is sequence-parallel; the
cross-attention reads the whole text from local queries. A grid with fewer patch rows than sequence ranks is refused
by the driver before any work (`grid_patch`; workers/bridge/spec.check_native_grid), and again at the call
(plan_inputs._shard_grid).

Everything else enters before the split: `padding_mask` (a channel joined to x), the image-to-video concat mask
(ComfyUI joins it to x's channels), `fps` (the RoPE table's), `denoise_mask` (read by ComfyUI's process_timestep,
outside the model), and Anima's `t5xxl_ids` / `t5xxl_weights` (ComfyUI runs the LLM adapter when it builds the
conditioning; where they reach the model its adapter runs on the whole text on every rank). Anima adds nothing to
the DiT's forward, so it runs this plan as a checked subclass (its own test: tests/server_e2e/test_comfyui_anima.py).
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitGrid

COMFY_PLAN = FamilyPlan(
    family="cosmos_predict2",
    model_class="MiniTrainDIT",
    batch_inputs=("x", "timesteps", "context", "padding_mask", "t5xxl_ids", "t5xxl_weights", "denoise_mask"),
    sequence={  # Block.forward(x_B_T_H_W_D, emb_B_T_D, crossattn_emb, rope_emb_L_1_1_D=..., extra_per_block_pos_emb=..)
        "blocks.0": [SplitGrid("x_B_T_H_W_D", dim=2, position=0)],
        "blocks.*": [SplitGrid("rope_emb_L_1_1_D", dim=1, position=3, flat=True),
                     SplitGrid("extra_per_block_pos_emb", dim=2, position=5)],
        "blocks.-1": [GatherOutput(dim=2, grid=True)],
    },
    other_inputs=("fps",),
    attention={"blocks.*.self_attn": Attention(seam="comfy")},
    heads_attr="num_heads",
    tp_refusal="tensor parallel is not declared for Cosmos Predict2 / Anima; use ulysses/ring/cfg degrees",
    pipeline_refusal="PipeFusion on Cosmos Predict2 / Anima is not implemented; use ulysses/ring/cfg degrees",
    comfy=True,
)

ADAPTER = FamilyAdapter(family="cosmos_predict2", title="Cosmos Predict2 / Anima", comfy_plan=COMFY_PLAN,
                        comfy_subclasses=("Anima",), comfy_module=("comfy.ldm.cosmos.predict2", "comfy.ldm.anima.model"),
                        grid_patch="patch_spatial")
