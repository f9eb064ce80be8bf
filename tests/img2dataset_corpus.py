"""A corpus written by img2dataset itself (pinned in the lock), downloading from an HTTP server on 127.0.0.1.

63 URLs in a LAION-like URL parquet (with `punsafe`, `pwatermark`, `similarity` and `AESTHETIC_SCORE` columns):
60 photographs of mixed sizes, and 3 that fail as LAION URLs do: a 404, a 503 and a page that is no image. It is
downloaded twice, as `webdataset` (tars of KEY.jpg / KEY.txt / KEY.json, 25 URLs per shard) and as `parquet`
(image bytes in a `jpg` column), both resized to 64 px (center crop), the metadata columns kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from corpus import photo
from servers import serve

NUM_URLS = 63
PER_SHARD = 25
IMAGE_SIZE = 64
COLUMNS = ["punsafe", "pwatermark", "similarity", "AESTHETIC_SCORE"]
FAILING = {20: "404", 41: "503", 62: "not an image"}

DOWNLOAD = """
import json, sys
from img2dataset import download
args = json.loads(sys.argv[1])
download(**args)
"""


def url_rows() -> list[dict]:
    rows = []
    for i in range(NUM_URLS):
        rows.append({"url": f"p{i}.jpg", "caption": f"a photo number {i}",
                     "punsafe": round((i % 10) / 10 + 0.05, 2), "pwatermark": round(0.1 * (i % 3), 1),
                     "similarity": round(0.25 + 0.01 * (i % 7), 2), "AESTHETIC_SCORE": 4 + (i % 4) * 0.5})
    return rows


def write_images(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(NUM_URLS):
        if FAILING.get(i) == "404":
            continue
        if FAILING.get(i) == "not an image":
            (folder / f"p{i}.jpg").write_text("<html><body>hotlinking is not allowed</body></html>")
            continue
        photo(*original_size(i), seed=i).save(folder / f"p{i}.jpg", quality=90)


def original_size(i: int) -> tuple[int, int]:
    """(width, height) of photograph i as the server has it: shorter sides 150..449, some wide, some tall."""
    return 180 + (i * 37) % 400, 150 + (i * 23) % 300


def build(folder: Path, resize_mode: str = "center_crop", formats=(("webdataset", "wds"), ("parquet", "parquet"))
          ) -> dict:
    """Download the corpus into `folder` with img2dataset (`resize_mode` as its flag, e.g. keep_ratio as the README
    recommends: the photographs keep their aspect ratios); returns the paths (and writes the file lists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = folder / "www"
    write_images(images)
    rows = url_rows()
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    with serve(images) as (base, server):
        server.failures[f"/p{[i for i, why in FAILING.items() if why == '503'][0]}.jpg"] = 10 ** 6
        urls = [{**r, "url": f"{base}/{r['url']}"} for r in rows]
        pq.write_table(pa.Table.from_pylist(urls), folder / "urls.parquet")
        for fmt, name in formats:
            args = {"url_list": str(folder / "urls.parquet"), "input_format": "parquet", "url_col": "url",
                    "caption_col": "caption", "output_format": fmt, "output_folder": str(folder / name),
                    "processes_count": 1, "thread_count": 4, "image_size": IMAGE_SIZE, "resize_mode": resize_mode,
                    "save_additional_columns": COLUMNS, "number_sample_per_shard": PER_SHARD,
                    "distributor": "multiprocessing", "enable_wandb": False, "retries": 0, "timeout": 10}
            done = subprocess.run([sys.executable, "-c", DOWNLOAD, json.dumps(args)], env=env, cwd=folder,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
    paths = {"folder": folder, "wds": folder / "wds", "parquet": folder / "parquet", "urls": rows}
    for name, kind, ext in (("wds", "tars", "tar"), ("parquet", "parquets", "parquet")):
        if any(made == name for _, made in formats):
            paths[kind] = sorted((folder / name).glob(f"*.{ext}"))
            assert len(paths[kind]) == 3, os.listdir(folder / name)
            paths[f"{kind[:-1]}_list"] = write_list(folder, kind, paths[kind])
    return paths


def write_list(folder: Path, name: str, shards) -> str:
    """`name.filelist` naming `shards`, and `name.filelist.list` naming it; returns the latter's path."""
    (folder / f"{name}.filelist").write_text("".join(f"{p}\n" for p in shards))
    listing = folder / f"{name}.filelist.list"
    listing.write_text(f"{name}.filelist\n")
    return str(listing)


def own_stats(folder: Path) -> dict:
    """img2dataset's totals over its `*_stats.json` files."""
    totals = {"count": 0, "successes": 0, "failed_to_download": 0, "failed_to_resize": 0}
    for path in folder.glob("*_stats.json"):
        stats = json.loads(path.read_text())
        for key in totals:
            totals[key] += stats[key]
    return totals
