"""State that loads without running code: nested dicts and lists as JSON, their arrays in safetensors.

A state tree (an optimizer's, an EMA's, a random generator's) is split into its structure and numbers,
written as `<name>.json`, and its arrays, written as `<name>.safetensors` (when it has any) and named in
the JSON by `{"__array__": key}`. Reading never unpickles: a checkpoint someone shared can be resumed,
exported or evaluated without trusting it, which `paddle.load` (pickle) cannot offer. safetensors has no
Paddle backend in the pinned stack, so arrays cross as numpy; bfloat16 (numpy has no such type) is kept
as its raw 16 bits and its dtype recorded beside the key.

A state held in shards (the optimizer state and EMA of a sharded run: each rank its own parameters') is written
by every rank as `<name>-<rank + 1>-of-<world>.json/.safetensors`, with `<name>.index.json` naming the file of every
array, as Hugging Face's `*.safetensors.index.json` does. `load_state` reads either layout, whole or only the
arrays a rank asks for, each array read by name without loading its file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ldm.runtime.safetensors_files import (
    SAFETENSORS_DTYPE,
    StateFormatError,
    file_arrays,
    read_array,
    safetensors_header,
)

ARRAY = "__array__"
TUPLE = "__tuple__"


def is_tensor(value) -> bool:
    return hasattr(value, "numpy") and hasattr(value, "dtype") and hasattr(value, "place")


def host_array(tensor) -> np.ndarray:
    """A Paddle tensor's values as a numpy array: on the CPU a view of its memory (DLPack, no copy; a trained
    parameter's through `detach`, which DLPack requires), elsewhere a copy of it alone to the host; bfloat16 (which
    numpy lacks) as its raw 16 bits. The copy is of a compact clone: Paddle's `numpy()` of a view into a larger buffer
    (a parameter of the flat update, `ldm.train.flat`) copies the whole buffer, which made saving `ldm-12layer` take
    minutes per checkpoint and one buffer's size more memory."""
    detached = tensor.detach()
    try:
        return np.from_dlpack(detached)
    except (BufferError, RuntimeError, TypeError):  # another device, or a dtype DLPack's numpy side lacks
        return detached.clone().numpy()


class LiveTensor:
    """A Paddle tensor to be written as it is when its turn comes: its host bytes (`host_array`: a view on a CPU, a
    copy from a GPU or of a bfloat16 tensor) are taken by the writer one tensor at a time and let go, so that a save
    that waits for its writing (`--async_save false`) or an export holds no host copy of the whole state beside it.
    Shape, dtype and size are known without a copy (the safetensors header comes first)."""

    def __init__(self, tensor, dtype: str | None = None):
        """`dtype`: written cast to it (numpy's name), one tensor at a time."""
        self.tensor, self.cast = tensor, dtype
        self.shape = tuple(tensor.shape)
        name = str(tensor.dtype).replace("paddle.", "")
        self.dtype = np.dtype(dtype or ("uint16" if name == "bfloat16" else name))  # bfloat16 as its raw 16 bits
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def array(self) -> np.ndarray:
        array = host_array(self.tensor)
        return array.astype(self.cast) if self.cast else array


def on_host(value) -> np.ndarray:
    """An array of a state (numpy, a Paddle tensor or a `LiveTensor`) in host memory."""
    if isinstance(value, LiveTensor):
        return value.array()
    return host_array(value) if is_tensor(value) else value


def contiguous(key: str, value) -> np.ndarray:
    """`flatten`'s default: the array in host memory, contiguous."""
    return np.ascontiguousarray(on_host(value))


