"""Reading a list of filelists into weighted shards.

A list of filelists has one filelist path per line, optionally followed by a sampling weight
(whitespace-separated, default 1). A filelist has one shard path per line. Blank lines and lines
starting with `#` are ignored in both.

Relative paths resolve against the current directory when they exist there (as in the original
example, run from the repository root), and otherwise against the folder of the file that names
them, so that a generated corpus can be moved as a whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class FileListError(ValueError):
    """A list of filelists or a filelist cannot be used."""


@dataclass(frozen=True)
class Shard:
    path: str
    weight: float = 1.0


def resolve(path: str, relative_to: str) -> str:
    if os.path.isabs(path) or "://" in path or os.path.exists(path):
        return path
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(relative_to)), path))


def _entries(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            for number, raw in enumerate(f, 1):
                line = raw.strip()
                if line and not line.startswith("#"):
                    yield number, line
    except FileNotFoundError:
        raise FileListError(f"file list not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FileListError(f"cannot read file list {path}: {e}") from None


def read_file_list(path: str) -> list[Shard]:
    """All shards named by the filelists of `path`, each with its filelist's weight."""
    shards: list[Shard] = []
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
        shards.extend(Shard(resolve(shard, filelist), weight) for _, shard in _entries(filelist))
    if not shards:
        raise FileListError(f"no shards listed in {path}")
    return shards


SHARDS_CHECKED = 1000


def check_shards(shards: list[Shard], file_list: str) -> None:
    """Before a run writes anything: no local shard there at all is an error, some missing a warning.

    Missing shards are otherwise counted as unreadable while training. At most `SHARDS_CHECKED` shards,
    spread evenly over the list, are looked at: on a FUSE mount of object storage each look is a
    request. Remote paths (`scheme://`) are not checked here.
    """
    import logging

    local = [s.path for s in shards if "://" not in s.path]
    sample = local[:: max(1, len(local) // SHARDS_CHECKED)]
    missing = [path for path in sample if not os.path.exists(path)]
    if sample and len(missing) == len(sample):
        raise FileListError(f"none of the {len(sample)} shard(s) looked at of the {len(local)} named by {file_list} "
                            f"exists (the first: {missing[0]}); relative paths resolve against the current folder, "
                            "else the filelist's")
    if missing:
        logging.getLogger("ldm.data").warning(
            "%d of the %d shards looked at (of %d named by %s) do not exist (the first: %s); missing shards are "
            "counted as unreadable", len(missing), len(sample), len(local), file_list, missing[0])
