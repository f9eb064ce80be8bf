"""`python -m ldm.prepare encode`: a caption-image corpus encoded once by the frozen autoencoder.

Training on the result (`ldm.data.latents`) skips the autoencoder's forward pass at every step.

- **Work:** input shard i becomes output shard `latents-<i>.gz`, written by loader slot i mod S (S = ranks x
  workers; whole shards, not the training plan's interleaved parts, so that an output's name and content
  do not depend on how many processes made it). Every record is encoded exactly once over the ranks.
- **Resume:** an output shard is written under a temporary name and renamed when complete; a run skips
  the shards whose output exists, so an interrupted encode goes on where it stopped, with any number of
  ranks. `.encode/settings.json` pins what the folder holds (autoencoder, crop, buckets, dtype, the input
  shard list): a resume with other settings is refused.
- **Buckets:** with `--aspect_buckets`, each record is cropped to the bucket nearest its aspect ratio
  (`ldm.models.buckets`) and its latent has that bucket's shape (its meta names the bucket); a batch holds
  one shape. The buckets' size step is the autoencoder's downsampling times the UNet's of
  `--model_name_or_path`, as the training run computes it, so that both name the same buckets.
- **Bad input:** a record that cannot be used is skipped and counted by reason, as training counts it; a
  truncated shard gives the records before the break. A shard that cannot be read (missing, or a store
  that kept failing) is not written: the run ends with exit status 1 and names it, and running the same
  command again retries it.
- **Geometry:** each record stores each copy's geometry (the image's original size, the crop's corner in the resized
  image, the crop's size; the mirror copy's left edge mirrored), what SDXL's time ids and PixArt-α's resolution and
  aspect ratio are made of, so that training from the corpus is conditioned as training from its images.
- **Text states:** with `--text_embeddings`, each record also holds its caption's states from the frozen text
  encoder of `--model_name_or_path` (`ldm.data.latents`), whose identity (fingerprint) they are recorded with;
  a run with another encoder, or one that trains its text encoder, refuses the corpus.
- **Output:** `latents.filelist` (one per distinct input weight) and `latents.filelist.list`, which keeps
  the input's weights, list the output shards that hold records; pass the latter as `--file_list`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import logging
import os
from collections import Counter

import numpy as np
import paddle
from paddle.io import DataLoader, IterableDataset
from tqdm import tqdm

from ldm.checkpoint.run_folder import NO_SPACE
from ldm.data import remote
from ldm.data.dataset import ShapeGroups, run_slot, to_uint8_batch
from ldm.data.filelist import Shard, check_shards, read_file_list
from ldm.data.filters import MetadataFilters, parse_filters, record_key_meta, record_parts
from ldm.data.latents import LatentMeta, fingerprint, latent_line, probe
from ldm.data.loader import watched
from ldm.data.readers import iter_records
from ldm.data.record import ImageTransform, SkipRecord, parse_record, sample_rng
from ldm.data.shard import LineTooLong, ShardError, ShardMissing, ShardTruncated, iter_lines
from ldm.data.stream import shard_error_reason
from ldm.data.watchdog import ReadingBoard
from ldm.models.autoencoder import autoencoder_identity, posterior, unit_range
from ldm.models.buckets import Bucket, bucket_name
from ldm.models.build import model_buckets
from ldm.runtime.compat import READER_POLL_SECONDS
from ldm.runtime.device import resolve_vae_dtype, use_fast_cpu_kernels
from ldm.runtime.distributed import Distributed
from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.data")

STATE = ".encode"


class EncodeError(UserError, ValueError):
    """The encode cannot start (a user error: exit status 2)."""


def output_name(index: int) -> str:
    return f"latents-{index:06d}.gz"


class ShardBatches(IterableDataset):
    """The crops of this rank's input shards, batch by batch: each batch says its shard, and the last one
    of a shard carries the shard's counts (and why it could not be read, if so). `board` says what each
    slot reads, for the stall watchdog."""

    def __init__(self, shards: list[Shard], output_dir: str, transform: ImageTransform, *, batch_size: int,
                 seed: int, rank: int, world_size: int, num_workers: int,
                 metadata_filter: MetadataFilters | None = None):
        super().__init__()
        self.shards, self.output_dir, self.transform = shards, output_dir, transform
        self.filters = metadata_filter
        self.batch_size, self.seed = batch_size, seed
        self.workers = max(1, num_workers)
        self.first_slot, self.num_slots = rank * self.workers, world_size * self.workers
        self.board = ReadingBoard(self.workers)

    def todo(self, slot: int) -> list[int]:
        """The input shards of a slot whose output does not exist yet."""
        return [i for i in range(slot, len(self.shards), self.num_slots)
                if not os.path.exists(os.path.join(self.output_dir, output_name(i)))]

    def __iter__(self):
        return run_slot(self.batches)

    def batches(self, worker: int):
        for index in self.todo(self.first_slot + worker):
            yield from self.shard_batches(index, worker)

    def shard_batches(self, index: int, worker: int):
        """A shard's batches; with buckets a batch holds crops of one shape (grouped as training groups them), and
        the groups left partly filled are sent at the shard's end, oldest first: the output order is the shard's
        alone."""
        path, seed_key = self.shards[index].path, self.shards[index].seed_key
        groups = ShapeGroups(self.batch_size)
        counts = Counter()
        unreadable = missing = ""
        self.board.post(worker, f"slot {self.first_slot + worker}: opening {path}")
        number = 0
        try:
            for number, line in iter_records(path):  # a text shard's lines, a tar's or parquet's samples
                try:
                    latent, caption, image = record_parts(line, parse_record, parse_record, self.filters)
                    crop, placement = self.transform.place(image, sample_rng(self.seed, 0, seed_key, number))
                except SkipRecord as e:
                    counts[e.reason] += 1
                    continue
                key, source = record_key_meta(line)
                # the crop's geometry and its mirror image's, copy 1 when the encode flips
                geometry = [placement.geometry(flipped).astype(int).tolist() for flipped in (False, True)]
                full = groups.add((crop, (caption, key or f"{os.path.basename(path)}:{number}", source, geometry),
                                   None, None))
                if full is not None:
                    self.board.post(worker, f"slot {self.first_slot + worker}: reading {path} (line {number})")
                    yield self.batch(index, full)
                    counts["ok"] += len(full)
        except (ShardTruncated, LineTooLong) as e:  # the records before the break are kept, as training keeps them
            counts[shard_error_reason(e)] += 1
        except ShardMissing as e:
            missing = str(e)
        except ShardError as e:
            unreadable = str(e)
        rest = []
        while (taken := groups.take_oldest()) is not None:
            rest.append(taken)
        counts["ok"] += sum(map(len, rest))
        rest = rest or [[]]
        for taken in rest[:-1]:
            yield self.batch(index, taken)
        yield self.batch(index, rest[-1], done={"counts": counts, "unreadable": unreadable, "missing": missing})

    @staticmethod
    def batch(index: int, taken: list, done: dict | None = None) -> dict:
        """`taken`: (crop, (caption, key, metadata, geometry of each orientation), None, None) each, as `ShapeGroups`
        holds them."""
        batch = {"shard": np.array([index], np.int64), "records": json.dumps([r for _, r, *_ in taken], default=str)}
        if taken:
            batch["pixel_values"] = to_uint8_batch([crop for crop, *_ in taken])
        if done is not None:  # the shard's last batch
            batch["done"] = json.dumps(done)
        return batch


@paddle.no_grad()
def encode_moments(vae, pixels, flips: bool, dtype: str = "float32") -> np.ndarray:
    """uint8 [B, 3, R, R] -> float32 posterior moments [B, copies, 2C, h, w] (copy 1: the mirror image); the
    encoder runs in `dtype` (`encode_autocast`)."""
    x = unit_range(paddle.to_tensor(pixels))  # (Paddle's CPU flip has no uint8 kernel)
    if flips:
        x = paddle.concat([x, x.flip([3])])
    moments = posterior(vae, x, dtype).parameters.astype("float32").numpy()
    n = len(pixels)
    return np.stack([moments[:n], moments[n:]], 1) if flips else moments[:, None]


class ShardWriters:
    """The output shards being written, one per input shard in progress; each is renamed into place when
    its last batch is written, after its counts are logged in `.encode/done-rank<r>.jsonl`."""

    def __init__(self, output_dir: str, rank: int):
        self.output_dir = output_dir
        self.log = os.path.join(output_dir, STATE, f"done-rank{rank}.jsonl")
        self.open: dict[int, object] = {}
        self.unreadable: dict[int, str] = {}
        self.missing: dict[int, str] = {}
        self.skipped: dict[int, Counter] = {}  # records dropped here (non-finite moments), by shard

    def partial(self, index: int) -> str:
        return os.path.join(self.output_dir, f".{output_name(index)}.partial")

    def write(self, index: int, records: list, moments: np.ndarray, meta: LatentMeta,
              texts: list[np.ndarray] | None = None) -> None:
        """Append a batch's records (`texts`: their captions' text states); one whose moments or text states are not
        finite in the stored dtype is skipped and counted."""
        import gzip

        if index not in self.open:
            self.open[index] = gzip.open(self.partial(index), "wb", compresslevel=1)  # noqa: SIM115 - closed in finish
        finite = storable(moments, meta.dtype)
        self.skipped.setdefault(index, Counter())["non_finite_latent"] += int((~finite).sum())
        if texts is not None:
            text_ok = np.array([storable_text(text, meta.text) for text in texts], bool)
            self.skipped[index]["non_finite_text"] += int((finite & ~text_ok).sum())
            finite &= text_ok
        texts = [None] * len(records) if texts is None else texts
        self.open[index].write(b"".join(
            latent_line(caption, key, m, dataclasses.replace(meta, geometry=tuple(map(tuple, geometry[:meta.copies]))),
                        source, text)
            for (caption, key, source, geometry), m, text, ok in zip(records, moments, texts, finite, strict=True)
            if ok))

    def finish(self, index: int, done: dict, meta: LatentMeta) -> None:
        self.write(index, [], np.zeros([0, *meta.shape], np.float32), meta)
        self.open.pop(index).close()
        if done["unreadable"] or done["missing"]:
            os.remove(self.partial(index))
            (self.unreadable if done["unreadable"] else self.missing)[index] = done["unreadable"] or done["missing"]
            return
        counts = Counter(done["counts"]) + self.skipped.pop(index, Counter())
        counts["ok"] -= counts["non_finite_latent"] + counts["non_finite_text"]
        with open(self.log, "a") as f:  # a line a crash cut stays a line of its own: the next one starts anew
            f.write("\n" + json.dumps({"shard": index, "counts": counts}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.partial(index), os.path.join(self.output_dir, output_name(index)))

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        self.open = {}

    def discard(self) -> None:
        """Drop the shards in progress (after a failed write: their files may be cut anywhere)."""
        for index, f in self.open.items():
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(OSError):
                os.remove(self.partial(index))
        self.open = {}


def storable(arrays: np.ndarray, dtype: str) -> np.ndarray:
    """Which of a batch's arrays are finite in the stored `dtype` (float16 overflows at 65504)."""
    axes = tuple(range(1, arrays.ndim))
    finite = np.isfinite(arrays).all(axis=axes)
    if dtype == "float16":
        finite &= (np.abs(arrays) <= np.finfo(np.float16).max).all(axis=axes)
    return finite


