"""A GGUF loader's tensor, operations and patcher, written for the tests to the contract ComfyUI-GGUF keeps
(city96/ComfyUI-GGUF ops.py / nodes.py / loader.py, read for its behaviour; this is our own code):

- every weight read from a .gguf file is a `torch.Tensor` subclass over the file's bytes (a quantized weight: uint8
  rows of blocks), with `tensor_type` (gguf.GGMLQuantizationType), `tensor_shape` (the logical shape, which its
  `shape` reports) and `patches` (LoRA patches held lazily) as keyword-only constructor arguments; `.to` keeps
  them, `detach` and `clone` return the tensor itself (so nn.Parameter wraps it without a copy);
- the operations class subclasses comfy.ops.manual_cast; its Linear holds no weight until loaded, its layers take a
  quantized weight as it is (`_load_from_state_dict`), dequantize it at each call (in `dequant_dtype`, a class
  attribute the loader sets on the shared class) and apply the tensor's patches with comfy.lora.calculate_weight;
  `state_dict()` reports meta placeholders (and a "temp.weight" for the largest layer) for ComfyUI's memory estimate;
- the ModelPatcher subclass patches a quantized weight by attaching the patches to it (no patched copy), clears
  them when unpatching, and keeps its class when cloned.
Dequantization is gguf-py's own (numpy), which is slow but exact for tiny models.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

import comfy.lora
import comfy.model_patcher
import comfy.ops
import comfy.utils

TORCH_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


class QuantTensor(torch.Tensor):
    """A weight as the .gguf file stores it."""

    def __new__(cls, data, *, tensor_type, tensor_shape, patches=None):
        return torch.Tensor._make_subclass(cls, data, False)

    def __init__(self, data, *, tensor_type, tensor_shape, patches=None):
        self.tensor_type = tensor_type
        self.tensor_shape = torch.Size(tensor_shape)
        self.patches = list(patches or [])

    def to(self, *args, **kwargs):
        out = super().to(*args, **kwargs)
        out.tensor_type = getattr(self, "tensor_type", None)
        out.tensor_shape = getattr(self, "tensor_shape", out.data.shape)
        out.patches = list(getattr(self, "patches", []))
        return out

    def detach(self, *args, **kwargs):
        return self

    def clone(self, *args, **kwargs):
        return self

    @property
    def shape(self):
        if not hasattr(self, "tensor_shape"):
            self.tensor_shape = self.size()
        return self.tensor_shape


def is_quantized(t) -> bool:
    return getattr(t, "tensor_type", None) not in (None,) + TORCH_TYPES


def dequantize(t, dtype, dequant_dtype=None) -> torch.Tensor:
    """The plain weight of a file tensor, in `dtype` (through `dequant_dtype` when the loader set one)."""
    plain = torch.Tensor.as_subclass(t, torch.Tensor)
    if not is_quantized(t):
        return plain.to(dtype)
    values = gguf.quants.dequantize(plain.cpu().numpy(), t.tensor_type)
    w = torch.from_numpy(np.ascontiguousarray(values)).reshape(t.tensor_shape).to(plain.device)
    if dequant_dtype not in (None, "target"):
        w = w.to(dequant_dtype)
    return w.to(dtype)


class QuantLayer(torch.nn.Module):
    comfy_cast_weights = True
    dequant_dtype = None
    patch_dtype = None
    largest_layer = False

    def quantized(self) -> bool:
        return is_quantized(self.weight) or is_quantized(getattr(self, "bias", None))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        weight, bias = state_dict.get(f"{prefix}weight"), state_dict.get(f"{prefix}bias")
        if not (is_quantized(weight) or is_quantized(bias) or isinstance(self, torch.nn.Linear)):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        for k, v in state_dict.items():
            leaf = k[len(prefix):]
            if leaf == "weight":
                self.weight = torch.nn.Parameter(v, requires_grad=False)
            elif leaf == "bias" and v is not None:
                self.bias = torch.nn.Parameter(v, requires_grad=False)
            else:
                unexpected_keys.append(k)
        if self.weight is None:
            missing_keys.append(f"{prefix}weight")
        if getattr(self.weight, "is_largest_weight", False):
            self.largest_layer = True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if not self.quantized():
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = torch.zeros_like(torch.Tensor.as_subclass(self.weight, torch.Tensor),
                                                          device="meta")
        if self.bias is not None:
            destination[prefix + "bias"] = torch.zeros_like(torch.Tensor.as_subclass(self.bias, torch.Tensor),
                                                            device="meta")
        if self.largest_layer:  # room for the dequantized weight, in ComfyUI's memory estimate
            destination[prefix + "temp.weight"] = torch.empty(self.weight.tensor_shape, device="meta",
                                                              dtype=torch.float16)

    def plain_weight(self, t, dtype):
        if t is None:
            return None
        w = dequantize(t, dtype, self.dequant_dtype)
        for patches, key in getattr(t, "patches", []):
            if self.patch_dtype is None:
                w = comfy.lora.calculate_weight(patches, w, key)
            else:
                w = comfy.lora.calculate_weight(patches, w, key, dtype if self.patch_dtype == "target"
                                                else self.patch_dtype)
        return w

    def cast_bias_weight(self, input=None, dtype=None, device=None, bias_dtype=None):
        if input is not None:
            dtype = dtype or getattr(input, "dtype", torch.float32)
            bias_dtype = bias_dtype or dtype
            device = device or input.device
        bias = None
        if self.bias is not None:
            bias = self.plain_weight(self.bias.to(device), dtype).to(bias_dtype)
        weight = self.plain_weight(self.weight.to(device), dtype).to(dtype)
        return weight, bias

    def forward_comfy_cast_weights(self, input, *args, **kwargs):
        out = self.forward_quant(input, *args, **kwargs) if self.quantized() else \
            super().forward_comfy_cast_weights(input, *args, **kwargs)
        return torch.Tensor.as_subclass(out, torch.Tensor) if isinstance(out, QuantTensor) else out

    def forward_quant(self, input):
        raise NotImplementedError


class QuantOps(comfy.ops.manual_cast):
    class Linear(QuantLayer, comfy.ops.manual_cast.Linear):
        def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
            torch.nn.Module.__init__(self)  # no weight until loaded: nothing allocated at construction
            self.in_features, self.out_features = in_features, out_features
            self.weight = None
            self.bias = None

        def forward_quant(self, input):
            weight, bias = self.cast_bias_weight(input)
            return torch.nn.functional.linear(input, weight, bias)

    class Conv2d(QuantLayer, comfy.ops.manual_cast.Conv2d):
        def forward_quant(self, input):
            weight, bias = self.cast_bias_weight(input)
            return self._conv_forward(input, weight, bias)

    class LayerNorm(QuantLayer, comfy.ops.manual_cast.LayerNorm):
        def forward_quant(self, input):
            weight, bias = self.cast_bias_weight(input)
            return torch.nn.functional.layer_norm(input, self.normalized_shape, weight, bias, self.eps)

    class GroupNorm(QuantLayer, comfy.ops.manual_cast.GroupNorm):
        def forward_quant(self, input):
            weight, bias = self.cast_bias_weight(input)
            return torch.nn.functional.group_norm(input, self.num_groups, weight, bias, self.eps)


class QuantModelPatcher(comfy.model_patcher.ModelPatcher):
    patch_on_device = False

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False):
        if key not in self.patches:
            return
        weight = comfy.utils.get_attr(self.model, key)
        if not is_quantized(weight):
            return super().patch_weight_to_device(key, device_to=device_to, inplace_update=inplace_update)
        out = weight.to(device_to) if device_to is not None else weight
        where = self.load_device if self.patch_on_device else self.offload_device
        out.patches = [(_to(self.patches[key], where), key)]
        comfy.utils.set_attr_param(self.model, key, out)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            for p in self.model.parameters():
                if is_quantized(p) and getattr(p, "patches", None):
                    p.patches = []
        return super().unpatch_model(device_to=device_to, unpatch_weights=unpatch_weights)

    def load(self, *args, force_patch_weights=False, **kwargs):
        super().load(*args, force_patch_weights=True, **kwargs)  # patches always go through patch_weight_to_device

    def clone(self, *args, **kwargs):
        cls = type(self)
        self.__class__ = QuantModelPatcher
        try:
            n = super().clone(*args, **kwargs)
        finally:
            self.__class__ = cls
        n.__class__ = QuantModelPatcher
        n.patch_on_device = getattr(self, "patch_on_device", False)
        return n


def _to(item, device):
    if isinstance(item, torch.Tensor):
        return item.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(_to(x, device) for x in item)
    return item

