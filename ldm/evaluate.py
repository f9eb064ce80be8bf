"""`python -m ldm.evaluate`: FID statistics, FID and CLIP score of image folders and corpora, offline.

    python -m ldm.evaluate convert-inception pt_inception-2015-12-05-6726825d.pth --output inception.safetensors
    python -m ldm.evaluate stats --file_list data/filelist/val.filelist.list --max_images 10000 \\
        --inception inception.safetensors --resolution 256 --output val256.npz
    python -m ldm.evaluate fid val256.npz samples/ --inception inception.safetensors --json
    python -m ldm.evaluate clip-score --images samples/ --captions prompts.txt --clip clip-vit-large-patch14/ --json
    python -m ldm.evaluate run --model OUT/pipeline --prompts coco30k.txt --num_samples 30000 --guidance_scale 1.5 3 \\
        --num_inference_steps 250 --inception inception.safetensors --reference coco256.npz --clip clip/ \\
        --output_dir eval/
    python -m ldm.evaluate loss --model OUT/checkpoint-5000 --file_list held_out.list [--weights raw]
    python -m paddle.distributed.launch --nproc_per_node 2 ldm/evaluate.py run ...   (the same numbers, split)

FID compares statistics of the same `--mode` and Inception weights only (recorded in each .npz); a folder given
to `fid` is measured on the spot with --inception. Weights load from safetensors only: convert pytorch-fid's
.pth or PaddleMIX's .pdparams once with `convert-inception`. Nothing is downloaded. `loss` is the held-out
validation loss training logs (eval/loss); `run` and `loss` split their work over the ranks of a launch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter

from ldm.evaluation.fid import FID_METHODS, MODES, Statistics, check_comparable, small_sample_warning
from ldm.models.buckets import add_bucket_flags
from ldm.runtime.cli import ToolParser
from ldm.runtime.errors import UserError
from ldm.runtime.files import atomic_write, save_figure, save_image


class EvalError(UserError):
    """A user error of the command line (one line, exit 2)."""


def use_threads(threads: int | None) -> None:
    """Paddle runs its CPU kernels on one thread unless told otherwise: the metric on every core it may use."""
    from ldm.runtime.compat import set_cpu_threads

    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    set_cpu_threads(threads)


def _progress(total: int | None, what: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="img", desc=what, disable=not sys.stderr.isatty())


def load_inception(path: str | None, needed_for: str):
    from ldm.evaluation.inception import Inception

    if not path:
        raise EvalError(f"{needed_for}: give the FID Inception weights with --inception W.safetensors (convert "
                        "pytorch-fid's pt_inception-2015-12-05-6726825d.pth with `python -m ldm.evaluate "
                        "convert-inception`)")
    return Inception.from_file(path)


def compute_statistics(images, inception, mode: str, batch_size: int, resolution: int | None,
                       total: int | None, what: str) -> Statistics:
    from ldm.evaluation.fid import inception_features, statistics

    with _progress(total, what) as bar:
        features = inception_features(images, inception, mode, batch_size, progress=bar.update)
    return statistics(features, mode, inception.fingerprint, resolution)


def folder_statistics(folder: str, inception, args) -> Statistics:
    from ldm.evaluation.fid import folder_images, list_images

    count = len(list_images(folder)[:args.max_images])
    if count < 2:
        raise EvalError(f"{folder}: {count} image(s); statistics need at least two (FID needs thousands)")
    return compute_statistics(folder_images(folder, args.resolution, args.max_images), inception, args.mode,
                              args.batch_size, args.resolution, count, folder)


# -- stats -------------------------------------------------------------------------------------------
def cmd_stats(args) -> int:
    from ldm.evaluation.fid import shard_images

    if bool(args.images) == bool(args.file_list):
        raise EvalError("give the images with exactly one of --images DIR or --file_list FILE")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise EvalError(f"--output {args.output}: the folder {folder} does not exist")
    inception = load_inception(args.inception, "stats")
    skipped: Counter = Counter()
    start = time.perf_counter()
    if args.images:
        stats = folder_statistics(args.images, inception, args)
    else:
        resolution = args.resolution or 256
        stats = compute_statistics(shard_images(args.file_list, resolution, skipped, args.max_images), inception,
                                   args.mode, args.batch_size, resolution, args.max_images, args.file_list)
    seconds = time.perf_counter() - start
    stats.save(args.output)
    note = small_sample_warning(stats, args.output)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    report = {"output": args.output, "images": stats.num_images, "skipped": dict(sorted(skipped.items())),
              "mode": stats.mode, "resolution": stats.resolution, "weights_sha256": stats.weights_sha256,
              "seconds": round(seconds, 3), "images_per_second": round(stats.num_images / seconds, 3)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"images          {stats.num_images} ({stats.mode}, resolution {stats.resolution or 'as stored'}; "
              f"{report['images_per_second']:.2f} images/s)")
        for reason, count in report["skipped"].items():
            print(f"  skipped {reason:<16} {count}")
        print(f"wrote {args.output}")
    return 0


# -- fid ---------------------------------------------------------------------------------------------
def cmd_fid(args) -> int:
    from ldm.evaluation.fid import fid_value

    sides = {}
    for path in (args.a, args.b):
        if not os.path.exists(path):
            raise EvalError(f"{path}: no such statistics file or image folder")
        if not os.path.isdir(path):
            sides[path] = Statistics.load(path)
    if args.mode is None:  # a folder is measured the way the statistics file it is compared with was
        args.mode = next((s.mode for s in sides.values() if s.mode in MODES), "clean")
    folders = [p for p in (args.a, args.b) if p not in sides]
    if folders:
        inception = load_inception(args.inception, f"{folders[0]} is a folder of images")
        for path in folders:
            sides[path] = folder_statistics(path, inception, args)
    a, b = sides[args.a], sides[args.b]
    notes = check_comparable(a, b, args.a, args.b)
    notes += [n for n in (small_sample_warning(a, args.a), small_sample_warning(b, args.b)) if n]
    value = fid_value(a, b, args.fid_method)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({"fid": value, "mode": a.mode or b.mode, "images": [a.num_images, b.num_images]}))
    else:
        print(f"FID {value:.4f} ({a.mode or b.mode or 'mode not recorded'}; {a.num_images or '?'} vs "
              f"{b.num_images or '?'} images)")
    return 0


# -- clip-score --------------------------------------------------------------------------------------
def read_captions(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            captions = [line.strip() for line in f.read().splitlines()]
    except FileNotFoundError:
        raise EvalError(f"--captions {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise EvalError(f"--captions {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    while captions and not captions[-1]:  # the blank lines an editor leaves at the end
        captions.pop()
    if not captions:
        raise EvalError(f"--captions {path} is empty: write one caption per line, in the images' file-name order")
    if "" in captions:
        raise EvalError(f"--captions {path}: line {captions.index('') + 1} is blank; every image needs its caption "
                        "(one per line, in the images' file-name order)")
    return captions


def cmd_clip_score(args) -> int:
    from ldm.evaluation.clip import ClipScorer
    from ldm.evaluation.fid import list_images, read_image

    captions = read_captions(args.captions)
    paths = list_images(args.images)
    if not paths:
        raise EvalError(f"--images {args.images}: no image files in it")
    if len(paths) != len(captions):
        raise EvalError(f"{len(paths)} images in {args.images} but {len(captions)} captions in {args.captions}: "
                        "give one caption per line, in the images' file-name order")
    scorer = ClipScorer(args.clip, batch_size=args.batch_size)
    images = [read_image(p) for p in paths]
    score, per_sample = scorer.clip_score(images, captions)
    if args.json:
        print(json.dumps({"clip_score": score, "per_sample": [float(v) for v in per_sample], "images": len(paths)}))
    else:
        for path, value in zip(paths, per_sample, strict=True):
            print(f"{value:8.3f}  {os.path.basename(path)}")
        print(f"CLIP score {score:.4f} over {len(paths)} images (mean of max(100 cos, 0))")
    return 0


# -- convert-inception --------------------------------------------------------------------------------
def cmd_convert(args) -> int:
    from ldm.evaluation.inception import convert_inception

    if os.path.abspath(args.file) == os.path.abspath(args.output):
        raise EvalError("--output must be another file than the one converted")
    report = convert_inception(args.file, args.output)
    print(f"read {report['source']} ({report['format']}): {report['tensors']} tensors")
    print(f"wrote {report['output']} (weights sha256 {report['weights_sha256']})")
    return 0


# -- run: generation + scoring ------------------------------------------------------------------------
def cmd_run(args) -> int:
    """Generate --num_samples images per guidance scale from a checkpoint or pipeline, then their FID against
    --reference and their CLIP score; results.json, samples.png and fid_clip.png in --output_dir."""
    from ldm.checkpoint.run_folder import CheckpointError
    from ldm.evaluation.clip import ClipScorer
    from ldm.evaluation.generated import GeneratedMetrics, Sampling, pipeline_images, read_prompts
    from ldm.inference.load import is_pipeline, load_for_inference
    from ldm.models.build import model_resolution
    from ldm.runtime.distributed import Distributed

    if args.num_samples < 2:  # FID's covariance needs two images: refused before anything is generated
        raise EvalError("--num_samples must be at least 2 (a covariance needs two images; FID needs thousands)")
    if not all(math.isfinite(g) for g in args.guidance_scale):
        raise EvalError(f"--guidance_scale must be finite numbers, not {' '.join(map(str, args.guidance_scale))}")
    prompts = read_prompts(args.prompts)
    reference = Statistics.load(args.reference)
    inception = load_inception(args.inception, "run")
    clip = ClipScorer(args.clip) if args.clip else None
    dist = Distributed.init()
    try:
        unet, text_encoder, vae, tokenizer, scheduler_config, used_ema = load_for_inference(
            args.model, use_ema=args.weights == "ema")
    except (FileNotFoundError, CheckpointError) as e:
        raise EvalError(f"--model {args.model}: {e}") from None
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.sampling import sampling_scheduler
    from ldm.models.text import prompt_length

    resolution = model_resolution(unet, vae)
    metrics = GeneratedMetrics(inception, reference, clip, args.mode, resolution, args.fid_method)
    sampling = Sampling(prompts, args.num_samples, list(args.guidance_scale), args.num_inference_steps, args.seed,
                        args.batch_size)
    notes = metrics.check(sampling)
    os.makedirs(args.output_dir, exist_ok=True)  # every input checked: an unusable --output_dir fails now, not later
    if not os.access(args.output_dir, os.W_OK):
        raise EvalError(f"--output_dir {args.output_dir} is not writable")
    if dist.is_main:
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
    make = pipeline_images(unet, text_encoder, vae, sampling_scheduler(scheduler_config),
                           CaptionTokenizer(tokenizer, prompt_length(text_encoder, tokenizer)), sampling)
    scored = metrics.evaluate(make, sampling, dist, keep_images=args.grid_images)
    if not dist.is_main:
        return 0
    weights = "EMA" if used_ema else "the pipeline's" if is_pipeline(args.model) else "trained"
    report = {"model": args.model, "weights": weights, "reference": args.reference, "mode": args.mode,
              "inception_sha256": inception.fingerprint, "clip": args.clip, "resolution": resolution,
              "num_samples": args.num_samples, "num_inference_steps": args.num_inference_steps, "seed": args.seed,
              "prompts": len(prompts), "ranks": dist.world_size, "results": [r.as_dict() for r in scored],
              "warnings": notes}
    os.makedirs(args.output_dir, exist_ok=True)
    with atomic_write(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    write_figures(scored, args.output_dir)
    if args.json:
        print(json.dumps(report))
    else:
        for r in scored:
            clip_text = f"  CLIP score {r.clip_score:.3f}" if r.clip_score is not None else ""
            print(f"guidance {r.guidance_scale:g}: FID {r.fid:.3f}{clip_text}  ({r.samples} samples, "
                  f"{r.seconds:.1f} s)")
        print(f"wrote results.json, samples.png and fid_clip.png to {args.output_dir}")
    return 0


def write_figures(scored, output_dir: str) -> None:
    """samples.png: a row of the first samples per guidance scale; fid_clip.png: FID against CLIP score (or against
    the guidance scale without CLIP), each point labelled with its scale, as the Stable Diffusion card plots it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ldm.inference.sampling import labeled_grid

    rows = [r for r in scored if r.images is not None]
    if rows:
        width = min(len(r.images) for r in rows)
        grid = np.concatenate([r.images[:width] for r in rows])
        save_image(labeled_grid(grid, [f"guidance {r.guidance_scale:g}" for r in rows]),
                   os.path.join(output_dir, "samples.png"))
    figure, axes = plt.subplots(figsize=(5, 4))
    with_clip = all(r.clip_score is not None for r in scored)
    xs = [r.clip_score if with_clip else r.guidance_scale for r in scored]
    ys = [r.fid for r in scored]
    axes.plot(xs, ys, marker="o")
    for x, y, r in zip(xs, ys, scored, strict=True):
        axes.annotate(f"{r.guidance_scale:g}", (x, y), textcoords="offset points", xytext=(4, 4))
    axes.set_xlabel("CLIP score" if with_clip else "guidance scale")
    axes.set_ylabel("FID")
    axes.set_title(f"FID against {'CLIP score' if with_clip else 'guidance'} ({scored[0].samples} samples)")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    save_figure(figure, os.path.join(output_dir, "fid_clip.png"), dpi=120)
    plt.close(figure)


