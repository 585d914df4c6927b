"""The automatic check: does a picture show what its caption asked for? (the classifier train.py trained)"""
from __future__ import annotations

from pathlib import Path

import torch

from . import CLASSIFIER_FILE, WEIGHTS, nets, shapes


class Checker:
    """Names the shape, colour and background of ComfyUI IMAGE tensors (B, H, W, 3) in [0, 1]."""

    def __init__(self, path: Path = WEIGHTS / CLASSIFIER_FILE):
        from safetensors.torch import load_file
        self.net = nets.new_classifier()
        self.net.load_state_dict(load_file(str(path)))
        self.net.eval()

    @torch.no_grad()
    def scenes(self, images: torch.Tensor) -> list:
        x = images.movedim(-1, 1).float()
        if x.shape[-2:] != (shapes.SIZE, shapes.SIZE):
            x = torch.nn.functional.interpolate(x, size=(shapes.SIZE, shapes.SIZE), mode="area")
        s, c, b = (o.argmax(1).tolist() for o in self.net(x))
        return [shapes.Scene(shapes.SHAPES[i], list(shapes.COLOURS)[j], list(shapes.BACKGROUNDS)[k])
                for i, j, k in zip(s, c, b)]

    def right(self, caption: str, image: torch.Tensor, attributes=("shape", "colour", "background")) -> bool:
        """Whether `image` (1, H, W, 3) shows what `caption` names: by default all of it (shape, colour and
        background); `attributes` picks some."""
        seen, asked = self.scenes(image)[0], shapes.parse(caption)
        return all(getattr(seen, a) == getattr(asked, a) for a in attributes)
