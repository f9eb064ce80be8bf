"""Shards and filelists behind URLs, read through fsspec: from a real HTTP server started here (with byte
ranges, 503s and connections dropped mid-file), from `file://` and from fsspec's memory filesystem."""

import json
import logging
import os

import fsspec
import pytest
from corpus import write_corpus
from entry import run_entry, run_python
from servers import serve

from ldm.data import remote, shard
from ldm.data.filelist import FileListError, check_shards, read_file_list
from ldm.data.shard import ShardError, ShardMissing, iter_lines
from ldm.data.stream import SlotStream


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(folder, its list of filelists): 30 records in 4 shards, every one its own gzip file."""
    folder = tmp_path_factory.mktemp("remote_corpus")
    return folder, write_corpus(str(folder), num_records=30, records_per_shard=8, kinds=("jpeg", "png"))


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.01)
    monkeypatch.setattr(remote, "BLOCK_SIZE", 4096)  # several ranged requests per shard
    monkeypatch.setattr(shard, "CHUNK", 4096)


def shard_names(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".gz"))


def test_http_shards_read_the_same_lines_as_the_files_through_503s_and_dropped_connections(corpus, fast_retries):
    folder, _ = corpus
    names = shard_names(folder)
    with serve(folder) as (url, server):
        server.failures[f"/{names[0]}"] = 2  # the open fails twice, then works
        server.cuts[f"/{names[1]}"] = 2  # two transfers break in the middle of the file
        for name in names:
            assert list(iter_lines(f"{url}/{name}")) == list(iter_lines(str(folder / name))), name
        assert server.failures[f"/{names[0]}"] == 0 and server.cuts[f"/{names[1]}"] == 0
        assert server.requests[f"/{names[1]}"] > 4  # it was read in ranges, not downloaded whole

        server.failures[f"/{names[2]}"] = 1000  # down for good: an error, after the attempts
        with pytest.raises(ShardError, match=rf"cannot open shard .*{names[2]}.* failed {remote.ATTEMPTS} times"):
            list(iter_lines(f"{url}/{names[2]}"))
        with pytest.raises(ShardMissing, match="shard not found"):  # a 404 is not retried
            list(iter_lines(f"{url}/no-such-shard.gz"))


def test_a_remote_filelist_with_relative_entries_and_unreadable_shards_counted_by_reason(corpus, fast_retries,
                                                                                        caplog):
    folder, _ = corpus
    names = shard_names(folder)
    (folder / "remote.filelist").write_text("\n".join([*names, "gone.gz", "down.gz"]) + "\n")
    (folder / "down.gz").write_bytes((folder / names[0]).read_bytes())
    (folder / "remote.filelist.list").write_text("remote.filelist\n")
    with serve(folder) as (url, server):
        server.failures["/down.gz"] = 1000
        shards = read_file_list(f"{url}/remote.filelist.list")
        assert [s.path for s in shards] == [f"{url}/{name}" for name in [*names, "gone.gz", "down.gz"]]
        with caplog.at_level(logging.WARNING, logger="ldm.data"):
            check_shards(shards, "remote.filelist.list")  # some missing, one not answering: warnings
        assert "1 of the 5 shards looked at (of 6 named by remote.filelist.list) do not exist" in caplog.text
        assert f"cannot look for shard {url}/down.gz" in caplog.text and "503" in caplog.text
        stream = SlotStream(shards, seed=1)
        captions = sorted(record.line.split(b"\t")[0].decode() for record in stream.pass_records())
    assert captions == sorted(f"photo {i}" for i in range(30))  # every record once
    assert stream.counts["unreadable_shard"] == 2  # the missing one and the one that never answered


def test_memory_and_file_urls_and_a_scheme_without_its_package(corpus, tmp_path):
    folder, listing = corpus
    names = shard_names(folder)
    fs = fsspec.filesystem("memory")
    for name in names:
        fs.pipe(f"/corpus/{name}", (folder / name).read_bytes())
    fs.pipe("/corpus/train.filelist", "".join(f"{name}\n" for name in names).encode())
    fs.pipe("/corpus/list", b"train.filelist\n")
    shards = read_file_list("memory://corpus/list")
    assert [s.path for s in shards] == [f"memory://corpus/{name}" for name in names]
    assert list(iter_lines(shards[0].path)) == list(iter_lines(str(folder / names[0])))
    assert list(iter_lines(f"file://{folder / names[1]}")) == list(iter_lines(str(folder / names[1])))

    with serve(tmp_path) as (url, server):  # a store that does not answer at all: warnings, not "none exists"
        server.failures.update({f"/p{i}.gz": 1000 for i in range(3)})
        check_shards(read_file_list_of(tmp_path, [f"{url}/p{i}.gz" for i in range(3)]), "x")
    with pytest.raises(FileListError, match="none of the 3 shard"):
        check_shards(read_file_list_of(tmp_path, ["memory://corpus/a.gz", "memory://corpus/b.gz",
                                                  "memory://corpus/c.gz"]), "x")
    missing = [s for s, package in remote.PACKAGES.items() if s != "http" and not importable(package)]
    if missing:
        with pytest.raises(FileListError, match=f"pip install {remote.PACKAGES[missing[0]]}"):
            check_shards(read_file_list_of(tmp_path, [f"{missing[0]}://bucket/part-0.gz"]), "x")


def read_file_list_of(folder, paths):
    (folder / "f").write_text("".join(f"{p}\n" for p in paths))
    (folder / "l").write_text("f\n")
    return read_file_list(str(folder / "l"))


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_tools_and_write_filelist_take_urls(corpus, tmp_path):
    folder, _ = corpus
    with serve(folder) as (url, _server):
        out = run_python(["-m", "ldm.data", "stats", "--file_list", f"{url}/train.filelist.list", "--json"])
        assert out.returncode == 0, out.stderr[-3000:]
        stats = json.loads(out.stdout)
        assert stats["shards"] == 4 and stats["missing_shards"] == 0 and stats["ok"] == 30

    listing = tmp_path / "found.filelist"
    out = run_python(["write_filelist.py", "--existing", f"file://{folder}/*.gz", "--output", listing])
    assert out.returncode == 0, out.stderr[-3000:]
    assert listing.read_text().splitlines() == [f"file://{folder}/{name}" for name in shard_names(folder)]
    out = run_python(["write_filelist.py", "--existing", "nosuchscheme://bucket/*.gz", "--output", listing])
    assert out.returncode == 1 and out.stderr.startswith("error: cannot list nosuchscheme://bucket/*.gz")


def test_the_training_loop_reads_http_shards_with_loader_workers(corpus, tmp_path, vocab_dir):
    folder, _ = corpus
    with serve(folder) as (url, server):
        result = run_entry("train_txt2img_laion400m_no_trainer.py", [
            "--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list",
            f"{url}/train.filelist.list", "--tokenizer_name", vocab_dir, "--model_max_length", "16",
            "--resolution", "32", "--train_batch_size", "4", "--num_workers", "2", "--max_train_steps", "3",
            "--logging_steps", "1", "--output_dir", str(tmp_path / "run")])
        assert result.returncode == 0, result.stderr[-3000:]
        assert sum(server.requests.get(f"/{name}", 0) for name in shard_names(folder)) >= 2
        assert "unreadable_shard" not in result.stderr
    assert (tmp_path / "run" / "pipeline" / "model_index.json").exists()
