"""FID: Inception pool3 statistics of image sets and the Fréchet distance between them, as the reference tools.

Two ways of bringing an image to the network's 299x299, which give different FIDs (they cannot be mixed):
- `clean` (default): clean-fid's resize: each channel as a float32 Pillow image ('F' mode) resized bicubic
  (antialiased) to 299x299, clipped to [0, 255], never quantised (`cleanfid.resize.make_resizer("PIL", False,
  "bicubic", (299, 299))`), then pytorch-fid's normalisation x / 255 * 2 - 1; the network does not resize.
- `legacy_pytorch`: exactly pytorch-fid: x / 255 (ToTensor), the network's bilinear resize to 299
  (align_corners=False, no antialiasing: aliased when downscaling), then x * 2 - 1.
Images are uint8 [H, W, 3] (0..255) or float [H, W, 3] in [0, 1] (generated images, kept as arrays: never
through JPEG). Statistics are pytorch-fid's (float64 mean and `np.cov(rowvar=False)`) and so is the distance
(`calculate_frechet_distance`), its matrix square root's trace taken from eigenvalues (pytorch-fid's value to 1e-4;
`method="sqrtm"` is its scipy sqrtm, eps offset and imaginary-part check exactly). A statistics file (.npz)
records the mode, the number of images, the fingerprint of the Inception weights and the image resolution, and
statistics of another mode or other weights are refused; pytorch-fid's own files (mu and sigma only) load too, with
a warning that what they were computed with is unknown.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ldm.runtime.errors import UserError

MODES = ("clean", "legacy_pytorch")
SIZE = 299
FEATURES = 2048
# FID's bias grows as the sample shrinks: below the feature dimension the covariance is not even full rank,
# and figures are not comparable with published ones (which use 10k-50k images)
UNBIASED_SAMPLES = 2048
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".ppm")
NOT_SAMPLES = ("grid.png",)  # `ldm.generate` writes its grid beside the samples: not one of them


class FIDError(UserError, ValueError):
    """Images or statistics that cannot give a FID (one line: what is wrong and how to fix it)."""


# -- images ------------------------------------------------------------------------------------------
def list_images(folder: str) -> list[str]:
    """The image files of a folder (not below it), sorted by name."""
    if not os.path.isdir(folder):
        raise FIDError(f"{folder}: no such folder")
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(IMAGE_EXTENSIONS)
                   and os.path.isfile(os.path.join(folder, n)) and n not in NOT_SAMPLES)
    return [os.path.join(folder, n) for n in names]


def read_image(path: str) -> np.ndarray:
    """uint8 [H, W, 3] as pytorch-fid and clean-fid read a file (`Image.open(path).convert("RGB")`)."""
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise FIDError(f"{path}: not a readable image ({type(e).__name__}: {e}); remove or replace it") from None


def as_pixels(image) -> np.ndarray:
    """float32 [H, W, 3] in 0..255 of a uint8 image (0..255) or a float one (0..1)."""
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.ndim != 3 or array.shape[2] != 3:
        raise FIDError(f"an image of shape {array.shape}: expected [height, width, 3]")
    if array.dtype == np.uint8:
        return array.astype(np.float32)
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float32) * np.float32(255)
    raise FIDError(f"an image of dtype {array.dtype}: expected uint8 (0..255) or float (0..1)")


def clean_resize(pixels: np.ndarray, size: int = SIZE) -> np.ndarray:
    """clean-fid's resize of float32 [H, W, 3] (0..255): per channel, Pillow bicubic in float, clipped."""
    channels = [np.asarray(Image.fromarray(np.ascontiguousarray(pixels[:, :, c]), mode="F")
                           .resize((size, size), resample=Image.BICUBIC)).clip(0, 255) for c in range(3)]
    return np.stack(channels, axis=2).astype(np.float32)


def network_input(image, mode: str) -> np.ndarray:
    """float32 [3, 299, 299] in [-1, 1] (clean), or [3, H, W] in [0, 1] (legacy_pytorch: the network resizes)."""
    pixels = as_pixels(image)
    if mode == "clean":
        return (clean_resize(pixels) / np.float32(255) * np.float32(2) - np.float32(1)).transpose(2, 0, 1)
    if mode == "legacy_pytorch":
        return (pixels / np.float32(255)).transpose(2, 0, 1)
    raise FIDError(f"unknown mode {mode!r}: choose {' or '.join(MODES)}")


