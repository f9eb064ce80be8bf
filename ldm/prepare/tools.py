"""`python -m ldm.prepare`: inspect, plan, benchmark and build caption-image shards."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from itertools import islice

from tqdm import tqdm

from ldm.data.filelist import read_file_list
from ldm.data.filters import parse_filters, record_key_meta, record_parts
from ldm.data.latents import DTYPES as LATENT_DTYPES
from ldm.data.readers import ShardFormatError, folder_records, iter_records, open_parquet, parquet_columns, shard_kind
from ldm.data.record import ImageTransform, SkipRecord, parse_record, sample_rng
from ldm.data.shard import ShardError, ShardMissing
from ldm.data.stream import SlotStream, shard_error_reason
from ldm.models.buckets import add_bucket_flags
from ldm.prepare.write import ShardWriter, record_line
from ldm.runtime.cli import ToolParser
from ldm.runtime.device import VAE_DTYPES
from ldm.runtime.errors import UserError


def tool_buckets(args, vae_config=None) -> tuple[tuple[int, int], ...] | None:
    """The buckets `--aspect_buckets` names for `--model_name_or_path` at `--resolution` (with `vae_config`, for that
    autoencoder instead of the model's); None: square crops."""
    from ldm.models.build import ModelSourceError, model_buckets

    try:
        return model_buckets(args.aspect_buckets, args.resolution, args.max_aspect_ratio, args.model_name_or_path,
                             vae_config)
    except ModelSourceError as e:
        raise UserError(str(e)) from None


# -- stats ---------------------------------------------------------------------------------------
def corpus_stats(file_list: str, resolution: int, min_image_size: int = 0, progress: bool = True,
                 metadata_filter: list[str] | None = None, buckets=None) -> dict:
    """Records, usable ones by kind, unusable ones by reason; with `buckets`, how many records each bucket gets and
    the mean fraction of an image's area its bucket's crop keeps, beside a square crop of its short side."""
    from ldm.data.latents import LatentTransform
    from ldm.models.buckets import area_kept, bucket_name

    filters = parse_filters(metadata_filter)
    shards = read_file_list(file_list)
    transforms = {False: ImageTransform(resolution, center_crop=True, min_image_size=min_image_size,
                                        buckets=buckets),
                  True: LatentTransform()}  # each record's kind from its content, as training reads it
    histogram: Counter = Counter()
    kept = {"buckets": 0.0, "center_crop": 0.0, "images": 0}
    kinds: Counter = Counter()
    bad: Counter = Counter()
    shard_errors: Counter = Counter()
    missing, problems, records, ok = [], [], 0, 0
    for shard in tqdm(shards, desc="shards", unit="shard", disable=not progress):
        try:
            for number, record in iter_records(shard.path):
                records += 1
                try:
                    latent, _, payload = record_parts(record, transforms[False].parse, transforms[True].parse, filters)
                    sample = transforms[latent](payload, sample_rng(0, 0, shard.seed_key, number))
                    ok += 1
                    kinds["latents" if latent else "images"] += 1
                    if buckets and not latent:
                        bucket = sample.shape[:2]
                        histogram[bucket_name(bucket)] += 1
                        width, height = image_size(payload)
                        kept["buckets"] += area_kept(width, height, bucket)
                        kept["center_crop"] += min(width, height) / max(width, height)
                        kept["images"] += 1
                    elif buckets:
                        histogram[bucket_name(payload[1].bucket or (payload[1].resolution,) * 2)] += 1
                except SkipRecord as e:
                    bad[e.reason] += 1
        except ShardMissing:
            missing.append(shard.path)
        except ShardError as e:
            shard_errors[shard_error_reason(e)] += 1
            problems.append(str(e))
    bucketed = {}
    if buckets:
        images = max(1, kept["images"])
        bucketed = {"buckets": {bucket_name(b): histogram[bucket_name(b)] for b in buckets},
                    "area_kept": {"buckets": kept["buckets"] / images, "center_crop": kept["center_crop"] / images}}
    return {
        **bucketed,
        "kinds": dict(sorted(kinds.items())),
        "shards": len(shards),
        "missing_shards": len(missing),
        "records": records,
        "ok": ok,
        "bad": dict(sorted(bad.items())),
        "shard_errors": dict(sorted(shard_errors.items())),
        "missing": missing[:20],
        "shard_problems": problems[:20],
    }


def image_size(image_bytes: bytes) -> tuple[int, int]:
    """(width, height) from an image's header (it decoded once already, so it opens)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(image_bytes)) as image:
        return image.size


def cmd_stats(args) -> None:
    stats = corpus_stats(args.file_list, args.resolution, args.min_image_size, progress=not args.json,
                         metadata_filter=args.metadata_filter, buckets=tool_buckets(args))
    if args.json:
        print(json.dumps(stats))
        return
    print(f"kinds           {', '.join(f'{n} {kind}' for kind, n in stats['kinds'].items()) or 'none usable'}")
    print(f"shards          {stats['shards']} ({stats['missing_shards']} missing)")
    print(f"records         {stats['records']}")
    print(f"usable          {stats['ok']}")
    for reason, count in stats["bad"].items():
        print(f"  skipped {reason:<16} {count}")
    for reason, count in stats["shard_errors"].items():
        print(f"  shards {reason:<17} {count}")
    for path in stats["missing"]:
        print(f"  missing {path}")
    for problem in stats["shard_problems"]:
        print(f"  shard problem: {problem}")
    if "buckets" in stats:
        total = max(1, sum(stats["buckets"].values()))
        print("buckets (height x width: records)")
        for name, count in stats["buckets"].items():
            print(f"  {name:<13} {count:>9} {count / total:6.1%}  {'#' * round(40 * count / total)}")
        kept = stats["area_kept"]
        print(f"area kept       {kept['buckets']:.1%} in buckets, {kept['center_crop']:.1%} by a square crop of "
              "the short side (mean per image)")


# -- plan ----------------------------------------------------------------------------------------
def slot_plan(file_list: str, world_size: int, num_workers: int, seed: int, pass_index: int,
              shuffle_buffer: int):
    """(rank, worker, shard, line) in the order each slot reads its records in one pass."""
    shards = read_file_list(file_list)
    workers = max(1, num_workers)
    for rank in range(world_size):
        for worker in range(workers):
            stream = SlotStream(shards, rank * workers + worker, world_size * workers, seed, shuffle_buffer)
            stream.pass_index = pass_index
            for record in stream.pass_records():
                yield rank, worker, record.shard, record.line_number


def resumed_slot_plan(shards, saved: list[dict], world_size: int, num_workers: int, seed: int | None,
                      shuffle_buffer: int, allow_data_change: bool = False):
    """(rank, worker, shard, line) that each slot of a `world_size` x `num_workers` run resumed from `saved` (every
    rank's stream state of a checkpoint) reads for the rest of the interrupted pass(es), in reading order (draw
    order with a shuffle buffer): with another layout, the plan `ldm.data.resume` made of what is left; with the
    same one, each slot's own rest up to the furthest pass any slot of the checkpoint is in."""
    from ldm.data.dataset import rank_stream_state, resolve_stream_state
    from ldm.data.resume import Schedule, slot_phase

    slot_states = [s for rank_state in saved for s in rank_state["slots"].values()]
    if seed is None:
        seed = next((s["seed"] for s in slot_states if "seed" in s), 0)
    workers = max(1, num_workers)
    for rank in range(world_size):
        resolved = resolve_stream_state(rank_stream_state(saved, rank, world_size), shards, seed, num_workers,
                                        allow_data_change)
        schedule = Schedule.from_json(resolved["schedule"])
        slots = {int(k): v for k, v in resolved["slots"].items()}
        # the same layout: up to the furthest phase of the checkpoint; another: the whole plan
        last = max(map(slot_phase, slot_states), default=0) if slots else len(schedule.plan) - 1
        first_role = resolved["batches"] % workers
        for worker in range(workers):
            slot = rank * workers + (worker + first_role) % workers
            stream = SlotStream(shards, slot, world_size * workers, seed, shuffle_buffer, state=slots.get(slot),
                                schedule=schedule)
            for record in stream.held_records():  # waiting in partly filled aspect-ratio buckets
                yield rank, worker, record.shard, record.line_number
            while stream.phase <= last:
                for record in stream.pass_records():
                    yield rank, worker, record.shard, record.line_number
                stream.next_pass()


def checkpoint_streams(path: str) -> list[dict]:
    """Every rank's stream state in the checkpoint `path`; UserError naming what `path` is when it is no checkpoint."""
    from ldm.checkpoint.format import read_training_state
    from ldm.checkpoint.run_folder import MANIFEST, checkpoint_dirs, checkpoint_problem

    if not os.path.isdir(path):
        raise UserError(f"--from_checkpoint {path}: no such folder")
    if os.path.isfile(os.path.join(path, "model_index.json")):
        raise UserError(f"--from_checkpoint {path} is an exported pipeline, which keeps no data position: name a "
                        "checkpoint-<step> folder of the run")
    found = checkpoint_dirs(path)
    if found:
        raise UserError(f"--from_checkpoint {path} is a run folder: name one of its checkpoints (the newest is "
                        f"{found[-1]})")
    problem = checkpoint_problem(path) if os.path.isfile(os.path.join(path, MANIFEST)) else None
    if problem is not None:  # a checkpoint whose files no longer match its manifest: a resume refuses it too
        raise UserError(f"--from_checkpoint {path}: not a usable checkpoint: {problem}")
    return read_training_state(path)["stream"]


def cmd_plan(args) -> None:
    out = sys.stdout
    if args.from_checkpoint:
        records = resumed_slot_plan(read_file_list(args.file_list), checkpoint_streams(args.from_checkpoint),
                                    args.world_size, args.num_workers, args.seed, args.shuffle_buffer,
                                    args.allow_data_change)
    else:
        records = slot_plan(args.file_list, args.world_size, args.num_workers, args.seed or 0, args.pass_index,
                            args.shuffle_buffer)
    for rank, worker, shard, line in records:
        out.write(f"{rank} {worker} {shard} {line}\n")


# -- bench ---------------------------------------------------------------------------------------
def pin_one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})


