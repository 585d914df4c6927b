"""The demo model's world: one coloured shape on a plain background, and the captions that name it.

The training script draws its whole dataset from here (fixed seeds, nothing downloaded), the tests and
the quality bench draw their prompts from here, and the classifier that checks a generated picture
predicts the same three attributes a caption names.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

SIZE = 64  # pixels: the model's native size (an 8 x 8 latent, 16 tokens of 2 x 2 patches)

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 225), "yellow": (240, 210, 40),
           "purple": (150, 60, 200), "white": (245, 245, 245)}
BACKGROUNDS = {"black": (18, 18, 18), "gray": (128, 128, 128), "white": (245, 245, 245),
               "sky": (150, 200, 245)}


@dataclass(frozen=True)
class Scene:
    """What a caption asks for: a shape, its colour and the background's."""

    shape: str
    colour: str
    background: str

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} on a {self.background} background"

    def labels(self) -> tuple:
        """Class indices (shape, colour, background) as the classifier predicts them."""
        return SHAPES.index(self.shape), list(COLOURS).index(self.colour), list(BACKGROUNDS).index(self.background)


def all_scenes() -> list:
    """Every scene whose shape stands out from its background (no white on white)."""
    return [Scene(s, c, b) for s in SHAPES for c in COLOURS for b in BACKGROUNDS if COLOURS[c] != BACKGROUNDS[b]]


def parse(caption: str) -> Scene:
    """The scene a caption of the training grammar names ("a red circle on a gray background")."""
    words = caption.lower().replace(",", " ").split()
    shape = next((w for w in words if w in SHAPES), None)
    colour = next((w for w in words if w in COLOURS), None)
    on = words.index("on") if "on" in words else len(words)
    background = next((w for w in words[on:] if w in BACKGROUNDS), None)
    if None in (shape, colour, background):
        raise ValueError(f"{caption!r} is not a demo caption: say 'a <colour> <shape> on a <background> background' "
                         f"with a colour of {list(COLOURS)}, a shape of {list(SHAPES)} and a background of "
                         f"{list(BACKGROUNDS)}")
    return Scene(shape, colour, background)


def render(scene: Scene, rng: random.Random, size: int = SIZE) -> torch.Tensor:
    """One picture of `scene` (3, size, size) in [0, 1]: random size, position near the middle, slight colour
    jitter, drawn at 4x and box-filtered down so the edges are smooth. Why large and near the middle: the
    model sees 4 x 4 pixel colour cells (nets.build_vae), and with shapes anywhere it drew scattered blobs;
    with radii 10-17 px near the middle, rounded blobs (the asked shape 40-60 % of the time); with radii
    15-22 px within 5 px of the middle, the asked shape ~90 % of the time after a quarter of the training
    and 32 of 32 in train.py's check after all of it."""
    from PIL import Image, ImageDraw

    up = 4
    big = size * up

    def jitter(rgb):
        return tuple(max(0, min(255, v + rng.randint(-12, 12))) for v in rgb)

    img = Image.new("RGB", (big, big), jitter(BACKGROUNDS[scene.background]))
    d = ImageDraw.Draw(img)
    r = rng.uniform(0.24, 0.34) * big  # half extent
    cx, cy = (big / 2 + rng.uniform(-0.08, 0.08) * big for _ in range(2))
    fill = jitter(COLOURS[scene.colour])
    if scene.shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif scene.shape == "square":
        s = r * 0.9
        d.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif scene.shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r * 1.05, cy + r * 0.8), (cx + r * 1.05, cy + r * 0.8)], fill=fill)
    else:  # cross
        t = r * 0.36
        d.rectangle((cx - r, cy - t, cx + r, cy + t), fill=fill)
        d.rectangle((cx - t, cy - r, cx + t, cy + r), fill=fill)
    img = img.resize((size, size), Image.BOX)
    pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return pixels.permute(2, 0, 1).float() / 255


def batch(n: int, rng: random.Random, scenes=None, size: int = SIZE):
    """n random pictures (n, 3, size, size) in [0, 1] and their scenes."""
    pool = scenes or all_scenes()
    picked = [rng.choice(pool) for _ in range(n)]
    return torch.stack([render(s, rng, size) for s in picked]), picked


TEST_SCENES = (  # the eight prompts the tests and the README check: every shape, colour and background
    Scene("circle", "red", "gray"), Scene("square", "blue", "white"), Scene("triangle", "yellow", "black"),
    Scene("cross", "green", "sky"), Scene("circle", "purple", "white"), Scene("square", "white", "black"),
    Scene("triangle", "red", "sky"), Scene("cross", "yellow", "gray"),
)
