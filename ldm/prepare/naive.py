"""A reference loader written the way the public example reads shards, for `bench` comparisons only.

stdlib gzip and base64, full-size decode, LANCZOS resize of the shorter side, then crop, float output.
"""

from __future__ import annotations

import base64
import gzip
import io
import os
import random
from collections.abc import Iterator

import fsspec
import numpy as np
from PIL import Image

from ldm.data import remote


def naive_samples(paths: list[str], resolution: int = 256, seed: int = 0) -> Iterator[np.ndarray]:
    rng = random.Random(seed)
    for path in paths:
        if remote.is_url(path):  # the same transport as the dataset's, without its retries
            try:
                raw = fsspec.open(path, "rb").open()
            except OSError:
                continue
        elif os.path.exists(path):
            raw = open(path, "rb")  # noqa: SIM115 - closed by the gzip reader below
        else:
            continue
        with raw, gzip.open(raw, "rb") as f:
            for line in f:
                try:
                    fields = line.decode("utf-8").rstrip("\n").split("\t")
                    image = Image.open(io.BytesIO(base64.b64decode(fields[2]))).convert("RGB")
                except Exception:  # noqa: BLE001 - mirrors the example's broad except
                    continue
                width, height = image.size
                scale = resolution / 0.9 / min(width, height)
                image = image.resize((round(width * scale), round(height * scale)), Image.Resampling.LANCZOS)
                left = rng.randint(0, image.size[0] - resolution)
                top = rng.randint(0, image.size[1] - resolution)
                image = image.crop((left, top, left + resolution, top + resolution))
                yield np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0
