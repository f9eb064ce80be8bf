"""img2dataset's own output (tests/img2dataset_corpus.py: the real tool, a real HTTP server, failing URLs) read
directly: WebDataset tars and img2dataset parquets in `stats`, `plan`, the stream (workers, ranks, resume), over
HTTP, with metadata filters; `convert` keeping the metadata; shards of the wrong kind named."""

import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import ROOT
from corpus import write_corpus
from img2dataset_corpus import IMAGE_SIZE, own_stats, write_list
from servers import serve
from test_data_stream import consume

from ldm.config.args import ArgumentError, DataArguments
from ldm.data.dataset import CaptionImageStream, StreamState, build_dataloader
from ldm.data.filelist import read_file_list
from ldm.data.filters import MetadataFilters
from ldm.data.readers import Sample, count_records, iter_records
from ldm.data.record import ImageTransform
from ldm.data.shard import iter_lines
from ldm.data.stream import SlotStream
from ldm.prepare.tools import slot_plan
from ldm.runtime.compat import stop_loader


def run(*args, cwd=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd or ROOT, timeout=600)


def stats(listing, *extra):
    out = run("-m", "ldm.data", "stats", "--file_list", str(listing), "--json", "--resolution", "32", *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def tar_samples(paths) -> list[dict]:
    """Each tar sample's members, read with tarfile (not with the code under test)."""
    samples = []
    for path in paths:
        groups: dict[str, dict] = {}
        with tarfile.open(path) as tar:
            for member in tar:
                key, ext = member.name.split(".", 1)
                groups.setdefault(key, {})[ext] = tar.extractfile(member).read()
        samples.extend({"key": k, "caption": g["txt"].decode(), "meta": json.loads(g["json"]), "jpg": g["jpg"]}
                       for k, g in groups.items())
    return samples


def expected_counts(metas: list[dict], filters: list[tuple[str, object]]) -> Counter:
    """What `stats` must count for `filters` [(reason, predicate or None for a missing key)], first failing first."""
    counts: Counter = Counter()
    for meta in metas:
        for reason, passes in filters:
            if not passes(meta):
                counts[reason] += 1
                break
        else:
            counts["ok"] += 1
    return counts


def test_stats_of_both_formats_match_img2dataset_own_stats(img2dataset_corpus):
    c = img2dataset_corpus
    for name, listing in (("wds", c["tar_list"]), ("parquet", c["parquet_list"])):
        own = own_stats(c[name])
        assert own["count"] == 63 and own["successes"] == 60
        got = stats(listing)
        assert got["ok"] == own["successes"] and got["kinds"] == {"images": 60}
        assert got["shard_errors"] == {} and got["missing_shards"] == 0
        if name == "wds":  # a tar holds the successes only
            assert got["records"] == own["successes"] and got["bad"] == {}
        else:  # a parquet holds every URL, the failures with their status and no image
            assert got["records"] == own["count"]
            assert got["bad"] == {"status_not_success": own["failed_to_download"] + own["failed_to_resize"]}


FILTERS = ["punsafe < 0.5", "AESTHETIC_SCORE >= 5", "min_side >= 250", "aspect_ratio <= 2"]


def test_filters_count_each_rejection_by_its_expression_in_both_formats(img2dataset_corpus):
    c = img2dataset_corpus
    metas = [s["meta"] for s in tar_samples(c["tars"])]
    assert all(m["width"] == IMAGE_SIZE and m["original_width"] > IMAGE_SIZE for m in metas)  # resized by img2dataset

    def side(m):
        return min(m["original_width"], m["original_height"])

    def ratio(m):
        return max(m["original_width"], m["original_height"]) / side(m)

    expected = expected_counts(metas, [("filter_punsafe_lt_0.5", lambda m: m["punsafe"] < 0.5),
                                       ("filter_AESTHETIC_SCORE_ge_5", lambda m: m["AESTHETIC_SCORE"] >= 5),
                                       ("filter_min_side_ge_250", lambda m: side(m) >= 250),
                                       ("filter_aspect_ratio_le_2", lambda m: ratio(m) <= 2)])
    assert all(expected[r] for r in ("ok", "filter_punsafe_lt_0.5", "filter_min_side_ge_250"))  # each one bites
    for listing, failures in ((c["tar_list"], 0), (c["parquet_list"], 3)):
        got = stats(listing, "--metadata_filter", *FILTERS)
        assert got["ok"] == expected["ok"]
        bad = {k: v for k, v in expected.items() if k != "ok"}
        if failures:
            bad["status_not_success"] = failures
        assert got["bad"] == bad
    # a key that no record has is counted under its own reason, never passed or dropped silently
    got = stats(c["tar_list"], "--metadata_filter", "punsafe < 0.5", "LICENSE == 1")
    assert got["ok"] == 0 and got["bad"] == {"filter_punsafe_lt_0.5": 30, "missing_key_LICENSE": 30}


def test_a_malformed_filter_is_one_line_before_anything_runs(img2dataset_corpus, tmp_path):
    for bad in ("punsafe <", "punsafe ~ 0.5", "0.5 > punsafe", "punsafe < high"):
        out = run("-m", "ldm.data", "convert", str(img2dataset_corpus["wds"]), "--output_dir", str(tmp_path / "o"),
                  "--metadata_filter", bad)
        assert out.returncode == 2 and "KEY OP NUMBER" in out.stderr.strip().splitlines()[-1], out.stderr
        assert not (tmp_path / "o").exists()
        with pytest.raises(ArgumentError, match="KEY OP NUMBER"):
            DataArguments(metadata_filter=["punsafe < 0.5", bad])
    assert DataArguments(metadata_filter=["punsafe<0.5", "min_side >= 256"]).metadata_filter


def test_records_carry_caption_image_and_metadata(img2dataset_corpus):
    c = img2dataset_corpus
    expected = {s["key"]: s for s in tar_samples(c["tars"])}
    got = [record for path in c["tars"] for _, record in iter_records(str(path))]
    assert [s.key for s in got] == list(expected)  # every sample, in file order
    for sample in got:
        want = expected[sample.key]
        assert (sample.caption, sample.image, sample.meta, sample.status) == (
            want["caption"], want["jpg"], want["meta"], "success")
    rows = [r for p in c["parquets"] for r in pq.read_table(p).to_pylist()]
    got = [record for path in c["parquets"] for _, record in iter_records(str(path))]
    assert len(got) == len(rows) == 63
    for sample, row in zip(got, rows, strict=True):
        assert (sample.key, sample.caption, sample.status, sample.image) == (row["key"], row["caption"], row["status"],
                                                                             row["jpg"])
        assert sample.meta["punsafe"] == row["punsafe"] and "jpg" not in sample.meta
        if row["status"] == "success":
            assert sample.image == expected[row["key"]]["jpg"]  # the same download in both formats
    assert [count_records(str(p)) for p in c["tars"]] == [24, 24, 12]
    assert [count_records(str(p)) for p in c["parquets"]] == [25, 25, 13]


def test_plan_reads_every_record_exactly_once_over_two_ranks_of_two_workers(img2dataset_corpus, tmp_path):
    c = img2dataset_corpus
    text = write_corpus(str(tmp_path / "text"), 10, 10)  # mixed with a text shard, weights included
    tars, parquets = c["tar_list"].removesuffix(".list"), c["parquet_list"].removesuffix(".list")
    (tmp_path / "mixed.list").write_text(f"{tars} 1\n{parquets} 2\n{text.removesuffix('.list')}\n")
    plan = list(slot_plan(str(tmp_path / "mixed.list"), 2, 2, seed=3, pass_index=0, shuffle_buffer=1))
    slots = Counter((rank, worker) for rank, worker, _, _ in plan)
    assert len(slots) == 4 and min(slots.values()) > 0
    read = Counter((shard, line) for _, _, shard, line in plan)
    expected = Counter()
    for listing, copies in ((c["tar_list"], 1), (c["parquet_list"], 2), (text, 1)):
        for shard in read_file_list(listing):
            for n in range(1, count_records(shard.path) + 1):
                expected[(shard.path, n)] += copies
    assert read == expected
    # fewer shards than slots: the tars alone over 8 slots
    plan = list(slot_plan(c["tar_list"], 2, 4, seed=0, pass_index=0, shuffle_buffer=1))
    assert len({(r, w) for r, w, _, _ in plan}) == 8
    assert sorted((s, n) for _, _, s, n in plan) == sorted(
        (str(p), n) for p, size in zip(c["tars"], (24, 24, 12), strict=True) for n in range(1, size + 1))
    out = run("-m", "ldm.data", "plan", "--file_list", c["tar_list"], "--world_size", "2", "--num_workers", "2")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 60


def _stream(listing, workers=0, **kw):
    return CaptionImageStream(read_file_list(listing), tokenize=lambda caption: np.frombuffer(
        caption.encode().ljust(24), np.uint8).copy(), transform=ImageTransform(32, center_crop=True),
        batch_size=1, caption_dropout_prob=0.0, num_workers=workers, shuffle_buffer=8, **kw)


def test_the_loader_with_two_workers_reads_each_success_once_per_pass(img2dataset_corpus, tmp_path):
    c = img2dataset_corpus
    tars, parquets = c["tar_list"].removesuffix(".list"), c["parquet_list"].removesuffix(".list")
    (tmp_path / "both.list").write_text(f"{tars}\n{parquets}\n")
    stream = _stream(str(tmp_path / "both.list"), workers=2)
    first_pass, later = Counter(), set()
    iterator = iter(build_dataloader(stream, 2))
    try:
        for batch in iterator:
            assert "stream_state" in batch, batch.get("data_error")
            state = json.loads(batch["stream_state"])
            pixels = np.asarray(batch["pixel_values"])
            assert pixels.shape == (1, 3, 32, 32) and pixels.dtype == np.uint8
            caption = np.asarray(batch["input_ids"])[0].tobytes().decode().strip()
            if state["pass"] == 0:
                first_pass[caption] += 1
            else:
                later.add(state["slot"])
            if later == {0, 1}:
                break
    finally:
        stop_loader(iterator)
    expected = Counter({f"a photo number {i}": 2 for i in range(63) if i not in (20, 41, 62)})
    assert first_pass == expected  # each success once from the tars and once from the parquets


def test_a_resume_inside_a_tar_continues_as_the_uninterrupted_stream(img2dataset_corpus):
    c = img2dataset_corpus
    shards = read_file_list(c["tar_list"])
    dataset = _stream(c["tar_list"])

    def make(record):
        sample, ids, _ = dataset.make_sample(record)
        return record.shard, record.line_number, record.pass_index, sample.tobytes(), ids.tobytes()

    def take(stream, n):
        out = []
        for sample in stream.samples(make):
            out.append(sample)
            if len(out) == n:
                return out

    straight = take(SlotStream(shards, 1, 2, seed=7, shuffle_buffer=8), 45)  # over a pass boundary
    first = SlotStream(shards, 1, 2, seed=7, shuffle_buffer=8)
    head = take(first, 17)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["line"] > 0  # stopped inside a tar
    resumed = take(SlotStream(shards, 1, 2, seed=7, shuffle_buffer=8, state=state), 28)
    assert head + resumed == straight


def test_remote_tars_and_parquets_over_http_with_a_broken_transfer(img2dataset_corpus, tmp_path, monkeypatch):
    c = img2dataset_corpus
    with serve(c["folder"]) as (base, server):
        names = [f"wds/{p.name}" for p in c["tars"]] + [f"parquet/{p.name}" for p in c["parquets"]]
        (tmp_path / "remote.filelist").write_text("".join(f"{base}/{n}\n" for n in names))
        (tmp_path / "remote.list").write_text("remote.filelist\n")
        server.cuts["/wds/00001.tar"] = 1  # a GET from past byte 0 sends half and drops the connection
        parquet = f"/parquet/{c['parquets'][0].name}"
        server.cuts[parquet] = 2  # its footer, then a row group: ranged reads, each cut once
        from ldm.data import remote, shard

        monkeypatch.setattr(remote, "BLOCK_SIZE", 16 << 10)  # several ranged reads per tar: one of them is cut
        monkeypatch.setattr(shard, "CHUNK", 16 << 10)
        records = [(s.path, n, r.key) for s in read_file_list(str(tmp_path / "remote.list"))
                   for n, r in iter_records(s.path)]
        assert server.cuts["/wds/00001.tar"] == 0 and server.cuts[parquet] == 0  # the cuts happened, reads went on
        got = stats(tmp_path / "remote.list")
    assert len(records) == 60 + 63
    assert got["ok"] == 120 and got["records"] == 123 and got["bad"] == {"status_not_success": 3}


def test_truncated_tars_and_wrong_kinds_are_named_and_counted(img2dataset_corpus, tmp_path):
    c = img2dataset_corpus
    data = c["tars"][0].read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2])
    with tarfile.open(c["tars"][0]) as tar:
        offsets = [m.offset for m in tar]
    (tmp_path / "cut-at-member.tar").write_bytes(data[: offsets[9]])  # a clean cut between members
    with zipfile.ZipFile(tmp_path / "shard.zip", "w") as z:
        z.writestr("a.txt", "a\tb\tc\n")
    (tmp_path / "page.gz").write_text("<!DOCTYPE html><html><body>403 Forbidden</body></html>\n" * 50)
    shutil.copy(c["wds"] / "00000_stats.json", tmp_path / "stats.gz")
    shutil.copy(c["wds"] / "00000.parquet", tmp_path / "urls.parquet")  # img2dataset's metadata parquet, no images
    names = ["cut.tar", "cut-at-member.tar", "shard.zip", "page.gz", "stats.gz", "urls.parquet"]
    got = stats(write_list(tmp_path, "bad", [tmp_path / n for n in names]))
    assert got["shard_errors"] == {"truncated_shard": 2, "unknown_format": 4}
    assert got["bad"] == {}  # never thousands of missing_columns
    assert 0 < got["ok"] < 24 and got["ok"] == got["records"]  # the samples before each break are kept
    problems = "\n".join(got["shard_problems"])
    for what in ("shard.zip is a zip archive", "page.gz is an HTML/XML page", "stats.gz is a JSON file",
                 "urls.parquet is a parquet without an image column", "cut.tar: unexpected end of data",
                 "cut-at-member.tar ends without its end marker"):
        assert what in problems, problems


