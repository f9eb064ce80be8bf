"""Reading a list of filelists into weighted shards.

A list of filelists has one filelist path per line, optionally followed by a sampling weight
(whitespace-separated, default 1). A filelist has one shard path per line. Blank lines and lines
starting with `#` are ignored in both.

Relative paths resolve against the current directory when they exist there (as in the original
example, run from the repository root), and otherwise against the folder of the file that names
them, so that a generated corpus can be moved as a whole; one that exists both ways as different files is
refused. Entries of a filelist at a URL resolve against the URL's folder only. A byte-order mark is ignored.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from dataclasses import dataclass, field

from ldm.data import remote
from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.data")


class FileListError(UserError, ValueError):
    """A list of filelists or a filelist cannot be used."""


@dataclass(frozen=True)
class Shard:
    path: str
    weight: float = 1.0
    # The shard as the lists name it ("filelist entry:shard entry", as written). Each record's caption
    # dropout and augmentations are seeded by it, not by `path`: a corpus read from another folder
    # (another clone, another mount point) trains the same. Empty: `path` stands for it.
    name: str = field(default="", compare=False)

    @property
    def seed_key(self) -> str:
        return self.name or self.path


def resolve(path: str, relative_to: str) -> str:
    """`path` as named in the list `relative_to`: as it is when absolute or a URL; else from the current directory
    when it exists there, else from the list's folder. An entry that exists both ways as two different files is
    refused: which corpus was meant cannot be told."""
    if os.path.isabs(path) or remote.is_url(path):
        return path
    if remote.is_url(relative_to):
        return remote.join(relative_to, path)
    beside = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(relative_to)), path))
    if os.path.exists(path):
        if os.path.exists(beside) and os.path.realpath(beside) != os.path.realpath(path):
            raise FileListError(f"{relative_to} names {path!r}, which is both {os.path.abspath(path)} (from the "
                                f"current directory) and {beside} (beside the list): write the one you mean as an "
                                "absolute path, or run from another directory")
        return path
    return beside


# the first bytes of files that are shards, not lists (a list of filelists given where a filelist was, or the reverse)
MAGIC = {b"\x1f\x8b": "a gzipped shard", b"PAR1": "a parquet file", b"\x89PNG": "a PNG image", b"\xff\xd8": "a JPEG"}


def _decode(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8-sig")  # a byte-order mark from an editor is not part of the first path
    except UnicodeDecodeError as e:
        kind = next((what for magic, what in MAGIC.items() if data.startswith(magic)), None)
        if kind is None and len(data) > 262 and data[257:262] == b"ustar":
            kind = "a tar file"
        if kind:
            raise FileListError(f"{path} is {kind}, not a list of paths: --file_list takes a list of filelists (one "
                                "filelist per line), and each filelist names shards") from None
        raise FileListError(f"cannot read file list {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read(path: str) -> str:
    if remote.is_url(path):
        try:
            remote.check_scheme(path)
        except ValueError as e:
            raise FileListError(f"cannot read file list {path}: {e}") from None
        with remote.open_url(path) as f:
            return _decode(f.read(), path)
    with open(path, "rb") as f:
        return _decode(f.read(), path)


def _entries(path: str):
    try:
        for number, raw in enumerate(_read(path).splitlines(), 1):
            line = raw.strip()
            if line and not line.startswith("#"):
                yield number, line
    except FileNotFoundError:
        raise FileListError(f"file list not found: {path}") from None
    except OSError as e:
        raise FileListError(f"cannot read file list {path}: {e}") from None


def read_file_list(path: str) -> list[Shard]:
    """All shards named by the filelists of `path`, each with its filelist's weight. A filelist named twice, or a
    shard named twice by one filelist, is refused (the weight repeats a filelist on purpose)."""
    shards: list[Shard] = []
    seen_lists: dict[str, int] = {}
    for number, line in _entries(path):
        fields = line.split()
        if len(fields) > 2:
            raise FileListError(f"{path}:{number}: expected 'filelist [weight]', got {line!r}")
        weight = 1.0
        if len(fields) == 2:
            try:
                weight = float(fields[1])
            except ValueError:
                raise FileListError(f"{path}:{number}: weight {fields[1]!r} is not a number") from None
            if not weight > 0 or weight == float("inf"):
                raise FileListError(f"{path}:{number}: weight must be a positive finite number, got {weight}")
        filelist = resolve(fields[0], path)
        if filelist in seen_lists:
            raise FileListError(f"{path}:{number} names {fields[0]} again (line {seen_lists[filelist]}): each pass "
                                f"would read its shards twice. To sample it more often give it a weight ({fields[0]} "
                                "2.0)")
        seen_lists[filelist] = number
        seen_shards: dict[str, int] = {}
        for shard_number, shard in _entries(filelist):
            resolved = resolve(shard, filelist)
            if resolved in seen_shards:
                raise FileListError(f"{filelist}:{shard_number} names {shard} again (line {seen_shards[resolved]}): "
                                    "each pass would read it twice. To sample shards more often, weight their "
                                    "filelist in the list of filelists")
            seen_shards[resolved] = shard_number
            shards.append(Shard(resolved, weight, name=f"{fields[0]}:{shard}"))
    if not shards:
        raise FileListError(f"no shards listed in {path}")
    return shards


def shard_set(shards: list[Shard]) -> dict:
    """What a data position is made for: the number of shards and a digest of their names (as the lists name them)
    and weights, in order. A pass's order and every saved position are positions in this list."""
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(f"{shard.seed_key}\t{shard.weight!r}\n".encode())
    return {"count": len(shards), "sha256": digest.hexdigest()}


