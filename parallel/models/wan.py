"""Wan 2.1 / 2.2 (ComfyUI's `WanModel`, and its VACE and Fun Camera subclasses): what is split for sequence
parallelism, tensor parallel and PipeFusion."""
from dataclasses import replace

from .adapter import FamilyAdapter
from ..tp import Colwise, Divide, Rowwise, ShardedNorm
from ..plan import Attention, BlockList, FamilyPlan, GatherOutput, PipelinePlan, SplitInput

# ComfyUI's own WanModel (comfy/ldm/wan/model.py). `forward_orig` computes the patch grid from the
# whole latent and every block receives the full RoPE table and modulation from its locals, so the
# tokens are split where they enter the first block, the RoPE table at every block, and the head's
# output is gathered before unpatchify. Wan 2.2 (TI2V, image-to-video with a noise mask) gives a
# per-frame modulation that each block repeats against its tokens: it becomes this rank's per-token rows.
#
# The conditioning ComfyUI passes beside x (comfy/model_base.py WAN21 / WAN22 extra_conds), and what the split does:
# - time_dim_concat (Phantom's subject frames): latent frames joined to x before the patch embedding, with RoPE rows
#   for them (_forward's t_len) - more tokens of the same kind, cut off after unpatchify: split with the rest;
# - reference_latent (Wan Fun Control's reference image, models with `ref_conv`): its tokens are put in front of x
#   before the first block (one more RoPE frame) and dropped after the head, i.e. after the gather: split likewise;
#   a per-frame modulation then repeats over a sequence it does not divide, as ComfyUI's repeat_e does (plan.py);
# - denoise_mask (WAN22): read by ComfyUI's process_timestep only; the model ignores it - it travels with the batch;
# - context_latents (ComfyUI 0.33's in-context reference, Bernini): a list of latents whose tokens are appended to the
#   sequence with RoPE rows of their own (a source id) and cut off after the head; not checked under the split -
#   refused under ulysses/ring (cfg/dp split the batch and run it exactly: tests/families/test_native_wan_conditioning.py).
_CONTEXT_LATENTS = ("in-context reference latents (context_latents: ComfyUI's Bernini reference conditioning) append "
                    "their own tokens to the video sequence, which this sequence split was not checked with; use "
                    "cfg/dp degrees (ulysses/ring degree 1) with them")
COMFY_PLAN = FamilyPlan(
    family="wan",
    model_class="WanModel",
    batch_inputs=("x", "timestep", "context", "clip_fea", "time_dim_concat", "reference_latent", "denoise_mask"),
    sequence={
        "blocks.0": [SplitInput("x", dim=1, position=0)],
        # the modulation: (B, frames or 1, 6, dim) at the blocks and (B, frames or 1, dim) at the head; a model that
        # makes it (B, 6, dim) / (B, dim) (VaceWanModel: one timestep) has no token axis - left alone (only_ndim)
        "blocks.*": [SplitInput("freqs", dim=1, position=2),
                     SplitInput("e", dim=1, position=1, only_ndim=4, only_full=True, per_group=True)],
        "head": [SplitInput("e", dim=1, position=1, only_ndim=3, only_full=True, per_group=True),
                 GatherOutput(dim=1)],
    },
    attention={"blocks.*.self_attn": Attention(seam="comfy")},
    # Megatron placement: q/k/v (and I2V's k_img/v_img) column sharded per head, o row sharded; Wan's q/k
    # RMSNorm spans all heads, so it is a ShardedNorm (one small all-reduce); the FFN col/row.
    tp={
        **{f"blocks.*.{a}.{n}": Colwise() for a in ("self_attn", "cross_attn") for n in ("q", "k", "v", "k_img", "v_img")},
        **{f"blocks.*.{a}.o": Rowwise() for a in ("self_attn", "cross_attn")},
        **{f"blocks.*.{a}.{n}": ShardedNorm() for a in ("self_attn", "cross_attn")
           for n in ("norm_q", "norm_k", "norm_k_img")},
        **{f"blocks.*.{a}": Divide(("num_heads",)) for a in ("self_attn", "cross_attn")},
        "blocks.*.ffn.0": Colwise(), "blocks.*.ffn.2": Rowwise(),
    },
    heads_attr="num_heads",
    # PipeFusion: the blocks take and return x; a patch is a band of token rows of the (frame, row)-stacked grid,
    # i.e. whole rows of one frame or several (the "video" layout); the sequence entries above cut x, the RoPE rows
    # and a per-frame modulation to it, and the head's output is scattered back before unpatchify
    pipeline=PipelinePlan((BlockList("blocks", streams=(("x", 0),), returns=("x",)),), "video"),
    # PipeFusion's patches are bands of the latent's own token grid: inputs that add tokens beside it do not fit
    pipeline_refusals={
        "time_dim_concat": "extra latent frames (time_dim_concat: Phantom subjects) add tokens beyond the latent's "
                           "grid, which PipeFusion's patches do not cover; use ulysses/ring/cfg degrees",
        "reference_latent": "a reference image (Wan Fun Control) adds tokens in front of the latent's, which "
                            "PipeFusion's patches do not cover; use ulysses/ring/cfg degrees",
        "context_latents": "in-context reference latents add tokens beyond the latent's grid, which PipeFusion's "
                           "patches do not cover; use cfg/dp degrees",
    },
    sequence_refusals={"context_latents": _CONTEXT_LATENTS},
    comfy=True,
)

