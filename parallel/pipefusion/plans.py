"""What PipeFusion splits: the stages' blocks and the latent layout, read from the family plan.

Each family plan (parallel/models/<family>.py, for ComfyUI's class) declares its
`pipeline`: which ModuleLists are "the blocks" (the stages split them), what a block carries to the
next one (`streams`) and in which order it returns them (`returns`). PipeFusion reuses the plan's
`sequence` entries (where the image token sequence starts and where it is gathered) to cut a patch
of token rows, and its `attention` entries to find the self-attention layers that need a stale-KV
buffer, so one generic driver can skip, feed and stop any family's blocks without copying a forward().
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import split_sizes
from ..config import ConfigError
from ..models import plan_for
from ..plan import BlockList, PipelinePlan  # noqa: F401  (re-exported: the data the family plans declare)


def pipeline_plan_for(fplan) -> PipelinePlan:
    """The PipeFusion stages a family plan declares, or a ConfigError saying why there are none."""
    if fplan.pipeline is None:
        raise ConfigError(fplan.pipeline_refusal or f"PipeFusion is not declared for {fplan.model_class}; use "
                                                    f"ulysses_degree/ring_degree (USP) instead")
    return fplan.pipeline


def flat_blocks(model, plan: PipelinePlan) -> list:
    """[(path, module, BlockList)] of every block in execution order."""
    mods = dict(model.named_modules())
    out = []
    for bl in plan.blocks:
        if bl.path not in mods:
            raise KeyError(f"the pipeline plan names {bl.path!r}, which {type(model).__name__} lacks")
        out += [(f"{bl.path}.{i}", m, bl) for i, m in enumerate(mods[bl.path])]
    return out


def stage_ranges(n_blocks: int, pp: int, layer_counts=None) -> list:
    """[start, stop) block index of each stage: `layer_counts` (attn_layer_num_for_pp) or an even split."""
    if pp > n_blocks:
        raise ConfigError(f"pp_degree={pp} but the model has only {n_blocks} transformer blocks: every stage "
                          f"needs at least one; set pp_degree to at most {n_blocks}")
    counts = list(layer_counts) if layer_counts is not None else split_sizes(n_blocks, pp)
    if sum(counts) != n_blocks:
        raise ConfigError(f"attn_layer_num_for_pp={tuple(counts)} sums to {sum(counts)} but the model has "
                          f"{n_blocks} transformer blocks; give counts that sum to {n_blocks}")
    starts = [sum(counts[:i]) for i in range(pp)]
    return [(s, s + c) for s, c in zip(starts, counts)]


@dataclass(frozen=True)
class Layout:
    """How the sampler's latent maps to the image token grid (row-major, `cols` tokens per row).

    `unit` is how many latent rows (image) make one token row: the patch size, so patch
    boundaries always fall on patch-size multiples of the latent height.
    """
    kind: str
    rows: int
    cols: int
    unit: int

    def patch_rows(self, num_patches: int) -> list:
        """[r0, r1) token rows of each patch: near-equal bands, larger ones first."""
        sizes = split_sizes(self.rows, num_patches)
        return [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(num_patches)]

    def tokens(self, r0: int, r1: int) -> tuple:
        return r0 * self.cols, r1 * self.cols

    def latent_rows(self, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """The latent rows of token rows [r0, r1): a view of `x` (the loop writes the sampler step through it)."""
        if self.kind == "image":
            return x.narrow(-2, r0 * self.unit, (r1 - r0) * self.unit)
        # video: (B, C, T, H, W) as (B, C, T*H, W): token row t*(H/unit) + i is latent rows unit*i..
        return x.view(*x.shape[:2], -1, x.shape[-1]).narrow(-2, r0 * self.unit, (r1 - r0) * self.unit)


def latent_layout(model, plan: PipelinePlan, x: torch.Tensor, num_patches: int) -> Layout:
    """The token grid of `x`, refusing sizes PipeFusion cannot split into `num_patches` bands."""
    if plan.latent == "image":
        ps = int(model.patch_size)
        if x.ndim != 4:
            raise ConfigError(f"{type(model).__name__} expects a (B, C, H, W) latent, got shape {tuple(x.shape)}")
        H, W = x.shape[-2:]
        if H % ps or W % ps:
            raise ConfigError(f"latent {H}x{W} is not a multiple of the patch size {ps}; pad or crop the latent "
                              f"to a multiple of {ps}")
        lay = Layout("image", H // ps, W // ps, ps)
    elif plan.latent == "video":  # (frame, row, col)-flattened patches: token rows run through every frame's rows
        pt, ph, pw = (int(v) for v in model.patch_size)
        if x.ndim != 5:
            raise ConfigError(f"{type(model).__name__} expects a (B, C, T, H, W) latent, got shape {tuple(x.shape)}")
        T, H, W = x.shape[-3:]
        if pt != 1 or H % ph or W % pw:
            raise ConfigError(f"latent {H}x{W} is not a multiple of the patch size {ph}x{pw} (or the temporal patch "
                              f"{pt} is not 1); use an image size that is a multiple of {8 * ph}")
        lay = Layout("video", T * H // ph, W // pw, ph)
    else:
        raise ConfigError(f"unknown PipeFusion latent layout {plan.latent!r} (image or video)")
    if num_patches > lay.rows:
        unit = f"{lay.unit} latent rows" if lay.kind == "image" else "one token row"
        raise ConfigError(f"num_pipeline_patch={num_patches} but the image has only {lay.rows} token rows "
                          f"(each patch needs at least {unit}); set num_pipeline_patch to at most {lay.rows} "
                          f"or use a taller image")
    return lay


def keep_stage_blocks(model, ctx) -> int:
    """Free the weights of the blocks other stages run (they become meta tensors): a stage holds only
    its own blocks plus the small embeddings and output layers. Returns the bytes released.

    A stage passes the streams around earlier stages' blocks and stops after its own last block, so
    those weights are never read; the model remembers its range so that a run with another split
    is refused instead of touching freed weights.
    """
    blocks = flat_blocks(model, pipeline_plan_for(plan_for(model)))
    start, stop = stage_ranges(len(blocks), ctx.pp.size, ctx.config.attn_layer_num_for_pp)[ctx.pp.rank]
    freed = 0
    for j, (_, mod, _) in enumerate(blocks):
        if not start <= j < stop:
            freed += sum(p.numel() * p.element_size() for p in mod.parameters() if not p.is_meta)
            mod.to_empty(device="meta")
    model._hp_pp_stage_blocks = (start, stop, len(blocks))
    return freed


def pipeline_problems(model, fplan, config, latent_shape) -> list:
    """Why PipeFusion with `config` cannot run `model` on a latent of `latent_shape` (empty if it can).

    Reads only (the latent is a meta tensor): the nodes call it on the driver's copy of the model before any
    worker starts, with the same checks the loop makes at run start.
    """
    try:
        pplan = pipeline_plan_for(fplan)
        stage_ranges(len(flat_blocks(model, pplan)), config.pp_degree, config.attn_layer_num_for_pp)
        P = config.num_pipeline_patch
        if P > 1 and config.warmup_steps < 1:
            raise ConfigError("PipeFusion needs warmup_steps >= 1: the first step fills the stale KV buffers with "
                              "the whole image; set warmup_steps to 1 or more")
        layout = latent_layout(model, pplan, torch.empty(latent_shape, device="meta"), P)
        sp = config.ulysses_degree * config.ring_degree
        small = min(t1 - t0 for t0, t1 in (layout.tokens(r0, r1) for r0, r1 in layout.patch_rows(P)))
        if sp > 1 and small < sp:
            raise ConfigError(f"a PipeFusion patch of {small} tokens cannot be split over sp_degree={sp} ranks; use "
                              f"fewer patches (num_pipeline_patch), a smaller ulysses/ring degree or a larger image")
    except ConfigError as e:
        return [str(e)]
    return []