def test_convert_keeps_metadata_and_refuses_what_it_cannot_read(img2dataset_corpus, tmp_path):
    c = img2dataset_corpus
    for name, skipped in (("wds", ""), ("parquet", "3 skipped: status_not_success 3")):
        out = run("-m", "ldm.data", "convert", str(c[name]), "--output_dir", str(tmp_path / name))
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.startswith("wrote 60 records") and skipped in out.stdout, out.stdout
        lines = [line for s in read_file_list(str(tmp_path / name / "train.filelist.list")) for line in
                 iter_lines(s.path)]
        assert len(lines) == 60
        meta = json.loads(lines[0].split(b"\t")[3])
        assert {"punsafe", "AESTHETIC_SCORE", "original_width", "original_height"} <= meta.keys()
        # the metadata survived: the filters count on the text shards what they count on the tars
        assert stats(tmp_path / name / "train.filelist.list", "--metadata_filter", *FILTERS)["ok"] == stats(
            c["tar_list"], "--metadata_filter", *FILTERS)["ok"]
    out = run("-m", "ldm.data", "convert", *map(str, c["tars"]), "--output_dir", str(tmp_path / "f"),
              "--metadata_filter", "punsafe < 0.5")
    assert out.returncode == 0 and out.stdout.startswith("wrote 30 records (30 skipped: filter_punsafe_lt_0.5 30)")
    # what nothing here reads is an error, and nothing is written
    (tmp_path / "junk").mkdir()
    shutil.copy(c["wds"] / "00000_stats.json", tmp_path / "junk")
    (tmp_path / "page.tar").write_text("<html>Not Found</html>")
    for bad, message in ((tmp_path / "junk", "without shards or captioned images"),
                         (tmp_path / "page.tar", "is an HTML/XML page"),
                         (c["wds"] / "00000.parquet", "without an image column")):
        out = run("-m", "ldm.data", "convert", str(bad), "--output_dir", str(tmp_path / "none"))
        assert out.returncode != 0 and message in out.stderr, out.stderr
        assert not (tmp_path / "none").exists()


