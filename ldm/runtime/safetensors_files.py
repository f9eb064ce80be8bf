"""Reading safetensors files tensor by tensor with plain reads: the header, one array at a time, and the file's
entries. Below the checkpoints (`ldm.checkpoint.serialization`, which writes these files) and the models
(`ldm.models.torch_layout`, which fills a part from them one tensor at a time), both of which read them so."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import numpy as np

from ldm.runtime.errors import UserError


class StateFormatError(UserError, ValueError):
    """A state or weights file that is not what this project writes (a safetensors file and its JSON)."""


SAFETENSORS_DTYPE = {np.dtype(numpy): name for numpy, name in (
    ("uint64", "U64"), ("int64", "I64"), ("float64", "F64"), ("float32", "F32"), ("uint32", "U32"), ("int32", "I32"),
    ("float16", "F16"), ("uint16", "U16"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"))}


def file_arrays(folder: str, by_file: dict[str, list[str]]) -> Iterator[tuple[str, np.ndarray]]:
    """The arrays of safetensors files (`by_file`: file name in `folder` -> the keys to read from it), one at a time:
    each read by name with plain reads into memory of its own (safetensors' `safe_open` maps the whole file,
    whose pages then count as the process's resident memory until it is closed)."""
    for file, keys in by_file.items():
        path = os.path.join(folder, file)
        with open(path, "rb") as f:
            header, start = safetensors_header(f, path)
            for key in keys:
                yield key, read_array(f, path, key, header, start)


def safetensors_entries(path: str) -> dict[str, tuple[np.dtype | None, tuple[int, ...]]]:
    """{name: (numpy dtype, None for one numpy has not, such as bfloat16; shape)} of a safetensors file's header."""
    with open(path, "rb") as f:
        header, _ = safetensors_header(f, path)
    return {name: (NUMPY_DTYPE.get(entry.get("dtype")), tuple(entry.get("shape", ())))
            for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)}


NUMPY_DTYPE = {name: numpy for numpy, name in SAFETENSORS_DTYPE.items()}


def safetensors_header(f, path: str) -> tuple[dict, int]:
    """A safetensors file's header ({name: {"dtype", "shape", "data_offsets"}}) and where its data begins."""
    try:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    except (struct.error, ValueError) as e:
        raise StateFormatError(f"{path} is not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise StateFormatError(f"{path} is not a safetensors file (its header is not a table)")
    return header, 8 + length


def read_array(f, path: str, key: str, header: dict, start: int) -> np.ndarray:
    entry = header.get(key)
    try:
        dtype, shape, (begin, end) = NUMPY_DTYPE[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise StateFormatError(f"{path} holds no readable array {key!r}") from None
    array = np.empty(shape, dtype)
    if end - begin != array.nbytes:
        raise StateFormatError(f"{path}: array {key!r} has {end - begin} bytes for its shape's {array.nbytes}")
    f.seek(start + begin)
    if array.nbytes and f.readinto(memoryview(array.reshape(-1).view(np.uint8))) != array.nbytes:
        raise StateFormatError(f"{path} ends inside array {key!r}")
    return array
