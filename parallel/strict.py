"""Strict mode: CPU (gloo) ranks that fail where NCCL ranks on GPUs would.

Every test runs on CPU with gloo, which forgives what NCCL does not: a collective's tensors may be on the host,
a send completes before anyone receives it, ranks may issue collectives in different orders and gloo sorts it
out by tag or fails with a clear error. On GPUs each of those is a crash ("Tensors must be CUDA") or a hang
found only on the first multi-GPU run. Strict mode makes a CPU world behave as an NCCL world would:

- **Device discipline** (`DeviceDiscipline`, a TorchFunctionMode): a rank computes on a *virtual* compute
  device, `cpu:0`, standing for `cuda:N`; the plain `cpu` device stands for the host. Tensors made without a
  device (`torch.tensor([..])`, `torch.arange(n)`) or moved with `.cpu()` / `.to("cpu")` are host tensors, as
  they would be next to CUDA; `.to(ctx.device)` and `device=x.device` of a compute tensor make compute tensors.
  A host tensor (not a 0-dim scalar) meeting compute tensors in one op raises, as CUDA's "Expected all tensors
  to be on the same device" would; so does `.numpy()` of a compute tensor.
- **Collectives** (`StrictComm.install` wraps torch.distributed): every tensor must be on the compute device;
  fp8 is refused in reductions (not an NCCL reduction type); before each collective the ranks of its group
  compare (sequence number, operation, element count) over a twin gloo group, so a rank that issues another
  collective, or the same one with another size, fails on every rank with both named instead of hanging.
- **Point-to-point**: tags are dropped (NCCL ignores them: messages between two ranks match in order). A send
  that does not complete until the matching receive is posted needs nothing here: gloo's tcp transport already
  waits for the receiver (measured: a send waited on before its peer posts the receive times out on plain gloo,
  tests/engine/test_strict_comm.py keeps that so).

Enabled in pool workers by HP_STRICT_COMM=1 (tests/conftest.py sets it for the whole test session); it patches
the torch.distributed functions of the worker process once, after init_process_group, and the executor runs
every compute job inside `DeviceDiscipline`. Never enabled in production: it doubles the collectives.
"""
from __future__ import annotations

import inspect
import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

ENV = "HP_STRICT_COMM"
HOST = torch.device("cpu")
COMPUTE = torch.device("cpu", 0)  # the virtual device a strict CPU rank computes on (stands for cuda:N)
_TAG = "_hp_host"

_DEVICE = torch.Tensor.device  # its __get__ reaches a TorchFunctionMode as a new method-wrapper each time
_FACTORIES = frozenset((
    "tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace",
    "rand", "randn", "randint", "randperm", "eye", "empty_strided", "frombuffer", "from_numpy", "scalar_tensor",
    "tril_indices", "triu_indices", "normal", "bernoulli", "hann_window"))
# Ops that legitimately take a host tensor beside a compute one on CUDA (copies; indexing with host indices).
_MIXING_OK = frozenset(("copy_", "to", "__setitem__", "__getitem__", "type_as", "set_", "index_put_",
                        "__get__", "__set__", "item", "tolist", "size", "dim", "numel", "stride"))


class StrictDeviceError(RuntimeError):
    """Strict mode: an op or a collective that would fail on CUDA / NCCL."""


def enabled() -> bool:
    return os.environ.get(ENV, "").strip() not in ("", "0")


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and t.__dict__.get(_TAG, False)


def _mark(value, host: bool):
    if isinstance(value, torch.Tensor):
        if host:
            value.__dict__[_TAG] = True
        else:
            value.__dict__.pop(_TAG, None)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _mark(v, host)
    return value


def _tensors(values, out: list) -> list:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            _tensors(v, out)
        elif isinstance(v, dict):
            _tensors(v.values(), out)
    return out


def _host_device(d) -> Optional[bool]:
    """True: a device argument naming the host; False: the compute device (or an accelerator); None: not a device."""
    if isinstance(d, str):
        try:
            d = torch.device(d)
        except RuntimeError:
            return None
    if isinstance(d, int):
        return False  # a bare index names an accelerator
    if not isinstance(d, torch.device):
        return None
    if d.type == "meta":
        return None
    return d.type == "cpu" and d.index is None


def _shape(t) -> tuple:
    return tuple(t.shape)


