"""A cost model of one diffusion step per parallel config, and the `auto` choice built on it.

Why a model and not a rule of thumb: whether a second rank helps depends on the model (blocks, width, heads),
the tokens, whether CFG doubles the batch, and the devices (a rank's throughput, the link). On this 2-core CPU a
tiny model's step is mostly fixed costs and a second rank only adds collectives; on 8 NVLinked H100s Flux's
attention dominates and Ulysses scales. The model is: compute (FLOPs from the shape / a throughput per rank) +
per-block fixed cost + communication (the exact bytes this implementation sends - bench/comm_volume.py's
formulas, asserted equal in tests/engine/test_costmodel.py - over a link bandwidth, plus a latency per collective) +
the driver's round trip and a per-rank dispatch cost. `choose` returns a config only when it is predicted faster
than degree 1 by a margin: never slower is the point.

Pure torch/python: nothing here imports ComfyUI (shape_from_module reads a module it is handed).
"""
from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional

from .comm import split_sizes
from .config import ConfigError, ParallelConfig
from .models import ADAPTERS, _match

# families whose text enters by cross-attention (the rest put it in the self-attention: MMDiT / single stream)
CROSS_TEXT = frozenset({"pixart", "wan", "wan_vace", "wan_camera", "ltxv", "ltxav", "cosmos_predict2"})
ULYSSES_CALLS_PER_LAYER = 2  # parallel/usp.py: q|k|v in one all-to-all, output (+ replicated text's heads) back
_TEXT_NAMES = ("txt", "context", "add_", "cap_", "kv_linear", "cross_attn.k", "cross_attn.v", "attn2.to_k",
               "attn2.to_v", "attn.w1", "mlpC")  # AuraFlow's text projections: attn.w1q/k/v/o, mlpC


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a forward depends on. `img_params` / `txt_params`: matmul weights one image / text token
    goes through per forward (modulation Linears excluded: they run once per sample, not per token)."""
    family: str
    blocks: int                 # self-attention layers
    text_blocks: int            # of those, layers whose self-attention also holds the text (MMDiT, single stream)
    hidden: int
    heads: int
    img_params: int
    txt_params: int
    out_per_token: int          # features of the gathered final output per token (patch cells x channels)
    patch: tuple = (1, 2, 2)    # latent cells per token: (frames, rows, cols)
    params: int = 0
    act_bytes: int = 4          # bytes per activation element on the wire (fp32 4, bf16 2)
    cross_text: bool = False    # text enters by cross-attention (PixArt, Wan)
    # the family's plan splits the joint text over the sequence ranks too (when it has at least one token per
    # rank); None: read from the family's adapter (SD3, Flux, Qwen-Image, Chroma do; Lumina 2, HunyuanVideo not)
    text_split: Optional[bool] = None
    # self-attention calls per forward where a block holds more than one (SD3.5's attn2); 0: one per block
    attention_layers: int = 0

    def __post_init__(self):
        for name in ("blocks", "hidden", "heads", "out_per_token", "act_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0 <= self.text_blocks <= self.blocks:
            raise ValueError(f"ModelShape.text_blocks must be in [0, blocks={self.blocks}], got {self.text_blocks}")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.text_split is None:
            object.__setattr__(self, "text_split", _plan_splits_text(self.family))

    def splits_text(self, text: int, sp: int) -> bool:
        """Whether `text` tokens are split over `sp` sequence ranks (parallel/plan.py: each rank needs one)."""
        return bool(self.text_split and self.text_blocks and sp > 1 and text >= sp)

    def shards(self, p: int, text: int, n: int, joint: bool) -> list:
        """Tokens per sequence rank in a layer: the image shards, plus the text's in a joint layer that splits it."""
        img = split_sizes(p, n)
        if joint and self.splits_text(text, n):
            return [a + b for a, b in zip(split_sizes(text, n), img)]
        return img

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def dit(cls, family: str, blocks: int, hidden: int, heads: int, mlp_ratio: float = 4.0, single_blocks: int = 0,
            out_per_token: int = 64, patch=(1, 2, 2), act_bytes: int = 2, cross_text: Optional[bool] = None):
        """A named DiT from its published sizes: `blocks` double-stream (MMDiT) or cross-attention blocks and
        `single_blocks` single-stream ones (Flux). Per block and token: q, k, v, out (4h^2) + MLP (2r h^2)."""
        cross = family in CROSS_TEXT if cross_text is None else cross_text
        per = int((4 + 2 * mlp_ratio) * hidden * hidden)
        if cross:  # image: self-attn, cross q/out, MLP; text: the cross-attention's k and v
            img, txt = blocks * (per + 2 * hidden * hidden), blocks * 2 * hidden * hidden
        else:      # double blocks: a stream each; single blocks: both streams through the same weights
            img = txt = (blocks + single_blocks) * per
        n = blocks + single_blocks
        return cls(family=family, blocks=n, text_blocks=0 if cross else n, hidden=hidden, heads=heads,
                   img_params=img, txt_params=txt, out_per_token=out_per_token, patch=tuple(patch),
                   params=img + (0 if cross else blocks * per), act_bytes=act_bytes, cross_text=cross)

    def tokens(self, latent_shape) -> int:
        """Image tokens of a latent (B, C, H, W) or (B, C, T, H, W): every cell padded up to whole patches."""
        dims = tuple(latent_shape[2:])
        if len(dims) == 2:
            dims = (1,) + dims
        pt, ph, pw = self.patch
        return math.ceil(dims[0] / pt) * math.ceil(dims[1] / ph) * math.ceil(dims[2] / pw)

    def facts(self, p: int, text: int) -> dict:
        """bench/comm_volume.py's `model_facts` dict for p image and `text` text tokens."""
        layers = [True] * self.text_blocks + [False] * (self.blocks - self.text_blocks)
        return dict(p=p, T=text, H=self.heads, D=self.head_dim, layers=layers, c_out=self.out_per_token,
                    out_ps=p * self.out_per_token)

    def forward_flops(self, p: int, text: int, batch: int, sp: int = 1) -> tuple:
        """(matmul FLOPs, attention FLOPs) of one rank's forward: image tokens split over `sp` ranks, text split
        too where the plan does (`splits_text`), else replicated (every rank projects all of it); attention
        split over sp (heads or query blocks)."""
        p_rank = max(split_sizes(p, sp))
        t_rank = max(split_sizes(text, sp)) if self.splits_text(text, sp) else text
        mm = 2 * batch * (self.img_params * p_rank + self.txt_params * t_rank)
        joint = p + text
        attn = 4 * batch * self.hidden * (self.text_blocks * joint * joint
                                          + (self.blocks - self.text_blocks) * p * (p + (text if self.cross_text else 0)))
        return mm, attn / sp


