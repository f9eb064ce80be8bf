"""Reference values for the FID and CLIP score tests, computed by the reference tools themselves.

Runs in its own virtualenv, outside the project (the project needs no torch):

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 scipy pillow safetensors numpy requests ftfy transformers
    /work/refvenv/bin/pip install --no-deps torchvision pytorch-fid clean-fid
    /work/refvenv/bin/python tests/reference/make_eval_fixtures.py [--benchmark FOLDER]

Writes tests/fixtures/eval/: pytorch-fid's pool3 features of the test images (`tests/eval_weights.py`) with the
seeded random Inception weights, by pytorch-fid's own path (legacy_pytorch) and with clean-fid's resize
(clean); pytorch-fid's FID between two halves of them and its Fréchet distance of seeded covariances; a tiny
random CLIP in Hugging Face's format (`tiny-clip/`) with transformers' per-sample 100 * cos of the test images
and captions; two small torch checkpoints (zip and legacy format) for the converter. `--benchmark FOLDER`
instead prints pytorch-fid's statistics images/s on this CPU and the project's command to compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import types

# pytorch-fid imports torchvision, whose registry wheels are built against a CUDA torch: beside torch's CPU
# build their import fails registering `torchvision::nms`, which nothing here uses
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import eval_weights as ew  # noqa: E402

OUT = os.path.join(os.path.dirname(HERE), "fixtures", "eval")
SET_A, SET_B = [0, 1, 2, 3], [4, 5, 6, 7]


def pytorch_fid_model(resize_input: bool):
    """pytorch-fid's InceptionV3([3]) with the seeded weights instead of the downloaded ones."""
    from pytorch_fid import inception as pfi

    def fid_inception_v3():  # pytorch-fid's own construction, without the download
        model = pfi._inception_v3(num_classes=1008, aux_logits=False, weights=None)
        model.Mixed_5b = pfi.FIDInceptionA(192, pool_features=32)
        model.Mixed_5c = pfi.FIDInceptionA(256, pool_features=64)
        model.Mixed_5d = pfi.FIDInceptionA(288, pool_features=64)
        model.Mixed_6b = pfi.FIDInceptionC(768, channels_7x7=128)
        model.Mixed_6c = pfi.FIDInceptionC(768, channels_7x7=160)
        model.Mixed_6d = pfi.FIDInceptionC(768, channels_7x7=160)
        model.Mixed_6e = pfi.FIDInceptionC(768, channels_7x7=192)
        model.Mixed_7b = pfi.FIDInceptionE_1(1280)
        model.Mixed_7c = pfi.FIDInceptionE_2(2048)
        names = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
        assert names == ew.inception_shapes(), set(names) ^ set(ew.inception_shapes())
        missing, unexpected = model.load_state_dict(
            {k: torch.from_numpy(v) for k, v in ew.random_inception().items()}, strict=False)
        assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing), (missing, unexpected)
        return model

    pfi.fid_inception_v3 = fid_inception_v3
    return pfi.InceptionV3([3], resize_input=resize_input).eval()


def write_images(folder: str) -> list[str]:
    paths = []
    for i, image in enumerate(ew.make_images()):
        path = os.path.join(folder, f"{i:02d}.png")
        Image.fromarray(image).save(path)
        paths.append(path)
    return paths


def legacy_features(paths: list[str]) -> np.ndarray:
    """pytorch-fid's own `get_activations` (ToTensor, the network's bilinear resize); batch 1: mixed sizes."""
    from pytorch_fid.fid_score import get_activations

    return get_activations(paths, pytorch_fid_model(resize_input=True), batch_size=1, dims=2048, device="cpu",
                           num_workers=0).astype(np.float32)


def clean_features(paths: list[str]) -> np.ndarray:
    """clean-fid's resize (Pillow bicubic per channel in float) and pytorch-fid's normalisation, no resize."""
    from cleanfid.resize import make_resizer

    resize = make_resizer("PIL", False, "bicubic", (299, 299))
    model = pytorch_fid_model(resize_input=False)
    out = []
    with torch.no_grad():
        for path in paths:
            resized = resize(np.asarray(Image.open(path).convert("RGB")))
            x = torch.from_numpy(resized.transpose(2, 0, 1).copy())[None] / 255
            out.append(model(x)[0][0, :, 0, 0].numpy())
    return np.stack(out).astype(np.float32)


def reference_fid(features: np.ndarray) -> float:
    from pytorch_fid.fid_score import calculate_frechet_distance

    a, b = features[SET_A].astype(np.float64), features[SET_B].astype(np.float64)
    return float(calculate_frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False)))


