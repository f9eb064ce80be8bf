"""Weights published as pickles (torch's `.pth`/`.bin`, Paddle's `.pdparams`), read without running their code.

Unpickling a file calls whatever the file names: `os.system` as readily as a tensor constructor. These readers
are `pickle.Unpickler`s whose `find_class` admits only what a file of weights needs and refuses anything else
before it is called; nothing here falls back to `torch.load`, `paddle.load` or a plain `pickle.load`.

    torch, zip format (torch >= 1.6)   archive/data.pkl names storages by key; their bytes are archive/data/<key>
    torch, legacy format               pickles of a magic number, the protocol, the system info, the object, the
                                       storage keys, then each storage's element count and bytes
    Paddle (`paddle.save`)             a dict of numpy arrays (Paddle 2.x: of (name, array) tuples), with
                                       bookkeeping keys such as "StructuredToParameterName@@"

Hand-written because neither library offers a loader that refuses code: `torch.load(weights_only=True)` needs
torch, and `paddle.load` unpickles in full.
"""

from __future__ import annotations

import collections
import os
import pickle
import zipfile

import numpy as np

from ldm.runtime.errors import UserError


class PickleError(UserError, ValueError):
    """A pickled weights file that is refused (it names code) or cannot be read. One line."""


TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
TORCH_LEGACY_HEAD = pickle.dumps(TORCH_LEGACY_MAGIC, protocol=2)  # how every legacy torch file starts
BFLOAT16 = "bfloat16"  # numpy has no bfloat16: read as uint16, widened to float32 exactly
TORCH_DTYPES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
                "BFloat16Storage": BFLOAT16, "LongStorage": np.int64, "IntStorage": np.int32,
                "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}
# Paddle's bookkeeping entries of a saved state dict: not weights
PADDLE_EXTRA_KEYS = ("StructuredToParameterName@@", "UnpackBigParamInfor@@")
ZIP_HEAD = b"PK\x03\x04"  # a zip file's first bytes: torch.save's format since torch 1.6


def is_pickle(head: bytes) -> bool:
    """A torch zip checkpoint, or a raw pickle (protocol 2 or later: torch's legacy format, paddle.save)."""
    return head[:4] == ZIP_HEAD or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def refusal(source: str, module: str, name: str) -> PickleError:
    return PickleError(f"{source}: refers to {module}.{name}, which a file of weights does not need: not read "
                       "(a pickle can run code)")


# -- torch ------------------------------------------------------------------------------------------------------
class _TorchStorage:
    """A storage of a torch checkpoint: its element type and where its bytes are."""

    def __init__(self, dtype, key):
        self.dtype, self.key, self.array = dtype, key, None

    def fill(self, data: bytes) -> None:
        if self.dtype == BFLOAT16:
            self.array = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            self.array = np.frombuffer(data, dtype=self.dtype)

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == BFLOAT16 else np.dtype(self.dtype).itemsize


def _rebuild_tensor(storage, offset, size, stride, *_):
    return ("tensor", storage, offset, tuple(size), tuple(stride))


def _rebuild_parameter(data, *_):  # an nn.Parameter saved as such: its tensor
    return data


class _TorchUnpickler(pickle.Unpickler):
    """Builds torch's tensor records, dicts and numbers; any other global is refused."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor, ("torch._utils", "_rebuild_tensor"):
               _rebuild_tensor, ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
               ("collections", "OrderedDict"): collections.OrderedDict}

    def __init__(self, file, source):
        super().__init__(file)
        self.source = source
        self.storages: dict[str, _TorchStorage] = {}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return self.ALLOWED[module, name]
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        raise refusal(self.source, module, name)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise PickleError(f"{self.source}: unsupported torch storage record {pid!r:.60}")
        dtype, key = pid[1], str(pid[2])
        if not (isinstance(dtype, type) or dtype == BFLOAT16):
            raise PickleError(f"{self.source}: unsupported torch storage type {dtype!r:.60}")
        return self.storages.setdefault(key, _TorchStorage(dtype, key))


def _torch_tensors(tree, source) -> dict[str, np.ndarray]:
    """{name: array} of an unpickled torch state dict whose storages are filled in."""
    if isinstance(tree, dict) and "state_dict" in tree and isinstance(tree["state_dict"], dict):
        tree = tree["state_dict"]
    if not isinstance(tree, dict):
        raise PickleError(f"{source}: holds a {type(tree).__name__}, not a state dict")
    out = {}
    for name, value in tree.items():
        if not (isinstance(value, tuple) and len(value) == 5 and value[0] == "tensor"):
            raise PickleError(f"{source}: {name!r} is not a tensor")
        _, storage, offset, size, stride = value
        flat = storage.array
        if flat is None:
            raise PickleError(f"{source}: the bytes of {name!r} are missing")
        itemsize = flat.itemsize
        out[str(name)] = np.lib.stride_tricks.as_strided(
            flat[offset:], shape=size, strides=[s * itemsize for s in stride]).copy() if size else \
            flat[offset:offset + 1].reshape(()).copy()
    return out


def _read_torch_zip(path: str) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(path) as archive:
        pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise PickleError(f"{path}: a zip without data.pkl: not a torch checkpoint")
        root = pkl[: -len("data.pkl")]
        with archive.open(pkl) as f:
            unpickler = _TorchUnpickler(f, path)
            tree = unpickler.load()
        for key, storage in unpickler.storages.items():
            storage.fill(archive.read(f"{root}data/{key}"))
    return _torch_tensors(tree, path)


def _read_torch_legacy(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        if _TorchUnpickler(f, path).load() != TORCH_LEGACY_MAGIC:
            raise PickleError(f"{path}: a pickle, but not a torch checkpoint")
        _TorchUnpickler(f, path).load()  # protocol version
        _TorchUnpickler(f, path).load()  # system info (little-endian, type sizes)
        unpickler = _TorchUnpickler(f, path)
        tree = unpickler.load()
        for key in _TorchUnpickler(f, path).load():
            storage = unpickler.storages[str(key)]
            count = int(np.frombuffer(f.read(8), dtype="<i8")[0])
            size = count * storage.itemsize
            data = f.read(size)
            if len(data) != size:
                raise PickleError(f"{path}: cut short (storage {key} has {len(data)} of {size} bytes)")
            storage.fill(data)
    return _torch_tensors(tree, path)


# -- Paddle -----------------------------------------------------------------------------------------------------
def _lod_tensor(expression, namespace=None, *_):
    """Paddle pickles a LoDTensor as `eval('data', {'data': array})`: that one form is evaluated, by lookup."""
    if expression != "data" or not isinstance(namespace, dict) or not isinstance(namespace.get("data"), np.ndarray):
        raise PickleError("a Paddle pickle calls eval with something other than a saved tensor: not read "
                          "(a pickle can run code)")
    return namespace["data"]


def _latin1_bytes(text, encoding="latin1"):
    """Protocol 2 pickles bytes as `_codecs.encode(text, 'latin1')`: admitted for that encoding only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise PickleError("a pickle calls _codecs.encode with something other than bytes: not read "
                          "(a pickle can run code)")
    return text.encode("latin1")