# -- loss: the held-out validation loss -----------------------------------------------------------------
def cmd_loss(args) -> int:
    """The held-out loss of a pipeline or checkpoint, as training logs it (`ldm.evaluation.heldout`)."""
    from ldm.data.filelist import check_shards, read_file_list
    from ldm.data.latents import fingerprint
    from ldm.evaluation.heldout import HeldOut, fixed_timesteps, read_records
    from ldm.inference.load import is_pipeline, load_for_inference
    from ldm.models.autoencoder import autoencoder_identity
    from ldm.models.buckets import backbone_buckets, bucket_name
    from ldm.models.build import model_resolution
    from ldm.models.diffusion import LatentDiffusion
    from ldm.models.noise import training_scheduler
    from ldm.models.text import prompt_length
    from ldm.runtime.distributed import Distributed
    from ldm.train.errors import user_errors

    dist = Distributed.init()
    with user_errors():
        check_shards(read_file_list(args.file_list), args.file_list)  # before the model takes its time to load
        try:
            unet, text_encoder, vae, tokenizer, scheduler_config, used_ema = load_for_inference(
                args.model, use_ema=args.weights == "ema")
        except FileNotFoundError as e:
            raise EvalError(str(e)) from None
        model = LatentDiffusion(unet, text_encoder, vae, training_scheduler(scheduler_config))
        resolution = args.resolution or model_resolution(unet, vae)
        buckets = backbone_buckets(args.aspect_buckets, resolution, args.max_aspect_ratio, vae.config, unet.config)
        records = read_records(args.file_list, args.validation_samples, resolution=resolution, tokenizer=tokenizer,
                               model_max_length=prompt_length(text_encoder, tokenizer),
                               autoencoder=fingerprint(autoencoder_identity(vae)), autoencoder_source=args.model,
                               buckets=buckets)
        timesteps = fixed_timesteps(args.validation_timesteps, model.noise_scheduler.config.num_train_timesteps)
        metrics = HeldOut(records, timesteps, dist, args.validation_batch_size).evaluate(model)
    if dist.is_main:
        weights = "EMA" if used_ema else "the pipeline's" if is_pipeline(args.model) else "trained"
        if args.json:
            shapes = {"buckets": [bucket_name(b) for b in buckets]} if buckets else {}
            print(json.dumps({"model": args.model, "weights": weights, "records": len(records),
                              "resolution": resolution, **shapes, **metrics}))
        else:
            crops = f"in buckets {', '.join(map(bucket_name, buckets))}" if buckets else "square"
            print(f"{args.model} ({weights} weights), {len(records)} records at {resolution} px, {crops}")
            for name, value in metrics.items():
                print(f"{name:>12} {value:.6f}")
    return 0


