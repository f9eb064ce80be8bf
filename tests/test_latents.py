"""Precomputed latents: the encode tool, run as users run it, and training on its output."""

import io
import json
import os
import shutil
import signal

import numpy as np
import paddle
import pytest
from conftest import ROOT, metrics_lines
from corpus import decode, gzip_lines, write_aspect_corpus, write_corpus
from entry import FILE_SIZE_LIMIT, launch_report, run_entry, run_python, start_python, weights

from ldm.data import latents
from ldm.data.filelist import read_file_list
from ldm.data.latents import from_bytes, parse_latent_record, to_bytes
from ldm.data.record import ImageTransform, parse_record, sample_rng
from ldm.data.shard import iter_lines
from ldm.models.autoencoder import autoencoder_identity
from ldm.models.buckets import nearest_bucket
from ldm.prepare.encode import encode_moments, load_autoencoder

RESOLUTION = 32
ENCODE = ["-m", "ldm.data", "encode"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("latent_corpus"))
    return write_corpus(folder, num_records=40, records_per_shard=8, kinds=("jpeg", "png"), bad_every=13)


def save_autoencoder(folder, seed: int) -> str:
    """The ldm-tiny autoencoder with weights of its own (a folder with weights counts as trained)."""
    from ppdiffusers import AutoencoderKL

    from ldm.models.build import read_config, vae_folder

    paddle.seed(seed)
    AutoencoderKL.from_config(read_config(vae_folder("ldm-tiny"))).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    return save_autoencoder(tmp_path_factory.mktemp("vae"), seed=1)


def encode_args(corpus, vae, out, *extra):
    return [*ENCODE, "--file_list", corpus, "--vae_name_or_path", vae, "--output_dir", str(out),
            "--resolution", str(RESOLUTION), "--batch_size", "3", "--num_workers", "2", *extra]


def listed(filelist) -> list[str]:
    with open(filelist) as f:
        return f.read().split()


def records_of(listing: str) -> dict[str, list[bytes]]:
    """Output shard name -> its lines."""
    folder = os.path.dirname(listing)
    names = listed(os.path.join(folder, "latents.filelist"))
    return {name: list(iter_lines(os.path.join(folder, name))) for name in names}


