"""State that loads without running code: nested dicts and lists as JSON, their arrays in safetensors.

A state tree (an optimizer's, an EMA's, a random generator's) is split into its structure and numbers,
written as `<name>.json`, and its arrays, written as `<name>.safetensors` (when it has any) and named in
the JSON by `{"__array__": key}`. Reading never unpickles: a checkpoint someone shared can be resumed,
exported or evaluated without trusting it, which `paddle.load` (pickle) cannot offer. safetensors has no
Paddle backend in the pinned stack, so arrays cross as numpy; bfloat16 (numpy has no such type) is kept
as its raw 16 bits and its dtype recorded beside the key.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

ARRAY = "__array__"
TUPLE = "__tuple__"


class StateFormatError(ValueError):
    """A state file that is not what this module writes."""


def _is_tensor(value) -> bool:
    return hasattr(value, "numpy") and hasattr(value, "dtype") and hasattr(value, "place")


def flatten(tree: Any, arrays: dict[str, np.ndarray], key: str = "") -> Any:
    """`tree` with every array (numpy or Paddle) moved into `arrays` and replaced by a reference."""
    if isinstance(tree, dict):
        return {str(k): flatten(v, arrays, f"{key}/{k}" if key else str(k)) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return {TUPLE: [flatten(v, arrays, f"{key}/{i}") for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [flatten(v, arrays, f"{key}/{i}") for i, v in enumerate(tree)]
    if _is_tensor(tree):
        dtype = str(tree.dtype).replace("paddle.", "")
        array = tree.numpy()
        arrays[key] = np.ascontiguousarray(array)
        return {ARRAY: key, "dtype": dtype} if dtype == "bfloat16" else {ARRAY: key}
    if isinstance(tree, np.ndarray):
        arrays[key] = np.ascontiguousarray(tree)
        return {ARRAY: key}
    if isinstance(tree, np.generic):
        return tree.item()
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    raise TypeError(f"cannot store {type(tree).__name__} at {key!r} without pickling it")


class Bfloat16(np.ndarray):
    """The raw 16 bits of a bfloat16 array (numpy has no such dtype); `to_paddle` restores the type."""

    def __new__(cls, bits: np.ndarray):
        return np.asarray(bits, dtype=np.uint16).view(cls)


def unflatten(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(tree, dict):
        if ARRAY in tree:
            try:
                array = arrays[tree[ARRAY]]
            except KeyError:
                raise StateFormatError(f"array {tree[ARRAY]!r} is missing") from None
            return Bfloat16(array) if tree.get("dtype") == "bfloat16" else array
        if TUPLE in tree:
            return tuple(unflatten(v, arrays) for v in tree[TUPLE])
        return {k: unflatten(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unflatten(v, arrays) for v in tree]
    return tree


def as_os_error(error: Exception, path: str) -> Exception:
    """safetensors writes in Rust and reports a failed write (a full disk, a file-size limit) as its own
    exception whose text carries the OS error code: an OSError with that errno again, so that callers
    handle it as any other failed write."""
    found = re.search(r"(?:code: |os error )(\d+)", str(error))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1))), path) if found else error


@contextlib.contextmanager
def writes_failing_as_os_errors(path: str):
    """Around a library's writing of weights (`save_pretrained`): its failed write, raised as safetensors' own
    exception, becomes the OSError it was (`as_os_error`), so that a full disk ends the run in one line there too."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised unchanged unless it carries an OS error code
        converted = as_os_error(e, path)
        if converted is e:
            raise
        raise converted from e


def save_state(folder: str, name: str, tree: Any) -> None:
    """`<folder>/<name>.json` and, if the tree holds arrays, `<folder>/<name>.safetensors`."""
    arrays: dict[str, np.ndarray] = {}
    structure = flatten(tree, arrays)
    if arrays:
        path = os.path.join(folder, f"{name}.safetensors")
        try:
            save_file(arrays, path)
        except Exception as e:  # noqa: BLE001 - narrowed below
            raise as_os_error(e, path) from None
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(structure, f)


def has_state(folder: str, name: str) -> bool:
    return os.path.isfile(os.path.join(folder, f"{name}.json"))


def load_state(folder: str, name: str) -> Any:
    """The tree `save_state` wrote, arrays as numpy."""
    try:
        with open(os.path.join(folder, f"{name}.json")) as f:
            structure = json.load(f)
    except ValueError as e:
        raise StateFormatError(f"{folder}/{name}.json is not JSON: {e}") from None
    path = os.path.join(folder, f"{name}.safetensors")
    arrays = load_file(path) if os.path.isfile(path) else {}
    return unflatten(structure, arrays)


def to_paddle(tree: Any) -> Any:
    """Arrays of a loaded tree as Paddle tensors (what `set_state_dict` of optimizers expects)."""
    import paddle

    if isinstance(tree, dict):
        return {k: to_paddle(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_paddle(v) for v in tree]
    if isinstance(tree, Bfloat16):
        return paddle.to_tensor(tree.view(np.uint16)).view(paddle.bfloat16)
    if isinstance(tree, np.ndarray):
        return paddle.to_tensor(tree)
    return tree