@dataclass(frozen=True)
class Link:
    """The link between ranks: bandwidth each rank sends at, a fixed cost per collective, and how much of ring
    attention's transfer hides behind its compute (GPU streams overlap; on CPU the gloo thread shares the core)."""
    bandwidth_Bps: float
    latency_s: float
    overlap: float = 0.0

    def __post_init__(self):
        if self.bandwidth_Bps <= 0 or self.latency_s < 0 or not 0 <= self.overlap <= 1:
            raise ValueError(f"Link needs bandwidth > 0, latency >= 0, overlap in [0, 1]; got {self}")

    def seconds(self, nbytes: float, calls: int = 1) -> float:
        return calls * self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class DeviceCost:
    """One kind of rank. GPU (cores = 0): a rank is a device with `flops` matmul FLOP/s. CPU (cores > 0): the
    ranks of a world share the cores (workers/launch.worker_threads: cores // world, a lone worker all of them)
    and `thread_speedup[t-1]` is the throughput at t threads relative to one thread, whose FLOP/s `flops` is."""
    name: str
    flops: float                    # effective matmul FLOP/s (one GPU, or one CPU thread)
    attn_flops: float               # effective attention FLOP/s
    link: Link
    cores: int = 0
    thread_speedup: tuple = (1.0,)
    rank_efficiency: float = 1.0    # a rank's throughput while other ranks run beside it (CPU: shared caches,
                                    # memory bandwidth, the gloo thread; 1 on separate GPUs)
    block_s: float = 0.0            # fixed cost per block and forward (kernel launches, Python, small tensors)
    forward_s: float = 0.0          # fixed cost per forward outside the blocks (embedders, RoPE tables, Python)
    step_s: float = 0.0             # the driver <-> pool round trip of one forward
    rank_s: float = 0.0             # per extra rank and forward (dispatch, shared memory, the gather's wait)

    def __post_init__(self):
        if self.flops <= 0 or self.attn_flops <= 0 or self.cores < 0 or not self.thread_speedup:
            raise ValueError(f"DeviceCost {self.name!r}: flops and attn_flops must be > 0, cores >= 0, "
                             f"thread_speedup non-empty")

    def threads(self, world: int) -> int:
        return 0 if not self.cores else (self.cores if world == 1 else max(1, self.cores // world))

    def speed(self, world: int) -> float:
        """Throughput of one rank in a world of `world` ranks, relative to `flops`."""
        shared = self.rank_efficiency if world > 1 else 1.0
        if not self.cores:
            return shared
        t = self.threads(world)
        ts = self.thread_speedup
        return shared * ts[min(t, len(ts)) - 1] * (t / len(ts) if t > len(ts) else 1.0)

    def with_cores(self, cores: int) -> "DeviceCost":
        return replace(self, cores=cores)


# ---------------------------------------------------------------- presets
# CPU: calibrated on this project's machine (AMD EPYC VM, 2 vCPUs, torch 2.13 CPU, gloo), bench/bench_costmodel.py
# --calibrate: fp32 matmul 88-93 GFLOP/s on one thread, CPU flash SDPA 68 GFLOP/s, times a model efficiency of
# 0.63 fitted to the medium SD3 step (238 ms on 1 thread, bench/results/scaling.md); 2 threads 1.66x one
# (143 ms, bench/results/overhead.md); two ranks each run at 0.86 of a lone one (scaling.md's CFG row); gloo
# between 2 processes: 0.34-0.44 ms per collective, 0.7-0.8 GB/s (probe); the fixed costs from the tiny model.
CPU_MATMUL_1T, CPU_SDPA_1T = 90e9, 68e9  # what `probe_cpu` measured on that machine
CPU_EPYC_2 = DeviceCost(name="cpu (EPYC VM, measured)", flops=CPU_MATMUL_1T * 0.63, attn_flops=CPU_SDPA_1T * 0.63,
                        link=Link(bandwidth_Bps=0.8e9, latency_s=0.4e-3, overlap=0.0), cores=2,
                        thread_speedup=(1.0, 1.66), rank_efficiency=0.86, block_s=0.4e-3, forward_s=5e-3,
                        step_s=1.5e-3, rank_s=2.0e-3)


def probe_cpu(threads: int = 1, reps: int = 3, calls: int = 3) -> dict:
    """This machine's fp32 matmul and CPU flash-SDPA FLOP/s at `threads` threads (min of `reps` x `calls`, after a
    warm-up), on the shapes the CPU preset was calibrated with: a 1101 x 256 x 1024 matmul, SDPA over 4 heads x
    1101 tokens x 64. ~0.1 s at 1 thread."""

    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(1101, 256, generator=g), torch.randn(256, 1024, generator=g)
        q = torch.randn(1, 4, 1101, 64, generator=g)
        out = {}
        for name, fn, flops in (("matmul_flops", lambda: a @ b, 2 * 1101 * 256 * 1024),
                                ("sdpa_flops", lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q),
                                 4 * 1101 * 1101 * 256)):
            fn()
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                best = min(best, (time.perf_counter() - t) / calls)
            out[name] = flops / best
        return out
    finally:
        torch.set_num_threads(old)


def probe_speed(device, threads: int = 1) -> float:
    """This rank's matmul throughput (FLOP/s) on `device`: a bf16 8192-square GEMM on a GPU (a few ms on any recent
    card), probe_cpu's fp32 matmul at `threads` threads on a CPU. What the sequence split weighs ranks by."""

    import torch
    if getattr(device, "type", "cpu") != "cuda":
        return probe_cpu(threads, reps=3, calls=2)["matmul_flops"]
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ a  # warm-up: cuBLAS picks its kernel
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a @ a
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def scaled_to(cost: DeviceCost, rates: dict) -> DeviceCost:
    """The CPU preset moved to a machine whose `probe_cpu` (1 thread) gave `rates`: compute and attention scale
    by the measured / calibrated throughput; threads, ranks, links and fixed costs keep the preset's figures."""
    m, s = rates["matmul_flops"] / CPU_MATMUL_1T, rates["sdpa_flops"] / CPU_SDPA_1T
    return replace(cost, name=f"cpu (probed here: matmul {rates['matmul_flops'] / 1e9:.0f}, SDPA "
                              f"{rates['sdpa_flops'] / 1e9:.0f} GFLOP/s per thread)",
                   flops=cost.flops * m, attn_flops=cost.attn_flops * s)
# H100 SXM: 989 TFLOP/s bf16 dense. Efficiency 35 % of it for the whole step's matmuls and attention: xDiT's
# published serial Flux.1-dev step at 1024^2 (6.71 s / 28 steps = 0.240 s, torch.compile) is ~33 % of peak, and
# FlashAttention-2 reaches ~35 % on H100 (FA3 more). NVLink 4: 450 GB/s per direction, an NCCL collective ~15 us;
# PCIe 4 x16: ~25 GB/s, ~30 us; ring K/V transfers overlap the attention (P2P on their own stream) - we assume
# 70 % of it hides (the blockwise kernels and the LSE merges are not free).
H100_PEAK = 989e12
H100_EFF, H100_ATTN_EFF = 0.35, 0.35
H100_NVLINK = DeviceCost(name="H100 SXM, NVLink", flops=H100_PEAK * H100_EFF, attn_flops=H100_PEAK * H100_ATTN_EFF,
                         link=Link(bandwidth_Bps=450e9, latency_s=15e-6, overlap=0.7), block_s=20e-6,
                         step_s=1.0e-3, rank_s=0.1e-3)
H100_PCIE = replace(H100_NVLINK, name="H100, PCIe 4", link=Link(bandwidth_Bps=25e9, latency_s=30e-6, overlap=0.7))
PRESETS = {"cpu": CPU_EPYC_2, "h100-nvlink": H100_NVLINK, "h100-pcie": H100_PCIE}


# ---------------------------------------------------------------- communication (bench/comm_volume.py's formulas)
def rank_bytes(shape: ModelShape, p: int, text: int, batch: int, config: ParallelConfig,
               coords: Optional[dict] = None) -> dict:
    """Bytes one rank sends in one forward, per counter name - the exact volume of this implementation
    (bench/comm_volume.py `analytic`, uneven splits included; tests/engine/test_costmodel.py asserts equality).
    `batch`: the batch on this rank's sequence group; coords: {"ulysses": u, "ring": rho} (default 0, 0)."""
    e, H, D = shape.act_bytes, shape.heads, shape.head_dim
    U, R = config.ulysses_degree, config.ring_degree
    u, rho = (coords or {}).get("ulysses", 0), (coords or {}).get("ring", 0)
    N, out = U * R, {}
    if N > 1:
        me = rho * U + u
        hu = split_sizes(H, U)
        h_loc = hu[u] if U > 1 else H
        for layers, joint in ((shape.text_blocks, True), (shape.blocks - shape.text_blocks, False)):
            s = shape.shards(p, text, N, joint)
            block = [sum(s[r * U:(r + 1) * U]) for r in range(R)]
            if layers and U > 1:
                out["all_to_all"] = out.get("all_to_all", 0) + layers * e * batch * D * (
                    3 * s[me] * (H - hu[u]) + hu[u] * (block[rho] - s[me]))
            if layers and R > 1:
                out["ring_p2p"] = out.get("ring_p2p", 0) + layers * e * 2 * batch * h_loc * max(block) * D * (R - 1)
        if U > 1 and text and shape.text_blocks and not shape.splits_text(text, N):
            # replicated text: its output's heads ride in the return all-to-all
            out["all_gather"] = shape.text_blocks * e * batch * hu[u] * text * D * (U - 1)
        out["all_gather"] = out.get("all_gather", 0) + e * batch * max(split_sizes(p, N)) * shape.out_per_token * (N - 1)
    return out


def batch_bytes(shape: ModelShape, p: int, batch: int, n: int) -> int:
    """CFG / DP: the model output gathered over the n batch ranks (comm_volume `analytic` for cfg/dp)."""
    return shape.act_bytes * max(split_sizes(batch, n)) * p * shape.out_per_token * (n - 1) if batch >= n > 1 else 0


def _collectives(shape: ModelShape, text: int, config: ParallelConfig) -> dict:
    """How many collective calls a forward makes, per op. parallel/usp.py's Ulysses: one all-to-all carries q, k
    and v in, one carries the output (and this rank's text heads, counted as "all_gather") back, per layer."""
    U, R = config.ulysses_degree, config.ring_degree
    calls = {}
    if U > 1:
        calls["all_to_all"] = ULYSSES_CALLS_PER_LAYER * shape.blocks
    if R > 1:
        calls["ring_p2p"] = (R - 1) * shape.blocks
    if U * R > 1:
        calls["all_gather"] = 1  # the final output; the text heads ride in the all-to-all
    return calls


def _plan_splits_text(family: str) -> bool:
    """Whether the family's plan (ComfyUI's class) declares a text split (a SplitInput with text=True)."""
    a = ADAPTERS.get(family)
    return a is not None and a.comfy_plan.splits_text


# ---------------------------------------------------------------- the prediction
def predict_step_s(shape: ModelShape, tokens: int, batch: int, config: ParallelConfig, cost: DeviceCost,
                   text: int = 77, kernel_speed=None) -> dict:
    """Predicted seconds of one forward (one sampler step: ComfyUI batches CFG's two halves into one call) of
    `batch` samples of `tokens` image tokens under `config`, with its parts. The slowest rank sets the time.

    `kernel_speed(batch, heads, length, threads)`: the speed of the attention kernel ComfyUI picked relative to
    torch's SDPA (which `cost.attn_flops` describes) for one rank's attention of that shape. Every rank of a
    world without ring attention runs that kernel (degree 1, cfg, dp - and Ulysses, parallel/attention_seam.py);
    ring attention runs SDPA-class kernels with a log-sum-exp. None: ComfyUI's kernel is SDPA."""
    n_batch = config.cfg_degree * config.dp_degree
    sp, world = config.sp_degree, config.world_size
    b_rank = max(split_sizes(batch, n_batch)) if batch >= n_batch else batch  # smaller: computed whole, redundant
    speed = cost.speed(world)
    mm, attn = shape.forward_flops(tokens, text, b_rank, sp)
    compute_s = mm / (cost.flops * speed)
    attn_s = attn / (cost.attn_flops * speed)
    ks = 1.0
    if kernel_speed is not None and config.ring_degree == 1:
        length = tokens + (text if shape.text_blocks else 0)  # a rank's attention sees the whole sequence
        ks = float(kernel_speed(b_rank, max(split_sizes(shape.heads, config.ulysses_degree)), length,
                                cost.threads(world)))
        attn_s /= ks
    fixed_s = shape.blocks * cost.block_s + cost.forward_s
    worst = {}
    for u, rho in itertools.product(range(config.ulysses_degree), range(config.ring_degree)):
        b = rank_bytes(shape, tokens, text, b_rank, config, {"ulysses": u, "ring": rho})
        if sum(b.values()) >= sum(worst.values()):
            worst = b
    calls = _collectives(shape, text, config)
    comm = {op: cost.link.seconds(nbytes, calls.get(op, 1)) for op, nbytes in worst.items()}
    if "ring_p2p" in comm:  # K/V blocks travel while the current block's attention runs
        comm["ring_p2p"] = max(comm["ring_p2p"] - cost.link.overlap * attn_s, calls["ring_p2p"] * cost.link.latency_s
                               * (1 - cost.link.overlap))
    gather = batch_bytes(shape, tokens, batch, n_batch)
    if n_batch > 1 and gather:
        comm["batch_gather"] = cost.link.seconds(gather)
    overhead_s = cost.step_s + (world - 1) * cost.rank_s
    total = compute_s + attn_s + fixed_s + sum(comm.values()) + overhead_s
    return {"config": config.describe(), "world": world, "threads": cost.threads(world), "compute_s": compute_s,
            "attention_s": attn_s, "kernel_speed": ks, "fixed_s": fixed_s, "comm_s": sum(comm.values()),
            "comm": comm, "bytes": {**worst, **({"batch_gather": gather} if gather else {})}, "overhead_s": overhead_s,
            "total_s": total}


def candidates(shape: ModelShape, tokens: int, batch: int, cfg_active: bool, n_devices: int) -> list:
    """Configs auto considers: ulysses / ring / cfg / dp degrees whose world fits the devices, with at most as many
    Ulysses ranks as heads, sequence ranks as tokens, batch ranks as samples; cfg 2 only when CFG is on."""
    out = []
    for cfg in ((1, 2) if cfg_active and batch >= 2 else (1,)):
        for dp in range(1, n_devices + 1):
            if dp > 1 and batch < cfg * dp:
                continue
            for u in range(1, min(shape.heads, n_devices) + 1):
                for r in range(1, n_devices + 1):
                    world = cfg * dp * u * r
                    if world <= n_devices and u * r <= tokens:
                        out.append(ParallelConfig(dp_degree=dp, cfg_degree=cfg, ulysses_degree=u, ring_degree=r))
    return out


def choose(shape: ModelShape, tokens: int, batch: int, cfg_active: bool, n_devices: int, cost: DeviceCost,
           text: int = 77, margin: float = 0.10, kernel_speed=None) -> tuple:
    """(ParallelConfig, table): the fastest candidate if it is predicted at least `margin` faster than degree 1,
    else degree 1. The table lists every candidate's prediction, fastest first (ties: the smaller world)."""
    if n_devices < 1:
        raise ConfigError(f"auto needs at least one device, got {n_devices}")
    table = [predict_step_s(shape, tokens, batch, c, cost, text, kernel_speed) | {"parallel_config": c}
             for c in candidates(shape, tokens, batch, cfg_active, n_devices)]
    table.sort(key=lambda r: (round(r["total_s"], 9), r["world"], r["parallel_config"].dp_degree))  # cfg before dp
    serial = next(r for r in table if r["world"] == 1)
    for r in table:
        r["speedup"] = serial["total_s"] / r["total_s"]
    best = table[0]
    chosen = best if best["speedup"] >= 1 + margin else serial
    for r in table:
        r["chosen"] = r is chosen
    return chosen["parallel_config"], table


def format_table(table: list, limit: int = 12) -> str:
    """A Markdown table of `choose`'s candidates (the first `limit`, the chosen one always shown)."""
    rows = [r for i, r in enumerate(table) if i < limit or r["chosen"]]
    md = ["| config | ranks | threads | compute ms | attention ms | comm ms | overhead ms | total ms | vs degree 1 |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["config"] + (" ← chosen" if r["chosen"] else "")
        md.append(f"| {name} | {r['world']} | {r['threads'] or '–'} | {1e3 * (r['compute_s'] + r['fixed_s']):.1f} | "
                  f"{1e3 * r['attention_s']:.1f} | {1e3 * r['comm_s']:.1f} | {1e3 * r['overhead_s']:.1f} | "
                  f"{1e3 * r['total_s']:.1f} | {r['speedup']:.2f}× |")
    return "\n".join(md)


# ---------------------------------------------------------------- reading a model
def _matches(pattern: str, name: str) -> bool:
    a, b = pattern.split("."), name.split(".")
    return len(a) == len(b) and all(x == "*" or x == y for x, y in zip(a, b))


def _block_prefix(pattern: str) -> str:
    """"blocks.*.attn" -> "blocks.*": the repeated block that holds the attention."""
    parts = pattern.split(".")
    return ".".join(parts[:parts.index("*") + 1]) if "*" in parts else pattern


def shape_from_module(model, act_bytes: Optional[int] = None) -> ModelShape:
    """The ModelShape of a ComfyUI diffusion model of any family in parallel/models: the blocks are
    the modules holding the adapter's self-attention; their Linear weights, read by name, are image-only,
    text-only (txt / context / cross-attention k, v) or both (a single-stream block); modulation Linears (once
    per sample) are left out. hidden = the most common Linear input width in the blocks; heads from the plan."""
    import torch

    found = _match(model)
    if found is None:
        raise ValueError(f"no adapter for {type(model).__name__}: cannot read its shape for auto")
    adapter, plan = found
    family = adapter.family
    cross = family in CROSS_TEXT
    modules = dict(model.named_modules())
    blocks, attention_layers = [], 0
    for pattern in plan.attention:
        prefix = _block_prefix(pattern)
        blocks += [n for n in modules if _matches(prefix, n)]
        calls = plan.attention[pattern].calls or (lambda module: 1)
        attention_layers += sum(calls(modules[n]) for n in modules if _matches(pattern, n))
    blocks = list(dict.fromkeys(blocks))  # a block holding two self-attentions (SD3.5's attn2) is one block
    heads = 0
    for attr in (plan.heads_attr, "num_heads", "n_heads", "heads", "num_attention_heads"):
        heads = heads or getattr(model, attr, 0)
    if not heads:  # a model that keeps the count on its attention modules only (LTX-Video)
        heads = next((getattr(modules[n], plan.heads_attr, 0) for n in modules for p in plan.attention
                      if _matches(p, n) and getattr(modules[n], plan.heads_attr, 0)), 0)
    img = txt = 0
    widths, text_blocks = Counter(), 0
    for name in blocks:
        linears = [(n, m) for n, m in modules[name].named_modules() if isinstance(m, torch.nn.Linear)
                   and "mod" not in n and "adaLN" not in n]
        texty = [any(t in n for t in _TEXT_NAMES) for n, _ in linears]
        joint_block = not cross and "refiner" not in name
        text_blocks += joint_block
        for (n, m), is_text in zip(linears, texty):
            w = m.in_features * m.out_features
            widths[m.in_features] += 1
            if is_text:
                txt += w
            else:
                img += w
                if joint_block and not any(texty):  # single stream: text tokens go through the same weights
                    txt += w
    if not blocks or not widths:
        raise ValueError(f"{type(model).__name__}: found no attention blocks ({list(plan.attention)}) to read")
    hidden = widths.most_common(1)[0][0]
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"{type(model).__name__}: no head count ({plan.heads_attr}) to read for auto")
    final = [m for n, m in modules.items() if isinstance(m, torch.nn.Linear) and "mod" not in n
             and n.split(".")[0] in ("final_layer", "head", "proj_out", "norm_out", "final_linear")]
    out_per_token = final[-1].out_features if final else hidden
    patch = (getattr(model, "patch_size", None) or getattr(getattr(model, "patchifier", None), "patch_size", None)
             or 2)  # LTX-Video's patchifier: (1, 1, 1)
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (1, int(patch), int(patch))
    patch = (1,) * (3 - len(patch)) + patch
    if act_bytes is None:
        dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
        act_bytes = 4 if dtype == torch.float32 else 2
    return ModelShape(family=family, blocks=len(blocks), text_blocks=text_blocks, hidden=hidden,
                      heads=heads, img_params=img, txt_params=txt, out_per_token=int(out_per_token),
                      patch=patch, params=sum(p.numel() for p in model.parameters()), act_bytes=act_bytes,
                      cross_text=cross, attention_layers=max(attention_layers, len(blocks)))
