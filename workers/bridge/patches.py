"""ComfyUI's weight patches (LoRA, LoHa, LoKr, OFT, GLoRA, BOFT, diffs, sets) travelling to the workers.

Why: a LoRA or a strength change used to re-send the whole patched model (Flux 531M on ulysses 2: 7.2 s against
KSampler's 2.55 s), and every strength became a new resident copy on every GPU. Patches are small: the driver sends
the model's *base* weights once and its `ModelPatcher.patches` each time they change; each rank applies them to
its base copy with ComfyUI's own code (comfy.lora.calculate_weight, the ops' set/convert functions for scaled fp8,
comfy.float.stochastic_rounding seeded by the key, in the running ComfyUI's LoRA compute dtype - exactly what its
ModelPatcher.patch_weight_to_device does), in place of the previous version, whose patched tensors are released first.

The encoding is JSON plus named tensors (nothing is pickled): a tensor becomes {"$t": name}, an adapter object
{"$adapter": class name in comfy.weight_adapter, "keys": its loaded keys, "weights": ...}, a tuple {"$tuple": [...]}.
A patch holding anything else - a Python function (a patch's `function`), an unknown object - is not portable: the
caller falls back to sending the patched weights (as before), never to a wrong result.
"""
from __future__ import annotations

import zlib

import torch

from ...parallel.shard import is_wrapper
from ..transport import new_mapped, read_tensor, unlink, write_tensor
from .loader_types import patcher_class
from .seams import has

PREFIX = "patch."          # the names of the patch tensors in a job
MODEL_PREFIX = "diffusion_model."


class NotPortable(ValueError):
    """Patches the workers cannot rebuild (a Python function, an unknown object)."""


def _encode(value, tensors: dict):
    if isinstance(value, torch.Tensor):
        name = f"{PREFIX}{len(tensors)}"
        tensors[name] = value.detach()
        return {"$t": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    cls = type(value)
    if hasattr(value, "loaded_keys") and hasattr(value, "weights") and cls.__module__.startswith("comfy.weight_adapter"):
        return {"$adapter": cls.__name__, "keys": sorted(value.loaded_keys or ()), "weights": _encode(value.weights, tensors)}
    raise NotPortable(f"a {cls.__module__}.{cls.__name__} in the patches")


def _number(value):
    """A strength as JSON: a hook keyframe's strength reaches ComfyUI's patches as a 0-d tensor (its interpolated
    keyframes are torch values); its value as a Python float is the same number in any float dtype it multiplies."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise NotPortable(f"a strength of shape {tuple(value.shape)}")
        return float(value.item())
    return value


def encode(patches: dict) -> tuple:
    """(spec, tensors) of a ModelPatcher's `patches` ({key: [(strength_patch, data, strength_model, offset,
    function)]}); NotPortable if any part cannot travel."""
    tensors, spec = {}, {}
    for key, entries in patches.items():
        if not key.startswith(MODEL_PREFIX):
            raise NotPortable(f"a patch of {key!r}, outside the diffusion model")
        out = []
        for strength_patch, data, strength_model, offset, function in entries:
            if function is not None:
                raise NotPortable(f"a patch of {key!r} with a Python function")
            out.append([_number(strength_patch), _encode(data, tensors), _number(strength_model),
                        None if offset is None else list(offset)])
        spec[key] = out
    return spec, tensors


def _decode(value, tensors: dict):
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$t" in value:
        return tensors[value["$t"]]
    if "$tuple" in value:
        return tuple(_decode(v, tensors) for v in value["$tuple"])
    if "$adapter" in value:
        import comfy.weight_adapter as wa
        cls = next((c for c in wa.adapters if c.__name__ == value["$adapter"]), None)
        if cls is None:
            raise ValueError(f"unknown weight adapter {value['$adapter']!r} (this ComfyUI has "
                             f"{[c.__name__ for c in wa.adapters]})")
        return cls(set(value["keys"]), _decode(value["weights"], tensors))
    raise ValueError(f"unexpected patch value {value!r}")


def decode(spec: dict, tensors: dict) -> dict:
    """The ModelPatcher-format patches of `encode`'s spec, with `tensors` (name -> tensor) put back."""
    return {key: [(sp, _decode(data, tensors), sm, None if offset is None else tuple(offset), None)
                  for sp, data, sm, offset in entries] for key, entries in spec.items()}


class _Holder(torch.nn.Module):
    """`diffusion_model` as the attribute ComfyUI's patch keys name it (BaseModel's layout)."""

    def __init__(self, dm):
        super().__init__()
        self.diffusion_model = dm


def lora_dtype(device) -> torch.dtype:
    """The dtype this ComfyUI's ModelPatcher.patch_weight_to_device patches a weight in on `device`: its
    `lora_compute_dtype(device)` where it has one (ComfyUI 0.33: float16 on a GPU that computes in half precision,
    float32 on the CPU), float32 in the ComfyUIs before it."""
    if has("comfy.model_management:lora_compute_dtype"):
        import comfy.model_management
        return comfy.model_management.lora_compute_dtype(torch.device(device))
    return torch.float32