def _legacy_batch(inputs: list[np.ndarray]):
    """pytorch-fid's resize and normalisation of [3, H, W] images in [0, 1]: one [N, 3, 299, 299] tensor."""
    import paddle
    import paddle.nn.functional as F

    resized = []
    for x in inputs:
        tensor = paddle.to_tensor(x[None])
        if tuple(x.shape[1:]) != (SIZE, SIZE):
            tensor = F.interpolate(tensor, size=(SIZE, SIZE), mode="bilinear", align_corners=False, align_mode=0)
        resized.append(tensor)
    return 2 * paddle.concat(resized, axis=0) - 1


def inception_features(images: Iterable, inception, mode: str = "clean", batch_size: int = 50,
                       progress: Callable[[int], None] | None = None) -> np.ndarray:
    """pool3 features, float32 [N, 2048], of uint8 or float images (see `as_pixels`) in batches.
    `inception`: an `ldm.evaluation.inception.Inception`; `progress(n)` is called after each batch."""
    if mode not in MODES:
        raise FIDError(f"unknown mode {mode!r}: choose {' or '.join(MODES)}")
    out, batch = [], []

    def run():
        x = np.stack(batch) if mode == "clean" else _legacy_batch(batch)
        out.append(inception(x))
        if progress:
            progress(len(batch))
        batch.clear()

    for image in images:
        batch.append(network_input(image, mode))
        if len(batch) == batch_size:
            run()
    if batch:
        run()
    return np.concatenate(out) if out else np.zeros((0, FEATURES), np.float32)


# -- statistics --------------------------------------------------------------------------------------
@dataclass
class Statistics:
    """What a FID compares: the features' mean and covariance, with what they were computed with (None:
    not recorded, as in pytorch-fid's files)."""

    mu: np.ndarray
    sigma: np.ndarray
    mode: str | None = None
    num_images: int | None = None
    weights_sha256: str | None = None
    resolution: int | None = None  # the side images were cropped to before the metric (None: as they were)

    def save(self, path: str) -> None:
        meta = {"mode": self.mode, "num_images": self.num_images, "weights_sha256": self.weights_sha256,
                "resolution": self.resolution}
        from ldm.runtime.files import atomic_write

        with atomic_write(path) as f:  # a file object: np.savez would add .npz to a name without it
            np.savez(f, mu=self.mu, sigma=self.sigma,
                     **{k: np.array(v) for k, v in meta.items() if v is not None})

    @classmethod
    def load(cls, path: str) -> Statistics:
        """Statistics of ours or pytorch-fid's `--save-stats` (mu and sigma only); never unpickles."""
        import zipfile

        try:
            with open(path, "rb") as f:
                head = f.read(8)
            if not head.startswith(b"PK\x03\x04"):  # an .npz is a zip; anything else is not statistics
                what = "an empty file" if not head else "a PNG image" if head.startswith(b"\x89PNG") else \
                    "a JPEG" if head.startswith(b"\xff\xd8") else "not a zip archive"
                raise FIDError(f"{path}: not a statistics .npz ({what}); write one with `python -m ldm.evaluate "
                               "stats`")
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except FIDError:
            raise
        except FileNotFoundError:
            raise FIDError(f"{path}: no such statistics file") from None
        except IsADirectoryError:
            raise FIDError(f"{path}: a folder, not a statistics file") from None
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise FIDError(f"{path}: a damaged statistics .npz ({str(e).splitlines()[0]}); write it again with "
                           "`python -m ldm.evaluate stats`") from None
        if "mu" not in arrays or "sigma" not in arrays:
            raise FIDError(f"{path}: holds no mu and sigma ({', '.join(arrays) or 'nothing'}): not FID statistics")
        mu, sigma = np.asarray(arrays["mu"], np.float64), np.asarray(arrays["sigma"], np.float64)
        if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
            raise FIDError(f"{path}: mu {mu.shape} and sigma {sigma.shape} do not fit (expected [D] and [D, D])")
        bad = [name for name, value in (("mu", mu), ("sigma", sigma)) if not np.isfinite(value).all()]
        if bad:
            raise FIDError(f"{path}: {' and '.join(bad)} hold non-finite values: not usable FID statistics (write "
                           "them again with `python -m ldm.evaluate stats`)")

        def meta(key, kind):
            return kind(arrays[key].item()) if key in arrays else None

        return cls(mu, sigma, meta("mode", str), meta("num_images", int), meta("weights_sha256", str),
                   meta("resolution", int))