def shard_set_change(recorded: dict | None, shards: list[Shard]) -> str | None:
    """How `shards` differ from the shard set a position `recorded` (None: not recorded, nothing to compare)."""
    if not recorded:
        return None
    now = shard_set(shards)
    if recorded.get("count") not in (None, now["count"]):
        return f"{recorded['count']} shards when it was saved, now {now['count']}"
    if recorded.get("sha256") not in (None, now["sha256"]):
        return f"the same {now['count']} shards in number, but other names, order or weights"
    return None


SHARDS_CHECKED = 1000
REMOTE_SHARDS_CHECKED = 8  # each is a request to the store
KINDS_CHECKED = 32  # local shards whose first bytes are read (a chunk each)


def check_shards(shards: list[Shard], file_list: str, one_kind: bool = False) -> None:
    """Before a run writes anything: no shard there at all is an error, some missing a warning; a URL
    scheme this process cannot read is an error naming the package to install; a shard of no kind the
    stream reads (an img2dataset `_stats.json` or metadata parquet listed by a glob, an HTML error page),
    or shards none of which can be read, are errors naming one.

    Missing shards are otherwise counted as unreadable while training. At most `SHARDS_CHECKED` local
    shards (on a FUSE mount of object storage each look is a request) and `REMOTE_SHARDS_CHECKED` URLs,
    spread evenly over the list, are looked at; the first bytes of `KINDS_CHECKED` of those local ones and
    of those URLs are read. A URL that cannot be looked at (no connection, no credentials) is a warning:
    the run's own reads retry, then count it. Shards not looked at are counted when they are read.

    `one_kind` (training): the first record of each text shard whose first bytes are read is read too, and shards of
    different kinds (images, latents, latents with cached text states) are refused: a loader slot batches one kind,
    and would otherwise meet the other only when it reaches such a shard, a pass or more into the run.
    """
    local = [s.path for s in shards if not remote.is_url(s.path)]
    urls = [s.path for s in shards if remote.is_url(s.path)]
    for url in {remote.scheme(u): u for u in urls}.values():
        try:
            remote.check_scheme(url)
        except ValueError as e:
            raise FileListError(f"{file_list} names {url}: {e}") from None
    local_sample = local[:: max(1, len(local) // SHARDS_CHECKED)]
    url_sample = urls[:: max(1, len(urls) // REMOTE_SHARDS_CHECKED)][:REMOTE_SHARDS_CHECKED]
    _check_sample(local_sample, len(local), file_list, os.path.exists)
    reachable = _check_sample(url_sample, len(urls), file_list, remote.exists)
    _check_kinds([p for p in local_sample[:: max(1, len(local_sample) // KINDS_CHECKED)] if _sniffable(p)]
                 + reachable, file_list, one_kind)


def _sniffable(path: str) -> bool:
    """A file or folder whose first bytes can be asked for without waiting on it (not a named pipe or device)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode)


KIND_CHECK_SECONDS = 10.0


def _check_kinds(paths: list[str], file_list: str, records: bool = False) -> None:
    """The kinds of `paths`, read in a thread given `KIND_CHECK_SECONDS`: a read that never returns (a hung store
    or mount, a named pipe) must not hang the start; it is left to the run's own reads and `--data_timeout`.
    `records`: the kinds of their first records too, which must be one."""
    import threading

    outcomes: list[tuple[str, Exception | None, str | None]] = []
    reader = threading.Thread(target=_read_kinds, args=(paths, outcomes, records), daemon=True,
                              name="shard-kind-check")
    reader.start()
    reader.join(KIND_CHECK_SECONDS)
    if reader.is_alive():
        logger.warning("reading the first bytes of the shards of %s took more than %.0f s (at %s): not checked "
                       "further; --data_timeout watches the run's own reads", file_list, KIND_CHECK_SECONDS,
                       paths[len(outcomes)] if len(outcomes) < len(paths) else "the end")
    outcomes = list(outcomes)
    _judge_kinds([(path, error) for path, error, _ in outcomes], file_list)
    if records:
        _judge_record_kinds({kind: path for path, _, kind in reversed(outcomes) if kind}, file_list)


def _read_kinds(paths: list[str], outcomes: list, records: bool) -> None:
    from ldm.data.latents import first_record_kind
    from ldm.data.readers import open_parquet, parquet_columns, shard_kind
    from ldm.data.shard import ShardError

    for path in paths:
        try:
            kind = shard_kind(path)
            if kind == "parquet":
                parquet_columns(open_parquet(path), path)  # a parquet of URLs or metadata holds no images
            record = None if not records else first_record_kind(path) if kind == "text" else "image"
            outcomes.append((path, None, record))
        except ShardError as e:
            outcomes.append((path, e, None))


def _judge_record_kinds(first: dict[str, str], file_list: str) -> None:
    """`first`: a shard of each kind of first record found. More than one kind is refused, naming a shard of each."""
    if len(first) < 2:
        return
    records = {"image": "an image record", "latent": "a latent record",
               "latent with text states": "a latent record with cached text states"}
    named = "; ".join(f"{path} begins with {records[kind]}" for kind, path in sorted(first.items()))
    fix = ("encode all of the corpus with --text_embeddings, or none of it" if "image" not in first else
           "train on images or on latents (python -m ldm.prepare encode), not both")
    raise FileListError(f"{file_list} mixes shards of different kinds, and a run trains on one: {named}. List shards "
                        f"of one kind: {fix}")


def _judge_kinds(outcomes: list[tuple[str, Exception | None]], file_list: str) -> None:
    from ldm.data.readers import ShardFormatError

    unreadable: list[str] = []
    for path, error in outcomes:
        if isinstance(error, ShardFormatError):
            raise FileListError(f"{file_list} names a file that is no shard: {error}. Remove it from the list "
                                "(python -m ldm.prepare stats --file_list ... names every such file)")
        if error is not None:
            if remote.is_url(path):  # the store may be slow or failing for now: the run's reads retry, then count
                logger.warning("cannot read the first bytes of %s: %s", path, error)
            else:
                unreadable.append(str(error))
    paths = [path for path, _ in outcomes if not remote.is_url(path)]
    if paths and len(unreadable) == len(paths):
        raise FileListError(f"none of the {len(paths)} shard(s) of {file_list} whose first bytes were read can be "
                            f"read (the first: {unreadable[0]})")


def _check_sample(sample: list[str], total: int, file_list: str, exists) -> list[str]:
    """The shards of `sample` that exist (those that could not be looked at left out)."""
    missing, failed, refused = [], [], []
    for path in sample:
        try:
            if not exists(path):
                missing.append(path)
        except remote.StoreRefused as e:
            if e.whole_store:  # a misspelled bucket, wrong keys: every shard would fail alike
                raise FileListError(f"{file_list} names {path}, and {remote.bucket(path)} refuses it ({e.reason}): "
                                    "check the bucket's name and the store's credentials (docs/data-formats.md)"
                                    ) from None
            refused.append((path, e))  # may be this object's alone (a 403 for a key the policy hides)
            failed.append(path)
            logger.warning("shard %s is refused: %s", path, e.reason)
        except OSError as e:
            failed.append(path)
            logger.warning("cannot look for shard %s: %s", path, e)
    if refused and len(refused) == len(sample):  # every shard looked at: the credentials, not the objects
        path, error = refused[0]
        raise FileListError(f"{file_list} names {len(sample)} shard(s) looked at, and the store refuses every one (the "
                            f"first: {path}: {error.reason}): check the store's credentials and permissions "
                            "(docs/data-formats.md)")
    looked = len(sample) - len(failed)
    if looked and len(missing) == looked:
        raise FileListError(f"none of the {looked} shard(s) looked at of the {total} named by {file_list} "
                            f"exists (the first: {missing[0]}); relative paths resolve against the current folder, "
                            "else the filelist's (a URL filelist's: its URL's folder)")
    if missing:
        logger.warning("%d of the %d shards looked at (of %d named by %s) do not exist (the first: %s); missing "
                       "shards are counted as unreadable", len(missing), looked, total, file_list, missing[0])
    absent = set(missing) | set(failed)
    return [path for path in sample if path not in absent]
