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
`pt_inception-2015-12-05-6726825d.pth` (a torch pickle) or PaddleMIX's `pp_inception-2015-12-05-6726825d.pdparams`
into such a file; both are read without torch and without running code (`ldm.models.pickled`).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ldm.models.pickled import PickleError, is_pickle, read_pickled_weights
from ldm.runtime.errors import UserError

FEATURES = 2048
SIZE = 299  # the network's input side


class WeightsError(UserError, ValueError):
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


def read_original(path: str) -> tuple[dict[str, np.ndarray], str]:
    """(weights under pytorch-fid's names, what the file was) of a published FID Inception file."""
    if not os.path.isfile(path):
        raise WeightsError(f"{path}: no such file")
    head = _head(path)
    if is_safetensors(head):
        state, kind = read_safetensors(path), "safetensors"
    else:
        try:
            state, kind = read_pickled_weights(path)
        except PickleError as e:
            raise WeightsError(str(e)) from None
    if any(k.startswith(("inception_stem.", "inception_block_list.")) for k in state):
        state = from_paddle_vision(state, path)
        kind += ", PaddleMIX / paddle.vision names"
    return state, kind


def convert_inception(src: str, dst: str) -> dict:
    """Write the FID Inception weights of `src` (pytorch-fid's .pth, PaddleMIX's .pdparams, or safetensors) to
    `dst` as safetensors under pytorch-fid's names, the classifier and batch counters left out. A pickled `src` is
    read by `ldm.models.pickled`, which refuses one that names anything but tensors."""
    from safetensors.numpy import save

    from ldm.runtime.files import atomic_write

    state, kind = read_original(src)
    weights = check_state(state, src)
    with atomic_write(dst) as f:
        f.write(save({k: np.ascontiguousarray(v) for k, v in weights.items()}))
    return {"source": src, "format": kind, "output": dst, "tensors": len(weights),
            "weights_sha256": weights_fingerprint(weights)}
