"""Bytes per rank of a parallel run, predicted before any worker starts, against what the devices hold.

Why: an out-of-memory error half-way through a run loses the run and says nothing about the fix, and some configs
can never fit - DistriFusion keeps every self-attention layer's full K/V twice over (stale buffers being read while
the next step's gather fills the others): ~350 GiB per rank for Wan 2.1 14B at 720p, on any GPU. The planner adds
up what a rank holds - its weights (whole, its tensor-parallel slice, its PipeFusion stage, or its shard plus the
blocks gathered around a forward), the activations of one block at its sequence share, the attention exchange
buffers, DistriFusion's and PipeFusion's K/V buffers, the gathered output - and refuses a config whose rank needs
more than the device has, naming the largest item and the settings that shrink it.

What is exact and what is an estimate: the K/V buffers and the weight split follow the implementation's own layout
(parallel/distrifusion.py `_Exchange`, parallel/pipefusion/stage.py, parallel/shard.py); activations are an estimate
(a block's widest working set: the MLP's 4x hidden twice, q/k/v, the attention output, the residual stream), so the
check refuses only what cannot fit the device's total memory; what does not fit its *free* memory is reported.
Pure python: the shape comes from parallel/costmodel.ModelShape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .comm import split_sizes
from .config import ConfigError, ParallelConfig

ACT_WIDTHS = 14        # hidden-widths live at a block's peak per token: MLP in/out of 4h (8), q/k/v (3), attention
                       # output (1), residual and its norm (2)
DEVICE_RESERVE = 0.92  # of a GPU's total memory a rank may plan to use (CUDA context, allocator fragmentation)


@dataclass
class RankMemory:
    """Predicted bytes one rank holds at its peak, by item (the largest rank of the config)."""
    items: dict = field(default_factory=dict)
    shared_weights: bool = False  # CPU ranks map one host copy of the weights (counted once for the host)

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def largest(self) -> tuple:
        return max(self.items.items(), key=lambda kv: kv[1])

    def describe(self) -> str:
        return ", ".join(f"{k} {gib(v)}" for k, v in sorted(self.items.items(), key=lambda kv: -kv[1]) if v)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.0f} MiB"


def rank_memory(shape, weight_bytes: int, config: ParallelConfig, latent_shape, text: int, batch: int,
                act_bytes: int, cpu: bool = False) -> RankMemory:
    """The peak bytes of the busiest rank of `config` for a `latent_shape` latent (batch includes CFG's halves as
    ComfyUI batches them), `text` text tokens, activations of `act_bytes` bytes (the compute dtype)."""
    c = config
    tokens = shape.tokens(latent_shape)
    n_batch = c.cfg_degree * c.dp_degree
    b = max(split_sizes(batch, n_batch)) if batch >= n_batch else batch
    sp, u, r = c.sp_degree, c.ulysses_degree, c.ring_degree
    heads_u = max(split_sizes(shape.heads, u)) // max(1, c.tp_degree) or 1
    D, hidden = shape.head_dim, shape.hidden
    items = {}
    # weights
    if c.tp_degree > 1:
        items["weights (tensor-parallel slice)"] = weight_bytes // c.tp_degree
    elif c.pp_degree > 1:
        items["weights (pipeline stage)"] = math.ceil(weight_bytes / c.pp_degree)
    elif c.shard_weights != "none":
        span = sp if c.shard_weights == "sequence" else c.world_size
        # a rank keeps 1/span of every block and gathers one block whole, the next in flight (parallel/shard.py)
        items["weights (shard)"] = math.ceil(weight_bytes / span)
        items["weights gathered around a block"] = 2 * math.ceil(weight_bytes / max(1, shape.blocks))
    else:
        items["weights"] = weight_bytes
    # one block's activations at this rank's sequence share (text split like the image where the plan splits it)
    p_rank = max(split_sizes(tokens, sp))
    t_rank = max(split_sizes(text, sp)) if shape.splits_text(text, sp) else text
    seq = tokens + (0 if shape.cross_text else text)
    items["activations (one block, estimate)"] = b * (p_rank + t_rank) * hidden * ACT_WIDTHS * act_bytes
    if u > 1:  # Ulysses: q/k/v of the whole sequence for this rank's heads, received; its own rows sent
        items["ulysses exchange"] = b * 3 * (seq * heads_u * D + (p_rank + t_rank) * hidden) * act_bytes
    if r > 1:  # ring: an fp32 running result and LSE, one block received while the next travels
        rows = max(split_sizes(tokens, sp)) * u + t_rank
        items["ring buffers"] = b * heads_u * rows * D * 4 + 2 * 2 * b * heads_u * rows * D * act_bytes
    if c.method == "distrifusion" and c.world_size > 1:
        # two exchanges (one read as stale while the next fills), each: every layer's padded K/V from every rank
        # plus this rank's own to send
        n = c.ulysses_degree
        P = max(split_sizes(tokens, n))
        per_exchange = (shape.attention_layers or shape.blocks) * 2 * b * shape.heads * P * D * act_bytes * (n + 1)
        items["DistriFusion K/V buffers"] = 2 * per_exchange
    if c.pp_degree > 1:  # a stage keeps its layers' image K/V for the whole latent
        stage_layers = math.ceil(shape.blocks / c.pp_degree)
        items["PipeFusion K/V buffers"] = stage_layers * 2 * b * heads_u * tokens * D * act_bytes
    if sp > 1 or n_batch > 1:  # the gathered output (fp32 on its way back)
        items["gathered output"] = batch * tokens * shape.out_per_token * 4
    return RankMemory(items, shared_weights=cpu and c.whole_model)


def _fix(name: str) -> str:
    if name.startswith("DistriFusion"):
        return ("DistriFusion keeps every layer's K/V of the whole image: use method 'usp' (exact, no K/V buffers) "
                "or a smaller latent")
    if name.startswith("PipeFusion"):
        return "raise pp_degree (fewer layers per stage), or use Ulysses / Ring instead of PipeFusion"
    if name.startswith("weights"):
        return ("split the weights: shard_weights 'all' (every rank keeps 1/N), tp_degree > 1, or fp8 weights "
                "(UNETLoader's weight_dtype); or more devices")
    return "raise ulysses_degree / ring_degree (each rank holds fewer tokens), or a smaller latent / batch"


def _fixes(mem: RankMemory) -> str:
    """The fix for each item that is at least a fifth of the rank's bytes, largest first."""
    big = [n for n, v in sorted(mem.items.items(), key=lambda kv: -kv[1]) if v >= 0.2 * mem.total] or \
        [mem.largest()[0]]
    return "; ".join(dict.fromkeys(_fix(n) for n in big))


