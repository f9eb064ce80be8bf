"""`python -m ldm.evaluate`: FID statistics, FID and CLIP score of image folders and corpora, offline.

    python -m ldm.evaluate convert-inception pt_inception-2015-12-05-6726825d.pth --output inception.safetensors
    python -m ldm.evaluate stats --file_list data/filelist/val.filelist.list --max_images 10000 \\
        --inception inception.safetensors --resolution 256 --output val256.npz
    python -m ldm.evaluate fid val256.npz samples/ --inception inception.safetensors --json
    python -m ldm.evaluate clip-score --images samples/ --captions prompts.txt --clip clip-vit-large-patch14/ --json

FID compares statistics of the same `--mode` and Inception weights only (recorded in each .npz); a folder given
to `fid` is measured on the spot with --inception. Weights load from safetensors only: convert pytorch-fid's
.pth or PaddleMIX's .pdparams once with `convert-inception`. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

from ldm.args import ToolParser
from ldm.evaluation.fid import MODES, FIDError, Statistics, check_comparable, small_sample_warning


class EvalError(Exception):
    """A user error of the command line (one line, exit 2)."""


def use_threads(threads: int | None) -> None:
    """Paddle runs its CPU kernels on one thread unless told otherwise: the metric on every core it may use."""
    import paddle

    from ldm.compat import private

    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    private(paddle.base.core, "set_num_threads", "running the evaluation on several CPU threads")(threads)


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
    from ldm.evaluation.fid import frechet_distance

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
    value = frechet_distance(a.mu, a.sigma, b.mu, b.sigma)
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
    if not any(captions):
        raise EvalError(f"--captions {path} is empty: write one caption per line, in the images' file-name order")
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
# RESERVED: `run` (generate images from a checkpoint or pipeline, then their FID against reference statistics
# and their CLIP score against the prompts) is added here. It uses the functions above on in-memory arrays:
# `ldm.evaluation.fid.inception_features(images, inception, mode)` -> `statistics(...)` -> `check_comparable` /
# `frechet_distance`, and `ldm.evaluation.clip.ClipScorer(folder).clip_score(images, captions)`.


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

    p = sub.add_parser("convert-inception", help="pytorch-fid's .pth or PaddleMIX's .pdparams of the FID Inception "
                                                 "to safetensors (unpickles it: only files you trust)")
    p.add_argument("file", help="pt_inception-2015-12-05-6726825d.pth or pp_inception-2015-12-05-6726825d.pdparams")
    p.add_argument("--output", required=True, metavar="W.safetensors")
    p.set_defaults(run=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batch_size", "max_images", "resolution", "threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1")
    from ldm.runtime import use_fast_cpu_kernels

    use_fast_cpu_kernels()
    from ldm.evaluation.clip import ClipError
    from ldm.evaluation.inception import WeightsError

    try:
        if args.command != "convert-inception":
            use_threads(args.threads)
        return args.run(args) or 0
    except (EvalError, FIDError, WeightsError, ClipError, OSError) as e:
        message = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror or e}"
        print(f"error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