def seed_of(key: str) -> int:
    """The seed ComfyUI rounds `key`'s patched weight with: comfy.utils.string_to_seed where it lives now (ComfyUI 0.33;
    its old place in comfy.model_patcher logs a warning at every call there), else that old place."""
    if has("comfy.utils:string_to_seed"):
        import comfy.utils
        return comfy.utils.string_to_seed(key)
    import comfy.model_patcher
    return comfy.model_patcher.string_to_seed(key)


def _patch_one(holder, key: str, original: torch.Tensor, patch, device, into=None) -> torch.Tensor:
    """ComfyUI's patched weight for `key` from its base (ModelPatcher.patch_weight_to_device, key for key, as the
    running ComfyUI does it: the work copy in its LoRA compute dtype, `lora_dtype`, the rounding seeded as it seeds
    it, `seed_of`), assigned in the model; returns what the model now holds there.

    `into(shape, dtype)`: where the patched weight must end (a shared-memory mapping, transport.new_mapped); a
    float32 weight patched in float32 is then computed in place there (no work copy, no copy after), any other lands
    there once rounded. Not for a layer that stores its own form (set_func: scaled fp8): that one is patched as
    ComfyUI does and returned for the caller to write."""
    import comfy.float
    import comfy.lora
    import comfy.utils
    from comfy.model_patcher import get_key_weight
    weight, set_func, convert_func = get_key_weight(holder, key)
    work = lora_dtype(device)
    if into is not None and set_func is None:
        into = into(original.shape, original.dtype)
    else:
        into = None
    if into is not None and original.dtype == work == torch.float32 and convert_func is None:
        temp = into.copy_(original)  # the float32 work copy is the destination itself
    else:
        temp = original.to(device=device, dtype=work, copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    out = comfy.lora.calculate_weight(patch, temp, key)
    if set_func is None:
        out = comfy.float.stochastic_rounding(out, original.dtype, seed=seed_of(key))
        if into is not None and out is not into:
            out = into.copy_(out)
        comfy.utils.set_attr_param(holder, key, out)
    else:
        set_func(out, inplace_update=False, seed=seed_of(key))
    return comfy.utils.get_attr(holder, key)


def _owners(keys: list, base: dict, size: int) -> dict:
    """key -> the rank that patches it: largest first to the least loaded rank (by weight elements), the same on
    every rank - the ranks wait for each other at the end, so an even split of the work is an even split of time."""
    load, owner = [0] * size, {}
    for key in sorted(keys, key=lambda k: (-base[k[len(MODEL_PREFIX):]].numel(), k)):
        r = min(range(size), key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += base[key[len(MODEL_PREFIX):]].numel()
    return owner


def apply(dm: torch.nn.Module, base: dict, patches: dict, previous: set, device, share=None, patcher=None,
          held: dict | None = None) -> set:
    """Patch `dm` in place from its `base` weights (name -> host tensor, unpatched): every key of `patches` gets
    ComfyUI's patched weight, every key of the `previous` version that these patches leave gets its base back.
    Returns the patched keys.

    `share` (CPU ranks of one machine, which map one copy of the base): (rank, size, shm prefix, barrier, tag - the
    version's name, the same on every rank). The patched keys are split between the ranks by size (`_owners`); each
    rank computes its keys directly in new shared-memory files and after the barrier maps the others' - the work is
    split N ways and the patched weights are one copy for the machine, not one per rank. Every rank maps those files
    shared, and `held` (a dict the caller keeps with the model) records the keys so held: the next version of the
    same keys (a strength change) is then written by each key's owner into those same pages, which every rank
    already maps - no file made, mapped or freed.

    `patcher` (workers/bridge/loader_types.describe_patcher): a custom loader's ModelPatcher that patches its own way;
    each key is then patched by that class's `patch_weight_to_device` (ComfyUI-GGUF: the quantized weight keeps
    its bytes and holds the patches, applied as it is dequantized at each call)."""
    import comfy.utils

    holder = _Holder(dm)
    device = torch.device(device)
    _quantized_bases(holder, base, set(previous) | set(patches), previous)
    if patcher is not None:
        return _apply_with_loader(holder, base, patches, previous, device, patcher)
    for key in sorted(set(previous) - set(patches)):
        comfy.utils.set_attr_param(holder, key, base[key[len(MODEL_PREFIX):]].to(device))
    keys = sorted(patches)
    # quantized weights are patched by every rank itself (dequantized, patched, re-quantized by the layer's own
    # set_weight as ComfyUI does): a quantized tensor has no storage of its own to share through a mapped file
    own = [key for key in keys if is_wrapper(base[key[len(MODEL_PREFIX):]])]
    for key in own:
        _patch_one(holder, key, base[key[len(MODEL_PREFIX):]], patches[key], device)
    keys = [key for key in keys if key not in own]
    if share is None or share[1] <= 1:
        for key in keys:
            _patch_one(holder, key, base[key[len(MODEL_PREFIX):]], patches[key], device)
    else:
        _apply_shared(holder, base, patches, previous, keys, device, share, held)
    return set(patches)


def _quantized_bases(holder, base: dict, keys: set, previous: set) -> None:
    """A key without a base weight is ComfyUI's quantized weight (a QuantizedTensor the model built from its parts):
    the layer's own tensor, before any patch, is the base every later version of the patches starts from (a key the
    previous version patched has no such tensor any more: an error)."""
    import comfy.utils

    for key in keys:
        if key[len(MODEL_PREFIX):] not in base:
            try:
                current = comfy.utils.get_attr(holder, key) if key not in previous else None
            except AttributeError:  # a key the model does not have
                current = None
            if current is None or not is_wrapper(current):
                raise KeyError(f"patch of {key!r}: no such base weight on this rank")
            base[key[len(MODEL_PREFIX):]] = current


def _apply_shared(holder, base: dict, patches: dict, previous: set, keys: list, device, share, held) -> None:
    """CPU ranks of one machine: each patches its share of `keys` into shared memory, then maps the others' (see
    apply)."""
    import comfy.utils
    from comfy.model_patcher import get_key_weight

    rank, size, prefix, barrier, tag = share
    held = {} if held is None else held
    owner = _owners(keys, base, size)
    # the keys patched where they will stay (every key but a layer that stores its own form, e.g. scaled fp8): the
    # same on every rank, so every rank agrees on which keys the next version rewrites in place
    mappable = {key for key in keys if get_key_weight(holder, key)[1] is None}
    # the same keys as the version held, split the same way: each owner rewrites the pages every rank maps already
    same = set(patches) == set(previous) and held.get("size") == size
    in_place = set(held.get("keys", ())) & mappable if same else set()
    held.clear()
    mine = {}
    for key in keys:
        if owner[key] != rank:
            continue
        name = _shared_name(prefix, tag, key)
        unlink({"name": name}, prefix)  # a failed earlier round of this version may have left it
        if key in in_place:
            current = comfy.utils.get_attr(holder, key)
            _patch_one(holder, key, base[key[len(MODEL_PREFIX):]], patches[key], device,
                       into=lambda shape, dtype, current=current: current)
            continue
        made = []

        def into(shape, dtype, name=name, made=made):
            desc, t = new_mapped(prefix, name, shape, dtype)
            made.append(desc)
            return t
        t = _patch_one(holder, key, base[key[len(MODEL_PREFIX):]], patches[key], device, into=into)
        mine[key] = made[0] if made else write_tensor(t, prefix, name=name)  # made: it holds that mapping already
    barrier()  # every owner wrote its keys (in place, or into its new file)
    for key in keys:
        if key in in_place or (key in mine and key in mappable):
            continue  # the pages this rank maps already
        desc = mine.get(key) or _described(holder, key, prefix, tag)
        comfy.utils.set_attr_param(holder, key, read_tensor(desc, prefix, mapped=True, shared=True))
    barrier()  # every rank mapped every file: the names can go (the pages stay while mapped)
    for desc in mine.values():
        unlink(desc, prefix)
    held.update(keys=frozenset(mappable), size=size, rewritten=len(in_place))


def _apply_with_loader(holder, base: dict, patches: dict, previous: set, device, desc: dict) -> set:
    """`apply` through the loader's own ModelPatcher class: every key of both versions goes back to its base tensor
    - with the patches a lazily patched tensor holds dropped, as the loader's unpatch does (ComfyUI-GGUF's contract:
    a quantized tensor keeps its patches in its `patches` list) - then the loader patches the new version's keys."""
    import comfy.utils

    cls = patcher_class(desc)
    p = cls(holder, load_device=device, offload_device=device, size=1)  # size given: nothing is measured
    for k, v in (desc.get("settings") or {}).items():
        setattr(p, k, v)
    p.patches = patches
    for key in sorted(set(previous) | set(patches)):
        t = base[key[len(MODEL_PREFIX):]]
        if isinstance(getattr(t, "patches", None), list):
            t.patches = []
        comfy.utils.set_attr_param(holder, key, t.to(device))
    for key in sorted(patches):
        p.patch_weight_to_device(key, device_to=device)
    p.backup.clear()  # the base tensors are kept by the resident model (r.base), not by this patcher
    return set(patches)


def _shared_name(prefix: str, tag: str, key: str) -> str:
    """The name every rank derives for `key`'s patched weight of the version `tag`, in the pool's namespace."""
    return f"{prefix}patch-{zlib.crc32(tag.encode()):08x}-{zlib.crc32(key.encode()):08x}"


def _described(holder, key: str, prefix: str, tag: str) -> dict:
    """The descriptor of the patched weight another rank wrote for `key` (same dtype and shape as this rank's)."""
    import comfy.utils
    t = comfy.utils.get_attr(holder, key)
    return {"name": _shared_name(prefix, tag, key), "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape)}