NVLINK_BPS, PCIE_BPS = 450e9, 25e9  # per GPU and direction: NVLink 4 (H100 SXM), PCIe 4 x16 (the cost model's links)


def shard_traffic(weight_bytes: int, config: ParallelConfig) -> str:
    """What weight sharding costs in transfers, said before a run: every forward all-gathers (N-1)/N of the model
    (parallel/shard.py) - hidden behind compute over NVLink, seconds per forward over PCIe. '' without sharding."""
    if config.shard_weights == "none":
        return ""
    span = config.sp_degree if config.shard_weights == "sequence" else config.world_size
    moved = weight_bytes * (span - 1) / span
    return (f"shard_weights={config.shard_weights!r}: each forward gathers {gib(moved)} of weights per rank - about "
            f"{moved / NVLINK_BPS * 1e3:.0f} ms over NVLink, {moved / PCIE_BPS:.1f} s over PCIe; without NVLink, "
            f"prefer fp8 weights or tp_degree if they fit")


def host_memory_bytes() -> int:
    """This machine's RAM (MemTotal; what CPU ranks share), or 0 where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_fits(mem: RankMemory, capacity: int, where: str, config: ParallelConfig, ranks_on_host: int = 1,
               weight_bytes: int = 0) -> None:
    """Refuse (ConfigError naming the numbers and the fix) a rank that needs more than `capacity` bytes (a GPU's
    total memory; for CPU ranks the host's, shared by `ranks_on_host` ranks that map one copy of the weights)."""
    if capacity <= 0:
        return  # unknown capacity: nothing to check against
    need = mem.total
    if ranks_on_host > 1:
        shared = weight_bytes if mem.shared_weights else 0
        need = shared + ranks_on_host * (mem.total - shared)
    budget = int(capacity * (DEVICE_RESERVE if ranks_on_host == 1 else 0.9))
    if need > budget:
        who = f"{ranks_on_host} ranks on {where}" if ranks_on_host > 1 else f"each rank on {where}"
        raise ConfigError(f"{config.describe()} needs about {gib(need)} for {who}, which has {gib(capacity)} "
                          f"({mem.describe()}); {_fixes(mem)}")