def _rate(samples, n: int) -> float:
    start = time.perf_counter()
    got = sum(1 for _ in islice(samples, n))
    elapsed = time.perf_counter() - start
    if got < n:
        raise UserError(f"the file list holds no usable record ({got} read)")
    return n / elapsed


def _cycled(make):
    """The samples of `make()` pass after pass: a small corpus still gives --num_samples of them."""
    while True:
        count = 0
        for sample in make():
            count += 1
            yield sample
        if not count:
            return


BENCH_BATCH = 8  # --aspect_buckets: the loader slot's batches are benched, grouped by bucket


def bench(file_list: str, num_samples: int, resolution: int, rounds: int = 3, against: str | None = None,
          metadata_filter: list[str] | None = None, buckets=None) -> tuple[float, float | None]:
    """Median samples/s of the real data path and of a reference, interleaved, one core. The reference: the data
    path itself on `against` (another file list: the same images in another format); with `buckets`, the data path
    on the same file list with square crops (the real path then crops to buckets and batches by shape); else the
    naive image reader (text image shards only: None for latent, tar or parquet shards, which it cannot read)."""
    import numpy as np

    from ldm.data.dataset import CaptionImageStream, batch_samples, to_pixel_values
    from ldm.data.latents import LatentTransform, probe

    filters = parse_filters(metadata_filter)

    def real_path(listing: str, buckets=None, batched: bool = False):
        shards = read_file_list(listing)
        meta = probe([s.path for s in shards])
        # the training sample path itself, without tokenization (the naive reference has none either)
        dataset = CaptionImageStream(shards, tokenize=str, transform=ImageTransform(resolution, buckets=buckets),
                                     latents=LatentTransform(buckets=buckets), batch_size=BENCH_BATCH,
                                     shuffle_buffer=1, metadata_filter=filters)
        finish = (lambda sample: np.stack([sample])) if meta else (lambda sample: to_pixel_values([sample]))

        def samples():
            if batched:  # the loader slot's batches (grouped by shape when bucketed), a yield per sample
                return (None for batch in dataset.batches(0) for _ in range(batch_samples(batch)))
            stream = SlotStream(shards, 0, 1, seed=0, shuffle_buffer=1)
            return stream.samples(lambda record: finish(dataset.make_sample(record)[0]))

        return shards, meta, samples

    shards, meta, real = real_path(file_list, buckets, batched=bool(buckets))
    reference = None
    if against:
        reference = real_path(against, buckets, batched=bool(buckets))[2]
    elif buckets:
        reference = real_path(file_list, None, batched=True)[2]
    elif meta is None and all(_is_text(s.path) for s in shards[:4]):
        from ldm.prepare.naive import naive_samples

        def reference():
            return naive_samples([s.path for s in shards], resolution)

    pin_one_core()
    fast, slow = [], []
    for _ in range(rounds):
        if reference is not None:
            slow.append(_rate(_cycled(reference), num_samples))
        fast.append(_rate(real(), num_samples))
    return float(np.median(fast)), float(np.median(slow)) if slow else None