ADAPTER = FamilyAdapter(
    family="wan", title="Wan 2.1/2.2", comfy_plan=COMFY_PLAN, comfy_module="comfy.ldm.wan.model",
)


# Wan 2.1 VACE (ComfyUI's VaceWanModel, a WanModel subclass): beside every k-th block a VACE block refines the
# control tokens `c` (the control video's latent, its masks and a reference frame, patchified exactly like x: as many
# tokens) against the *unsplit* patch embedding `x_orig` and adds a hint to x. `forward_orig` keeps x_orig before the
# first block's split, so each VACE block takes its rows of x_orig, of the RoPE table and - at the first VACE block,
# where it is still whole - of c; the c it returns is local and stays so. Its self-attention goes through the seam.
VACE_PLAN = replace(
    COMFY_PLAN, family="wan_vace", model_class="VaceWanModel",
    batch_inputs=COMFY_PLAN.batch_inputs + ("vace_context",),
    other_inputs=("vace_strength",),  # one float per control video (a list: ComfyUI's CONDConstant), not per token
    sequence={**COMFY_PLAN.sequence,
              "vace_blocks.*": [SplitInput("c", dim=1, position=0, only_full=True),
                                SplitInput("x", dim=1, only_full=True), SplitInput("freqs", dim=1, only_full=True)]},
    attention={**COMFY_PLAN.attention, "vace_blocks.*.self_attn": Attention(seam="comfy")},
    tp=None, tp_refusal="tensor parallel is not declared for Wan VACE's hint blocks; use ulysses/ring/cfg degrees",
    pipeline=None, pipeline_refusal="PipeFusion is not declared for Wan VACE's hint blocks; use ulysses/ring/cfg degrees",
)

# Wan Fun Camera (ComfyUI's CameraWanModel, 2.1 and 2.2): the camera adapter's embedding is added to the patch
# embedding before the tokens are flattened, so the sequence plan is Wan's; its `camera_conditions` carry the batch.
CAMERA_PLAN = replace(
    COMFY_PLAN, family="wan_camera", model_class="CameraWanModel",
    batch_inputs=COMFY_PLAN.batch_inputs + ("camera_conditions",),
    tp=None, tp_refusal="tensor parallel is not declared for Wan Fun Camera; use ulysses/ring/cfg degrees",
    pipeline=None, pipeline_refusal="PipeFusion was not checked on Wan Fun Camera; use ulysses/ring/cfg degrees",
)

VARIANTS = (FamilyAdapter(family="wan_vace", title="Wan 2.1 VACE", comfy_plan=VACE_PLAN,
                          comfy_module="comfy.ldm.wan.model"),
            FamilyAdapter(family="wan_camera", title="Wan Fun Camera", comfy_plan=CAMERA_PLAN,
                          comfy_module="comfy.ldm.wan.model"))
