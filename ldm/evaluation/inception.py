"""The FID Inception v3 in Paddle: pytorch-fid's port of TensorFlow's 2015-12-05 graph, up to its pool3 features.

FID is only comparable between papers when computed with this exact network: TensorFlow's Inception, whose
blocks differ from torchvision's (average pools that leave the padding out of the mean, a max pool in the last
block, batch norms with eps 0.001). pytorch-fid ports it as `fid_inception_v3` with the blocks `FIDInceptionA`,
`FIDInceptionC`, `FIDInceptionE_1` and `FIDInceptionE_2`; this module is that network, layer for layer, with
the same parameter names, so that its weights load under pytorch-fid's state-dict names:

    pytorch-fid (torch)                      this module (Paddle)
    Conv2d_1a_3x3.conv.weight                Conv2d_1a_3x3.conv.weight
    Mixed_5b.branch1x1.bn.weight / .bias     Mixed_5b.branch1x1.bn.weight / .bias
    Mixed_5b.branch1x1.bn.running_mean       Mixed_5b.branch1x1.bn._mean
    Mixed_5b.branch1x1.bn.running_var        Mixed_5b.branch1x1.bn._variance
    *.bn.num_batches_tracked                 (ignored: a counter, no weight)
    fc.weight, fc.bias                       (ignored: the classifier, not needed for pool3)

Weights load from safetensors only (no pickle runs code here); `convert_inception` turns pytorch-fid's
`pt_inception-2015-12-05-6726825d.pth` (a torch pickle, read without torch and without running its code) or
PaddleMIX's `pp_inception-2015-12-05-6726825d.pdparams` into such a file.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import zipfile

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

FEATURES = 2048
SIZE = 299  # the network's input side


class WeightsError(ValueError):
    """Inception weights that cannot be used: missing, not safetensors, of other names or shapes. One line."""


# -- the network ---------------------------------------------------------------------------------------
class BasicConv2d(nn.Layer):
    """Convolution without bias, batch norm (eps 0.001, TensorFlow's), ReLU."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2D(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                              bias_attr=False)
        self.bn = nn.BatchNorm2D(out_channels, epsilon=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _avg_pool_without_padding(x):
    """TensorFlow's 3x3 average pool: the zero padding is not counted in the mean (torch: count_include_pad=False)."""
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, exclusive=True)


class FIDInceptionA(nn.Layer):
    def __init__(self, in_channels, pool_features):
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 64, 1)
        self.branch5x5_1 = BasicConv2d(in_channels, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(in_channels, pool_features, 1)

    def forward(self, x):
        branch5x5 = self.branch5x5_2(self.branch5x5_1(x))
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = self.branch_pool(_avg_pool_without_padding(x))
        return paddle.concat([self.branch1x1(x), branch5x5, branch3x3dbl, branch_pool], axis=1)


class InceptionB(nn.Layer):
    """torchvision's InceptionB (Mixed_6a), unchanged in the FID network."""

    def __init__(self, in_channels):
        super().__init__()
        self.branch3x3 = BasicConv2d(in_channels, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x):
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return paddle.concat([self.branch3x3(x), branch3x3dbl, F.max_pool2d(x, kernel_size=3, stride=2)], axis=1)


class FIDInceptionC(nn.Layer):
    def __init__(self, in_channels, channels_7x7):
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(in_channels, 192, 1)
        self.branch7x7_1 = BasicConv2d(in_channels, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(in_channels, 192, 1)

    def forward(self, x):
        branch7x7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        branch7x7dbl = self.branch7x7dbl_1(x)
        for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            branch7x7dbl = layer(branch7x7dbl)
        branch_pool = self.branch_pool(_avg_pool_without_padding(x))
        return paddle.concat([self.branch1x1(x), branch7x7, branch7x7dbl, branch_pool], axis=1)


class InceptionD(nn.Layer):
    """torchvision's InceptionD (Mixed_7a), unchanged in the FID network."""

    def __init__(self, in_channels):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(in_channels, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_channels, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x):
        branch3x3 = self.branch3x3_2(self.branch3x3_1(x))
        branch7x7x3 = self.branch7x7x3_1(x)
        for layer in (self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4):
            branch7x7x3 = layer(branch7x7x3)
        return paddle.concat([branch3x3, branch7x7x3, F.max_pool2d(x, kernel_size=3, stride=2)], axis=1)


class FIDInceptionE(nn.Layer):
    """`FIDInceptionE_1` (Mixed_7b: average pool without padding) and, with `max_pool`, `FIDInceptionE_2`
    (Mixed_7c: a max pool, as the TensorFlow graph has it)."""

    def __init__(self, in_channels, max_pool: bool = False):
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(in_channels, 320, 1)
        self.branch3x3_1 = BasicConv2d(in_channels, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(in_channels, 192, 1)

    def forward(self, x):
        branch3x3 = self.branch3x3_1(x)
        branch3x3 = paddle.concat([self.branch3x3_2a(branch3x3), self.branch3x3_2b(branch3x3)], axis=1)
        branch3x3dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        branch3x3dbl = paddle.concat([self.branch3x3dbl_3a(branch3x3dbl), self.branch3x3dbl_3b(branch3x3dbl)], axis=1)
        pooled = (F.max_pool2d(x, kernel_size=3, stride=1, padding=1) if self.max_pool
                  else _avg_pool_without_padding(x))
        return paddle.concat([self.branch1x1(x), branch3x3, branch3x3dbl, self.branch_pool(pooled)], axis=1)


def FIDInceptionE_1(in_channels):  # pytorch-fid's class name
    return FIDInceptionE(in_channels)


def FIDInceptionE_2(in_channels):
    return FIDInceptionE(in_channels, max_pool=True)


class FIDInceptionV3(nn.Layer):
    """pool3 features [N, 2048] of images [N, 3, H, W] in [-1, 1] (pytorch-fid's `InceptionV3([3])` after its
    optional resize and normalisation, which `ldm.evaluation.fid` does)."""

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b = FIDInceptionA(192, pool_features=32)
        self.Mixed_5c = FIDInceptionA(256, pool_features=64)
        self.Mixed_5d = FIDInceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = FIDInceptionC(768, channels_7x7=128)
        self.Mixed_6c = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6d = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6e = FIDInceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = FIDInceptionE_1(1280)
        self.Mixed_7c = FIDInceptionE_2(2048)

    def forward(self, x):
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b, self.Mixed_6c,
                      self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):
            x = block(x)
        return x.mean(axis=[2, 3])  # adaptive average pool to 1x1


# -- names -----------------------------------------------------------------------------------------------
TORCH_TO_PADDLE = {".bn.running_mean": ".bn._mean", ".bn.running_var": ".bn._variance"}
IGNORED = (".num_batches_tracked", "fc.weight", "fc.bias")  # pytorch-fid keys that hold no pool3 weight


def paddle_name(torch_name: str) -> str:
    for torch_suffix, paddle_suffix in TORCH_TO_PADDLE.items():
        if torch_name.endswith(torch_suffix):
            return torch_name[: -len(torch_suffix)] + paddle_suffix
    return torch_name


def torch_name(paddle_name_: str) -> str:
    for torch_suffix, paddle_suffix in TORCH_TO_PADDLE.items():
        if paddle_name_.endswith(paddle_suffix):
            return paddle_name_[: -len(paddle_suffix)] + torch_suffix
    return paddle_name_


def is_ignored(name: str) -> bool:
    return name.endswith(IGNORED[0]) or name in IGNORED[1:]


def expected_shapes() -> dict[str, tuple[int, ...]]:
    """pytorch-fid's names and shapes of every pool3 weight (from the network itself)."""
    with paddle.LazyGuard():
        model = FIDInceptionV3()
    return {torch_name(k): tuple(v.shape) for k, v in model.state_dict().items()}


def weights_fingerprint(state: dict[str, np.ndarray]) -> str:
    """sha256 of the pool3 weights' content (names, shapes, float32 bytes, in name order), not of the file:
    the same weights converted twice, or saved with or without the classifier, have one fingerprint."""
    digest = hashlib.sha256()
    for name in sorted(k for k in state if not is_ignored(k)):
        array = np.ascontiguousarray(state[name], dtype=np.float32)
        digest.update(f"{name}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def check_state(state: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """The pool3 weights of `state` (pytorch-fid's names) as float32, or WeightsError naming what is wrong."""
    shapes = expected_shapes()
    unknown = sorted(k for k in state if k not in shapes and not is_ignored(k))
    missing = sorted(k for k in shapes if k not in state)
    if unknown:
        raise WeightsError(f"{source}: {len(unknown)} unknown key(s) ({', '.join(unknown[:3])}"
                           f"{', ...' if len(unknown) > 3 else ''}): not the FID Inception under pytorch-fid's "
                           "names; convert the original with `python -m ldm.evaluate convert-inception`")
    if missing:
        raise WeightsError(f"{source}: {len(missing)} weight(s) missing ({', '.join(missing[:3])}"
                           f"{', ...' if len(missing) > 3 else ''}); convert the complete original with "
                           "`python -m ldm.evaluate convert-inception`")
    wrong = [f"{k} is {tuple(state[k].shape)}, expected {shapes[k]}" for k in sorted(shapes)
             if tuple(state[k].shape) != shapes[k]]
    if wrong:
        raise WeightsError(f"{source}: {len(wrong)} weight(s) of the wrong shape ({wrong[0]}"
                           f"{', ...' if len(wrong) > 1 else ''}): not the FID Inception v3")
    bad = [k for k in shapes if not np.issubdtype(state[k].dtype, np.floating)]
    if bad:
        raise WeightsError(f"{source}: {bad[0]} holds {state[bad[0]].dtype} values, not floating point")
    return {k: np.asarray(state[k], dtype=np.float32) for k in shapes}


def _head(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(16)


def is_safetensors(head: bytes) -> bool:
    """safetensors: an 8-byte little-endian header length, then the JSON header."""
    return len(head) > 8 and head[8:9] == b"{"


def is_pickle(head: bytes) -> bool:
    """A torch zip checkpoint, or a raw pickle (protocol 2 or later: torch's legacy format, paddle.save)."""
    return head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file; WeightsError for a file that is missing or not safetensors (a pickle
    is refused unread: loading one runs whatever code it carries)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not os.path.isfile(path):
        raise WeightsError(f"{path}: no such file; give the FID Inception weights as safetensors (convert "
                           "pytorch-fid's .pth with `python -m ldm.evaluate convert-inception`)")
    head = _head(path)
    if not is_safetensors(head):
        if path.endswith(".npz"):
            raise WeightsError(f"{path} is a numpy .npz (FID statistics?), not Inception weights: give the "
                               "safetensors `python -m ldm.evaluate convert-inception` writes")
        if is_pickle(head):
            raise WeightsError(f"{path} is a pickle (a torch .pth or a Paddle .pdparams), which is not loaded: "
                               f"convert it once with `python -m ldm.evaluate convert-inception {path} "
                               "--output W.safetensors`")
        raise WeightsError(f"{path} is not a safetensors file; give the weights `python -m ldm.evaluate "
                           "convert-inception` writes")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WeightsError(f"{path} is not a readable safetensors file ({detail}); write it again with "
                           "`python -m ldm.evaluate convert-inception`") from None


class Inception:
    """The FID Inception with its weights, in eval mode, and their fingerprint (recorded in statistics)."""

    def __init__(self, state: dict[str, np.ndarray], source: str = "weights"):
        weights = check_state(state, source)
        self.fingerprint = weights_fingerprint(weights)
        self.source = source
        self.model = FIDInceptionV3()
        self.model.set_state_dict({paddle_name(k): v for k, v in weights.items()})
        self.model.eval()

    @classmethod
    def from_file(cls, path: str) -> Inception:
        return cls(read_safetensors(path), path)

    def __call__(self, x) -> np.ndarray:
        """pool3 features (float32 numpy [N, 2048]) of a float32 [N, 3, H, W] array or tensor in [-1, 1]."""
        if not isinstance(x, paddle.Tensor):
            x = paddle.to_tensor(np.asarray(x, dtype=np.float32))
        with paddle.no_grad():
            return self.model(x).numpy()


# -- converting the published weights ------------------------------------------------------------------
# PaddleMIX's FID Inception (ppdiffusers/ppdiffusers/metrics/inception.py, weights `pp_inception-2015-12-05-
# 6726825d.pdparams`) is `paddle.vision.models.inception_v3(num_classes=1008)` with the FID blocks swapped in,
# which keep paddle.vision's attribute names: its state dict is named as paddle.vision's Inception v3 is.
PADDLE_VISION_STEM = {"conv_1a_3x3": "Conv2d_1a_3x3", "conv_2a_3x3": "Conv2d_2a_3x3", "conv_2b_3x3": "Conv2d_2b_3x3",
                      "conv_3b_1x1": "Conv2d_3b_1x1", "conv_4a_3x3": "Conv2d_4a_3x3"}
PADDLE_VISION_BLOCKS = ["Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d",
                        "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c"]
PADDLE_VISION_LAYER = {"0.weight": "conv.weight", "1.weight": "bn.weight", "1.bias": "bn.bias",
                       "1._mean": "bn.running_mean", "1._variance": "bn.running_var"}


def from_paddle_vision_name(name: str) -> str | None:
    """pytorch-fid's name of a paddle.vision / PaddleMIX Inception v3 state-dict key; None if it has none."""
    if name in ("fc.weight", "fc.bias"):
        return name
    parts = name.split(".")
    if parts[0] == "inception_stem" and len(parts) == 4 and parts[1] in PADDLE_VISION_STEM:
        layer = PADDLE_VISION_LAYER.get(".".join(parts[2:]))
        return f"{PADDLE_VISION_STEM[parts[1]]}.{layer}" if layer else None
    if parts[0] == "inception_block_list" and len(parts) == 5 and parts[1].isdigit() \
            and int(parts[1]) < len(PADDLE_VISION_BLOCKS):
        branch = "branch_pool" if parts[2] == "branch_pool_conv" else parts[2]
        layer = PADDLE_VISION_LAYER.get(".".join(parts[3:]))
        return f"{PADDLE_VISION_BLOCKS[int(parts[1])]}.{branch}.{layer}" if layer else None
    return None


def from_paddle_vision(state: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    renamed = {}
    for name, value in state.items():
        target = from_paddle_vision_name(name)
        if target is None:
            raise WeightsError(f"{source}: unknown key {name!r}: not PaddleMIX's FID Inception (paddle.vision "
                               "Inception v3 names)")
        value = np.asarray(value)
        renamed[target] = value.T if name == "fc.weight" else value  # a Paddle Linear stores [in, out]
    return renamed


class _TorchStorage:
    """A storage of a torch checkpoint: its element type and where its bytes are."""

    def __init__(self, dtype, key):
        self.dtype, self.key, self.array = dtype, key, None


TORCH_DTYPES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
                "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
                "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


def _rebuild_tensor(storage, offset, size, stride, *_):
    return ("tensor", storage, offset, tuple(size), tuple(stride))


class _TorchUnpickler(pickle.Unpickler):
    """Reads the tensors of a torch checkpoint and nothing else: the only callables it will build are torch's
    tensor rebuild function and an OrderedDict; any other global (the code a pickle can carry) is refused."""

    def __init__(self, file, source):
        super().__init__(file)
        self.source = source
        self.storages: dict[str, _TorchStorage] = {}

    def find_class(self, module, name):
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        raise WeightsError(f"{self.source}: refers to {module}.{name}, which a file of weights does not need: "
                           "not read (a pickle can run code)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise WeightsError(f"{self.source}: unsupported torch storage record {pid!r:.60}")
        dtype, key = pid[1], str(pid[2])
        if not isinstance(dtype, type):
            raise WeightsError(f"{self.source}: unsupported torch storage type {dtype!r:.60}")
        return self.storages.setdefault(key, _TorchStorage(dtype, key))


def _tensors(tree, source) -> dict[str, np.ndarray]:
    """{name: array} of an unpickled state dict whose storages are filled in."""
    if isinstance(tree, dict) and "state_dict" in tree and isinstance(tree["state_dict"], dict):
        tree = tree["state_dict"]
    if not isinstance(tree, dict):
        raise WeightsError(f"{source}: holds a {type(tree).__name__}, not a state dict")
    out = {}
    for name, value in tree.items():
        if not (isinstance(value, tuple) and len(value) == 5 and value[0] == "tensor"):
            raise WeightsError(f"{source}: {name!r} is not a tensor")
        _, storage, offset, size, stride = value
        flat = storage.array
        itemsize = flat.itemsize
        out[str(name)] = np.lib.stride_tricks.as_strided(
            flat[offset:], shape=size, strides=[s * itemsize for s in stride]).copy() if size else \
            flat[offset:offset + 1].reshape(()).copy()
    return out


TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def _read_torch_zip(path: str) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(path) as archive:
        pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise WeightsError(f"{path}: a zip without data.pkl: not a torch checkpoint")
        root = pkl[: -len("data.pkl")]
        with archive.open(pkl) as f:
            unpickler = _TorchUnpickler(f, path)
            tree = unpickler.load()
        for key, storage in unpickler.storages.items():
            storage.array = np.frombuffer(archive.read(f"{root}data/{key}"), dtype=storage.dtype)
    return _tensors(tree, path)


def _read_torch_legacy(path: str) -> dict[str, np.ndarray]:
    """torch's format before 1.6: pickles of the magic number, the protocol version and the system info, then
    of the object (storages by reference), of the storage keys, then each storage's element count and bytes."""
    with open(path, "rb") as f:
        if _TorchUnpickler(f, path).load() != TORCH_LEGACY_MAGIC:
            raise WeightsError(f"{path}: a pickle, but not a torch checkpoint")
        _TorchUnpickler(f, path).load()  # protocol version
        _TorchUnpickler(f, path).load()  # system info (little-endian, type sizes)
        unpickler = _TorchUnpickler(f, path)
        tree = unpickler.load()
        for key in _TorchUnpickler(f, path).load():
            storage = unpickler.storages[str(key)]
            count = int(np.frombuffer(f.read(8), dtype="<i8")[0])
            size = count * np.dtype(storage.dtype).itemsize
            data = f.read(size)
            if len(data) != size:
                raise WeightsError(f"{path}: cut short (storage {key} has {len(data)} of {size} bytes)")
            storage.array = np.frombuffer(data, dtype=storage.dtype)
    return _tensors(tree, path)


def read_torch_checkpoint(path: str) -> dict[str, np.ndarray]:
    """The tensors of a `torch.save` file, read without torch: the zip format (torch >= 1.6) and the earlier
    sequential one (not checked here which of the two pytorch-fid's .pth is in: both are read).
    Only tensors, dicts and numbers are built: any other object the pickle names is refused."""
    try:
        return _read_torch_zip(path) if zipfile.is_zipfile(path) else _read_torch_legacy(path)
    except WeightsError:
        raise
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, IndexError, AttributeError,
            zipfile.BadZipFile) as e:
        raise WeightsError(f"{path}: cannot read it as a torch checkpoint ({type(e).__name__}: {e})") from None


def _read_paddle_pickle(path: str) -> dict[str, np.ndarray]:
    """A `paddle.save` state dict, through paddle.load (which unpickles it)."""
    try:
        loaded = paddle.load(path, return_numpy=True)
    except Exception as e:  # noqa: BLE001 - paddle.load raises many kinds for a file that is not its own
        raise WeightsError(f"{path}: neither a torch checkpoint nor a Paddle state dict ({type(e).__name__})") \
            from None
    if not isinstance(loaded, dict):
        raise WeightsError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
    return {str(k): np.asarray(v) for k, v in loaded.items()}


def read_original(path: str) -> tuple[dict[str, np.ndarray], str]:
    """(weights under pytorch-fid's names, what the file was) of a published FID Inception file."""
    if not os.path.isfile(path):
        raise WeightsError(f"{path}: no such file")
    head = _head(path)
    if is_safetensors(head):
        state, kind = read_safetensors(path), "safetensors"
    elif zipfile.is_zipfile(path):
        state, kind = read_torch_checkpoint(path), "torch checkpoint (zip)"
    elif is_pickle(head):
        try:
            state, kind = read_torch_checkpoint(path), "torch checkpoint (legacy)"
        except WeightsError:
            state, kind = _read_paddle_pickle(path), "Paddle state dict"
    else:
        raise WeightsError(f"{path}: neither safetensors, a torch checkpoint nor a Paddle state dict")
    if any(k.startswith(("inception_stem.", "inception_block_list.")) for k in state):
        state = from_paddle_vision(state, path)
        kind += ", PaddleMIX / paddle.vision names"
    return state, kind


def convert_inception(src: str, dst: str) -> dict:
    """Write the FID Inception weights of `src` (pytorch-fid's .pth, PaddleMIX's .pdparams, or safetensors) to
    `dst` as safetensors under pytorch-fid's names, the classifier and batch counters left out. Unpickles `src`
    (restricted to tensors for a torch file; through paddle.load for a Paddle one): only for files you trust."""
    from safetensors.numpy import save_file

    state, kind = read_original(src)
    weights = check_state(state, src)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, dst)
    return {"source": src, "format": kind, "output": dst, "tensors": len(weights),
            "weights_sha256": weights_fingerprint(weights)}
