"""`python -m ldm.prepare` and `write_filelist.py`, run as a user runs them."""

import io
import json
import os
import tarfile
from collections import Counter

import pytest
from conftest import ROOT
from corpus import bad_lines, image_bytes, write_corpus
from entry import run_python

from ldm.data.filelist import read_file_list
from ldm.data.shard import iter_lines


def run(*args, cwd=None):
    return run_python(args, cwd)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    listing = write_corpus(str(folder), num_records=35, records_per_shard=10, bad_every=5)
    with open(os.path.join(folder, "train.filelist"), "a") as f:
        f.write("gone.gz\n")
    return listing


def test_stats_json_counts_every_reason(corpus):
    out = run("-m", "ldm.data", "stats", "--file_list", corpus, "--json", "--min_image_size", "64")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["shards"] == 6 and stats["missing_shards"] == 1
    assert stats["records"] == 35 + 7 and stats["ok"] == 35
    assert stats["bad"] == {reason: 1 for reason in bad_lines()}


def test_plan_covers_every_record_once(corpus):
    out = run("-m", "ldm.data", "plan", "--file_list", corpus, "--world_size", "2", "--num_workers", "2")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert {(r, w) for r, w, _, _ in rows} == {(str(r), str(w)) for r in range(2) for w in range(2)}
    read = Counter((path, int(n)) for _, _, path, n in rows)
    expected = Counter((s.path, n) for s in read_file_list(corpus) if os.path.exists(s.path)
                       for n, _ in enumerate(iter_lines(s.path), 1))
    assert read == expected