class DeviceDiscipline(TorchFunctionMode):
    """Tracks which CPU tensors stand for host memory and which for the rank's compute device (module docstring)."""

    lenient = 0  # > 0 inside `lenient()`: calls pass through unchecked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.lenient:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DEVICE:
            d = func(*args)
            return COMPUTE if d.type == "cpu" and not is_host(args[0]) else d
        name = getattr(func, "__name__", "")
        target = self._target(func, name, args, kwargs)  # True host, False compute, None inherit
        tensors = _tensors(args, _tensors(kwargs.values(), []))
        hosts = [t for t in tensors if is_host(t)]
        if hosts and name not in _MIXING_OK and target is None:
            mixed = [t for t in tensors if not is_host(t) and t.device.type == "cpu"]
            big = [t for t in hosts if t.dim() > 0]
            if mixed and big:
                raise StrictDeviceError(
                    f"{name}: a host tensor {_shape(big[0])} {big[0].dtype} meets a tensor on the rank's compute "
                    f"device {_shape(mixed[0])} {mixed[0].dtype}; on CUDA this fails (\"Expected all tensors to be "
                    f"on the same device\"). Make it on the device (device=x.device / ctx.device) or move it "
                    f"with .to(device) [strict mode, {ENV}=1]")
        if name == "numpy" and tensors and not is_host(tensors[0]) and tensors[0].device.type == "cpu":
            raise StrictDeviceError("numpy(): the tensor is on the rank's compute device; on CUDA this fails. "
                                    f"Call .cpu() first [strict mode, {ENV}=1]")
        out = func(*args, **kwargs)
        if name.endswith("_") and tensors and out is tensors[0]:
            return out  # in place: the tensor keeps its device
        if target is None:
            target = bool(hosts) and len(hosts) == len(tensors)
        elif out is (args[0] if args else None) and is_host(out) != target and isinstance(out, torch.Tensor):
            out = out.view(out.shape)  # `.to()` returned its input: a moved tensor is another tensor on CUDA
        return _mark(out, target) if isinstance(out, (torch.Tensor, list, tuple)) else out

    @staticmethod
    def _target(func, name, args, kwargs) -> Optional[bool]:
        if "device" in kwargs and kwargs["device"] is not None:
            named = _host_device(kwargs["device"])
            if named is not None:
                return named
        if name == "cpu":
            return True
        if name == "cuda":
            return False
        if name == "to":
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    return is_host(a)
                named = _host_device(a)
                if named is not None:
                    return named
            return None
        if name in _FACTORIES and func is getattr(torch, name, None):
            if name in ("as_tensor", "asarray") and args and isinstance(args[0], torch.Tensor):
                return None
            return True  # no device: the host, as next to CUDA
        return None


# ---- collectives ----

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "broadcast", "reduce", "barrier",
                "gather", "scatter")
_P2P = ("isend", "irecv", "send", "recv")
_REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce")
_SAME_SIZE = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_single", "reduce")