def test_bench_tar_and_parquet_against_the_same_images_as_text_shards(img2dataset_corpus, tmp_path):
    c = img2dataset_corpus
    out = run("-m", "ldm.data", "convert", str(c["wds"]), "--output_dir", str(tmp_path / "text"))
    assert out.returncode == 0
    for listing in (c["tar_list"], c["parquet_list"]):
        out = run("-m", "ldm.data", "bench", "--file_list", listing, "--against",
                  str(tmp_path / "text" / "train.filelist.list"), "--num_samples", "40", "--rounds", "1",
                  "--resolution", "32", "--metadata_filter", "punsafe < 2")
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines()[-1].startswith("ratio") and float(out.stdout.split()[-1].rstrip("x")) > 0


def test_metadata_filters_read_text_latent_and_sample_metadata():
    filters = MetadataFilters(["punsafe < 0.5", "min_side >= 100"])
    sample = Sample("k", "c", b"img", "success", {"punsafe": 0.2, "original_width": 300, "original_height": 120})
    filters.check(sample.meta, sample.image)
    from ldm.data.record import SkipRecord

    with pytest.raises(SkipRecord) as e:
        filters.check({"punsafe": 0.7}, None)
    assert e.value.reason == "filter_punsafe_lt_0.5"
    with pytest.raises(SkipRecord) as e:
        filters.check({"punsafe": None}, None)
    assert e.value.reason == "missing_key_punsafe"
    image = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (90, 200)).save(image, "JPEG")
    with pytest.raises(SkipRecord) as e:  # no original size: the image's own header
        filters.check({"punsafe": 0.1}, image.getvalue())
    assert e.value.reason == "filter_min_side_ge_100"