def test_bench_prints_both_rates_and_the_ratio_last(corpus):
    # 50 samples of a corpus of 35 usable records: both paths cycle it
    out = run("-m", "ldm.data", "bench", "--file_list", corpus, "--num_samples", "50", "--rounds", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "naive" in lines[0] and "ldm" in lines[1]
    naive, ours = (float(line.split("images/s")[0].split()[-1]) for line in lines[:2])
    assert lines[-1].startswith("ratio")
    assert float(lines[-1].split()[1].rstrip("x")) == pytest.approx(ours / naive, rel=0.01, abs=0.01)


@pytest.mark.parametrize("argv, message", [
    (["stats", "--file_list", "/no/such/list"], "file list not found"),
    (["plan", "--file_list", "x", "--world_size", "0", "--num_workers", "1"], "--world_size must be at least 1"),
    (["plan", "--file_list", "x", "--world_size", "1", "--num_workers", "-2"], "--num_workers must be at least 0"),
    (["bench", "--file_list", "/no/such/list"], "file list not found"),
    (["convert", "/no/such/dir", "--output_dir", "/tmp/x"], "input not found"),
    (["frobnicate"], "invalid choice"),
    (["plan", "--file_lst", "x"], "--file_lst (did you mean --file_list?)"),  # the subcommand's own flags
    (["stats", "--file", "x"], "unknown flag(s) for this entry point: --file"),  # no silent prefix matching
])
def test_user_errors_exit_non_zero_with_one_readable_line(argv, message):
    out = run("-m", "ldm.data", *argv)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr


def test_convert_folder_tar_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        (folder / f"im{i}.jpg").write_bytes(image_bytes("jpeg", seed=i))
        (folder / f"im{i}.txt").write_text(f"folder caption {i}")
    (folder / "orphan.png").write_bytes(image_bytes("png"))  # no caption: skipped, reported
    with tarfile.open(tmp_path / "wds.tar", "w") as tar:
        for i in range(2):
            for name, data in ((f"k{i}.jpg", image_bytes("jpeg", seed=10 + i)),
                               (f"k{i}.json", json.dumps({"caption": f"tar caption {i}"}).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    pq.write_table(pa.table({"caption": ["parquet caption"], "jpg": [image_bytes("jpeg", seed=20)],
                             "key": ["000001"]}), tmp_path / "part.parquet")

    out = run("-m", "ldm.data", "convert", str(folder), str(tmp_path / "wds.tar"), str(tmp_path / "part.parquet"),
              "--output_dir", str(tmp_path / "shards"), "--records_per_shard", "4")
    assert out.returncode == 0, out.stderr
    assert "orphan" in out.stderr
    listing = tmp_path / "shards" / "train.filelist.list"
    assert str(listing) in out.stdout
    stats = json.loads(run("-m", "ldm.data", "stats", "--file_list", str(listing), "--json").stdout)
    assert stats == {"kinds": {"images": 6}, "shards": 2, "missing_shards": 0, "records": 6, "ok": 6, "bad": {},
                     "shard_errors": {}, "missing": [], "shard_problems": []}
    shards = read_file_list(str(listing))
    captions = sorted(line.split(b"\t")[0].decode() for s in shards for line in iter_lines(s.path))
    assert captions == sorted([f"folder caption {i}" for i in range(3)] + ["tar caption 0", "tar caption 1",
                                                                           "parquet caption"])


def test_convert_of_nothing_usable_or_into_a_used_folder_is_one_line_and_leaves_the_retry_free(tmp_path):
    from ldm.prepare.tools import main

    tarfile.open(tmp_path / "empty.tar", "w").close()
    (tmp_path / "bad.gz").write_bytes(b"no tabs here\n" * 3)
    out = run("-m", "ldm.data", "convert", str(tmp_path / "empty.tar"), str(tmp_path / "bad.gz"), "--output_dir",
              str(tmp_path / "shards"))
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.splitlines()[-1].startswith("error: no usable record in the inputs (3 skipped")
    assert not (tmp_path / "shards").exists()  # no file list naming nothing is left behind

    used = tmp_path / "used"
    first = write_corpus(str(used), num_records=6, records_per_shard=3)
    before = sorted(os.listdir(used))
    assert main(["convert", str(tmp_path / "bad.gz"), "--output_dir", str(used)]) == 2
    assert main(["convert", first, "--output_dir", str(used)]) == 2  # the same name: refused, nothing touched
    assert sorted(os.listdir(used)) == before
    assert main(["convert", str(used / "train-00000.gz"), "--output_dir", str(used), "--name", "again"]) == 0
    assert len(read_file_list(str(used / "again.filelist.list"))) == 1


def test_write_filelist_default_and_options(tmp_path):
    out = run(str(ROOT / "write_filelist.py"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = (tmp_path / "data/filelist/laion400m_en.filelist").read_text().splitlines()
    assert len(lines) == 60000 and lines[0] == "/data/laion400m/part-00000.gz" and lines[-1].endswith("part-59999.gz")

    (tmp_path / "shards").mkdir()
    for name in ("b.gz", "a.gz"):
        (tmp_path / "shards" / name).write_bytes(b"")
    out = run(str(ROOT / "write_filelist.py"), "--existing", str(tmp_path / "shards/*.gz"), "--output", "x.list",
              cwd=tmp_path)
    assert out.returncode == 0 and (tmp_path / "x.list").read_text().split() == [
        str(tmp_path / "shards/a.gz"), str(tmp_path / "shards/b.gz")]
    out = run(str(ROOT / "write_filelist.py"), "--pattern", "s3://bucket/{:03d}.gz", "--count", "2", "--output", "y",
              cwd=tmp_path)
    assert (tmp_path / "y").read_text().split() == ["s3://bucket/000.gz", "s3://bucket/001.gz"]


def test_write_filelist_does_not_list_its_own_output_when_run_again(tmp_path):
    for name in ("a.gz", "b.gz"):
        (tmp_path / name).write_bytes(b"")
    for _ in range(2):
        out = run_python(["write_filelist.py", "--existing", f"{tmp_path}/*", "--output", tmp_path / "all.filelist"])
        assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "all.filelist").read_text().splitlines() == [str(tmp_path / "a.gz"), str(tmp_path / "b.gz")]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
