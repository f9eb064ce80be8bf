"""A captioned-shapes corpus in the production shard format, for the demo and the tests.

Each image: one shape (circle, square, triangle) in one colour, on a plain background of another
colour, random size (45-80% of the side) and position; caption `a {colour} {shape} on a {background} background`.
Deterministic for a seed: record i depends only on (seed, i). Images are square unless `max_aspect_ratio` > 1: then
each has a random aspect ratio within it (area about the resolution squared), for runs in aspect-ratio buckets.
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image, ImageDraw

from ldm.data.tokenize import write_vocab
from ldm.prepare.write import ShardWriter, encode_image, record_line

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "purple": (140, 40, 170),
    "orange": (250, 140, 20),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle")
SIZE_RANGE = (0.45, 0.8)  # side of the shape's box, as a fraction of the image side


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def caption(colour: str, shape: str, background: str) -> str:
    return f"{article(colour)} {colour} {shape} on {article(background)} {background} background"


def render(shape: str, colour: str, background: str, resolution: int, rng: np.random.Generator,
           canvas: tuple[int, int] | None = None) -> Image.Image:
    """The shape on a `resolution` square, or on a `canvas` (width, height), sized by its shorter side."""
    width, height = canvas or (resolution, resolution)
    side = min(width, height)
    image = Image.new("RGB", (width, height), COLOURS[background])
    draw = ImageDraw.Draw(image)
    size = int(rng.integers(int(side * SIZE_RANGE[0]), int(side * SIZE_RANGE[1]) + 1))
    x0 = int(rng.integers(0, width - size + 1))
    y0 = int(rng.integers(0, height - size + 1))
    box = (x0, y0, x0 + size - 1, y0 + size - 1)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + size / 2, y0), (x0, y0 + size - 1), (x0 + size - 1, y0 + size - 1)], fill=fill)
    return image


def record(index: int, seed: int, resolution: int, max_aspect_ratio: float = 1.0) -> tuple[str, Image.Image]:
    rng = np.random.default_rng([seed, index])
    canvas = None
    if max_aspect_ratio > 1:  # drawn apart, so that a square corpus stays what it was
        ratio = float(np.exp(np.random.default_rng([seed, index, 1]).uniform(-1, 1) * np.log(max_aspect_ratio)))
        canvas = (max(1, round(resolution * ratio ** 0.5)), max(1, round(resolution / ratio ** 0.5)))
    names = list(COLOURS)
    colour = names[int(rng.integers(len(names)))]
    background = names[int(rng.integers(len(names) - 1))]
    if background == colour:  # a different colour from the same set, uniformly
        background = names[-1]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    return caption(colour, shape, background), render(shape, colour, background, resolution, rng, canvas)


def vocabulary() -> list[str]:
    return sorted({w for c in COLOURS for s in SHAPES for w in caption(c, s, c).split()} | set(COLOURS))


def synth_corpus(output_dir: str, num_records: int, resolution: int = 64, seed: int = 0,
                 records_per_shard: int = 1000, image_format: str = "PNG", progress=None,
                 max_aspect_ratio: float = 1.0) -> str:
    """Write the shards, their filelist and list of filelists, and a WordPiece vocab in `tokenizer/`."""
    indices = range(num_records) if progress is None else progress(range(num_records))
    with ShardWriter(output_dir, "shapes", records_per_shard) as writer:
        for i in indices:
            text, image = record(i, seed, resolution, max_aspect_ratio)
            data = encode_image(image, image_format, **({"quality": 95} if image_format == "JPEG" else {}))
            writer.write(record_line(text, data, key=f"{seed}-{i}"))
    write_vocab(vocabulary(), os.path.join(output_dir, "tokenizer"))
    return os.path.join(output_dir, "shapes.filelist.list")