def test_filter_numbers_are_shown_and_counted_as_written():
    from ldm.data.record import SkipRecord

    filters = MetadataFilters(["punsafe >= 0.1000001", "original_width > 30000001", "original_width > 3e+07"])
    assert [f.reason for f in filters.filters] == ["filter_punsafe_ge_0.1000001", "filter_original_width_gt_30000001",
                                                   "filter_original_width_gt_3e07"]
    with pytest.raises(SkipRecord) as e:
        filters.check({"punsafe": 0.1, "original_width": 4e7}, None)
    assert e.value.reason == "filter_punsafe_ge_0.1000001"
    assert "punsafe = 0.1, not punsafe >= 0.1000001" in e.value.detail
    with pytest.raises(SkipRecord) as e:
        filters.check({"punsafe": 0.2, "original_width": 30000001}, None)
    assert "original_width = 30000001, not original_width > 30000001" in e.value.detail
    assert len({f.reason for f in MetadataFilters(["a < 0.10000001", "a < 0.10000002"]).filters}) == 2
    for bound in ("inf", "1e999", "-1e999"):
        with pytest.raises(ValueError, match="finite" if bound != "inf" else "expected"):
            MetadataFilters([f"punsafe < {bound}"])


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_tars_of_every_header_format_group_by_key_as_webdataset_does(fmt, mode):
    """Long names (GNU L records, pax path records, ustar prefixes), directories, gzip: as tarfile wrote them."""
    from ldm.data.readers import tar_records

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode, format=fmt) as tar:
        folder = tarfile.TarInfo("dir")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for i in range(5):
            base = ("d" * (60 if fmt == tarfile.USTAR_FORMAT else 130)) + f"/sub.v1/k{i}" if i % 2 else f"k{i}"
            for ext, data in (("jpg", b"J" * (i * 300 + 1)), ("txt", f"cap {i}".encode()), ("json", b'{"a": %d}' % i)):
                info = tarfile.TarInfo(f"{base}.{ext}")
                info.size = len(data)
                if fmt == tarfile.PAX_FORMAT:
                    info.pax_headers = {"comment": "x"}
                tar.addfile(info, io.BytesIO(data))
    got = [(n, s.key, s.caption, len(s.image), s.meta) for n, s in tar_records(io.BytesIO(buf.getvalue()), "t",
                                                                                  lambda n: True)]
    assert [(n, c, size, meta) for n, _, c, size, meta in got] == [
        (i + 1, f"cap {i}", i * 300 + 1, {"a": i}) for i in range(5)]
    assert got[1][1].endswith("/sub.v1/k1") and got[2][1] == "k2"
    assert [n for n, _ in tar_records(io.BytesIO(buf.getvalue()), "t", lambda n: n % 2 == 0)] == [2, 4]


