"""A generated visual task: count the shapes of one colour in a PIL-drawn image.

Each image is a grid of cells; some cells hold one shape (circle, square or triangle) in one of a
few colours, centred in its cell so that shapes never overlap and every one is fully visible. The
question names a colour; the answer is how many shapes have it (0 included). Examples depend only
on (seed, split, index); the held-out split draws from its own seed stream and any image it shares
with the training split's first `train_size` is dropped from it, so eval accuracy is on unseen images.

`write_split` writes PNGs plus a JSONL in the image-record format of miles.data.images.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from miles.data.example import Example

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 70, 220)}
SHAPES = ("circle", "square", "triangle")
# The background is the mean colour of the Qwen-VL image processors (CLIP's image_mean x 255), so an
# empty cell normalises to ~0 and a shape is all the signal its patch carries. On white, every patch
# of an 84 x 84 image shares one large mean-pixel component: a random tiny tower's merged tokens are
# then near-parallel and the tiny decoder stayed at the answers' prior for 100s of SFT steps
# (docs/vlm.md, "Why it did not learn").
BACKGROUND = (123, 117, 104)
_SPLITS = {"train": 0, "eval": 1}
# 3 x 3 cells of 28 px: each cell is one 2 x 2 merged Qwen-VL token (14 px patches). The memory
# planner sizes the vision tower's work from IMAGE_SIDE (miles/hardware/vision_footprint.py).
GRID, CELL = 3, 28
IMAGE_SIDE = GRID * CELL


@dataclass(frozen=True)
class ShapeScene:
    grid: int  # cells per side
    cell: int  # cell side in pixels
    shapes: tuple[tuple[int, int, str, str], ...]  # (row, col, shape, colour)
    colour: str  # the colour asked about

    @property
    def answer(self) -> int:
        return sum(1 for *_, c in self.shapes if c == self.colour)

    @property
    def question(self) -> str:
        return f"How many {self.colour} shapes are in the image? Answer with a number."

    def render(self) -> Image.Image:
        side = self.grid * self.cell
        image = Image.new("RGB", (side, side), BACKGROUND)
        draw = ImageDraw.Draw(image)
        pad = self.cell // 5
        for row, col, shape, colour in self.shapes:
            x0, y0 = col * self.cell + pad, row * self.cell + pad
            x1, y1 = (col + 1) * self.cell - pad, (row + 1) * self.cell - pad
            fill = COLOURS[colour]
            if shape == "circle":
                draw.ellipse((x0, y0, x1, y1), fill=fill)
            elif shape == "square":
                draw.rectangle((x0, y0, x1, y1), fill=fill)
            else:
                draw.polygon(((x0 + x1) / 2, y0, x1, y1, x0, y1), fill=fill)
        return image


def scene(seed: int, split: str, index: int, grid: int = GRID, cell: int = CELL, max_shapes: int = 5) -> ShapeScene:
    """Example `index` of `split` ("train" / "eval")."""
    rng = np.random.default_rng([seed, _SPLITS[split], index])
    n = int(rng.integers(1, max_shapes + 1))
    cells = rng.choice(grid * grid, size=n, replace=False)
    shapes = tuple((int(c) // grid, int(c) % grid, SHAPES[int(rng.integers(len(SHAPES)))],
                    list(COLOURS)[int(rng.integers(len(COLOURS)))]) for c in sorted(cells))
    return ShapeScene(grid, cell, shapes, list(COLOURS)[int(rng.integers(len(COLOURS)))])


def split_scenes(seed: int, split: str, size: int, train_size: int = 0, **kw) -> list[ShapeScene]:
    """`size` scenes of `split`; for "eval", none equal to one of the first `train_size` train scenes."""
    if split == "train":
        return [scene(seed, "train", i, **kw) for i in range(size)]
    seen = {scene(seed, "train", i, **kw) for i in range(train_size)}
    out, i = [], 0
    while len(out) < size:
        s = scene(seed, "eval", i, **kw)
        if s not in seen:
            out.append(s)
        i += 1
    return out


def write_split(directory: str | Path, scenes: list[ShapeScene], name: str) -> Path:
    """PNGs under directory/<name>/ and directory/<name>.jsonl (image paths relative to it)."""
    directory = Path(directory)
    (directory / name).mkdir(parents=True, exist_ok=True)
    lines = []
    for i, s in enumerate(scenes):
        rel = f"{name}/{i:05d}.png"
        s.render().save(directory / rel)
        content = [{"type": "image", "image": rel}, {"type": "text", "text": s.question}]
        lines.append(json.dumps({"prompt": [{"role": "user", "content": content}], "label": str(s.answer)}))
    path = directory / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def examples(seed: int, split: str, size: int, train_size: int = 0) -> list[Example]:
    """The split as the run's Examples (images rendered in memory, the record format of write_split)."""
    out = []
    for s in split_scenes(seed, split, size, train_size):
        content = ({"type": "image"}, {"type": "text", "text": s.question})
        out.append(Example(prompt=s.question, label=str(s.answer), images=(s.render(),),
                           messages=({"role": "user", "content": list(content)},)))
    return out


def reward(response: str, label: str, **info) -> float:
    """1.0 when the last integer in the response equals the label, else 0.0 (`task.reward:
    miles.data.shape_count.reward`; the record's info is not needed)."""
    numbers = re.findall(r"-?\d+", response)
    return float(bool(numbers) and int(numbers[-1]) == int(label))