def flatten(tree: Any, arrays: dict[str, np.ndarray], key: str = "", take: Callable | None = None,
            mine: Callable[[str], bool] | None = None) -> Any:
    """`tree` with every array (numpy or Paddle) moved into `arrays` and replaced by a reference.

    `take(key, value)`: what is kept of each array, given as it is in the tree (default `contiguous`: the array in
    host memory; a snapshot passes a copy into a reused buffer, a save written before training goes on a
    `LiveTensor`). `mine(key)`: only the arrays it accepts are taken; the others' references stay in the structure
    (`select` drops them)."""
    if isinstance(tree, dict):
        return {str(k): flatten(v, arrays, f"{key}/{k}" if key else str(k), take, mine) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return {TUPLE: [flatten(v, arrays, f"{key}/{i}", take, mine) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [flatten(v, arrays, f"{key}/{i}", take, mine) for i, v in enumerate(tree)]
    if is_tensor(tree) or isinstance(tree, np.ndarray):
        dtype = str(tree.dtype).replace("paddle.", "")
        if mine is None or mine(key):
            arrays[key] = (take or contiguous)(key, tree)
        return {ARRAY: key, "dtype": dtype} if dtype == "bfloat16" else {ARRAY: key}
    if isinstance(tree, np.generic):
        return tree.item()
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    raise TypeError(f"cannot store {type(tree).__name__} at {key!r} without pickling it")


def array_sizes(tree: Any, key: str = "") -> dict[str, int]:
    """The bytes of every array of `tree`, by the key `flatten` gives it (nothing is copied)."""
    if isinstance(tree, dict):
        return {k: v for name, value in tree.items()
                for k, v in array_sizes(value, f"{key}/{name}" if key else str(name)).items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, value in enumerate(tree) for k, v in array_sizes(value, f"{key}/{i}").items()}
    if is_tensor(tree):
        return {key: int(tree.numel()) * tree.element_size()}
    if isinstance(tree, np.ndarray):
        return {key: tree.nbytes}
    return {}


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


# safetensors' order of the arrays in a file: by dtype, widest first (its `Dtype` enum reversed), then by name
DTYPE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "I8", "U8", "BOOL")
WRITE_PIECE = 16 << 20  # hashed, then written, a piece at a time: the hash follows the bytes while they are hot


@dataclass(frozen=True)
class Written:
    """A file as it was written: its size and the sha256 of its bytes (a manifest's entry)."""

    size: int
    sha256: str

    def entry(self) -> dict:
        return {"size": self.size, "sha256": self.sha256}


def write_safetensors(path: str, arrays: dict[str, np.ndarray | LiveTensor],
                      metadata: dict[str, str] | None = None) -> Written:
    """`arrays` as a safetensors file, flushed to disk, hashed as it is written; the same bytes as safetensors'
    `save_file`. Written here because `save_file` first copies every array into a bytes object and cannot report
    the hash: a checkpoint would then be copied once more and read back in full to be sealed. A `LiveTensor` is
    brought to the host only when its bytes are written, and let go before the next one is."""
    order = sorted(arrays, key=lambda k: (DTYPE_ORDER.index(SAFETENSORS_DTYPE[arrays[k].dtype]), k))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        array = arrays[key]
        header[key] = {"dtype": SAFETENSORS_DTYPE[array.dtype], "shape": list(array.shape),
                       "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    try:
        with open(path, "wb") as f:
            for piece in (struct.pack("<Q", len(text)), text):
                digest.update(piece)
                f.write(piece)
            for key in order:
                data = memoryview(contiguous(key, arrays[key]).reshape(-1).view(np.uint8))
                for start in range(0, len(data), WRITE_PIECE):
                    piece = data[start:start + WRITE_PIECE]
                    digest.update(piece)  # hashlib and file writes release the GIL: training goes on beside them
                    f.write(piece)
                data = piece = None  # a tensor's host copy (GPU, bfloat16) lives only while it is written
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            e.filename = path
        raise
    return Written(8 + len(text) + offset, digest.hexdigest())


def write_bytes(path: str, data: bytes) -> Written:
    """A small file (a state's JSON structure), flushed to disk; its manifest entry."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return Written(len(data), hashlib.sha256(data).hexdigest())


def split_state(tree: Any, take: Callable | None = None, mine: Callable[[str], bool] | None = None,
                ) -> tuple[bytes, dict[str, np.ndarray]]:
    """A state tree as the two things `save_state` writes: its structure as JSON and its arrays (only those
    `mine(key)` accepts, the structure then without the others; `take`: see `flatten`)."""
    arrays: dict[str, np.ndarray] = {}
    structure = flatten(tree, arrays, take=take, mine=mine)
    if mine is not None:
        structure = select(structure, mine)
    return json.dumps(structure).encode(), arrays


def save_state(folder: str, name: str, tree: Any) -> list[str]:
    """`<folder>/<name>.json` and, if the tree holds arrays, `<folder>/<name>.safetensors`, flushed to disk;
    returns the arrays' keys."""
    structure, arrays = split_state(tree)
    if arrays:
        write_safetensors(os.path.join(folder, f"{name}.safetensors"), arrays)
    write_bytes(os.path.join(folder, f"{name}.json"), structure)
    return sorted(arrays)


def shard_name(name: str, rank: int, world_size: int) -> str:
    return f"{name}-{rank + 1:05d}-of-{world_size:05d}"  # numbered from 1, as Hugging Face's shards


def write_state_index(folder: str, name: str, keys_by_rank: list[list[str]]) -> None:
    """`<name>.index.json`: every array of the shards the ranks wrote (`save_state` under `shard_name`), by the file
    that holds it."""
    world_size = len(keys_by_rank)
    weight_map = {key: shard_name(name, rank, world_size) + ".safetensors"
                  for rank, keys in enumerate(keys_by_rank) for key in keys}
    index = {"world_size": world_size, "shards": [shard_name(name, r, world_size) for r in range(world_size)],
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(folder, f"{name}.index.json"), "w") as f:
        json.dump(index, f, indent=1)


def has_state(folder: str, name: str) -> bool:
    return os.path.isfile(os.path.join(folder, f"{name}.json")) or \
        os.path.isfile(os.path.join(folder, f"{name}.index.json"))


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise StateFormatError(f"{path} is not JSON: {e}") from None


def _merge(into: Any, other: Any) -> Any:
    """The union of two shards' structures (dicts merge key by key; elsewhere the first shard's value stands)."""
    if isinstance(into, dict) and isinstance(other, dict) and ARRAY not in into and TUPLE not in into:
        for key, value in other.items():
            into[key] = _merge(into[key], value) if key in into else value
    return into


def select(tree: Any, wanted) -> Any:
    """`tree` without the array references `wanted(key)` declines (dict entries dropped)."""
    if isinstance(tree, dict) and ARRAY not in tree and TUPLE not in tree:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict) and ARRAY in value and not wanted(value[ARRAY]):
                continue
            out[key] = select(value, wanted)
        return out
    return tree


def _array_keys(tree: Any) -> list[str]:
    if isinstance(tree, dict):
        if ARRAY in tree:
            return [tree[ARRAY]]
        return [k for v in tree.values() for k in _array_keys(v)]
    if isinstance(tree, list):
        return [k for v in tree for k in _array_keys(v)]
    return []


def load_state(folder: str, name: str, wanted=None) -> Any:
    """The tree `save_state` wrote (whole, or in every rank's shard), arrays as numpy. `wanted(key)`: read only
    the arrays it accepts (the others' entries are left out), each by name from the file that holds it."""
    structure, by_file = _stored(folder, name, wanted)
    return unflatten(structure, dict(file_arrays(folder, by_file)))


def state_arrays(folder: str, name: str, wanted=None) -> Iterator[tuple[str, np.ndarray]]:
    """The arrays of the state `save_state` wrote (those `wanted(key)` accepts), as (key, array), read one at a time
    as they are asked for: a caller that uses each and lets it go (an export applying the EMA) holds one at a time."""
    return file_arrays(folder, _stored(folder, name, wanted)[1])


class StoredArrays:
    """The arrays of a stored state (those `wanted(key)` accepts), each read by key when asked for: the structure and
    each file's header are read once, so that a caller reading one array of many states at a time (a post-hoc EMA's
    reconstruction, tensor by tensor over its snapshots) holds one array of each at most."""

    def __init__(self, folder: str, name: str, wanted=None):
        self.folder = folder
        structure, by_file = _stored(folder, name, wanted)
        self.structure = structure
        self.file_of = {key: file for file, keys in by_file.items() for key in keys}
        self._headers: dict[str, tuple[dict, int]] = {}

    def keys(self) -> list[str]:
        return sorted(self.file_of)

    def read(self, key: str) -> np.ndarray:
        file = self.file_of.get(key)
        if file is None:
            raise StateFormatError(f"{self.folder} holds no array {key!r}")
        path = os.path.join(self.folder, file)
        with open(path, "rb") as f:
            if file not in self._headers:
                self._headers[file] = safetensors_header(f, path)
            return read_array(f, path, key, *self._headers[file])


def _stored(folder: str, name: str, wanted) -> tuple[Any, dict[str, list[str]]]:
    """A stored state's structure (without the arrays `wanted` declines) and the keys of its arrays by file."""
    index_path = os.path.join(folder, f"{name}.index.json")
    if os.path.isfile(index_path):
        index = _read_json(index_path)
        structure: Any = {}
        for shard in index["shards"]:
            structure = _merge(structure, _read_json(os.path.join(folder, f"{shard}.json")))
        files = index["weight_map"]
    else:
        structure = _read_json(os.path.join(folder, f"{name}.json"))
        path = os.path.join(folder, f"{name}.safetensors")
        files = {key: f"{name}.safetensors" for key in _array_keys(structure)} if os.path.isfile(path) else {}
    if wanted is not None:
        structure = select(structure, wanted)
    by_file: dict[str, list[str]] = {}
    for key in _array_keys(structure):
        if key not in files:
            raise StateFormatError(f"{folder}/{name}: array {key!r} is in no file")
        by_file.setdefault(files[key], []).append(key)
    return structure, by_file


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
