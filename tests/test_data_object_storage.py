"""Shards on S3 and GCS, read as users read them: a real S3 API server (moto's server mode) on 127.0.0.1, reached
with only the standard AWS variables set (AWS_ENDPOINT_URL, the keys, the region), through a proxy that answers
503 SlowDown and breaks transfers in the middle of a file on demand: gzipped text, img2dataset's tars and its
parquets. Then gs:// against a Google Cloud Storage API server (gcp-storage-emulator), reached with the standard
STORAGE_EMULATOR_HOST."""

import json
import os

import pytest
from corpus import write_corpus
from entry import run_entry, run_python
from servers import serve_gcs, serve_s3, upload_folder

from ldm.data import remote, shard
from ldm.data.shard import iter_lines

BUCKET = "laion"


@pytest.fixture(scope="module")
def s3(tmp_path_factory, img2dataset_corpus):
    """(AWS variables, proxy, local corpus folder, img2dataset corpus) with both corpora uploaded."""
    import s3fs

    folder = tmp_path_factory.mktemp("s3_corpus")
    write_corpus(str(folder), num_records=30, records_per_shard=8, kinds=("jpeg", "png"))
    with serve_s3() as (env, client, proxy):
        client.create_bucket(Bucket=BUCKET)
        upload_folder(client, folder, BUCKET, "shards")
        for kind in ("wds", "parquet"):
            upload_folder(client, img2dataset_corpus[kind], BUCKET, kind)
        s3fs.S3FileSystem.clear_instance_cache()  # a filesystem made for another endpoint is not reused
        yield env, proxy, folder, img2dataset_corpus
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def aws(s3, monkeypatch):
    env, proxy, folder, img = s3
    for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    proxy.failures.clear()
    proxy.cuts.clear()
    proxy.requests.clear()
    return proxy, folder, img


def gz_names(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".gz"))


def test_s3_shards_read_the_same_lines_through_slow_downs_and_transfers_broken_mid_file(aws, monkeypatch):
    proxy, folder, _ = aws
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.01)
    monkeypatch.setattr(remote, "BLOCK_SIZE", 4096)  # several ranged requests per shard
    monkeypatch.setattr(shard, "CHUNK", 4096)
    names = gz_names(folder)
    proxy.failures[f"/{BUCKET}/shards/{names[0]}"] = 3  # SlowDown, SlowDown, SlowDown, then the answer
    proxy.cuts[f"/{BUCKET}/shards/{names[1]}"] = 2  # two transfers break in the middle of the file
    for name in names:
        assert list(iter_lines(f"s3://{BUCKET}/shards/{name}")) == list(iter_lines(str(folder / name))), name
    assert proxy.failures[f"/{BUCKET}/shards/{names[0]}"] == 0 and proxy.cuts[f"/{BUCKET}/shards/{names[1]}"] == 0
    assert proxy.requests[f"/{BUCKET}/shards/{names[1]}"] > 4  # read in ranges, not downloaded whole
    with pytest.raises(shard.ShardMissing, match="shard not found"):  # NoSuchKey is not retried
        list(iter_lines(f"s3://{BUCKET}/shards/no-such-shard.gz"))


def test_write_filelist_lists_s3_shards_and_the_data_tools_read_every_record(aws, tmp_path):
    proxy, folder, _ = aws
    listing = tmp_path / "s3.filelist"
    out = run_python(["write_filelist.py", "--existing", f"s3://{BUCKET}/shards/*.gz", "--output", listing])
    assert out.returncode == 0, out.stderr[-3000:]
    assert listing.read_text().splitlines() == [f"s3://{BUCKET}/shards/{name}" for name in gz_names(folder)]
    (tmp_path / "train.filelist.list").write_text(f"{listing}\n")
    proxy.failures[f"/{BUCKET}/shards/{gz_names(folder)[2]}"] = 2
    out = run_python(["-m", "ldm.data", "stats", "--file_list", str(tmp_path / "train.filelist.list"), "--json"])
    assert out.returncode == 0, out.stderr[-3000:]
    stats = json.loads(out.stdout)
    assert stats["shards"] == 4 and stats["missing_shards"] == 0 and stats["ok"] == 30, stats
    assert stats.get("unreadable_shard", 0) == 0