@pytest.fixture(scope="module")
def encoded(corpus, vae, tmp_path_factory):
    out = tmp_path_factory.mktemp("encoded") / "latents"
    result = run_python(encode_args(corpus, vae, out, "--random_flip"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "use --file_list" in result.stdout
    return str(out / "latents.filelist.list"), result.stdout


def test_stored_dtypes_round_trip_as_paddle_casts_them():
    values = np.random.default_rng(0).normal(0, 3, (2, 8, 4, 4)).astype(np.float32)
    values[0, 0, 0, :3] = [1.00390625, 1.01171875, -2.0078125]  # halfway cases of bfloat16's rounding
    assert np.array_equal(from_bytes(to_bytes(values, "float32"), "float32", list(values.shape)), values)
    for dtype in ("float16", "bfloat16"):
        expected = paddle.to_tensor(values).astype(dtype).astype("float32").numpy()
        got = from_bytes(to_bytes(values, dtype), dtype, list(values.shape))
        np.testing.assert_array_equal(got, expected, err_msg=dtype)
        assert len(to_bytes(values, dtype)) == values.size * 2


def test_a_step_on_precomputed_moments_equals_the_step_on_their_images(vae, vocab_dir):
    """The same seed gives the same loss whether the autoencoder runs in the step or ran before it."""
    from ldm.config.args import DataArguments, ModelArguments
    from ldm.train import setup

    data = DataArguments(tokenizer_name=vocab_dir, model_max_length=8, resolution=RESOLUTION)
    tokenizer = setup.build_tokenizer(data)
    model, components = setup.build_model(ModelArguments(model_name_or_path="ldm-tiny", vae_name_or_path=vae),
                                          data, tokenizer, recompute=False, seed=0)
    pixels = np.random.default_rng(0).integers(0, 256, (4, 3, RESOLUTION, RESOLUTION), dtype=np.uint8)
    ids = paddle.randint(1, tokenizer.vocab_size, [4, 8])
    moments = encode_moments(components.vae, pixels, flips=False)[:, 0]
    model.train()
    paddle.seed(7)
    from_images = float(model(paddle.to_tensor(pixels), ids))
    paddle.seed(7)
    from_moments = float(model(None, ids, paddle.to_tensor(moments)))
    assert from_moments == pytest.approx(from_images, rel=1e-5)
    paddle.seed(8)  # another draw of noise and timesteps moves it: the comparison above is not vacuous
    assert float(model(None, ids, paddle.to_tensor(moments))) != pytest.approx(from_images, rel=1e-3)


def test_encode_writes_every_usable_record_once_with_its_mirror_image(corpus, vae, encoded):
    listing, stdout = encoded
    shards = records_of(listing)
    inputs = listed(os.path.join(os.path.dirname(corpus), "train.filelist"))
    assert len(shards) == len(inputs) == 6
    assert "skipped: " in stdout and "empty_image 1, missing_columns 1" in stdout  # bad lines, counted by reason

    seed_keys = {shard.path: shard.seed_key for shard in read_file_list(corpus)}
    meta = None
    for name, lines in shards.items():
        source = os.path.join(os.path.dirname(corpus), inputs[int(name[len("latents-"):-3])])
        usable = []
        for number, line in enumerate(iter_lines(source), 1):
            try:
                usable.append((number, *parse_record(line)))
            except Exception:  # noqa: BLE001 - the bad lines of the corpus
                continue
        assert [parse_latent_record(line)[0] for line in lines] == [caption for _, caption, _ in usable]
        meta = parse_latent_record(lines[0])[1][1]
        assert meta.shape == (2, 8, RESOLUTION // 4, RESOLUTION // 4) and meta.dtype == "float16"
        # the first record's two copies are the autoencoder's moments of its crop and of the mirrored crop
        number, _, image = usable[0]
        crop = ImageTransform(RESOLUTION)(image, sample_rng(0, 0, seed_keys[source], number))
        expected = encode_moments(load_autoencoder(vae, False), crop.transpose(2, 0, 1)[None], flips=True)[0]
        data, _, _ = parse_latent_record(lines[0])[1]
        got = from_bytes(data, "float16", list(meta.shape))
        np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)
        assert not np.allclose(got[0], got[1], atol=1e-2)  # the mirror image is another crop
        # each copy's geometry: the image's size before the resize, the crop's corner in the resized image (the
        # mirror's left edge mirrored in it), the 32 x 32 crop
        _, placed = ImageTransform(RESOLUTION).place(image, sample_rng(0, 0, seed_keys[source], number))
        top, left, width = placed.top, placed.left, placed.resized[1]
        h, w = decode(image).size[::-1]
        assert meta.geometry == ((h, w, top, left, 32, 32), (h, w, top, width - 32 - left, 32, 32))
    assert meta.vae == latents.fingerprint(autoencoder_identity(load_autoencoder(vae, False)))

    stats = run_python(["-m", "ldm.data", "stats", "--file_list", listing, "--json"])
    assert stats.returncode == 0, stats.stderr[-2000:]
    assert '"kinds": {"latents": 40}' in stats.stdout and '"ok": 40' in stats.stdout and '"bad": {}' in stats.stdout


def test_an_interrupted_encode_goes_on_to_the_same_output(corpus, vae, encoded, tmp_path):
    out = tmp_path / "latents"
    args = encode_args(corpus, vae, out, "--random_flip")
    code, log = run_until_encode(args, "1/6", signal.SIGKILL)
    assert code == -signal.SIGKILL, log[-3000:]
    before = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)
              if n.startswith("latents-") and n.endswith(".gz")}
    assert 1 <= len(before) < 6

    refused = run_python(encode_args(corpus, vae, out, "--random_flip", "--dtype", "float32"))
    assert refused.returncode == 2 and "other settings (dtype: 'float16' there, 'float32' now)" in refused.stderr

    resumed = run_python(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{len(before)} done already" in resumed.stderr
    assert {n: os.stat(out / n).st_mtime_ns for n in before} == before  # finished shards are not encoded again
    expected = records_of(encoded[0])
    got = records_of(str(out / "latents.filelist.list"))
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name] == expected[name], name  # line for line: no record lost, none written twice
    assert not [n for n in os.listdir(out) if n.endswith(".partial")]


