"""Tensor parallel: Megatron-style column/row sharding through torch's DTensor styles.

A family declares a `tp` plan in diffusers' `_tp_plan` format (module-name
pattern -> "colwise" | "rowwise" | PackedRowwise); Flux reuses diffusers' own
`FluxTransformer2DModel._tp_plan`. Q/K/V and MLP-up projections are column
sharded (each rank computes its heads / hidden slice, no communication), the
attention output and MLP-down projections are row sharded (one all-reduce per
sub-block: seed 003's placement). diffusers refuses TP on CPU, so the plan is
applied here with `parallelize_module` on a DeviceMesh built from our tp group.

Composes with USP: the attention sees this rank's heads only, and Ulysses
splits those further - rank order puts tp innermost, so its all-reduces stay
on the closest devices.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class PackedRowwise:
    """Row-wise sharding of a Linear whose input concatenates column-sharded blocks of different widths.

    Flux's single-stream `proj_out` takes cat([attention (inner), MLP (4*inner)]): every block is split
    across ranks separately so the weight columns line up with each rank's local input.
    """

    def __init__(self, blocks=None):
        self.blocks = blocks


class _PackedRowwiseStyle(RowwiseParallel):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks
        self.src_data_rank = None

    def _partition_linear_fn(self, name, module, device_mesh):
        n, r = device_mesh.size(), device_mesh.get_local_rank()
        w = module.weight
        pieces = [blk.chunk(n, dim=1)[r] for blk in w.split(list(self.blocks), dim=1)]
        local = torch.cat(pieces, dim=1).contiguous()
        module.register_parameter("weight", torch.nn.Parameter(
            DTensor.from_local(local, device_mesh, [Shard(1)], run_check=False), requires_grad=False))
        if module.bias is not None:
            from torch.distributed.tensor import Replicate, distribute_tensor
            module.register_parameter("bias", torch.nn.Parameter(
                distribute_tensor(module.bias, device_mesh, [Replicate()], src_data_rank=None), requires_grad=False))


def _style(value, module):
    if value == "colwise":
        s = ColwiseParallel()
    elif value == "rowwise":
        s = RowwiseParallel()
    elif type(value).__name__ in ("PackedRowwise", "PackedRowwiseParallel"):
        blocks = getattr(value, "blocks", None) or getattr(module, "_tp_packed_row_blocks", None)
        if not blocks:
            raise ValueError(f"packed row-wise style without blocks on {type(module).__name__}")
        return _PackedRowwiseStyle(blocks)
    else:
        raise ValueError(f"unsupported tensor-parallel style {value!r}")
    s.src_data_rank = None  # every rank already holds the same full weights: slice locally, no broadcast
    return s


def check_tp(model: torch.nn.Module, plan, tp_size: int) -> None:
    """Refuse, before sharding anything, a degree the model cannot be split by."""
    if plan.tp_layout() is None:
        raise ValueError(f"tensor parallel is not supported for {plan.model_class}: {plan.tp_refusal}")
    heads = getattr(model.config, plan.heads_attr)
    if heads % tp_size:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"tp_degree={tp_size} does not divide the model's {heads} attention heads; "
                         f"use a tp_degree in {ok}")


def apply_tp(model: torch.nn.Module, plan, ax, device_type: str = "cpu") -> torch.nn.Module:
    """Shard `model` in place over the ranks of axis `ax` (the tp axis)."""
    from .plan import path_matches

    check_tp(model, plan, ax.size)
    mesh = DeviceMesh.from_group(ax.group, device_type=device_type, mesh=list(ax.ranks))
    modules = dict(model.named_modules())
    styles = {}
    for pattern, value in plan.tp_layout().items():
        for path, mod in modules.items():
            if path_matches(path, pattern):
                if not isinstance(mod, torch.nn.Linear):
                    raise ValueError(f"tp plan entry {pattern!r} matched {path!r}, a {type(mod).__name__}")
                if mod.out_features % ax.size and value == "colwise":
                    raise ValueError(f"{path} has {mod.out_features} outputs, not divisible by tp_degree={ax.size}")
                styles[path] = _style(value, mod)
    if not styles:
        raise ValueError(f"the {plan.family} tp plan matched no Linear module")
    parallelize_module(model, mesh, styles)
    n = ax.size
    for path, style in styles.items():  # DTensor's all-reduces bypass comm.py: count them here
        if isinstance(style, RowwiseParallel):
            modules[path].register_forward_hook(
                lambda mod, args, out: ax.stats.record("tp_all_reduce",
                                                       out.numel() * out.element_size() * 2 * (n - 1) // n))
    # AttnProcessor2_0-style processors derive head_dim from attn.heads: give them the local head count.
    for path, mod in modules.items():
        if hasattr(mod, "heads") and f"{path}.to_q" in styles:
            mod.heads = mod.heads // ax.size
    model._hp_tp_size = ax.size
    return model


def local_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank actually holds (the local shard of DTensors; freed meta weights of
    other PipeFusion stages do not count)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        if not t.is_meta:
            total += t.numel() * t.element_size()
    return total