class StrictComm:
    """Wraps torch.distributed in this process so that a gloo CPU world fails where NCCL would."""

    def __init__(self) -> None:
        self.real = {}
        self.order = {}   # group (None: world) -> twin gloo group for the order check
        self.seq = {}

    @staticmethod
    def installed() -> bool:
        return getattr(dist.all_reduce, "strict", False)

    def install(self) -> "StrictComm":
        names = _COLLECTIVES + _P2P + ("new_group",)
        for n in names:
            fn = getattr(c10d, n, None)
            if fn is not None:
                self.real[n] = fn
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.order[None] = self.real["new_group"](backend="gloo")
        for n in self.real:
            wrapped = self._p2p(n) if n in _P2P else getattr(self, "_" + n, None) or self._collective(n)
            for mod in (dist, c10d):
                if hasattr(mod, n):
                    setattr(mod, n, wrapped)
        return self

    # -- groups --
    def _new_group(self, ranks=None, *args, **kwargs):
        group = self.real["new_group"](ranks, *args, **kwargs)
        same = {k: v for k, v in kwargs.items() if k in ("timeout", "use_local_synchronization")}
        twin = self.real["new_group"](ranks, backend="gloo", **same)  # collective: every rank, in the same order
        if group not in (None, c10d.GroupMember.NON_GROUP_MEMBER):
            self.order[group] = twin
        return group

    @staticmethod
    def _key(group):
        return None if group is None or group is c10d.GroupMember.WORLD or group == dist.group.WORLD else group

    # -- checks --
    def _check_tensors(self, op: str, tensors) -> None:
        for t in _tensors(tensors, []):
            if is_host(t):
                raise StrictDeviceError(
                    f"{op}: a host tensor {_shape(t)} {t.dtype} in a collective; NCCL needs every tensor on the "
                    f"rank's GPU (\"Tensors must be CUDA\"). Make it with device=... of the data it describes "
                    f"[strict mode, {ENV}=1]")
            if op in _REDUCTIONS and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise StrictDeviceError(f"{op}: {t.dtype} is not an NCCL reduction type; reduce in a wider type "
                                        f"or move raw bytes [strict mode, {ENV}=1]")

    def _agree(self, op: str, group, numel: int) -> None:
        key = self._key(group)
        twin = self.order.get(key)
        if twin is None:
            return  # a group of one, or this rank is not in it
        size = dist.get_world_size(twin)
        if size <= 1:
            return
        seq = self.seq[key] = self.seq.get(key, 0) + 1
        code = _COLLECTIVES.index(op) if op in _COLLECTIVES else len(_COLLECTIVES)
        with torch._C.DisableTorchFunction():
            mine = torch.tensor([seq, code, numel if op in _SAME_SIZE else -1], dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in range(size)]
            self.real["all_gather"](every, mine, group=twin)
        rows = [tuple(int(v) for v in t) for t in every]
        if any(r != rows[0] for r in rows):
            ranks = dist.get_process_group_ranks(twin)

            def say(r):
                what = _COLLECTIVES[r[1]] if r[1] < len(_COLLECTIVES) else "?"
                return f"{what} #{r[0]}" + (f" of {r[2]} elements" if r[2] >= 0 else "")
            detail = "; ".join(f"rank {g}: {say(r)}" for g, r in zip(ranks, rows))
            raise StrictDeviceError(
                f"ranks of one group issued different collectives ({detail}); NCCL would hang or mix the data: "
                f"every rank of a group must issue the same collectives, with the same sizes, in the same order "
                f"[strict mode, {ENV}=1]")

    def _collective(self, op: str):
        real = self.real[op]

        def wrapped(*args, **kwargs):
            tensors = _tensors(args, _tensors(kwargs.values(), []))
            self._check_tensors(op, tensors)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            numel = tensors[-1].numel() if op in ("all_gather_into_tensor", "all_gather_single") and tensors \
                else (tensors[0].numel() if tensors else 0)
            self._agree(op, group, numel)
            return real(*args, **kwargs)
        wrapped.__name__ = op
        wrapped.__wrapped__ = real
        wrapped.strict = True
        return wrapped

    # -- point to point: tags dropped, as NCCL matches the messages of a pair in order --
    def _p2p(self, op: str):
        real = self.real[op]
        sig = inspect.signature(real)

        def wrapped(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            self._check_tensors(op, [bound.arguments["tensor"]])
            bound.arguments["tag"] = 0
            return real(*bound.args, **bound.kwargs)
        wrapped.__name__ = op
        wrapped.__wrapped__ = real
        return wrapped


def compute_device(device: torch.device) -> torch.device:
    """The device a strict CPU rank computes on: the virtual `cpu:0` instead of `cpu` (an accelerator stays)."""
    return COMPUTE if device.type == "cpu" else device


class lenient:
    """Suspend the device discipline of the enclosing DeviceDiscipline modes for a block: torch.compile's dynamo
    cannot trace through the mode's bookkeeping (tensor tags), so a compiled call runs unchecked (the collectives
    stay strict: StrictComm wraps torch.distributed itself). Outside strict mode it does nothing."""

    def __enter__(self):
        from torch.overrides import _get_current_function_mode_stack
        self.modes = [m for m in _get_current_function_mode_stack() if isinstance(m, DeviceDiscipline)]
        for m in self.modes:
            m.lenient += 1
        return self

    def __exit__(self, *exc):
        for m in self.modes:
            m.lenient -= 1
        return False


def opaque_to_dynamo() -> None:
    """Make the strict collective wrappers opaque to torch.compile (dynamo runs them as they are, a graph break, instead
    of tracing their checks): called when a model is first compiled, so worker processes that never compile never
    import dynamo. Outside strict mode it does nothing."""
    if not StrictComm.installed():
        return
    import torch._dynamo
    for mod in (dist, c10d):
        for name in _COLLECTIVES + _P2P:
            fn = getattr(mod, name, None)
            if getattr(fn, "strict", False) and not getattr(fn, "opaque", False):
                opaque = torch._dynamo.disable(fn)
                opaque.opaque = True
                setattr(mod, name, opaque)