# -- entry ---------------------------------------------------------------------------------------------
def add_common(p, inception_required: bool = False) -> None:
    p.add_argument("--inception", required=inception_required, metavar="W.safetensors",
                   help="the FID Inception weights under pytorch-fid's names (see convert-inception)")
    p.add_argument("--batch_size", type=int, default=50)
    p.add_argument("--max_images", type=int, default=None, metavar="N", help="the first N images only")
    p.add_argument("--resolution", type=int, default=None, metavar="R",
                   help="center-crop images to RxR first as training does (shards: default 256; folders: images "
                        "as they are unless given)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core this process may use)")


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(prog="python -m ldm.evaluate", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stats", help="Inception statistics (mu, sigma) of an image folder or a corpus, as .npz")
    p.add_argument("--images", metavar="DIR", help="a folder of images (sorted by name)")
    p.add_argument("--file_list", metavar="FILE", help="a corpus's file list (shards of any kind ldm.data reads)")
    p.add_argument("--mode", choices=MODES, default="clean",
                   help="clean: clean-fid's resize (default); legacy_pytorch: pytorch-fid's own preprocessing")
    add_common(p)
    p.add_argument("--output", required=True, metavar="S.npz")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(run=cmd_stats)

    p = sub.add_parser("fid", help="FID between two statistics files or image folders")
    p.add_argument("a", help="statistics .npz (ours or pytorch-fid's) or a folder of images")
    p.add_argument("b", help="statistics .npz or a folder of images")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="how folders are measured (default: the mode the statistics file records, else clean)")
    p.add_argument("--fid_method", choices=FID_METHODS, default="eigenvalues",
                   help="tr sqrt(S1 S2) from eigenvalues (default: pytorch-fid's value to 1e-4, seconds faster) or by "
                        "scipy's sqrtm (pytorch-fid's own computation, its handling of near-singular products exactly)")
    add_common(p)
    p.add_argument("--json", action="store_true", help='print {"fid": ...}')
    p.set_defaults(run=cmd_fid)

    p = sub.add_parser("clip-score", help="CLIP score of a folder of images and their captions")
    p.add_argument("--images", required=True, metavar="DIR", help="a folder of images (sorted by name)")
    p.add_argument("--captions", required=True, metavar="FILE", help="one caption per line, in file-name order")
    p.add_argument("--clip", required=True, metavar="FOLDER",
                   help="a CLIP in Hugging Face's format (config.json, model.safetensors, vocab.json, merges.txt, "
                        "preprocessor_config.json), e.g. openai/clip-vit-large-patch14")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core this process may use)")
    p.add_argument("--json", action="store_true", help='print {"clip_score": ..., "per_sample": [...]}')
    p.set_defaults(run=cmd_clip_score)

    p = sub.add_parser("run", help="generate images from a checkpoint or pipeline per guidance scale, then their "
                                   "FID and CLIP score (split over the ranks under paddle.distributed.launch)")
    p.add_argument("--model", required=True, help="an exported pipeline folder or a training checkpoint")
    p.add_argument("--prompts", required=True, metavar="FILE", help="one prompt per line, cycled over the samples")
    p.add_argument("--num_samples", type=int, required=True, help="images per guidance scale (FID: 10k-30k)")
    p.add_argument("--guidance_scale", type=float, nargs="+", default=[7.5], metavar="G")
    p.add_argument("--num_inference_steps", type=int, default=50, help="DDIM steps")
    p.add_argument("--inception", required=True, metavar="W.safetensors",
                   help="the FID Inception weights under pytorch-fid's names (see convert-inception)")
    p.add_argument("--reference", required=True, metavar="S.npz",
                   help="statistics of real images at the model's resolution (python -m ldm.evaluate stats)")
    p.add_argument("--clip", metavar="FOLDER", help="a CLIP in Hugging Face's format: also the CLIP score")
    p.add_argument("--mode", choices=MODES, default="clean", help="as the reference was computed")
    p.add_argument("--fid_method", choices=FID_METHODS, default="eigenvalues",
                   help="tr sqrt(S1 S2) from eigenvalues (default: pytorch-fid's value to 1e-4, seconds faster) or by "
                        "scipy's sqrtm (pytorch-fid's own computation, its handling of near-singular products exactly)")
    p.add_argument("--weights", choices=("ema", "raw"), default="ema",
                   help="a checkpoint's EMA weights when it has them (as exported), or its trained ones")
    p.add_argument("--seed", type=int, default=0, help="sample i's noise is drawn from (seed, i)")
    p.add_argument("--batch_size", type=int, default=8, help="images generated (and scored) at once per rank")
    p.add_argument("--grid_images", type=int, default=8, help="samples per guidance scale in samples.png")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core this process may use)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--json", action="store_true", help="print results.json on stdout too")
    p.set_defaults(run=cmd_run)

    p = sub.add_parser("loss", help="the held-out validation loss of a pipeline or checkpoint, as training logs it "
                                    "(eval/loss, eval/loss_t<t>)")
    p.add_argument("--model", required=True, help="an exported pipeline folder or a training checkpoint")
    p.add_argument("--file_list", required=True, help="held-out shards: a list of filelists, as for training")
    p.add_argument("--validation_samples", type=int, default=256, help="records evaluated (the first ones)")
    p.add_argument("--validation_timesteps", type=int, default=8, help="timesteps per record")
    p.add_argument("--validation_batch_size", type=int, default=8, help="records per forward pass")
    p.add_argument("--weights", choices=("ema", "raw"), default="ema",
                   help="a checkpoint's EMA weights when it has them (as exported), or its trained ones")
    p.add_argument("--resolution", type=int, default=None,
                   help="image size (default: the model's, from its UNet and autoencoder)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core this process may use)")
    add_bucket_flags(p, model=False)
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(run=cmd_loss)

    p = sub.add_parser("convert-inception", help="pytorch-fid's .pth or PaddleMIX's .pdparams of the FID Inception "
                                                 "to safetensors (unpickles it: only files you trust)")
    p.add_argument("file", help="pt_inception-2015-12-05-6726825d.pth or pp_inception-2015-12-05-6726825d.pdparams")
    p.add_argument("--output", required=True, metavar="W.safetensors")
    p.set_defaults(run=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batch_size", "max_images", "resolution", "threads", "num_samples", "num_inference_steps",
                 "validation_samples", "validation_timesteps", "validation_batch_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1")

    from ldm.runtime.device import use_fast_cpu_kernels

    use_fast_cpu_kernels()

    try:
        if args.command != "convert-inception":
            use_threads(args.threads)
        return args.run(args) or 0
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (UserError, OSError) as e:
        message = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror or e}"
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from ldm.runtime.distributed import run_main

    run_main(main)