def statistics(features: np.ndarray, mode: str | None = None, weights_sha256: str | None = None,
               resolution: int | None = None) -> Statistics:
    """pytorch-fid's statistics (float64 mean, covariance with rowvar=False) of [N, D] features, N >= 2."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or features.shape[0] < 2:
        count = features.shape[0] if features.ndim == 2 else 0
        raise FIDError(f"{count} image(s): a covariance needs at least two images (FID needs thousands: "
                       f"{UNBIASED_SAMPLES} or more)")
    return Statistics(np.mean(features, axis=0), np.cov(features, rowvar=False), mode, int(features.shape[0]),
                      weights_sha256, resolution)


def small_sample_warning(stats: Statistics, name: str = "statistics") -> str | None:
    """A message when the statistics come from fewer images than FID needs to be unbiased enough to compare."""
    if stats.num_images is not None and stats.num_images < UNBIASED_SAMPLES:
        return (f"{name}: {stats.num_images} images, fewer than {UNBIASED_SAMPLES} (the feature dimension): "
                "the covariance is rank-deficient and FID is biased upwards; compare only FIDs of the same count")
    return None


def check_comparable(a: Statistics, b: Statistics, name_a: str = "A", name_b: str = "B") -> list[str]:
    """FIDError if `a` and `b` were computed differently (mode, weights, resolution, dimension); the warnings
    to print when that cannot be checked (a file without records)."""
    if a.mu.shape != b.mu.shape:
        raise FIDError(f"{name_a} has {a.mu.shape[0]} features and {name_b} {b.mu.shape[0]}: not from the same layer")
    for field, fix in (("mode", "compute both with the same --mode"),
                       ("weights_sha256", "compute both with the same --inception weights"),
                       ("resolution", "compute both at the same --resolution")):
        va, vb = getattr(a, field), getattr(b, field)
        if va is not None and vb is not None and va != vb:
            shown = (va[:12], vb[:12]) if field == "weights_sha256" else (va, vb)
            raise FIDError(f"{name_a} (with {field} {shown[0]}) and {name_b} (with {field} {shown[1]}) were computed "
                           f"differently: FIDs of differently computed statistics are not comparable; {fix}")
    notes = []
    for name, stats in ((name_a, a), (name_b, b)):
        if stats.mode is None:
            notes.append(f"{name} does not record its mode and Inception weights (a pytorch-fid file?): make sure "
                         "they are the other side's (pytorch-fid's own files are legacy_pytorch)")
    return notes


FID_METHODS = ("eigenvalues", "sqrtm")


def trace_sqrt_product(sigma1, sigma2) -> float:
    """tr sqrt(S1 S2) of two covariance matrices, as the sum of the square roots of the eigenvalues of
    sqrt(S1) S2 sqrt(S1): similar to S1 S2, symmetric and positive semi-definite, so two symmetric
    eigendecompositions replace scipy's Schur-form sqrtm (several times faster on 2048 x 2048; torchmetrics computes
    FID this way). Eigenvalues that rounding leaves slightly negative are zeros of a singular product; a clearly
    negative one means a matrix that is no covariance."""
    w, v = np.linalg.eigh(sigma1)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    product = np.linalg.eigvalsh(root @ sigma2 @ root)
    for values in (w, product):  # (a Σ₂ that is not positive semi-definite shows in the product's eigenvalues)
        if values.min() < -1e-5 * max(np.abs(w).max(), np.abs(product).max(), 1e-12):
            raise FIDError(f"a covariance matrix with a negative eigenvalue ({values.min():.3g}) has no real square "
                           "root (imaginary component): not statistics of images")
    return float(np.sqrt(np.clip(product, 0, None)).sum())


def _trace_sqrtm(sigma1, sigma2, eps: float) -> float:
    """pytorch-fid's own root: scipy's sqrtm, eps on both diagonals where the product is singular (its root not
    finite), an imaginary part above 1e-3 on the diagonal an error and a smaller one dropped."""
    from scipy import linalg

    with warnings.catch_warnings():  # scipy warns of a singular product, which is handled below as pytorch-fid does
        warnings.simplefilter("ignore")
        covmean = linalg.sqrtm(sigma1.dot(sigma2))
        if not np.isfinite(covmean).all():
            offset = np.eye(sigma1.shape[0]) * eps
            covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise FIDError(f"the covariances' product has no real square root (imaginary component "
                           f"{np.max(np.abs(covmean.imag)):.3g}): use more images")
        covmean = covmean.real
    return float(np.trace(covmean))


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6, method: str = "eigenvalues") -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 sqrt(S1 S2)), pytorch-fid's `calculate_frechet_distance`. `method`:
    `eigenvalues` (default: `trace_sqrt_product`, pytorch-fid's value to 1e-4 relative, seconds less per FID) or
    `sqrtm` (pytorch-fid's own computation, to reproduce its handling of a near-singular product exactly)."""
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise FIDError(f"statistics of different dimensions: {mu1.shape} and {mu2.shape}")
    if method == "sqrtm":
        trace_root = _trace_sqrtm(sigma1, sigma2, eps)
    elif method == "eigenvalues":
        trace_root = trace_sqrt_product(sigma1, sigma2)
    else:
        raise FIDError(f"unknown FID method {method!r}: choose {' or '.join(FID_METHODS)}")
    diff = mu1 - mu2
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_root)


