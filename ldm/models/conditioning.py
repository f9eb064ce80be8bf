"""What a backbone is conditioned on, as one record: the text states, their mask, the pooled text vector and the
added conditions (Stable Diffusion XL's size and crop, PixArt-α's resolution and aspect ratio), each present or not
as the model's family needs it.

The data path fills it (a batch's `conditioning`: these field names, as arrays, and `dropped` for cached text
states), the text encoders make its text part (`ldm.models.text.encode_prompt`), the objective passes it on without
reading it, and the family's `predict` reads the fields its backbone takes (`ldm.models.families`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import paddle

# The added condition of an image's geometry, one row per image: (original height, original width, crop top, crop
# left, target height, target width) in pixels, in Stable Diffusion XL's order of its time ids. Original: the decoded
# image's size before any resize; crop: the crop's corner in the resized image, as the bucket or the centre or random
# crop placed it (its left edge mirrored when the image was flipped); target: the crop's size. A family derives what its
# backbone reads from it (SDXL: the six numbers; PixArt-α multi-scale: the original size and the target's aspect ratio).
GEOMETRY = "geometry"


def sampling_geometry(height: int, width: int, rows: int) -> np.ndarray:
    """The geometry of `rows` images sampled at `height` x `width`: original = target = the requested size, crop (0, 0),
    as diffusers' pipelines condition them."""
    return np.tile(np.array([[height, width, 0, 0, height, width]], dtype="float32"), (rows, 1))


@dataclass
class Conditioning:
    states: paddle.Tensor  # [B, L, D]
    mask: paddle.Tensor | None = None  # [B, L], 1 for a real token; None: every token counts
    pooled: paddle.Tensor | None = None  # [B, P]
    added: dict[str, paddle.Tensor] = field(default_factory=dict)  # each [B, ...]

    @classmethod
    def from_arrays(cls, fields: dict) -> Conditioning:
        """The record of a batch's arrays (numpy or tensors): states and pooled as float32, the mask as int64."""
        def tensor(value, dtype):
            return None if value is None else paddle.to_tensor(value).astype(dtype)

        return cls(tensor(fields.get("states"), "float32"), tensor(fields.get("mask"), "int64"),
                   tensor(fields.get("pooled"), "float32"),
                   {name: tensor(value, "float32") for name, value in (fields.get("added") or {}).items()})

    def text_where(self, rows: paddle.Tensor, other: Conditioning) -> Conditioning:
        """This record with `other`'s text (states, mask, pooled: one row, broadcast) where `rows` ([B] bool) is
        true: a dropped caption's. Its added conditions stay: they describe the image, not the caption."""
        def pick(mine, theirs):
            if mine is None:
                return None
            where = rows.reshape([-1] + [1] * (mine.ndim - 1))
            return paddle.where(where, theirs.astype(mine.dtype).expand(mine.shape), mine)

        return replace(self, states=pick(self.states, other.states), mask=pick(self.mask, other.mask),
                       pooled=pick(self.pooled, other.pooled))

    def repeat(self, batch: int) -> Conditioning:
        """One row's record for a batch of `batch` rows."""
        def expand(value):
            return None if value is None else value.expand([batch, *value.shape[1:]])

        return Conditioning(expand(self.states), expand(self.mask), expand(self.pooled),
                            {name: expand(value) for name, value in self.added.items()})

    @staticmethod
    def concat(records: list[Conditioning]) -> Conditioning:
        """The records' rows, one after the other (classifier-free guidance: the unconditional rows first)."""
        def join(values):
            return None if values[0] is None else paddle.concat(values)

        first = records[0]
        return Conditioning(join([r.states for r in records]), join([r.mask for r in records]),
                            join([r.pooled for r in records]),
                            {name: join([r.added[name] for r in records]) for name in first.added})

    def astype(self, dtype: str) -> Conditioning:
        """The states and pooled vector in `dtype` (the mask and added conditions stay as they are)."""
        return replace(self, states=self.states.astype(dtype),
                       pooled=None if self.pooled is None else self.pooled.astype(dtype))