def fid_of_folders(paths: list[str]) -> float:
    """pytorch-fid's `calculate_fid_given_paths` on two folders: its whole legacy path, end to end."""
    from pytorch_fid import fid_score

    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for name, indices in (("a", SET_A), ("b", SET_B)):
            folder = os.path.join(tmp, name)
            os.mkdir(folder)
            for i in indices:
                os.symlink(paths[i], os.path.join(folder, os.path.basename(paths[i])))
            folders.append(folder)
        pytorch_fid_model(resize_input=True)  # installs the seeded weights into pytorch-fid's constructor
        return float(fid_score.calculate_fid_given_paths(folders, batch_size=1, device="cpu", dims=2048,
                                                         num_workers=0))


# -- tiny CLIP -------------------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's / CLIP's reversible map of bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def tiny_bpe() -> tuple[dict[str, int], list[str]]:
    """A CLIP-style vocabulary: the 256 byte symbols, with '</w>', the merges of the captions' words (words of
    more than 6 letters only partly merged, so BPE splits them), then the two special tokens, last as in CLIP."""
    import regex

    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols]
    merges: list[str] = []
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""", regex.IGNORECASE)
    words = []
    for caption in ew.CAPTIONS:
        words += [w for w in pattern.findall(caption.lower()) if w not in words]
    for word in words:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        merged = parts[0]
        for part in parts[1: 6 if len(word) > 6 else len(parts)]:
            merge = f"{merged} {part}"
            merged += part
            if merge not in merges:
                merges.append(merge)
                vocab.append(merged)
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return {token: i for i, token in enumerate(vocab)}, merges


PREPROCESSOR = {  # openai/clip-vit-large-patch14's preprocessor_config.json, with a small size
    "crop_size": 32, "do_center_crop": True, "do_normalize": True, "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 40,
}


def make_tiny_clip(folder: str) -> None:
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    os.makedirs(folder, exist_ok=True)
    vocab, merges = tiny_bpe()
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f, indent=2)
    tokenizer = CLIPTokenizer.from_pretrained(folder, model_max_length=77)
    tokenizer.save_pretrained(folder)
    for extra in ("tokenizer.json", "chat_template.jinja"):  # the project reads vocab.json and merges.txt
        if os.path.exists(os.path.join(folder, extra)):
            os.remove(os.path.join(folder, extra))
    # openai's config: bos 0, eos 2 (the text model then pools at the highest id, <|endoftext|>), pad 1
    config = CLIPConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                     "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1},
        vision_config={"hidden_size": 48, "intermediate_size": 53, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 32, "patch_size": 8, "hidden_act": "quick_gelu"},
        projection_dim=16)
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    with torch.no_grad():  # larger than the 0.02 init: cosines that differ between captions and images
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embedding" not in name:
                p.mul_(4)
    model.save_pretrained(folder, safe_serialization=True)


def clip_reference(folder: str, paths: list[str]) -> dict:
    """transformers' per-sample 100 * cos, by the PIL image processor (the one openai's config names)."""
    from transformers import CLIPModel, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = CLIPModel.from_pretrained(folder).eval()
    tokenizer = CLIPTokenizer.from_pretrained(folder)
    processor = CLIPImageProcessorPil.from_pretrained(folder)
    images = [Image.open(p).convert("RGB") for p in paths]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    tokens = tokenizer(ew.CAPTIONS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image_features = model.get_image_features(pixel_values=pixels).pooler_output
        text_features = model.get_text_features(input_ids=tokens["input_ids"],
                                                attention_mask=tokens["attention_mask"]).pooler_output
    image_features = image_features / image_features.norm(p=2, dim=-1, keepdim=True)
    text_features = text_features / text_features.norm(p=2, dim=-1, keepdim=True)
    per_sample = (100 * (image_features * text_features).sum(-1)).tolist()
    ids = [row[: int(mask.sum())] for row, mask in zip(tokens["input_ids"].tolist(), tokens["attention_mask"],
                                                         strict=True)]
    return {"per_sample": per_sample, "input_ids": ids, "pixel_values": pixels.numpy()}


# -- torch checkpoints for the converter ----------------------------------------------------------------
def write_torch_checkpoints() -> dict:
    """A few of the seeded weights, saved by torch in both its formats, with the counters a BN state dict has
    and a non-contiguous tensor (stored with its strides). The legacy file's bytes differ from run to run (torch
    names its storages by address there); its contents do not."""
    weights = ew.random_inception(with_fc=False)
    names = ["Conv2d_1a_3x3.conv.weight", "Conv2d_1a_3x3.bn.weight", "Conv2d_1a_3x3.bn.bias",
             "Conv2d_1a_3x3.bn.running_mean", "Conv2d_1a_3x3.bn.running_var"]
    state = {k: torch.from_numpy(weights[k].copy()) for k in names}
    state["Conv2d_1a_3x3.bn.num_batches_tracked"] = torch.tensor(7, dtype=torch.int64)
    transposed = torch.from_numpy(weights["Conv2d_2a_3x3.conv.weight"][:, :, 0, 0].copy()).t()  # a strided view
    state["transposed"] = transposed
    state["half"] = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    torch.save(state, os.path.join(OUT, "tiny_zip.pth"))
    torch.save(state, os.path.join(OUT, "tiny_legacy.pth"), _use_new_zipfile_serialization=False)
    return {k: v.numpy().tolist() if v.ndim == 0 or k in ("half",) else hashlib.sha256(
        np.ascontiguousarray(v.numpy()).tobytes()).hexdigest() for k, v in state.items()}


BENCH_IMAGES = 64


def benchmark(folder: str) -> None:
    """pytorch-fid's statistics throughput (its `calculate_activation_statistics`: decoding, ToTensor, the
    network's resize, pool3, mean and covariance; batch 50, no loader workers) on BENCH_IMAGES 256x256 test
    images written to FOLDER/images, with the seeded weights, which FOLDER/inception.safetensors holds for the
    project's command to time on the same images."""
    from pytorch_fid.fid_score import calculate_activation_statistics
    from safetensors.numpy import save_file

    images = os.path.join(folder, "images")
    os.makedirs(images, exist_ok=True)
    paths = []
    for i in range(BENCH_IMAGES):
        path = os.path.join(images, f"{i:03d}.png")
        if not os.path.exists(path):
            Image.fromarray(ew.make_image(100 + i, 256, 256)).save(path)
        paths.append(path)
    save_file(ew.random_inception(), os.path.join(folder, "inception.safetensors"))
    model = pytorch_fid_model(resize_input=True)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        calculate_activation_statistics(paths[:4], model, batch_size=4, device="cpu", num_workers=0)  # warm-up
        start = time.perf_counter()
        calculate_activation_statistics(paths, model, batch_size=50, device="cpu", num_workers=0)
        rate = len(paths) / (time.perf_counter() - start)
        print(f"pytorch-fid {versions()['pytorch-fid']} (torch {torch.__version__}), {threads} thread(s): "
              f"{rate:.2f} images/s")
    print(f"the same in the project: python -m ldm.evaluate stats --images {images} --inception "
          f"{os.path.join(folder, 'inception.safetensors')} --mode legacy_pytorch --batch_size 50 --threads N "
          "--output /tmp/bench.npz --json")


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "torchvision", "pytorch-fid", "clean-fid", "transformers",
                                              "numpy", "scipy", "pillow")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--benchmark", metavar="FOLDER",
                        help="instead, print pytorch-fid's statistics images/s on test images it writes to FOLDER")
    args = parser.parse_args()
    if args.benchmark:
        benchmark(args.benchmark)
        return
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_images(tmp)
        legacy, clean = legacy_features(paths), clean_features(paths)
        np.savez_compressed(os.path.join(OUT, "inception_features.npz"), legacy_pytorch=legacy, clean=clean)
        from pytorch_fid.fid_score import calculate_frechet_distance

        frechet = {kind: float(calculate_frechet_distance(*ew.covariance_pair(kind)))
                   for kind in ("well_conditioned", "rank_deficient")}
        make_tiny_clip(os.path.join(OUT, "tiny-clip"))
        clip = clip_reference(os.path.join(OUT, "tiny-clip"), paths)
        np.savez_compressed(os.path.join(OUT, "clip_pixel_values.npz"), pixel_values=clip.pop("pixel_values"))
        reference = {
            "versions": versions(),
            "weights_digest": ew.weights_digest(ew.random_inception()),
            "images_sha256": hashlib.sha256(b"".join(i.tobytes() for i in ew.make_images())).hexdigest(),
            "fid_sets": [SET_A, SET_B],
            "fid": {"legacy_pytorch": reference_fid(legacy), "clean": reference_fid(clean),
                    "legacy_pytorch_calculate_fid_given_paths": fid_of_folders(paths)},
            "frechet": frechet,
            "clip": clip,
            "captions": ew.CAPTIONS,
            "torch_checkpoint": write_torch_checkpoints(),
        }
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
    print(json.dumps({k: reference[k] for k in ("fid", "frechet")}, indent=1))
    print("per-sample CLIP", [round(v, 3) for v in reference["clip"]["per_sample"]])


if __name__ == "__main__":
    main()