def _is_text(path: str) -> bool:
    try:
        return shard_kind(path) == "text"
    except ShardError:
        return True  # the naive reader skips what it cannot open, as the example does


def cmd_bench(args) -> None:
    buckets = tool_buckets(args)
    fast, slow = bench(args.file_list, args.num_samples, args.resolution, args.rounds, args.against,
                       args.metadata_filter, buckets)
    if slow is None:
        print(f"ldm data path    {fast:8.1f} samples/s (one core; the naive reference reads text image shards only)")
        return
    name = f"data path on {args.against}" if args.against else "square crops" if buckets else "naive reference"
    print(f"{name:<16} {slow:8.1f} images/s (one core)")
    print(f"{'buckets' if buckets and not args.against else 'ldm data path':<16} {fast:8.1f} images/s (one core)")
    print(f"ratio            {fast / slow:8.2f}x")


# -- convert -------------------------------------------------------------------------------------
FORMATS = "a WebDataset .tar, an img2dataset .parquet, a text shard, or a folder of these or of captioned images"


def _folder_sources(folder: str) -> list[str]:
    """The shards in a folder (and below), told by content: tars, parquets with images, gzip text shards. Other
    files (img2dataset's `_stats.json`, its per-shard URL parquets, images) are not shards; [] when none is."""
    sources = []
    for root, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            path = os.path.join(root, name)
            try:
                kind = shard_kind(path)
                if kind == "parquet":
                    parquet_columns(open_parquet(path), path)
                elif kind == "text":
                    with open(path, "rb") as f:
                        if f.read(2) != b"\x1f\x8b":  # plain text beside shards: captions, JSON, notes
                            continue
            except ShardError:
                continue
            sources.append(path)
    return sources


