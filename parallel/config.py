"""The user-facing description of a parallel run.

A `ParallelConfig` is frozen and validated on construction so that a bad
combination is refused *before* any process is started or any step is run;
every message names the field to change and, where one exists, a value that
would work (xDiT #345: degrees that don't multiply to the device count gave a
confusing error deep inside NCCL).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

METHODS = ("usp", "distrifusion")
SHARD_CHOICES = ("none", "sequence", "all")


class ConfigError(ValueError):
    """A ParallelConfig that cannot run; the message says what to change."""


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def normalize_devices(devices) -> tuple:
    """The devices list as the workers will use it (`cuda:N` or `cpu`, lower case, no blanks), refused where one
    world could not run on it: every rank of a world talks through one backend (NCCL for GPUs, gloo for CPUs), so
    CPU and CUDA ranks do not mix; NCCL cannot put two ranks on one GPU, and fails on it only at the first
    collective, after the whole weight load, hence the check here; a bare `cuda` names no GPU."""
    out = []
    for d in devices:
        name = str(d).strip().lower()
        kind, sep, index = name.partition(":")
        if kind == "cpu" and not sep:
            out.append("cpu")
        elif kind == "cuda" and sep and index.isdigit():
            out.append(f"cuda:{int(index)}")
        elif kind == "cuda":
            raise ConfigError(f"device {str(d)!r} names no GPU: list one index per rank, e.g. cuda:0,cuda:1")
        else:
            raise ConfigError(f"device {str(d)!r} is neither cpu nor cuda:<index>; e.g. cuda:0,cuda:1 or cpu,cpu")
    kinds = {d.partition(":")[0] for d in out}
    if len(kinds) > 1:
        raise ConfigError(f"devices {', '.join(out)} mix CPU and CUDA ranks; one world talks through one backend "
                          f"(NCCL between GPUs, gloo between CPU processes): list only cuda:<index> devices or only cpu")
    seen = [d for i, d in enumerate(out) if d.startswith("cuda") and d in out[:i]]
    if seen:
        raise ConfigError(f"devices list {', '.join(sorted(set(seen)))} more than once; NCCL runs one rank per GPU: "
                          f"list distinct GPUs, or lower the degrees to the number of GPUs")
    return tuple(out)


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of every parallel axis, innermost (tp) to outermost (dp).

    world_size = dp * cfg * pp * ring * ulysses * tp; sp = ulysses * ring.
    `method` picks what the sequence ranks do: "usp" (exact Ulysses/Ring
    attention) or "distrifusion" (displaced patch parallelism with stale
    activations, which reuses the sp ranks as patch ranks).
    """

    dp_degree: int = 1
    cfg_degree: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    pp_degree: int = 1
    num_pipeline_patch: Optional[int] = None
    attn_layer_num_for_pp: Optional[tuple] = None
    tp_degree: int = 1
    warmup_steps: int = 1
    method: str = "usp"
    devices: tuple = field(default=())
    # weight sharding (parallel/shard.py): "none", "sequence" (over the ulysses x ring ranks) or "all" (the world)
    shard_weights: str = "none"

    def __post_init__(self) -> None:
        for name in ("dp_degree", "cfg_degree", "ulysses_degree", "ring_degree", "pp_degree", "tp_degree"):
            _check_int(name, getattr(self, name), 1)
        _check_int("warmup_steps", self.warmup_steps, 0)
        if self.cfg_degree not in (1, 2):
            raise ConfigError(
                f"cfg_degree must be 1 or 2 (a CFG batch has two halves: conditional and unconditional), "
                f"got {self.cfg_degree}; use dp_degree to split the batch further")
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {METHODS}, got {self.method!r}")

        # PipeFusion knobs.
        if self.num_pipeline_patch is None:
            object.__setattr__(self, "num_pipeline_patch", self.pp_degree)
        _check_int("num_pipeline_patch", self.num_pipeline_patch, 1)
        if self.pp_degree > 1 and self.num_pipeline_patch < self.pp_degree:
            raise ConfigError(
                f"num_pipeline_patch ({self.num_pipeline_patch}) must be >= pp_degree ({self.pp_degree}) so every "
                f"pipeline stage has a patch to work on; set num_pipeline_patch to {self.pp_degree} or more")
        if self.pp_degree == 1 and self.num_pipeline_patch != 1:
            raise ConfigError(
                f"num_pipeline_patch={self.num_pipeline_patch} only applies to PipeFusion; "
                f"set pp_degree > 1 or num_pipeline_patch to 1")
        if self.attn_layer_num_for_pp is not None:
            layers = tuple(self.attn_layer_num_for_pp)
            object.__setattr__(self, "attn_layer_num_for_pp", layers)
            if len(layers) != self.pp_degree:
                raise ConfigError(
                    f"attn_layer_num_for_pp has {len(layers)} entries but pp_degree is {self.pp_degree}: "
                    f"give one layer count per pipeline stage")
            for i, n in enumerate(layers):
                _check_int(f"attn_layer_num_for_pp[{i}]", n, 1)

        # Combinations we refuse, with the reason.
        if self.tp_degree > 1 and self.pp_degree > 1:
            raise ConfigError(
                "tp_degree > 1 with pp_degree > 1 is not supported: PipeFusion's per-stage KV buffers hold full "
                "heads while tensor parallel shards them; set tp_degree=1 or pp_degree=1")
        if self.method == "distrifusion" and (self.pp_degree > 1 or self.tp_degree > 1 or self.ring_degree > 1):
            raise ConfigError(
                "method='distrifusion' splits the image into one patch per sequence rank: set its degree with "
                "ulysses_degree and keep ring_degree=1, pp_degree=1 and tp_degree=1")

        if self.shard_weights not in SHARD_CHOICES:
            raise ConfigError(f"shard_weights must be one of {SHARD_CHOICES}, got {self.shard_weights!r}")
        if self.shard_weights != "none":
            if self.tp_degree > 1 or self.pp_degree > 1:
                raise ConfigError(
                    "shard_weights with tensor parallel or PipeFusion: those split the weights themselves (per "
                    "layer slice / per stage); set shard_weights to 'none', or tp_degree and pp_degree to 1")
            span = self.sp_degree if self.shard_weights == "sequence" else self.world_size
            if span == 1:
                raise ConfigError(
                    f"shard_weights={self.shard_weights!r} shards over {'the ulysses x ring ranks' if self.shard_weights == 'sequence' else 'the world'}, "
                    f"which is one rank here: raise ulysses_degree or ring_degree"
                    f"{', or use shard_weights=all' if self.world_size > 1 else ''}, or set shard_weights to 'none'")
        devices = normalize_devices(self.devices)
        object.__setattr__(self, "devices", devices)
        if devices and len(devices) != self.world_size:
            raise ConfigError(
                f"the degrees multiply to a world of {self.world_size} processes "
                f"({self.describe()}), but {len(devices)} device(s) were listed ({', '.join(devices)}); "
                f"list {self.world_size} devices or lower the degrees")

    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def world_size(self) -> int:
        return self.dp_degree * self.cfg_degree * self.pp_degree * self.sp_degree * self.tp_degree

    def describe(self) -> str:
        parts = [f"{n}{getattr(self, n + '_degree')}" for n in ("dp", "cfg", "pp", "ring", "ulysses", "tp")
                 if getattr(self, n + "_degree") > 1]
        if self.shard_weights != "none":
            parts.append(f"shard:{self.shard_weights}")
        return "·".join(parts) or "serial"

    @property
    def intercepts_attention(self) -> bool:
        """Whether the workers need attention calls they can intercept (sequence or pipeline parallel): they then
        import ComfyUI with its pytorch kernel (workers/bridge/build.py import_comfy)."""
        return self.sp_degree > 1 or self.pp_degree > 1

    def world_key(self, split_kernel: bool = True) -> tuple:
        """What the worker processes depend on: a config change that keeps this key reuses the running workers
        (their torch.distributed world and the ComfyUI imported in them); each rank builds the process groups of
        a new mesh_key in place. `split_kernel`: keep worlds that intercept attention apart from those that do not
        (ComfyUI picks its attention kernel once, at import; moot where the driver's kernel is pytorch's anyway)."""
        return (self.world_size, self.devices, self.intercepts_attention if split_kernel else None)

    def mesh_key(self) -> tuple:
        """What the process groups and a resident model's layout depend on: configs with the same key share them."""
        return (self.dp_degree, self.cfg_degree, self.pp_degree, self.ring_degree,
                self.ulysses_degree, self.tp_degree, self.devices, self.shard_weights)

    @property
    def whole_model(self) -> bool:
        """Every rank holds every weight whole: no tensor-parallel slices, PipeFusion stages or weight shards. Only
        then can a rank rebuild another layout from its weights, or apply weight patches to them."""
        return self.tp_degree == 1 and self.pp_degree == 1 and self.shard_weights == "none"

    @property
    def batch_only(self) -> bool:
        """Only the batch is split (cfg / dp): every rank runs the whole model as it is, so any model can run it
        (parallel/models/any_model.py)."""
        return self.whole_model and self.sp_degree == 1

    def layout_key(self) -> tuple:
        """What a resident model's parallelized layout depends on: the mesh and the method. USP and DistriFusion on
        the same ranks share process groups but not a model: DistriFusion's hooks keep stale K/V and a step count,
        so a model parallelized for one method must never serve the other."""
        return self.mesh_key() + (self.method,)

    def layout_name(self) -> str:
        """layout_key as the name a rank files a parallelized model under (and reports it by: workers/residency.py)."""
        return "-".join(map(str, self.layout_key()))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown ParallelConfig field(s): {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        for k in ("attn_layer_num_for_pp", "devices"):
            if isinstance(d.get(k), list):
                d[k] = tuple(d[k])
        return cls(**d)

    def check_world(self, available: int, kind: str = "device") -> None:
        """Refuse a world larger than what the machine has, naming the axes to lower."""
        if self.world_size > available:
            raise ConfigError(
                f"the degrees ({self.describe()}) need {self.world_size} {kind}s but only {available} "
                f"are available; lower a degree so the product is at most {available}")