@pytest.mark.parametrize("kind", ["wds", "parquet"])
def test_img2dataset_tars_and_parquets_on_s3_read_as_their_local_copies(aws, tmp_path, kind):
    proxy, _, img = aws
    files = img["tars" if kind == "wds" else "parquets"]
    proxy.cuts[f"/{BUCKET}/{kind}/{files[0].name}"] = 1
    counts = {}
    remote_entries = [f"s3://{BUCKET}/{kind}/{p.name}" for p in files]
    for where, entries in (("local", [str(p) for p in files]), ("s3", remote_entries)):
        (tmp_path / f"{where}.filelist").write_text("".join(f"{e}\n" for e in entries))
        (tmp_path / f"{where}.list").write_text(f"{tmp_path / f'{where}.filelist'}\n")
        out = run_python(["-m", "ldm.data", "stats", "--file_list", str(tmp_path / f"{where}.list"), "--json"])
        assert out.returncode == 0, out.stderr[-3000:]
        counts[where] = json.loads(out.stdout)
    assert counts["s3"]["ok"] == counts["local"]["ok"] > 50
    assert counts["s3"]["shards"] == 3 and counts["s3"].get("unreadable_shard", 0) == 0
    assert sum(n for path, n in proxy.requests.items() if path.startswith(f"/{BUCKET}/{kind}/")) >= 3


@pytest.mark.slow
def test_the_training_loop_reads_s3_shards_with_loader_workers(aws, tmp_path, vocab_dir):
    proxy, folder, _ = aws
    (tmp_path / "s3.filelist").write_text("".join(f"s3://{BUCKET}/shards/{n}\n" for n in gz_names(folder)))
    (tmp_path / "train.filelist.list").write_text(f"{tmp_path / 's3.filelist'}\n")
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [
        "--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list",
        str(tmp_path / "train.filelist.list"), "--tokenizer_name", vocab_dir, "--model_max_length", "16",
        "--resolution", "32", "--train_batch_size", "4", "--num_workers", "2", "--max_train_steps", "3",
        "--logging_steps", "1", "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unreadable_shard" not in result.stderr
    assert sum(proxy.requests.get(f"/{BUCKET}/shards/{n}", 0) for n in gz_names(folder)) >= 2
    assert (tmp_path / "run" / "pipeline" / "model_index.json").exists()


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    import gcsfs

    folder = tmp_path / "corpus"
    folder.mkdir()
    write_corpus(str(folder), num_records=20, records_per_shard=8, kinds=("jpeg",))
    with serve_gcs(BUCKET) as (proxied, direct, proxy):
        gcsfs.GCSFileSystem.clear_instance_cache()
        gcsfs.GCSFileSystem(endpoint_url=direct, token="anon").put(
            [str(folder / n) for n in gz_names(folder)], f"{BUCKET}/shards/")
        gcsfs.GCSFileSystem.clear_instance_cache()
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxied)
        monkeypatch.setenv("FSSPEC_GCS_TOKEN", "anon")  # no credentials to look for (the docs' advice)
        monkeypatch.setattr(remote, "_fork_safe", False)  # the variable is read at the next use
        yield proxy, folder
        gcsfs.GCSFileSystem.clear_instance_cache()