def convert_sources(inputs: list[str]) -> list[tuple[str, str]]:
    """(kind, path) for every input: 'folder' (captioned images) or 'shard'; UserError, before anything is
    written, for an input that is missing or that nothing here can read."""
    sources = []
    for path in inputs:
        if os.path.isdir(path):
            shards = _folder_sources(path)
            if shards:
                sources.extend(("shard", p) for p in shards)
            elif any(problem is None for _, _, problem in folder_records(path)):
                sources.append(("folder", path))
            else:
                raise UserError(f"{path}: a folder without shards or captioned images; expected {FORMATS}")
        elif not os.path.exists(path):
            raise UserError(f"input not found: {path}")
        else:
            try:
                kind = shard_kind(path)
                if kind == "parquet":
                    parquet_columns(open_parquet(path), path)
            except ShardFormatError as e:
                raise UserError(str(e)) from None
            except ShardError as e:
                raise UserError(f"{path} cannot be read: {e}; expected {FORMATS}") from None
            sources.append(("shard", path))
    return sources


NOTED_SKIPS = 5


def _skip(skipped: Counter, reason: str, where: str, detail: str = "") -> None:
    skipped[reason] += 1
    if sum(skipped.values()) <= NOTED_SKIPS:
        print(f"skipped {where}: {reason} {detail}".rstrip(), file=sys.stderr)


def _shard_entries(path: str, filters, skipped: Counter):
    """(caption, image bytes, key, metadata) of each usable image record of a shard of any kind."""
    try:
        for number, record in iter_records(path):
            try:
                latent, caption, image = record_parts(record, parse_record, parse_record, filters)
            except SkipRecord as e:
                _skip(skipped, e.reason, f"{path}:{number}", e.detail)
                continue
            key, meta = record_key_meta(record)
            yield caption, image, key or f"{number}", meta
    except ShardError as e:  # the records before the break are kept
        _skip(skipped, shard_error_reason(e), path, str(e))


def _folder_entries(folder: str, filters, skipped: Counter):
    for key, record, problem in folder_records(folder):
        if problem:
            _skip(skipped, "no_caption", problem)
            continue
        caption, image, meta = record
        if filters:
            try:
                filters.check(meta, image)
            except SkipRecord as e:
                _skip(skipped, e.reason, f"{folder}/{key}", e.detail)
                continue
        yield caption, image, key, meta