def test_a_corpus_moved_to_another_folder_encodes_to_the_same_latents(corpus, vae, encoded, tmp_path):
    """Random crops are seeded by the shard as the lists name it, not by where the corpus lies."""
    moved = shutil.copytree(os.path.dirname(corpus), tmp_path / "moved")
    result = run_python(encode_args(os.path.join(moved, os.path.basename(corpus)), vae, tmp_path / "latents",
                                    "--random_flip"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert records_of(str(tmp_path / "latents" / "latents.filelist.list")) == records_of(encoded[0])


def run_until_encode(args, pattern, signum):
    """`python -m ldm.prepare encode ...` signalled once `pattern` is in its output."""
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "log")
        child = start_python(args, None, log, log, new_session=True)
        deadline = time.monotonic() + 120
        while child.exitcode is None and time.monotonic() < deadline:
            if pattern in read_text(log):
                os.killpg(child.pid, signum)
                break
            time.sleep(0.02)
        child.join(60)
        if child.exitcode is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.join()
        return child.exitcode, read_text(log)


def read_text(path) -> str:
    with open(path) as f:
        return f.read()


def test_a_done_log_cut_by_a_crash_loses_no_shard(corpus, vae, encoded, tmp_path):
    out = tmp_path / "latents"
    shutil.copytree(os.path.dirname(encoded[0]), out)
    log = out / ".encode" / "done-rank0.jsonl"
    log.write_bytes(log.read_bytes()[: log.stat().st_size // 2])  # later entries gone, one cut in the middle
    again = run_python(encode_args(corpus, vae, out, "--random_flip"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "6 done already" in again.stderr and "encoded 40 records of 6 of 6 shards" in again.stdout
    assert records_of(str(out / "latents.filelist.list")) == records_of(encoded[0])


def test_records_whose_moments_do_not_fit_the_stored_dtype_are_skipped_and_counted(tmp_path):
    from ldm.prepare.encode import ShardWriters

    meta = latents.LatentMeta("v", "float16", (1, 2, 1, 1), 8)
    (tmp_path / ".encode").mkdir()
    writers = ShardWriters(str(tmp_path), rank=0)
    moments = np.array([[1.0, 2.0], [np.nan, 0.0], [7e4, 0.0], [-3.0, 0.5]], np.float32).reshape(4, 1, 2, 1, 1)
    writers.write(0, [[f"c{i}", f"k{i}", None, [[8, 8, 0, 0, 8, 8]]] for i in range(4)], moments, meta)  # (caption,
    # key, metadata, geometry)
    writers.finish(0, {"counts": {"ok": 4}, "unreadable": "", "missing": ""}, meta)
    lines = list(iter_lines(str(tmp_path / "latents-000000.gz")))
    assert [parse_latent_record(line)[0] for line in lines] == ["c0", "c3"]  # NaN and 7e4 (> float16's max) dropped
    entry = json.loads(read_text(tmp_path / ".encode" / "done-rank0.jsonl").strip().splitlines()[-1])
    assert entry == {"shard": 0, "counts": {"ok": 2, "non_finite_latent": 2}}


def test_an_unreadable_shard_is_retried_and_a_missing_one_left_out(corpus, vae, tmp_path):
    folder = tmp_path / "corpus"
    shutil.copytree(os.path.dirname(corpus), folder)
    listing = str(folder / os.path.basename(corpus))
    shard = folder / "train-00002.gz"
    shard.rename(folder / "away.gz")
    shard.mkdir()  # there, but it cannot be read (as a store that keeps failing)
    out = tmp_path / "latents"
    bf16 = ("--vae_dtype", "bfloat16")  # pinned with the other settings: every retry passes it again
    first = run_python(encode_args(listing, vae, out, *bf16))
    assert first.returncode == 1, first.stderr[-3000:]
    assert "error: 1 shard(s) could not be read" in first.stdout and "train-00002.gz" in first.stdout
    assert "run the same command again" in first.stdout
    assert listed(out / "latents.filelist") == [f"latents-00000{i}.gz" for i in (0, 1, 3, 4, 5)]
    if not paddle.amp.is_bfloat16_supported():  # a CPU: the encoder falls back to float32, and says so
        assert "bf16 mixed precision is not supported on this device" in first.stderr
        assert "encoding with the autoencoder in fp32" in first.stderr

    shard.rmdir()  # gone for good: left out, as training counts and skips a missing shard
    second = run_python(encode_args(listing, vae, out, *bf16))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "warning: 1 shard(s) do not exist" in second.stdout and "5 done already" in second.stderr
    assert len(listed(out / "latents.filelist")) == 5

    (folder / "away.gz").rename(shard)
    third = run_python(encode_args(listing, vae, out, *bf16))
    assert third.returncode == 0 and "warning" not in third.stdout, third.stderr[-3000:]
    assert len(listed(out / "latents.filelist")) == 6


def test_an_encode_that_finds_no_space_ends_with_one_line_and_the_retry_finishes(corpus, vae, encoded, tmp_path):
    out = tmp_path / "latents"
    args = encode_args(corpus, vae, out, "--random_flip")[len(ENCODE):]
    full = run_python(["-c", FILE_SIZE_LIMIT, str(4 << 10), ROOT / "encode_latents.py", *args])
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert full.stderr.strip().splitlines()[-1].startswith(f"error: no space left to write in {out}")
    assert not [n for n in os.listdir(out) if n.endswith(".partial")]
    retry = run_python([*ENCODE, *args])
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert records_of(str(out / "latents.filelist.list")) == records_of(encoded[0])


def test_latent_shards_train_on_the_loop_and_refuse_another_autoencoder(encoded, vae, vocab_dir, tmp_path):
    listing, _ = encoded
    common = ["--pretrained_model_name_or_path", "ldm-tiny", "--file_list", listing, "--tokenizer_name", vocab_dir,
              "--model_max_length", "16", "--resolution", str(RESOLUTION), "--train_batch_size", "4",
              "--max_train_steps", "3", "--logging_steps", "1", "--num_workers", "2"]
    script = "train_txt2img_laion400m_no_trainer.py"
    ok = run_entry(script, common + ["--vae_name_or_path", vae, "--random_flip", "--output_dir", str(tmp_path / "a")])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "training on precomputed latents" in ok.stderr and "data_ok 12" in ok.stderr
    assert os.path.isdir(tmp_path / "a" / "pipeline")

    other = save_autoencoder(tmp_path / "other_vae", seed=2)
    refused = run_entry(script, common + ["--vae_name_or_path", other, "--output_dir", str(tmp_path / "b")])
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "latents-0000" in last and "latents of autoencoder" in last, last
    assert not os.path.exists(tmp_path / "b")

    autoencoder = run_entry("train_autoencoder.py", ["--model_name_or_path", "ldm-tiny", "--file_list",
                                                     listing, "--resolution", str(RESOLUTION), "--output_dir",
                                                     str(tmp_path / "c"), "--max_train_steps", "1"])
    assert autoencoder.returncode == 2, autoencoder.stderr[-3000:]
    assert "needs image shards" in autoencoder.stderr and not os.path.exists(tmp_path / "c")


def test_a_run_on_latents_resumes_to_the_weights_of_an_uninterrupted_one(encoded, vae, vocab_dir, tmp_path):
    common = ["--pretrained_model_name_or_path", "ldm-tiny", "--vae_name_or_path", vae, "--file_list", encoded[0],
              "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", str(RESOLUTION),
              "--train_batch_size", "4", "--num_workers", "2", "--random_flip", "--use_ema", "--seed", "3",
              "--save_steps", "2", "--shuffle_buffer", "8"]
    script = "train_txt2img_laion400m_no_trainer.py"
    straight = run_entry(script, common + ["--max_train_steps", "4", "--output_dir", str(tmp_path / "a")])
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = run_entry(script, common + ["--max_train_steps", "2", "--output_dir", str(tmp_path / "b")])
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_entry(script, common + ["--max_train_steps", "4", "--output_dir", str(tmp_path / "b"),
                                          "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    expected, _ = weights(tmp_path / "a" / "checkpoint-4")
    got, _ = weights(tmp_path / "b" / "checkpoint-4")
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_latent_shards_train_on_the_trainer_path(encoded, vae, vocab_dir, tmp_path):
    result = run_entry("train_txt2img_laion400m_trainer.py", [
        "--do_train", "--model_name_or_path", "ldm-tiny", "--vae_name_or_path", vae, "--file_list", encoded[0],
        "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", str(RESOLUTION),
        "--per_device_train_batch_size", "4", "--max_steps", "2", "--logging_steps", "1", "--save_steps", "2",
        "--output_dir", str(tmp_path / "run"), "--validation_file_list", encoded[0], "--validation_steps", "2",
        "--validation_samples", "6", "--validation_timesteps", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training on precomputed latents" in result.stderr and "data_ok: 8" in result.stderr
    assert os.path.isdir(tmp_path / "run" / "pipeline")
    # the autoencoder does not run: its encode is no part of a sample's FLOPs
    assert "vae_encode 0 G" in result.stderr
    # the held-out loss on latent shards, as `python -m ldm.evaluate loss` computes it for the checkpoint
    logged = metrics_lines(tmp_path / "run")
    logged = [line for line in logged if "eval/loss" in line]
    assert [line["step"] for line in logged] == [2]
    offline = run_python(["-m", "ldm.evaluate", "loss", "--model", str(tmp_path / "run" / "checkpoint-2"),
                          "--file_list", encoded[0], "--validation_samples", "6", "--validation_timesteps", "2",
                          "--json"])
    assert offline.returncode == 0, offline.stderr[-3000:]
    printed = json.loads(offline.stdout.strip().splitlines()[-1])
    assert printed["records"] == 6 and printed["resolution"] == RESOLUTION
    for name in ("loss", "loss_t250", "loss_t750"):
        assert printed[name] == pytest.approx(logged[0][f"eval/{name}"], rel=1e-6), name


def test_a_file_list_mixing_two_autoencoders_stops_the_run_with_one_line(encoded, corpus, vae, vocab_dir, tmp_path):
    other = save_autoencoder(tmp_path / "other_vae", seed=2)
    out = tmp_path / "other"
    assert run_python(encode_args(corpus, other, out)).returncode == 0
    mixed = tmp_path / "mixed.filelist"
    first = os.path.dirname(encoded[0])
    mixed.write_text(f"{first}/latents-000000.gz\n{out}/latents-000001.gz\n")
    listing = tmp_path / "mixed.filelist.list"
    listing.write_text(f"{mixed}\n")
    run = run_entry("train_txt2img_laion400m_no_trainer.py", [
        "--pretrained_model_name_or_path", "ldm-tiny", "--vae_name_or_path", vae, "--file_list", str(listing),
        "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", str(RESOLUTION),
        "--train_batch_size", "4", "--max_train_steps", "20", "--shuffle_buffer", "16", "--output_dir",
        str(tmp_path / "run")])
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}/latents-000001.gz:") and "latents of autoencoder" in last, last


@pytest.mark.distributed
def test_two_ranks_encode_every_record_exactly_once(corpus, vae, encoded, tmp_path):
    out = tmp_path / "latents"
    result = run_entry("encode_latents.py", encode_args(corpus, vae, out, "--random_flip")[len(ENCODE):], launch=True,
                       cwd=tmp_path)
    assert result.returncode == 0, launch_report(result, tmp_path)
    expected = records_of(encoded[0])
    got = records_of(str(out / "latents.filelist.list"))
    assert got == expected  # the same output shards, line for line, as one process wrote
    assert {f for f in os.listdir(out / ".encode") if f.startswith("done-")} == {"done-rank0.jsonl",
                                                                                  "done-rank1.jsonl"}


def test_img2dataset_tars_and_parquets_encode_filtered_keeping_their_metadata(img2dataset_corpus, vae, tmp_path):
    c = img2dataset_corpus
    tars, parquets = c["tar_list"].removesuffix(".list"), c["parquet_list"].removesuffix(".list")
    (tmp_path / "both.list").write_text(f"{tars}\n{parquets}\n")
    out = tmp_path / "latents"
    result = run_python(encode_args(str(tmp_path / "both.list"), vae, out, "--metadata_filter", "punsafe < 0.5"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "filter_punsafe_lt_0.5 60" in result.stdout and "status_not_success 3" in result.stdout, result.stdout
    lines = [line for shard in records_of(str(out / "latents.filelist.list")).values() for line in shard]
    assert len(lines) == 60  # 30 of the 60 downloads, from the tars and from the parquets
    metas = [json.loads(line.split(b"\t")[3])["metadata"] for line in lines]
    assert all(m["punsafe"] < 0.5 and m["original_width"] > 64 for m in metas)
    # the kept metadata filters the latent records in their turn
    stats = run_python(["-m", "ldm.data", "stats", "--file_list", str(out / "latents.filelist.list"), "--json",
                        "--metadata_filter", "AESTHETIC_SCORE >= 5"])
    assert json.loads(stats.stdout)["ok"] == sum(m["AESTHETIC_SCORE"] >= 5 for m in metas) > 0


# -- aspect-ratio buckets ------------------------------------------------------------------------------------
BUCKETS = ((48, 24), (40, 24), (32, 32), (24, 40), (24, 48))  # auto at 32px for ldm-tiny (size step 4 x 2)
BUCKETED = ("--aspect_buckets", "auto", "--model_name_or_path", "ldm-tiny")


@pytest.fixture(scope="module")
def aspect_corpus(tmp_path_factory):
    return write_aspect_corpus(str(tmp_path_factory.mktemp("aspect_corpus")), num_records=30, records_per_shard=8,
                               seed=0)


@pytest.fixture(scope="module")
def bucket_encoded(aspect_corpus, vae, tmp_path_factory):
    out = tmp_path_factory.mktemp("bucket_encoded") / "latents"
    result = run_python(encode_args(aspect_corpus, vae, out, *BUCKETED))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "aspect-ratio buckets 48x24, 40x24, 32x32, 24x40, 24x48" in result.stdout, result.stdout
    return str(out / "latents.filelist.list")


def test_a_bucketed_encode_writes_each_latent_at_its_buckets_shape(aspect_corpus, vae, bucket_encoded):
    from PIL import Image

    folder = os.path.dirname(aspect_corpus)
    inputs = listed(os.path.join(folder, "train.filelist"))
    seed_keys = {shard.path: shard.seed_key for shard in read_file_list(aspect_corpus)}
    shards = records_of(bucket_encoded)
    assert len(shards) == len(inputs) == 4
    autoencoder = load_autoencoder(vae, False)
    encoded, used = [], set()
    for name, lines in shards.items():
        source = os.path.join(folder, inputs[int(name[len("latents-"):-3])])
        images = {caption: (number, image) for number, (caption, image)
                  in enumerate(map(parse_record, iter_lines(source)), 1)}
        seen: dict = {}
        for line in lines:
            caption, (data, meta, _) = parse_latent_record(line)
            number, image = images[caption]
            bucket = nearest_bucket(BUCKETS, *Image.open(io.BytesIO(image)).size)
            assert meta.bucket == bucket, caption
            assert meta.shape == (1, 8, bucket[0] // 4, bucket[1] // 4) and meta.resolution == RESOLUTION
            assert from_bytes(data, meta.dtype, list(meta.shape)).shape == meta.shape
            seen.setdefault(bucket, []).append(number)
            encoded.append(caption)
            if bucket not in used:  # the moments of one crop of each bucket: the autoencoder's of that crop
                used.add(bucket)
                crop = ImageTransform(RESOLUTION, buckets=BUCKETS)(image, sample_rng(0, 0, seed_keys[source], number))
                assert crop.shape == (*bucket, 3)
                expected = encode_moments(autoencoder, crop.transpose(2, 0, 1)[None], flips=False)[0]
                np.testing.assert_allclose(from_bytes(data, meta.dtype, list(meta.shape)), expected, rtol=2e-3,
                                           atol=2e-3)
        assert all(numbers == sorted(numbers) for numbers in seen.values())  # a bucket's records in shard order
    assert sorted(encoded) == sorted(f"photo {i}" for i in range(30))  # every record, once
    assert used == set(BUCKETS)


def test_a_bucketed_encode_refuses_other_buckets_on_resume_and_unusable_ones_at_start(aspect_corpus, vae,
                                                                                     bucket_encoded, tmp_path):
    out = tmp_path / "latents"
    shutil.copytree(os.path.dirname(bucket_encoded), out)
    other = run_python(encode_args(aspect_corpus, vae, out, "--aspect_buckets", "32x32,24x40",
                                   "--model_name_or_path", "ldm-tiny"))
    assert other.returncode == 2, other.stderr[-3000:]
    assert "other settings (aspect_buckets: ['48x24', '40x24', '32x32', '24x40', '24x48'] there" in other.stderr
    square = run_python(encode_args(aspect_corpus, vae, out))
    assert square.returncode == 2 and "other settings (aspect_buckets:" in square.stderr, square.stderr[-3000:]

    for flags in (("--aspect_buckets", "30x30"), ("--aspect_buckets", "auto", "--resolution", "36")):
        bad = run_python(encode_args(aspect_corpus, vae, tmp_path / "bad", "--model_name_or_path", "ldm-tiny", *flags))
        assert bad.returncode == 2, bad.stderr[-3000:]
        last = bad.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "multiple of 8" in last and "Traceback" not in bad.stderr, last
        assert not os.path.exists(tmp_path / "bad")


def test_bucketed_latents_train_in_their_buckets_and_a_square_run_refuses_them(bucket_encoded, vae, vocab_dir,
                                                                               tmp_path):
    common = ["--pretrained_model_name_or_path", "ldm-tiny", "--vae_name_or_path", vae, "--file_list", bucket_encoded,
              "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", str(RESOLUTION),
              "--train_batch_size", "4", "--max_train_steps", "3", "--logging_steps", "1", "--num_workers", "2"]
    script = "train_txt2img_laion400m_no_trainer.py"
    ok = run_entry(script, common + ["--aspect_buckets", "auto", "--output_dir", str(tmp_path / "a")])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "training on precomputed latents" in ok.stderr and "data_bucket_" in ok.stderr, ok.stderr[-3000:]

    square = run_entry(script, common + ["--output_dir", str(tmp_path / "b")])
    assert square.returncode == 2, square.stderr[-3000:]
    last = square.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "aspect-ratio buckets" in last, last


def test_multi_scale_pixart_trains_each_bucketed_latent_once_and_refuses_a_corpus_without_geometry(
        bucket_encoded, vae, tmp_path, monkeypatch):
    """PixArt-α's multi-scale DiT (pixart-ms-tiny: resolution and aspect-ratio conditions) on bucketed latents: a pass
    reads every record once, a batch one bucket, each conditioned on its stored geometry. The same corpus as encoded
    before records stored their geometry (each record's meta without it) is refused in one line at start, naming the
    encode; a model that does not read it (ldm-tiny) still trains on it."""
    from ldm.data.dataset import CONSUMED_LOG

    log = tmp_path / "consumed"
    monkeypatch.setenv(CONSUMED_LOG, str(log))
    common = ["--vae_name_or_path", vae, "--resolution", str(RESOLUTION), "--aspect_buckets", "auto",
              "--train_batch_size", "4", "--num_workers", "0", "--model_max_length", "16", "--report_to", "none"]
    pixart = ["--pretrained_model_name_or_path", "pixart-ms-tiny", "--allow_untrained_text_encoder"]
    result = run_entry("train_txt2img_laion400m_no_trainer.py", [
        *pixart, *common, "--file_list", bucket_encoded, "--max_train_steps", "10", "--save_steps", "10",
        "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in log.read_text().splitlines()]
    pass0 = [(shard, line) for p, _, shard, line, *_ in rows if p == "0"]
    assert len(pass0) == len(set(pass0)) == 30  # the whole pass, each record once
    shapes = {}
    for _, _, _, _, shape, _, batch in rows:
        shapes.setdefault(batch, set()).add(shape)
    assert all(len(s) == 1 for s in shapes.values()) and len(set.union(*shapes.values())) >= 3
    monkeypatch.delenv(CONSUMED_LOG)

    old = tmp_path / "old"
    old.mkdir()
    for name in os.listdir(os.path.dirname(bucket_encoded)):
        path = os.path.join(os.path.dirname(bucket_encoded), name)
        if name.startswith("latents-") and name.endswith(".gz"):
            lines = []
            for line in iter_lines(path):
                fields = line.split(b"\t")
                meta = json.loads(fields[3])
                assert len(meta.pop("geometry")) == 1  # one copy: encoded without --random_flip
                fields[3] = json.dumps(meta, separators=(",", ":")).encode()
                lines.append(b"\t".join(fields))
            gzip_lines(str(old / name), lines)
        elif os.path.isfile(path):
            shutil.copy(path, old / name)
    listing = str(old / os.path.basename(bucket_encoded))
    refused = run_entry("train_txt2img_laion400m_no_trainer.py", [
        *pixart, *common, "--file_list", listing, "--max_train_steps", "1", "--output_dir", str(tmp_path / "no")])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert ("latents encoded without each image's size and crop (its geometry), which this run's model is "
            "conditioned on: encode the corpus again") in line and "python -m ldm.prepare encode" in line, line
    assert not (tmp_path / "no").exists()
    payload = parse_latent_record(next(iter(iter_lines(str(old / "latents-000000.gz")))))[1]
    moments, geometry = latents.LatentTransform(buckets=BUCKETS).sample(payload, sample_rng(0, 0, "a", 1))
    assert geometry is None and moments.shape[0] == 8  # what every other model trains on, as before
