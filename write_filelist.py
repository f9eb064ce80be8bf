"""Write a filelist of shard paths.

With no arguments it does what the original example does: 60,000 paths
/data/laion400m/part-00000.gz ... part-59999.gz into data/filelist/laion400m_en.filelist.

    python write_filelist.py                                   # the original 60,000 paths
    python write_filelist.py --pattern '/mnt/laion/part-{:05d}.gz' --count 1000 --output my.filelist
    python write_filelist.py --existing '/mnt/laion/*.gz' --output my.filelist   # shards that exist
    python write_filelist.py --existing /mnt/laion --output my.filelist          # every file in a folder
    python write_filelist.py --existing 's3://bucket/laion/*.gz' --output my.filelist   # any fsspec URL
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from ldm.data import remote
from ldm.runtime.cli import ToolParser
from ldm.runtime.files import atomic_write


def pattern_paths(pattern: str, count: int, start: int = 0) -> list[str]:
    return [pattern.format(i) for i in range(start, start + count)]


def existing_paths(where: str) -> list[str]:
    if remote.is_url(where):  # object storage, HTTP, ...: listed through fsspec
        return remote.glob(where)
    if os.path.isdir(where):
        paths = [os.path.join(where, name) for name in os.listdir(where)]
        return sorted(p for p in paths if os.path.isfile(p))
    return sorted(p for p in glob.glob(where) if os.path.isfile(p))


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pattern", default="/data/laion400m/part-{:05d}.gz",
                        help="str.format pattern of a shard path, given the shard number")
    source.add_argument("--existing", metavar="FOLDER_OR_GLOB",
                        help="list the shards that exist under a folder or match a glob instead (a local path or "
                             "an fsspec URL: s3://, gs://, hdfs://, http(s)://, ...)")
    parser.add_argument("--count", type=int, default=60000, help="number of paths written with --pattern")
    parser.add_argument("--start", type=int, default=0, help="first shard number with --pattern")
    parser.add_argument("--output", default="data/filelist/laion400m_en.filelist")
    args = parser.parse_args(argv)

    if args.existing:
        try:
            paths = existing_paths(args.existing)
        except (OSError, ValueError, ImportError) as e:
            parser.exit(1, f"error: cannot list {args.existing}: {e}\n")
        own = os.path.realpath(args.output)  # listed when it lies in the folder or matches the glob: not a shard
        paths = [p for p in paths if "://" in p or os.path.realpath(p) != own]
        if not paths:
            parser.exit(1, f"error: no shard files under {args.existing}\n")
    else:
        if args.count < 1:
            parser.exit(2, "error: --count must be at least 1\n")
        try:
            paths = pattern_paths(args.pattern, args.count, args.start)
        except (IndexError, KeyError, ValueError) as e:
            parser.exit(2, f"error: --pattern {args.pattern!r} cannot be formatted with a number: {e}\n")
    folder = os.path.dirname(args.output)
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
        with atomic_write(args.output, "w") as f:
            f.writelines(p + "\n" for p in paths)
    except OSError as e:
        parser.exit(1, f"error: cannot write {args.output}: {e.strerror or e}\n")
    print(f"wrote {len(paths)} shard paths to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