def convert(inputs: list[str], output_dir: str, records_per_shard: int, name: str = "train",
            metadata_filter: list[str] | None = None) -> tuple[str, int, Counter]:
    """Text shards from any readable inputs, each record's metadata as its fourth column; returns (list of
    filelists, records written, records skipped by reason)."""
    filters = parse_filters(metadata_filter)
    sources = convert_sources(inputs)
    earlier = ShardWriter.outputs_in(output_dir, name)
    if earlier:  # the new file list would not name them, and a later `ls *.gz` would mix both
        raise UserError(f"{output_dir} already holds {len(earlier)} file(s) of a corpus named {name!r} "
                        f"({os.path.basename(earlier[0])}, ...): choose another --output_dir or --name, or remove them")
    written, skipped = 0, Counter()
    writer = ShardWriter(output_dir, name, records_per_shard)
    try:
        for kind, path in sources:
            entries = _folder_entries(path, filters, skipped) if kind == "folder" else _shard_entries(path, filters,
                                                                                                      skipped)
            for caption, image, key, meta in tqdm(entries, desc=os.path.basename(path.rstrip("/")), unit="rec"):
                writer.write(record_line(caption, image, key, meta))
                written += 1
        if not written:
            raise UserError(f"no usable record in the inputs ({skip_summary(skipped)}); nothing was written")
    except BaseException:
        writer.discard()  # a failed convert leaves nothing that blocks the corrected retry
        raise
    return writer.close(), written, skipped


def skip_summary(skipped: Counter) -> str:
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items()))
    return f"{sum(skipped.values())} skipped{': ' + reasons if reasons else ''}"


def cmd_convert(args) -> int:
    listing, written, skipped = convert(args.inputs, args.output_dir, args.records_per_shard, args.name,
                                        args.metadata_filter)
    print(f"wrote {written} records ({skip_summary(skipped)}); use --file_list {listing}")
    return 0


# -- encode ------------------------------------------------------------------------------------
def cmd_encode(args) -> int:
    from ldm.models.build import ModelSourceError
    from ldm.prepare.encode import encode_corpus
    from ldm.runtime.distributed import exit_process, launched_world_size

    try:
        code = encode_corpus(args)
    except ModelSourceError as e:
        raise UserError(str(e)) from None
    except OSError as e:  # the output folder (permissions, a read-only mount...): the finished shards are kept
        raise UserError(f"{e}; the shards finished are kept: fix it, then run the same command again") from None
    if launched_world_size() > 1:
        exit_process(code)
    return code


# -- synth -------------------------------------------------------------------------------------
def cmd_synth(args) -> None:
    from ldm.prepare.synth import synth_corpus

    listing = synth_corpus(args.output_dir, args.num_records, args.resolution, args.seed, args.records_per_shard,
                           args.format.upper(), progress=lambda it: tqdm(it, desc="synth", unit="rec"),
                           max_aspect_ratio=args.max_aspect_ratio)
    print(f"wrote {args.num_records} records; use --file_list {listing} "
          f"--tokenizer_name {os.path.join(args.output_dir, 'tokenizer')}")


# -- entry ---------------------------------------------------------------------------------------
FILTER_HELP = ("keep only records whose metadata passes every 'KEY OP NUMBER' (OP: < <= > >= == !=), e.g. "
               "'punsafe < 0.5' 'AESTHETIC_SCORE >= 5' 'min_side >= 256' (derived: min_side, aspect_ratio)")