def test_gcs_shards_are_listed_read_exactly_and_counted_by_the_tools(gcs, tmp_path, monkeypatch):
    proxy, folder = gcs
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.01)
    monkeypatch.setattr(remote, "BLOCK_SIZE", 4096)
    monkeypatch.setattr(shard, "CHUNK", 4096)
    names = gz_names(folder)
    for name in names:
        assert list(iter_lines(f"gs://{BUCKET}/shards/{name}")) == list(iter_lines(str(folder / name))), name
    downloads = [path for path, n in proxy.requests.items() if path.endswith(names[0]) and "download" in path]
    assert downloads and proxy.requests[downloads[0]] > 2  # read in ranges
    proxy.cuts[downloads[0]] = 1
    proxy.failures[downloads[0]] = 1
    assert list(iter_lines(f"gs://{BUCKET}/shards/{names[0]}")) == list(iter_lines(str(folder / names[0])))
    assert proxy.cuts[downloads[0]] == 0 and proxy.failures[downloads[0]] == 0

    listing = tmp_path / "gs.filelist"
    out = run_python(["write_filelist.py", "--existing", f"gs://{BUCKET}/shards/*.gz", "--output", listing])
    assert out.returncode == 0, out.stderr[-3000:]
    assert listing.read_text().splitlines() == [f"gs://{BUCKET}/shards/{name}" for name in names]
    (tmp_path / "train.filelist.list").write_text(f"{listing}\n")
    out = run_python(["-m", "ldm.data", "stats", "--file_list", str(tmp_path / "train.filelist.list"), "--json"])
    assert out.returncode == 0, out.stderr[-3000:]
    stats = json.loads(out.stdout)
    assert stats["shards"] == 3 and stats["ok"] == 20, stats


def test_a_misspelled_bucket_ends_the_start_in_one_line_naming_it(aws, tmp_path, vocab_dir):
    proxy, folder, _ = aws
    (tmp_path / "s3.filelist").write_text("".join(f"s3://laoin/shards/part-{i:05d}.gz\n" for i in range(12)))
    (tmp_path / "train.filelist.list").write_text(f"{tmp_path / 's3.filelist'}\n")
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [
        "--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list",
        str(tmp_path / "train.filelist.list"), "--tokenizer_name", vocab_dir, "--model_max_length", "16",
        "--resolution", "32", "--train_batch_size", "4", "--max_train_steps", "3", "--output_dir",
        str(tmp_path / "run")])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "s3://laoin refuses it (NoSuchBucket" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
    assert sum(n for path, n in proxy.requests.items() if path.startswith("/laoin")) <= 4  # looked up once, no retry


@pytest.mark.parametrize("credentials", ["wrong", "none"])
def test_wrong_or_missing_credentials_are_refused_at_once_not_retried(aws, monkeypatch, credentials):
    import moto.settings
    import s3fs

    from ldm.data.filelist import FileListError, check_shards, read_file_list

    proxy, folder, _ = aws
    if credentials == "wrong":  # the server checks keys from now on: "testing" is no key it knows
        monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        says = "403 Forbidden: the credentials are wrong"
    else:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        says = "NoCredentialsError: Unable to locate credentials"
    s3fs.S3FileSystem.clear_instance_cache()
    url = f"s3://{BUCKET}/shards/{gz_names(folder)[0]}"
    with pytest.raises(remote.StoreRefused, match=says):
        remote.open_url(url)
    (folder.parent / f"{credentials}.filelist").write_text(f"{url}\n")
    listing = folder.parent / f"{credentials}.filelist.list"
    listing.write_text(f"{credentials}.filelist\n")
    # no keys refuse the whole store at once; a 403 may be one object's, so it ends the start when every shard
    # looked at is refused (here the one listed)
    refused = rf"refuses it \({says}" if credentials == "none" else rf"the store refuses every one .*{says}"
    with pytest.raises(FileListError, match=refused):
        check_shards(read_file_list(str(listing)), str(listing))
    assert proxy.requests.get(f"/{BUCKET}/shards/{gz_names(folder)[0]}", 0) <= 2  # one look each, no retries
    s3fs.S3FileSystem.clear_instance_cache()