class EncoderStates:
    """One frozen text encoder of `encode --text_embeddings` (its `part` of the model: `text_encoder`, ...): captions
    in, each one's float32 states [L, D] out (an encoder that masks its padding: its real tokens only, [n, D]) with
    its pooled vector (a CLIP with a projection's) or None; `entry`, what a record's meta says of them."""

    def __init__(self, part: str, family, encoder, tokenizer, dtype: str, max_length: int | None, source: str):
        from ldm.data.latents import text_fingerprint
        from ldm.data.tokenize import CaptionTokenizer
        from ldm.models.text import TextEncoderError, cache_entry, caption_length, text_encoder_identity

        self.encoder = encoder
        try:  # as the training run makes them (`ldm.train.setup.with_caption_length`)
            length = caption_length(max_length, tokenizer, getattr(encoder.config, "max_position_embeddings", None))
        except TextEncoderError as e:
            raise EncodeError(f"{source}: {e}") from None
        self.tokenize = CaptionTokenizer(tokenizer, length)
        self.identity = text_encoder_identity(encoder, family, length)
        self.entry = {"encoder": text_fingerprint(self.identity), "dtype": dtype, **cache_entry(encoder, length)}
        self.part = part

    @paddle.no_grad()
    def __call__(self, captions: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        from ldm.models.text import encode_prompt

        # the caption as the latent record stores it (its whitespace folded), as training would tokenize it
        ids = paddle.to_tensor(np.stack([self.tokenize(" ".join(caption.split())) for caption in captions]))
        encoded = encode_prompt(self.encoder, ids)
        states = encoded.states.astype("float32").numpy()
        pooled = [None] * len(states) if encoded.pooled is None else list(encoded.pooled.astype("float32").numpy())
        if encoded.mask is not None:
            states = [s[:n] for s, n in zip(states, encoded.mask.sum(axis=1).numpy(), strict=True)]
        return list(zip(states, pooled, strict=True))


def storable_text(text, spec: dict) -> bool:
    """Are a caption's text states (one encoder's array or (states, pooled), or several's [(states, pooled), ...])
    finite as stored?"""
    if "encoders" not in spec:
        return all(bool(storable(array[None], spec["dtype"])[0]) for array in
                   (text if isinstance(text, tuple) else (text,)))
    return all(bool(storable(array[None], part["dtype"])[0]) for part, arrays in zip(spec["encoders"], text,
                                                                                     strict=True)
               for array in arrays if array is not None)


class CaptionStates:
    """The frozen text encoders of `encode --text_embeddings`, in the model's order (today one: a model of several
    is refused at its loading): each caption's stored text states, and the meta's `text` saying how
    (`ldm.data.latents`: one encoder's form, or several's with each one's part, fingerprint and pooled vector)."""

    def __init__(self, model_name_or_path: str, dtype: str, allow_untrained: bool = False,
                 max_length: int | None = None):
        from ldm.models.build import load_caption_encoder, model_family

        family, encoder, tokenizer = load_caption_encoder(model_name_or_path, allow_untrained)
        self.compose([EncoderStates(family.folder, family, encoder, tokenizer, dtype, max_length, model_name_or_path)],
                     model_family(model_name_or_path))

    @classmethod
    def of(cls, parts: list[EncoderStates], family=None) -> CaptionStates:
        """The encoders given, in order (a model of several: SD3's), for a model of `family`."""
        captions = cls.__new__(cls)
        captions.compose(parts, family)
        return captions

    def compose(self, parts: list[EncoderStates], family) -> None:
        self.parts, self.identity = parts, parts[0].identity
        if len(self.parts) == 1:  # what the model's family keeps: the pooled vector where its backbone reads one
            entry = self.parts[0].entry
            self.meta = family.cached_text(entry) if family is not None else entry
        else:
            self.meta = {"encoders": [{"part": p.part, **p.entry} for p in self.parts]}

    def __call__(self, captions: list[str]) -> list:
        """Each caption's states (one encoder: an array, or (states, pooled) where the meta keeps the pooled vector;
        several: [(states, pooled or None), ...] in order)."""
        per_encoder = [part(captions) for part in self.parts]
        if len(self.parts) == 1:
            if "pooled" in self.meta:
                return [(states, pooled) for states, pooled in per_encoder[0]]
            return [states for states, _ in per_encoder[0]]
        return [list(caption) for caption in zip(*per_encoder, strict=True)]


def settings_of(args, shards: list[Shard], meta: LatentMeta, buckets: tuple[Bucket, ...] | None = None) -> dict:
    # the shards' order and names make the output's (weights only shape the file lists, written anew each run)
    listed = hashlib.sha256("\n".join(s.path for s in shards).encode()).hexdigest()
    return {"file_list": args.file_list, "input_shards": len(shards), "input_shards_sha256": listed,
            "vae": meta.vae, "vae_name_or_path": args.vae_name_or_path, "dtype": meta.dtype,
            "resolution": meta.resolution, "random_flip": args.random_flip, "center_crop": args.center_crop,
            "min_image_size": args.min_image_size, "seed": args.seed, "vae_dtype": args.vae_dtype,
            "aspect_buckets": [bucket_name(b) for b in buckets] if buckets else None, "text": meta.text,
            "geometry": True,  # a folder begun before records stored it is not completed with records that do
            **({"metadata_filter": list(args.metadata_filter)} if getattr(args, "metadata_filter", None) else {})}


def claim(output_dir: str, settings: dict) -> int:
    """Create the output folder, or check that what it holds was made with these settings; returns how many
    output shards exist already."""
    path = os.path.join(output_dir, STATE, "settings.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        free = ("file_list", "vae_name_or_path")  # the same corpus and autoencoder may be named another way
        differ = sorted(k for k in settings if k not in free and saved.get(k) != settings[k])
        if differ:
            raise EncodeError(f"{output_dir} holds latents encoded with other settings ({', '.join(differ)}: "
                              f"{', '.join(f'{saved.get(k)!r} there, {settings[k]!r} now' for k in differ)}); pass "
                              "the same flags and file list to go on, or another --output_dir")
        return len(glob.glob(os.path.join(output_dir, "latents-*.gz")))
    if os.path.isdir(output_dir) and set(os.listdir(output_dir)) - {STATE}:  # (a start cut before its settings)
        raise EncodeError(f"{output_dir} exists and is not an encode's output folder: pass a new or empty --output_dir")
    os.makedirs(os.path.join(output_dir, STATE), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(settings, f, indent=1)
    os.replace(path + ".tmp", path)
    return 0


def read_done(output_dir: str, num_shards: int) -> dict[int, dict]:
    """Counts of every output shard that exists: its last logged entry, or its lines counted when it has none."""
    logged: dict[int, dict] = {}
    for log in sorted(glob.glob(os.path.join(output_dir, STATE, "done-rank*.jsonl"))):
        with open(log) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # blank, or cut by a crash before its shard was renamed into place
                logged[entry["shard"]] = entry["counts"]
    done = {}
    for index in range(num_shards):
        path = os.path.join(output_dir, output_name(index))
        if os.path.exists(path):
            done[index] = logged.get(index) or {"ok": sum(1 for _ in iter_lines(path))}
    return done


def write_file_lists(output_dir: str, shards: list[Shard], done: dict[int, dict]) -> str:
    """`latents*.filelist` (one per input weight) and `latents.filelist.list`; shards without records are left out."""
    groups: dict[float, list[int]] = {}
    for index, shard in enumerate(shards):
        if done.get(index, {}).get("ok"):
            groups.setdefault(shard.weight, []).append(index)
    listing = os.path.join(output_dir, "latents.filelist.list")
    entries = []
    for number, (weight, indices) in enumerate(groups.items()):
        name = "latents.filelist" if len(groups) == 1 else f"latents-{number}.filelist"
        with open(os.path.join(output_dir, name), "w") as f:
            f.writelines(output_name(i) + "\n" for i in indices)
        entries.append(name if weight == 1 else f"{name} {weight:g}")
    with open(listing, "w") as f:
        f.writelines(entry + "\n" for entry in entries)
    return listing


def load_autoencoder(name_or_path: str, allow_untrained: bool):
    from ppdiffusers import AutoencoderKL

    from ldm.models.build import check_autoencoder_trained, load_part, vae_folder

    vae, loaded = load_part(AutoencoderKL, vae_folder(name_or_path))
    check_autoencoder_trained(loaded, name_or_path, allow_untrained)
    vae.eval()
    return vae


def encode_corpus(args) -> int:
    """Encode `args.file_list` into `args.output_dir`; returns the exit status (1: some shards unreadable)."""
    if remote.is_url(args.output_dir):
        raise EncodeError(f"--output_dir must be a local or mounted folder, not {args.output_dir}: encode there, "
                          "then copy the folder to the store (its file lists are relative)")
    use_fast_cpu_kernels()
    dist = Distributed.init()
    shards = read_file_list(args.file_list)
    dist.from_main(lambda: check_shards(shards, args.file_list))
    if dist.from_main(lambda: probe([s.path for s in shards])) is not None:
        raise EncodeError(f"{args.file_list} holds latent shards already")
    vae = load_autoencoder(args.vae_name_or_path, args.allow_untrained_vae)

    args.vae_dtype = resolve_vae_dtype(args.vae_dtype)
    probe_moments = encode_moments(vae, np.zeros([1, 3, args.resolution, args.resolution], np.uint8), args.random_flip)
    captions = CaptionStates(args.model_name_or_path, args.text_dtype, args.allow_untrained_text_encoder,
                             args.model_max_length) if args.text_embeddings else None
    meta = LatentMeta(fingerprint(autoencoder_identity(vae)), args.dtype, tuple(probe_moments.shape[1:]),
                      args.resolution, text=captions.meta if captions else None)
    # this autoencoder with the UNet the latents are for, as the training run has them
    buckets = model_buckets(args.aspect_buckets, args.resolution, args.max_aspect_ratio, args.model_name_or_path,
                            vae.config)
    described = meta.describe()
    if buckets:  # the probe's square shape is not what is stored
        described = (f"autoencoder {meta.vae}, {meta.dtype} moments of each record at its bucket's size, in "
                     f"aspect-ratio buckets {', '.join(map(bucket_name, buckets))}")
    existing = dist.from_main(lambda: claim(args.output_dir, settings_of(args, shards, meta, buckets)))
    if dist.is_main:
        logger.info("encoding %d shards into %s (%s); %d done already", len(shards), args.output_dir,
                    described, existing)
    transform = ImageTransform(args.resolution, center_crop=args.center_crop, min_image_size=args.min_image_size,
                               buckets=buckets)
    reader = ShardBatches(shards, args.output_dir, transform, batch_size=args.batch_size, seed=args.seed,
                          rank=dist.rank, world_size=dist.world_size, num_workers=args.num_workers,
                          metadata_filter=parse_filters(getattr(args, "metadata_filter", None)))
    todo = sum(len(reader.todo(reader.first_slot + w)) for w in range(reader.workers))
    loader = DataLoader(reader, batch_size=None, num_workers=args.num_workers, use_shared_memory=False,
                        timeout=READER_POLL_SECONDS)
    writers = ShardWriters(args.output_dir, dist.rank)
    progress = tqdm(total=todo, desc=f"encode (rank {dist.rank})", unit="shard", disable=not dist.is_main)

    batches = watched(loader, args.data_timeout)
    try:
        for batch in batches:
            index = int(np.asarray(batch["shard"])[0])
            records = json.loads(batch["records"])
            if records:
                pixels = np.asarray(batch["pixel_values"])
                moments = encode_moments(vae, pixels, args.random_flip, args.vae_dtype)
                shaped = dataclasses.replace(meta, shape=tuple(moments.shape[1:]),
                                             bucket=tuple(pixels.shape[2:])) if buckets else meta
                texts = captions([caption for caption, *_ in records]) if captions else None
                writers.write(index, records, moments, shaped, texts)
            if "done" in batch:
                writers.finish(index, json.loads(batch["done"]), meta)
                progress.update(1)
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        writers.discard()
        raise EncodeError(f"no space left to write in {args.output_dir} ({e.strerror}); the shards finished are kept: "
                          "free space, then run the same command again") from None
    finally:
        batches.close()
        writers.close()
        progress.close()
    unreadable, missing = ({i: e for rank_part in dist.gather(part) for i, e in rank_part.items()}
                           for part in (writers.unreadable, writers.missing))
    dist.barrier()
    if dist.is_main:
        done = read_done(args.output_dir, len(shards))
        listing = write_file_lists(args.output_dir, shards, done)
        totals = Counter()
        for counts in done.values():
            totals.update(counts)
        skipped = ", ".join(f"{reason} {n}" for reason, n in sorted(totals.items()) if reason != "ok") or "none"
        print(f"encoded {totals['ok']} records of {len(done)} of {len(shards)} shards into {args.output_dir} "
              f"({described}); skipped: {skipped}")
        if missing:
            first = missing[min(missing)]
            print(f"warning: {len(missing)} shard(s) do not exist (the first: {first}): left out of the file list, as "
                  "training counts and skips them; the same command encodes them if they appear")
        if unreadable:
            first = unreadable[min(unreadable)]
            print(f"error: {len(unreadable)} shard(s) could not be read (the first: {first}); run the same command "
                  "again to retry them (encoded shards are skipped)")
        print(f"use --file_list {listing}")
    return 1 if unreadable else 0