def add_filter_flag(parser) -> None:
    parser.add_argument("--metadata_filter", nargs="+", default=[], metavar="EXPR", help=FILTER_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(prog="python -m ldm.prepare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stats", help="read every record and count usable and unusable ones by reason")
    p.add_argument("--file_list", required=True)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--min_image_size", type=int, default=0)
    add_filter_flag(p)
    add_bucket_flags(p)
    p.set_defaults(run=cmd_stats)

    p = sub.add_parser("plan", help="print 'rank worker shard line' for every record each slot reads in a pass, or "
                                    "(--from_checkpoint) in the rest of the pass a checkpoint interrupted")
    p.add_argument("--file_list", required=True)
    p.add_argument("--world_size", type=int, required=True)
    p.add_argument("--num_workers", type=int, required=True)
    p.add_argument("--seed", type=int, default=None, help="the run's --seed (default 0; with --from_checkpoint, "
                                                          "the checkpoint's)")
    p.add_argument("--pass", dest="pass_index", type=int, default=0)
    p.add_argument("--from_checkpoint", default=None, metavar="DIR",
                   help="what each slot of a run of this --world_size and --num_workers resumed from the checkpoint "
                        "DIR reads for the rest of the interrupted pass, whatever layout wrote DIR")
    p.add_argument("--shuffle_buffer", type=int, default=1,
                   help="1 (default) prints reading order; the training value prints the order samples are drawn")
    p.add_argument("--allow_data_change", action="store_true",
                   help="with --from_checkpoint: plan as a run with this flag resumes over a file list that names "
                        "other shards than the checkpoint's (a new pass over the new shards)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("bench", help="images/s of the data path vs a naive reference, one core")
    p.add_argument("--file_list", required=True)
    p.add_argument("--num_samples", type=int, default=300)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", help="another file list (the same images in another format) read by the same data "
                                     "path as the reference, instead of the naive reader")
    add_filter_flag(p)
    add_bucket_flags(p)
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("convert", help="build text shards (metadata kept as a fourth column) from WebDataset tars, "
                                       "img2dataset parquets, text shards, or folders of these or of captioned images")
    p.add_argument("inputs", nargs="+")
    add_filter_flag(p)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--records_per_shard", type=int, default=10000)
    p.add_argument("--name", default="train")
    p.set_defaults(run=cmd_convert)

    p = sub.add_parser("encode", help="encode a corpus once with the frozen autoencoder into latent shards, which "
                                      "training then reads instead of images (see ldm/prepare/encode.py)")
    p.add_argument("--file_list", required=True)
    p.add_argument("--vae_name_or_path", required=True,
                   help="the autoencoder the diffusion model will be trained with (folder or hub name)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--center_crop", action="store_true", help="center crop (default: one random crop per record)")
    p.add_argument("--random_flip", action="store_true",
                   help="also encode each crop's mirror image, so that training can flip at random")
    add_bucket_flags(p)  # each record's latent at its bucket's shape; train with the same flags
    p.add_argument("--dtype", choices=LATENT_DTYPES, default="float16",
                   help="stored precision of the posterior moments")
    p.add_argument("--vae_dtype", choices=VAE_DTYPES, default="float32",
                   help="precision the encoder runs in (float16/bfloat16: autocast on a GPU; float32 where "
                        "unsupported)")
    p.add_argument("--min_image_size", type=int, default=0)
    add_filter_flag(p)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--num_workers", type=int, default=2, help="decoding processes per rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the random crops")
    p.add_argument("--allow_untrained_vae", action="store_true", help="encode with an autoencoder without weights "
                   "(tests)")
    p.add_argument("--text_embeddings", action="store_true",
                   help="also store each caption's states from the frozen text encoder of --model_name_or_path (a "
                        "Stable Diffusion model's CLIP): training then runs no text encoder")
    p.add_argument("--model_max_length", type=int, default=None,
                   help="caption length in tokens, as training takes it (default: the model's, its tokenizer's saved "
                        "length within its text encoder's positions, as training's default)")
    p.add_argument("--text_dtype", choices=LATENT_DTYPES, default="float16",
                   help="stored precision of the text states (float32 for runs that must equal encoding on the fly)")
    p.add_argument("--allow_untrained_text_encoder", action="store_true",
                   help="encode with a text encoder without weights (tests)")
    p.add_argument("--data_timeout", type=float, default=600,
                   help="seconds without a batch before the run stops with stacks and the shards being read (0: never)")
    p.set_defaults(run=cmd_encode)

    p = sub.add_parser("synth", help="write a captioned-shapes corpus (demo and tests) with its tokenizer vocab")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--num_records", type=int, default=10000)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--records_per_shard", type=int, default=1000)
    p.add_argument("--format", choices=("png", "jpeg"), default="png")
    p.add_argument("--max_aspect_ratio", type=float, default=1.0,
                   help="images of random aspect ratios within this (long side / short side; 1: square)")
    p.set_defaults(run=cmd_synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_filters(getattr(args, "metadata_filter", None))  # a malformed expression: before anything is read
    except ValueError as e:
        parser.error(str(e))
    for name in ("world_size", "num_samples", "records_per_shard", "resolution", "rounds", "num_records",
                 "batch_size"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name} must be at least 1")
    if getattr(args, "num_workers", 0) < 0:
        parser.error("--num_workers must be at least 0")
    try:
        return args.run(args) or 0
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