def fid_value(a: Statistics, b: Statistics, method: str = "eigenvalues") -> float:
    """The FID of statistics already checked comparable; a distance, so never below 0 (the square root's rounding
    leaves equal statistics at about -1e-4: reported as 0)."""
    return max(0.0, frechet_distance(a.mu, a.sigma, b.mu, b.sigma, method=method))


def fid(a: Statistics, b: Statistics, method: str = "eigenvalues") -> float:
    check_comparable(a, b)
    return fid_value(a, b, method)


# -- image sources -----------------------------------------------------------------------------------
def folder_images(folder: str, resolution: int | None = None, max_images: int | None = None) -> Iterator[np.ndarray]:
    """The images of a folder in name order (an unreadable one: FIDError), each center-cropped to `resolution`
    as the training data path crops (`ImageTransform(resolution, center_crop=True)`) when it is given."""
    paths = list_images(folder)[:max_images]
    transform = None
    if resolution:
        from ldm.data.record import ImageTransform

        transform = ImageTransform(resolution, center_crop=True)
    for path in paths:
        if transform is None:
            yield read_image(path)
            continue
        from ldm.data.record import SkipRecord, sample_rng

        with open(path, "rb") as f:
            data = f.read()
        try:
            yield transform(data, sample_rng(0, 0, path, 0))
        except SkipRecord as e:
            detail = f"{e.reason} {e.detail}".rstrip()
            raise FIDError(f"{path}: not a readable image ({detail}); remove or replace it") from None


def _latent_record(record):
    from ldm.data.record import SkipRecord

    raise SkipRecord("latent_record", "a latent record: FID needs images")


def shard_images(file_list: str, resolution: int, skipped: Counter, max_images: int | None = None) \
        -> Iterator[np.ndarray]:
    """The images of a corpus's shards (any kind `ldm.data` reads), as training crops them at the center at
    `resolution`; unusable records and shards are counted by reason in `skipped`, not raised."""
    from ldm.data.filelist import read_file_list
    from ldm.data.filters import record_parts
    from ldm.data.readers import iter_records
    from ldm.data.record import ImageTransform, SkipRecord, sample_rng
    from ldm.data.shard import ShardError, ShardMissing
    from ldm.data.stream import shard_error_reason

    transform = ImageTransform(resolution, center_crop=True)
    count = 0
    for shard in read_file_list(file_list):
        try:
            for number, record in iter_records(shard.path):
                try:
                    _, _, payload = record_parts(record, transform.parse, _latent_record, None)
                    image = transform(payload, sample_rng(0, 0, shard.seed_key, number))
                except SkipRecord as e:
                    skipped[e.reason] += 1
                    continue
                yield image
                count += 1
                if max_images is not None and count >= max_images:
                    return
        except ShardMissing:
            skipped["missing_shard"] += 1
        except ShardError as e:
            skipped[shard_error_reason(e)] += 1
