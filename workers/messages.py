"""The typed messages of a run's model calls: what the driver sends and what a rank reads, through one class each
(a step-mode call: ForwardJob; the workers' whole loop: LoopJob; a model made resident: LoadJob, with the ComfyUI
model it builds: NativeSpec or VaeSpec, each with ComfyRuntime - how the rank imports ComfyUI).

Why: the ranks read about forty string keys out of payload dicts, so a key spelt one way by the driver and another
by a rank was a value silently missing (a `.get()` answering None) - a reuse not made, a hook group not switched.
A message is a frozen dataclass: the driver builds it by field name (a misspelt field is a TypeError where it is
written), it travels as JSON (`message()`), and a rank reads it back with `from_message()`, which refuses a field it
does not know. Like the load decision (workers/residency.LoadDecision); the tensors travel beside it, by name.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Optional, Union

from .protocol import VAE_FAMILIES  # (torch-free, as this module: see LoadJob)

_SEQUENCES = ("reuse", "changing", "conds")


def _set_fields(items) -> dict:
    """A message's fields as JSON: the unset ones (None, an empty sequence) left out, sequences as lists - at every
    level of nested messages (asdict's dict_factory), plain dict values as they are."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in items if v is not None and v != ()}


class _Message:
    """message() / from_message() of a frozen message dataclass: JSON out without the unset fields, and back in
    refusing a field the class does not know (the driver and the rank not the same version, or a misspelt key)."""
    _required = ("key",)
    _what = "a job"

    def _check_key(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"{self._what} names its resident model (key), got {self.key!r}")

    def message(self) -> dict:
        return asdict(self, dict_factory=_set_fields)

    @classmethod
    def from_message(cls, d: dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        what = cls.__name__
        if unknown:
            raise ValueError(f"{what}: unknown field(s) {unknown} (a {what} has {sorted(known)}): the driver "
                             f"and this rank are not the same version of the pack, or a field is misspelt")
        missing = [k for k in cls._required if k not in d]
        if missing:
            raise ValueError(f"{what}: no {', '.join(missing)} (a {what} needs {list(cls._required)})")
        return cls(**d)


@dataclass(frozen=True)
class ForwardJob(_Message):
    """One step-mode model call (workers/jobs.job_forward), built by workers/driver/step.py from what the proxy
    (workers/bridge/proxy.py) read of ComfyUI's call."""
    key: str                              # the resident model (workers/bridge/residency.weights_key)
    structure: dict = field(default_factory=dict)  # the call's arguments as JSON, tensors named beside it
    call_index: Optional[int] = None      # the sampler's model call in this run (DistriFusion's warmup / stale step)
    run: Optional[str] = None             # the run these calls belong to (inputs reused only within it)
    previous_call: Optional[int] = None   # the call whose unchanged inputs the workers hold
    reuse: tuple = ()                     # tensors equal to the previous call's: taken from the workers' copy
    changing: tuple = ()                  # tensors new at every call (the latent, the timestep): never kept
    object_values: Optional[dict] = None  # ComfyUI object patches of plain values, set around the call
    hooks: Optional[dict] = None          # the call's hook group (workers/bridge/carry.hook_call)
    bypass: Optional[dict] = None         # LoRA bypass adapters (workers/bridge/carry.bypass_call)
    conds: Optional[tuple] = None         # which conditionings the call holds (ComfyUI's cond_or_uncond)
    compile: Optional[dict] = None        # ComfyUI's TorchCompileModel options
    fbcache: Optional[dict] = None        # First Block Cache's rule and the call's sigma
    kwargs: Optional[dict] = None         # the call's arguments given whole (the doctor, tests) instead of structure
    _what = "a forward job"

    def __post_init__(self):
        for name in _SEQUENCES:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        self._check_key()

    def after(self, **changes) -> "ForwardJob":
        """This call with some fields set (the run's reuse of the previous call's inputs: step.submit_once)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class LoopJob(_Message):
    """The workers' whole denoising loop (loop mode, PipeFusion: workers/jobs.job_loop), built by
    workers/driver/loop.py; the noise, sigmas and conditioning tensors travel beside it by name."""
    key: str                              # the resident model
    sampler: str                          # ComfyUI's sampler name the workers' loop runs (parallel/sampling.py)
    convention: dict                      # how sigma and the model output map to ComfyUI's denoised (loop_convention)
    structure: dict = field(default_factory=dict)  # the captured conditioning as JSON, tensors named beside it
    cfg_scale: Optional[float] = None     # classifier-free guidance, None when the batch holds no uncond
    step_cache: Optional[dict] = None     # EasyCache's rule (ComfyUI's node or Parallel Config's step_cache)
    object_values: Optional[dict] = None  # ComfyUI object patches of plain values, set around the loop
    run: Optional[str] = None             # names the run's bypass adapters on the workers
    bypass: Optional[dict] = None         # LoRA bypass adapters (workers/bridge/carry.bypass_call)
    previews: Optional[bool] = None       # rank 0 sends its denoised latent each step (set by the pool's submit)
    _required = ("key", "sampler", "convention")
    _what = "a loop job"

    def __post_init__(self):
        self._check_key()


class _Part(_Message):
    """A message inside a message (a model spec, its ops, ComfyUI's runtime): no resident key of its own to check;
    its nested parts given as their JSON form are read back through their own class in __post_init__, so that a
    misspelt field deep inside fails at the rank's from_message too, naming it, and from_message(message()) is
    equal. `_parts`: (field, class) of those parts."""
    _required = ()
    _parts = ()

    def __post_init__(self):
        for name, cls in self._parts:
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, cls.from_message(value))
            elif not isinstance(value, cls):
                raise TypeError(f"{type(self).__name__}.{name} is a {cls.__name__} (or its message), "
                                f"got {type(value).__name__}")


@dataclass(frozen=True)
class ComfyRuntime(_Part):
    """How a rank imports ComfyUI as the driver's process did (workers/bridge/build.comfy_runtime): where it lives,
    the flags that choose its kernels and device, and the attention kernel it picked (by ComfyUI's registry name)."""
    comfy_dir: Optional[str] = None       # ComfyUI's directory, put on the rank's sys.path
    comfy_args: dict = field(default_factory=dict)  # build.FORWARDED_ARGS as the driver's ComfyUI has them
    attention: Optional[str] = None       # the driver's attention kernel, for the Ulysses ranks


@dataclass(frozen=True)
class ModelOps(_Part):
    """The facts comfy.ops.pick_operations chose ComfyUI's operations class by (or a custom loader's operations, by
    name): the ranks pick the same (workers/bridge/build.py). Dtypes encoded (carry.encode_value)."""
    weight_dtype: Optional[dict] = None   # unet_config's dtype
    manual_cast_dtype: Optional[dict] = None
    fp8_optimizations: bool = False
    scaled_fp8: Optional[dict] = None     # ComfyUI <= 0.3.x's scaled-fp8 checkpoints
    custom: Optional[dict] = None         # a custom loader's operations (GGUF: loader_types.describe_operations)
    quant_config: Optional[dict] = None   # ComfyUI's mixed-precision ops (quantized checkpoints)
    disabled: Optional[list] = None       # the quantized formats the driver's device emulates


@dataclass(frozen=True)
class NativeSpec(_Part):
    """ComfyUI's diffusion model as a rank builds it (workers/bridge/build.build_native), written by
    workers/bridge/spec.native_spec: the class, its unet_config (encoded), the ops and how the weights that travel
    beside it are rebuilt."""
    module: str                           # the diffusion model's module
    class_name: str                       # its qualified name in that module
    unet_config: dict                     # ComfyUI's unet_config, encoded (carry.encode_value)
    ops: ModelOps
    runtime: ComfyRuntime
    tensors: Optional[dict] = None        # a custom loader's tensors (GGUF): {name: loader_types.describe}
    packages: Optional[list] = None       # the custom nodes' folders those tensors' classes come from
    quantized: Optional[dict] = None      # ComfyUI's quantized weights: {name: loader_types.quantized_tensors entry}
    compute_dtype: Optional[dict] = None  # a ModelComputeDtype node's dtype (encoded), with force_cast
    force_cast: bool = False
    patcher: Optional[dict] = None        # a loader's ModelPatcher that patches its own way (GGUF), with patches
    _required = ("module", "class_name", "unet_config", "ops", "runtime")
    _parts = (("ops", ModelOps), ("runtime", ComfyRuntime))


@dataclass(frozen=True)
class VaeSpec(_Part):
    """ComfyUI's VAE model as a rank builds it (workers/bridge/build.build_native_vae), written by
    workers/bridge/vae.native_vae_spec: ComfyUI's detection picks the class from the weights, checked against these."""
    class_name: str                       # module.qualname of the driver's first_stage_model
    runtime: ComfyRuntime
    dtype: Optional[dict] = None          # the VAE's dtype (encoded)
    attrs: dict = field(default_factory=dict)  # the classes it was built with, by name (vae.settings)
    metadata: Optional[dict] = None       # a configuration the weights alone do not give (LTX)
    _required = ("class_name", "runtime")
    _parts = (("runtime", ComfyRuntime),)


@dataclass(frozen=True)
class LoadJob(_Message):
    """A model made resident on every rank as the driver decided (workers/load_job.job_load_model), built by
    workers/pool.py; the weights and the patches' tensors travel beside it by name."""
    key: str                              # the model's residency key
    family: str                           # the family adapter it runs under (parallel/models), or "vae_comfy"
    decision: dict                        # the driver's LoadDecision (workers/residency.py), as its message()
    native: Optional[Union[NativeSpec, VaeSpec]] = None  # ComfyUI's model (or VAE) the rank builds
    lineage: Optional[str] = None         # this model under other patches: another version is replaced, not kept
    patch_spec: Optional[dict] = None     # ComfyUI's weight patches (workers/bridge/patches.py), their tensors beside
    _required = ("key", "family", "decision")
    _what = "a load job"

    def __post_init__(self):
        """`native` given as its JSON form is read back as the spec the family builds: a VaeSpec for a VAE family
        (workers/protocol.VAE_FAMILIES), else a NativeSpec. Chosen by the family and not by a field of its own: the
        family already says what the rank builds, and a second statement of it could disagree with the first."""
        self._check_key()
        if self.native is not None:
            object.__setattr__(self, "native", typed_native(self.family, self.native, f"{self._what} {self.key!r}"))


def typed_native(family: str, native, what: str):
    """`native` as the spec `family` builds - a VaeSpec for a VAE family (workers/protocol.VAE_FAMILIES), else a
    NativeSpec - read back from its JSON form; a ValueError naming `what` for a misspelt field or the other kind.
    LoadJob reads its spec through it, and the pool checks a spec with it before any weight is written."""
    kind = VaeSpec if family in VAE_FAMILIES else NativeSpec
    if isinstance(native, dict):
        try:
            return kind.from_message(native)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: its native spec: {e}") from None
    if not isinstance(native, kind):
        raise ValueError(f"{what} of family {family!r} builds from a {kind.__name__}, got a {type(native).__name__}")
    return native