def test_a_two_worker_loader_resumed_inside_tars_and_parquets_sees_the_uninterrupted_batches(img2dataset_corpus,
                                                                                           tmp_path):
    c = img2dataset_corpus
    tars, parquets = c["tar_list"].removesuffix(".list"), c["parquet_list"].removesuffix(".list")
    (tmp_path / "both.list").write_text(f"{tars}\n{parquets}\n")
    listing = str(tmp_path / "both.list")

    def make(state=None):
        stream = CaptionImageStream(read_file_list(listing), tokenize=lambda caption: np.frombuffer(
            caption.encode().ljust(24), np.uint8).copy(), transform=ImageTransform(32), batch_size=4,
            caption_dropout_prob=0.2, num_workers=2, shuffle_buffer=16, state=state,
            metadata_filter=MetadataFilters(["punsafe < 0.8"]))
        return build_dataloader(stream, 2)

    total, cut = 30, 11  # 120 samples: past the first pass (96 records pass the filter)
    tracker = StreamState(2)
    expected = consume(make(), tracker, total)
    first = StreamState(2)
    got = consume(make(), first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    assert any(s["line"] > 0 for s in state["slots"].values())  # inside a shard
    second = StreamState(2)
    second.load_state_dict(state)
    got += consume(make(state), second, total - cut)
    for (p1, i1), (p2, i2) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(p1, p2)
    counts = tracker.counts()
    assert counts == second.counts() and counts["filter_punsafe_lt_0.8"] > 0 and counts["status_not_success"] > 0


@pytest.mark.parametrize("compressed", [False, True])
def test_an_empty_tar_holds_no_record(tmp_path, compressed):
    import tarfile

    from ldm.data.readers import count_records, iter_records, shard_kind

    path = tmp_path / ("empty.tar.gz" if compressed else "empty.tar")
    tarfile.open(path, "w:gz" if compressed else "w").close()
    assert shard_kind(str(path)) == "tar"
    assert count_records(str(path)) == 0 and list(iter_records(str(path))) == []
    from ldm.data.filelist import Shard
    from ldm.data.stream import NoUsableData, SlotStream

    with pytest.raises(NoUsableData, match="hold no record at all"):  # a slot whose share is empty shards only
        next(SlotStream([Shard(str(path))]).samples(lambda record: record))


def small_tar(path, keys, image=b"\xff\xd8\xff fake jpeg", fmt=tarfile.DEFAULT_FORMAT):
    """A webdataset tar with a jpg, txt and json member per key, written by tarfile."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for i, key in enumerate(keys):
            for ext, data in (("jpg", image), ("txt", f"caption {i}".encode()), ("json", b'{"i": %d}' % i)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def read_until_break(path):
    from ldm.data.readers import iter_records
    from ldm.data.shard import ShardTruncated

    got = []
    try:
        for _, sample in iter_records(str(path)):
            got.append(sample.caption)
    except ShardTruncated as e:
        return got, str(e)
    return got, None


@pytest.mark.parametrize("where, kept", [("after_last_member", 5), ("inside_first_header_of_5", 4),
                                         ("inside_data_of_5", 4), ("inside_last_member_of_5", 4),
                                         ("inside_padding_of_last_member", 5), ("inside_pax_record_of_5", 4)])
def test_a_tar_that_breaks_keeps_every_sample_read_whole(tmp_path, where, kept):
    whole = tmp_path / "whole.tar"
    pax = where == "inside_pax_record_of_5"  # long names: a pax record before each member, tarfile's default
    small_tar(whole, [("x" * 120 if pax else "") + f"k{i}" for i in range(5)],
              fmt=tarfile.PAX_FORMAT if pax else tarfile.DEFAULT_FORMAT)
    with tarfile.open(whole) as tar:
        members = tar.getmembers()
    assert len(members) == 15
    last = members[-1]
    cut = {"after_last_member": last.offset_data + -(-last.size // 512) * 512,
           "inside_first_header_of_5": members[12].offset + 100,
           "inside_data_of_5": members[12].offset_data + 5,
           "inside_last_member_of_5": last.offset_data + 3,
           "inside_padding_of_last_member": last.offset_data + last.size + 10,
           "inside_pax_record_of_5": members[12].offset + 512 + 20}[where]
    broken = tmp_path / "broken.tar"
    broken.write_bytes(whole.read_bytes()[:cut])
    got, error = read_until_break(broken)
    assert got == [f"caption {i}" for i in range(kept)]
    assert error is not None and f"after sample {kept}" in error  # the break itself is counted (truncated_shard)


def test_two_adjacent_samples_under_one_key_are_two_records(tmp_path):
    path = tmp_path / "dup.tar"
    small_tar(path, ["a", "k0", "k0", "b"])
    from ldm.data.readers import count_records

    got, error = read_until_break(path)
    assert error is None and got == ["caption 0", "caption 1", "caption 2", "caption 3"]
    assert count_records(str(path)) == 4


@pytest.mark.slow
def test_buckets_keep_more_of_img2dataset_keep_ratio_output_than_a_square_crop(tmp_path):
    """img2dataset run as the README recommends (--resize_mode keep_ratio): `ldm.prepare stats --aspect_buckets auto`
    reads its tars, sends each photograph to the bucket of its original aspect ratio and reports the area kept."""
    from img2dataset_corpus import FAILING, NUM_URLS, build, original_size

    from ldm.models.buckets import area_kept, auto_buckets, bucket_name, nearest_bucket

    corpus = build(tmp_path, resize_mode="keep_ratio", formats=(("webdataset", "wds"),))
    out = subprocess.run([sys.executable, "-m", "ldm.data", "stats", "--file_list", corpus["tar_list"], "--json",
                          "--resolution", str(IMAGE_SIZE), "--aspect_buckets", "auto", "--model_name_or_path",
                          "ldm-tiny"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    stats = json.loads(out.stdout)
    buckets = auto_buckets(IMAGE_SIZE, 8)
    sizes = [original_size(i) for i in range(NUM_URLS) if i not in FAILING]
    assert stats["ok"] == len(sizes)
    want = Counter(bucket_name(nearest_bucket(buckets, w, h)) for w, h in sizes)
    got = Counter(stats["buckets"])
    assert sum((want - got).values()) <= 2, (want, got)  # keep_ratio rounds sides: a ratio at a boundary may flip
    kept = stats["area_kept"]
    assert kept["buckets"] == pytest.approx(np.mean([area_kept(w, h, nearest_bucket(buckets, w, h))
                                                     for w, h in sizes]), abs=0.01)
    assert kept["center_crop"] == pytest.approx(np.mean([min(w, h) / max(w, h) for w, h in sizes]), abs=0.01)
    print(f"img2dataset keep_ratio, {len(sizes)} photographs: area kept {kept['buckets']:.1%} in buckets, "
          f"{kept['center_crop']:.1%} by a square crop")
    assert kept["buckets"] > kept["center_crop"] + 0.15
