"""The seeded weights every tiny checkpoint writer shares (tiny_checkpoints, tiny_vaes, tiny_controlnets): a ComfyUI
class built on the meta device, every state-dict entry filled from one generator at a scale that keeps activations
O(1), saved with safetensors."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file


def _random_state_dict(module: torch.nn.Module, seed: int, dtype: torch.dtype,
                       device: str = "cpu") -> dict[str, torch.Tensor]:
    """Seeded values for every entry of module.state_dict(), scaled so activations stay O(1).

    Nothing is left at zero (ComfyUI and diffusers zero-init some output layers): a zero layer
    would let a wrong key mapping pass the equivalence tests unnoticed.
    """
    gen = torch.Generator(device).manual_seed(seed)  # device "cuda": the values of 12B parameters in seconds
    out = {}
    for name, ref in module.state_dict().items():
        shape = tuple(ref.shape)
        if not ref.dtype.is_floating_point:
            raise TypeError(f"unexpected non-float entry {name} ({ref.dtype}) in a tiny checkpoint")
        leaf = name.rsplit(".", 1)[-1]
        t = torch.randn(shape, generator=gen, device=device)
        if "norm" in name or leaf in ("gamma", "scale"):
            t = 1.0 + 0.1 * t  # norm gains near 1
        elif "pos_embed" in name or "y_embedding" in name:
            t = 0.5 * t
        elif len(shape) >= 2:
            t = t / math.sqrt(max(1, math.prod(shape[1:])))
        else:
            t = 0.1 * t
        out[name] = t.to(dtype).contiguous().cpu()
    return out


def _save(module_factory, path: Path, seed: int, dtype: torch.dtype,
          meta_context: bool = False, device: str = "cpu", metadata: dict | None = None,
          file_key=None) -> dict[str, torch.Tensor]:
    """Build on the meta device: DiT classes take device= (a global meta context would break their
    `.item()` calls at init); the VAE classes take no device argument, so they need the context.
    `metadata`: more of the file's metadata (sizes its detection does not read); `file_key(name)`: a tensor's name in
    the file where the file form differs from the module's. Returns the state dict as the module holds it."""
    if meta_context:
        with torch.device("meta"):
            module = module_factory()
    else:
        module = module_factory()
    sd = _random_state_dict(module, seed, dtype, device)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(sd if file_key is None else {file_key(k): v for k, v in sd.items()}, str(path),
              metadata={"format": "pt", **(metadata or {})})
    return sd