class _PaddleUnpickler(pickle.Unpickler):
    """Builds numpy arrays, dicts, tuples and numbers; any other global is refused."""

    def __init__(self, file, source):
        super().__init__(file)
        self.source = source

    def find_class(self, module, name):
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name in ("_reconstruct", "scalar"):
            return getattr(np.core.multiarray, name)
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module in ("builtins", "__builtin__") and name == "tuple":
            return tuple
        if module in ("builtins", "__builtin__") and name == "eval":
            return _lod_tensor
        if module == "_codecs" and name == "encode":
            return _latin1_bytes
        raise refusal(self.source, module, name)


def _paddle_tensors(loaded, source) -> dict[str, np.ndarray]:
    if not isinstance(loaded, dict):
        raise PickleError(f"{source}: holds a {type(loaded).__name__}, not a state dict")
    loaded = dict(loaded)
    for original, info in (loaded.get("UnpackBigParamInfor@@") or {}).items():  # a tensor saved in slices (protocol 2)
        parts = [loaded.pop(part) for part in info["slices"]]
        loaded[original] = np.concatenate(parts).reshape(info["OriginShape"])
    out = {}
    for name, value in loaded.items():
        if name in PADDLE_EXTRA_KEYS:
            continue
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], np.ndarray):  # Paddle 2.x
            value = value[1]
        if not isinstance(value, np.ndarray):
            raise PickleError(f"{source}: {name!r} is a {type(value).__name__}, not a tensor")
        out[str(name)] = value
    return out


def read_paddle(path: str) -> dict[str, np.ndarray]:
    """The arrays of a `paddle.save` state dict (`.pdparams`), read without running code."""
    with open(path, "rb") as f:
        return _paddle_tensors(_PaddleUnpickler(f, path).load(), path)


def read_torch(path: str) -> dict[str, np.ndarray]:
    """The arrays of a `torch.save` state dict (`.pth`, `.bin`, `.ckpt`), zip or legacy format, read without torch
    and without running code."""
    return _read_torch_zip(path) if zipfile.is_zipfile(path) else _read_torch_legacy(path)


READ_ERRORS = (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, IndexError, AttributeError,
               zipfile.BadZipFile, OSError)


def read_pickled_weights(path: str) -> tuple[dict[str, np.ndarray], str]:
    """(arrays by name, which format) of a torch or Paddle pickle of weights, told apart by their first bytes;
    PickleError when it names anything but what weights need, or is neither."""
    if not os.path.isfile(path):
        raise PickleError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(len(TORCH_LEGACY_HEAD))
    if zipfile.is_zipfile(path):
        reader, kind = read_torch, "torch checkpoint (zip)"
    elif head == TORCH_LEGACY_HEAD:
        reader, kind = read_torch, "torch checkpoint (legacy)"
    elif head[:4] == ZIP_HEAD:  # a zip whose central directory, at its end, is missing
        raise PickleError(f"{path}: a torch checkpoint (zip) cut short or damaged: its end is missing; copy it again")
    elif is_pickle(head):
        reader, kind = read_paddle, "Paddle state dict"
    else:
        raise PickleError(f"{path}: neither a torch checkpoint nor a Paddle state dict")
    try:
        return reader(path), kind
    except PickleError:
        raise
    except READ_ERRORS as e:
        raise PickleError(f"{path}: cannot read it as a {kind} ({type(e).__name__}: {str(e)[:200]})") from None
