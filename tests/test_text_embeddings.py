"""Cached text states (`python -m ldm.prepare encode --text_embeddings`): a Stable Diffusion model's frozen CLIP encoder
run once over the captions, its states stored beside each latent, and training that reads them instead of running
the encoder: the same losses as encoding on the fly, refused by a run of another encoder or one that trains its own."""

import json

import numpy as np
import pytest
from conftest import metrics_lines
from corpus import write_aspect_corpus, write_corpus
from entry import run_entry, run_python
from interop_models import tiny_sd_pipeline

from ldm.data.latents import (
    LatentMeta,
    LatentMismatch,
    LatentTransform,
    latent_line,
    parse_latent_record,
    text_fingerprint,
)
from ldm.data.shard import iter_lines

RESOLUTION = 32
ENCODE = ["-m", "ldm.data", "encode"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A Stable Diffusion pipeline folder whose parts have weights (sd-tiny's, seeded)."""
    return tiny_sd_pipeline(str(tmp_path_factory.mktemp("sd")))


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, model):
    """The same corpus encoded twice: with its text states (float32) and without."""
    folder = tmp_path_factory.mktemp("text")
    corpus = write_corpus(str(folder / "corpus"), num_records=24, records_per_shard=6, kinds=("jpeg", "png"))
    out = {}
    for name, extra in (("cached", ["--text_embeddings", "--text_dtype", "float32"]), ("plain", [])):
        result = run_python([*ENCODE, "--file_list", corpus, "--vae_name_or_path", model, "--model_name_or_path",
                             model, "--output_dir", str(folder / name), "--resolution", str(RESOLUTION), "--dtype",
                             "float32", "--num_workers", "0", "--batch_size", "4", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = str(folder / name / "latents.filelist.list")
    return out


def train(model, file_list, out, *extra):
    return run_entry("train_txt2img_laion400m_no_trainer.py", [
        "--model_name_or_path", model, "--file_list", file_list, "--resolution", str(RESOLUTION),
        "--train_batch_size", "2", "--max_train_steps", "12", "--save_steps", "12", "--num_workers", "0",
        "--report_to", "none", "--logging_steps", "1", "--learning_rate", "1e-3", "--caption_dropout_prob", "0.3",
        "--output_dir", str(out), *extra])


def test_cached_text_states_train_to_the_losses_of_encoding_on_the_fly(model, encoded, tmp_path):
    runs = {}
    for name, file_list in encoded.items():
        result = train(model, file_list, tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [line["train/loss"] for line in metrics_lines(tmp_path / name) if "train/loss" in line]
    assert len(runs["cached"]) == 12
    np.testing.assert_allclose(runs["cached"], runs["plain"], rtol=1e-5)
    assert len(set(runs["cached"])) == 12  # updates that differ: the comparison could fail


def test_a_cached_record_holds_its_captions_states_as_the_encoder_computes_them(model, encoded):
    import os

    from ldm.data.latents import from_bytes
    from ldm.data.record import decode_base64
    from ldm.prepare.encode import CaptionStates

    shard = os.path.join(os.path.dirname(encoded["cached"]), "latents-000000.gz")
    caption, (_, meta, text) = parse_latent_record(next(iter(iter_lines(shard))))
    states = CaptionStates(model, "float32")
    assert meta.text == states.meta and meta.text["shape"] == [77, 32]
    stored = from_bytes(decode_base64(text), "float32", meta.text["shape"])
    np.testing.assert_allclose(stored, states([caption])[0], rtol=1e-5, atol=1e-5)  # batches of other sizes
    with open(os.path.join(os.path.dirname(encoded["cached"]), ".encode", "settings.json")) as f:
        settings = json.load(f)
    assert settings["text"]["encoder"] == text_fingerprint(states.identity)


def test_a_run_that_trains_its_text_encoder_or_has_another_refuses_cached_states_in_one_line(model, encoded,
                                                                                           tmp_path):
    result = train(model, encoded["cached"], tmp_path / "trained", "--train_text_encoder", "true",
                   "--max_train_steps", "1")
    assert result.returncode != 0
    assert "this run trains its" in result.stderr.strip().splitlines()[-1] and "Traceback" not in result.stderr
    assert not (tmp_path / "trained" / "checkpoint-1").exists()
    meta = LatentMeta("vae", "float32", (1, 8, 4, 4), RESOLUTION, text={"encoder": "abc", "dtype": "float16",
                                                                           "shape": [77, 32]})
    with pytest.raises(LatentMismatch, match="this run's frozen text encoder is def"):
        LatentTransform(cached_text="def").check(meta)
    LatentTransform(cached_text=None).check(meta)  # the data tools and held-out records check nothing


def test_encoding_text_states_of_ldmbert_is_refused_in_one_line(encoded, tmp_path):
    corpus = write_corpus(str(tmp_path / "corpus"), num_records=4, records_per_shard=4)
    result = run_python([*ENCODE, "--file_list", corpus, "--vae_name_or_path", "ldm-tiny", "--allow_untrained_vae",
                         "--model_name_or_path", "ldm-tiny", "--output_dir", str(tmp_path / "out"), "--resolution",
                         str(RESOLUTION), "--num_workers", "0", "--text_embeddings"])
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert "trains with the UNet" in lines[-1] and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def t5_model(tmp_path_factory):
    from interop_models import tiny_t5_model

    return tiny_t5_model(str(tmp_path_factory.mktemp("t5")))


def test_a_t5_encoders_padding_is_masked_so_only_its_real_tokens_condition_the_unet(t5_model):
    """What a compact cached record leaves out (the states past its caption's end) changes nothing: the UNet's
    cross-attention and the encoder's self-attention mask them."""
    import paddle

    from ldm.data.tokenize import CaptionTokenizer
    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion
    from ldm.models.text import encode_prompt, load_text_tokenizer

    c = build_components(t5_model)
    assert c.family.name == "t5" and c.pretrained["text_encoder"]
    model = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler, freeze_text_encoder=True)
    tokenize = CaptionTokenizer(load_text_tokenizer(c.family, f"{t5_model}/tokenizer"), 16)
    ids = paddle.to_tensor(np.stack([tokenize("a red circle"), tokenize("the blue square on a green background")]))
    encoded = encode_prompt(c.text_encoder, ids)
    states, mask = encoded.states, encoded.mask
    lengths = mask.sum(axis=1)
    assert 0 < int(lengths[0]) < int(lengths[1]) < 16
    garbage = states.numpy().copy()
    garbage[0, int(lengths[0]):] = 100.0  # past the first caption's end
    model.keep_empty_caption(tokenize(""))
    moments = paddle.randn([2, 8, 4, 4])
    losses = []
    for cached in (states.numpy(), garbage):
        paddle.seed(3)
        losses.append(float(model(None, None, moments, conditioning={
            "states": cached, "mask": mask.numpy(), "dropped": np.array([False, False])})))
    assert losses[0] == losses[1]
    paddle.seed(3)
    assert float(model(None, ids, moments)) == pytest.approx(losses[0], rel=1e-6)  # encoding on the fly


def test_t5_states_are_stored_compact_and_train_as_encoding_on_the_fly(t5_model, tmp_path):
    corpus = write_corpus(str(tmp_path / "corpus"), num_records=12, records_per_shard=6)
    lists = {}
    for name, extra in (("cached", ["--text_embeddings", "--text_dtype", "float32"]), ("plain", [])):
        result = run_python([*ENCODE, "--file_list", corpus, "--vae_name_or_path", t5_model, "--model_name_or_path",
                             t5_model, "--output_dir", str(tmp_path / name), "--resolution", str(RESOLUTION),
                             "--dtype", "float32", "--num_workers", "0", "--model_max_length", "16", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        lists[name] = str(tmp_path / name / "latents.filelist.list")
    _, (_, meta, _) = parse_latent_record(next(iter(iter_lines(str(tmp_path / "cached" / "latents-000000.gz")))))
    assert meta.text["length"] == 16 and meta.text["shape"][0] < 16  # "photo N" and its EOS: its real tokens only
    losses = {}
    for name, file_list in lists.items():
        result = train(t5_model, file_list, tmp_path / f"run-{name}", "--max_train_steps", "6", "--save_steps", "6",
                       "--model_max_length", "16")
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = [line["train/loss"] for line in metrics_lines(tmp_path / f"run-{name}") if "train/loss" in line]
    assert len(losses["cached"]) == 6
    np.testing.assert_allclose(losses["cached"], losses["plain"], rtol=1e-5)


def test_encode_and_training_read_one_caption_length_from_the_model(t5_model, tmp_path):
    """Unset, --model_max_length is the model's (its tokenizer's saved length) in `encode --text_embeddings` and in
    training alike: the run takes the cache it made, whatever the tokenizer says."""
    import shutil

    from ldm.config.args import DataArguments, ModelArguments, SamplingArguments
    from ldm.prepare.encode import CaptionStates
    from ldm.train.objective import TextToImage

    folder = tmp_path / "t5-40"
    shutil.copytree(t5_model, folder)
    config = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 40}))
    encoded = CaptionStates(str(folder), "float32")
    run = TextToImage(ModelArguments(model_name_or_path=str(folder)), DataArguments(), SamplingArguments(),
                      recompute=False, seed=0)
    assert encoded.meta["length"] == run.data.model_max_length == run.tokenizer.model_max_length == 40
    assert encoded.meta["encoder"] == run.cached_text


def test_a_file_list_mixing_cached_and_plain_latent_shards_is_refused_at_start(model, encoded, tmp_path):
    """Before any batch: a loader slot batches one kind, and met the other only when it reached such a shard (in the
    second pass, with 6 workers and a shard each). Every shard's first record is read at start."""
    import glob
    import os

    from ldm.config.args import DataArguments
    from ldm.data.filelist import FileListError
    from ldm.models.text import CLIP, load_text_tokenizer
    from ldm.runtime.distributed import Distributed
    from ldm.train.batches import build_batches

    shards = {name: sorted(glob.glob(os.path.join(os.path.dirname(file_list), "latents-*.gz")))
              for name, file_list in encoded.items()}
    mixed = [*shards["cached"][:-1], shards["plain"][-1]]
    filelist = tmp_path / "mixed.filelist"
    filelist.write_text("".join(f"{path}\n" for path in mixed))
    (tmp_path / "mixed.filelist.list").write_text(f"{filelist}\n")
    tokenizer = load_text_tokenizer(CLIP, os.path.join(model, "tokenizer"))
    data = DataArguments(file_list=str(tmp_path / "mixed.filelist.list"), resolution=RESOLUTION)
    with pytest.raises(FileListError, match="mixes shards of different kinds") as refused:
        build_batches(data, tokenizer, batch_size=2, seed=0, dist=Distributed(), num_workers=len(mixed),
                      autoencoder="any", cached_text="any")
    assert f"{shards['plain'][-1]} begins with a latent record" in str(refused.value)
    assert "begins with a latent record with cached text states" in str(refused.value)
    assert "--text_embeddings" in str(refused.value)


def test_a_corrupt_text_column_is_counted_as_bad_text_state(encoded):
    """Not as `bad_latent`: the latent is sound, the cached text states are not (docs/data-formats.md lists it)."""
    import os

    from ldm.data.record import SkipRecord

    shard = os.path.join(os.path.dirname(encoded["cached"]), "latents-000000.gz")
    line = next(iter(iter_lines(shard)))
    _, (data, meta, text) = parse_latent_record(line)
    with pytest.raises(SkipRecord) as missing:
        parse_latent_record(b"\t".join(line.split(b"\t")[:4]))  # the meta names states, the column is gone
    with pytest.raises(SkipRecord) as cut:
        LatentTransform(cached_text=meta.text["encoder"]).text_states((data, meta, text[:-8]))
    assert missing.value.reason == cut.value.reason == "bad_text_state"
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                           "data-formats.md")) as f:
        assert "`bad_text_state`" in f.read()


def several_encoders_record(rng):
    """A latent record holding the states of three encoders as SD3 has them (two CLIPs with pooled vectors, a T5
    stored compact), and what it was made from."""
    parts = [{"part": "text_encoder", "encoder": "a" * 16, "dtype": "float32", "shape": [7, 8], "pooled": [6]},
             {"part": "text_encoder_2", "encoder": "b" * 16, "dtype": "float32", "shape": [7, 12], "pooled": [10]},
             {"part": "text_encoder_3", "encoder": "c" * 16, "dtype": "float32", "shape": [16, 12], "length": 16}]
    arrays = [(rng.normal(size=[7, 8]), rng.normal(size=[6])), (rng.normal(size=[7, 12]), rng.normal(size=[10])),
              (rng.normal(size=[5, 12]), None)]
    meta = LatentMeta("v" * 16, "float32", (1, 8, 2, 2), 16, text={"encoders": parts})
    line = latent_line("a red circle", "k", rng.normal(size=[1, 8, 2, 2]), meta, text=arrays)
    return parse_latent_record(line.rstrip(b"\n"))[1], arrays  # as shards yield lines


def test_cached_states_of_several_encoders_are_each_read_back_with_their_pooled_vectors():
    payload, arrays = several_encoders_record(np.random.default_rng(0))
    assert "text_encoder_2 bbbbbbbbbbbbbbbb, float32 7x12 and pooled 10" in payload[1].describe()
    read = LatentTransform(cached_text=("a" * 16, "b" * 16, "c" * 16)).encoder_states(payload)
    assert [real for _, real, _ in read] == [7, 7, 5]
    for (states, _, pooled), (expected, expected_pooled) in zip(read, arrays, strict=True):
        np.testing.assert_array_equal(states[:len(expected)], expected.astype(np.float32))
        assert pooled is None if expected_pooled is None else np.array_equal(pooled, expected_pooled.astype("f4"))
    assert read[2][0].shape == (16, 12) and not read[2][0][5:].any()  # the compact T5 padded back, with zeros


def test_several_encoders_states_of_another_encoder_or_another_set_are_refused_in_one_line():
    payload, _ = several_encoders_record(np.random.default_rng(1))
    meta = payload[1]
    for cached, expected in (
            (("a" * 16, "d" * 16, "c" * 16), "whose text_encoder_2 states are of encoder bbbbbbbbbbbbbbbb, and this "
                                             "run's is dddddddddddddddd"),
            ("a" * 16, "the text states of 3 encoder(s) (text_encoder aaaaaaaaaaaaaaaa, text_encoder_2 "),
            ("", "and this run trains its text encoder")):
        with pytest.raises(LatentMismatch) as e:
            LatentTransform(cached_text=cached).check(meta)
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_single_encoders_record_keeps_its_format_and_reads_as_one_of_several():
    rng = np.random.default_rng(2)
    states = rng.normal(size=[7, 8]).astype(np.float32)
    meta = LatentMeta("v" * 16, "float32", (1, 8, 2, 2), 16, text={"encoder": "a" * 16, "dtype": "float32",
                                                                   "shape": [7, 8]})
    line = latent_line("a", "k", rng.normal(size=[1, 8, 2, 2]), meta, text=states)
    assert b'"text":{"encoder":"aaaaaaaaaaaaaaaa","dtype":"float32","shape":[7,8]}' in line
    payload = parse_latent_record(line.rstrip(b"\n"))[1]
    transform = LatentTransform(cached_text="a" * 16)
    transform.check(payload[1])
    (read, real, pooled), = transform.encoder_states(payload)
    np.testing.assert_array_equal(read, transform.text_states(payload)[0])
    assert real == 7 and pooled is None


def test_encode_stores_each_encoders_states_and_pooled_vector_with_its_identity(t5_model):
    """Two encoders as SD3 pairs them (a CLIP with a projection, a T5 stored compact): each one's states and pooled
    vector as the encoder computes them, under each one's part and fingerprint."""
    import paddle
    from ppdiffusers.transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from ldm.models.build import PRESETS_DIR, load_caption_encoder, read_config
    from ldm.models.text import CLIP, T5, encode_prompt, load_text_tokenizer
    from ldm.prepare.encode import CaptionStates, EncoderStates, storable_text

    config = {**read_config(PRESETS_DIR / "sd-tiny" / "text_encoder"), "projection_dim": 24}
    config.pop("architectures")
    clip = CLIPTextModelWithProjection(CLIPTextConfig(**config))
    clip.eval()
    clip_tokenizer = load_text_tokenizer(CLIP, str(PRESETS_DIR / "sd-tiny" / "tokenizer"))
    _, t5, t5_tokenizer = load_caption_encoder(t5_model)
    captions = CaptionStates.of([EncoderStates("text_encoder", CLIP, clip, clip_tokenizer, "float32", None, "clip"),
                                 EncoderStates("text_encoder_3", T5, t5, t5_tokenizer, "float32", 16, "t5")])
    first, second = captions.meta["encoders"]
    assert (first["part"], first["pooled"], second["part"], second["length"]) == ("text_encoder", [24],
                                                                                  "text_encoder_3", 16)
    assert "pooled" not in second
    text = captions(["a red circle", "the blue square"])[0]
    assert storable_text(text, captions.meta)
    meta = LatentMeta("v" * 16, "float32", (1, 8, 2, 2), 16, text=captions.meta)
    line = latent_line("a red circle", "k", np.zeros([1, 8, 2, 2]), meta, text=text)
    fingerprints = tuple(text_fingerprint(part.identity) for part in captions.parts)
    (clip_states, _, pooled), (t5_states, t5_real, t5_pooled) = LatentTransform(
        cached_text=fingerprints).encoder_states(parse_latent_record(line.rstrip(b"\n"))[1])
    out = clip(paddle.to_tensor(captions.parts[0].tokenize("a red circle")[None]), return_dict=True)
    np.testing.assert_allclose(clip_states, out.last_hidden_state[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled, out.text_embeds[0].numpy(), rtol=1e-5, atol=1e-6)
    encoded = encode_prompt(t5, paddle.to_tensor(captions.parts[1].tokenize("a red circle")[None]))
    states, mask = encoded.states, encoded.mask
    real = int(mask.sum())
    assert t5_real == real < 16 and t5_pooled is None and t5_states.shape == (16, 32)
    np.testing.assert_allclose(t5_states[:real], states[0, :real].numpy(), rtol=1e-5, atol=1e-6)



def test_a_cached_corpus_gives_a_batch_the_conditioning_it_has_on_the_fly(model, tmp_path):
    """The same records, bucketed, centre-cropped and flipped at random, read as images (their captions encoded on the
    fly) and from their latent records with cached text states, each drawn with the image record's generator (the
    same caption dropout and flips): a batch's conditioning is the same, its geometry to the pixel (a mirror copy's
    left edge mirrored in the resized image) and its text states as the encoder computes them."""
    import paddle

    from ldm.data.dataset import CaptionImageStream
    from ldm.data.filelist import read_file_list
    from ldm.data.latents import from_bytes
    from ldm.data.record import ImageTransform
    from ldm.data.stream import Record
    from ldm.data.tokenize import CaptionTokenizer
    from ldm.inference.load import load_tokenizer_of
    from ldm.models.build import build_components, model_buckets
    from ldm.models.conditioning import GEOMETRY
    from ldm.models.diffusion import LatentDiffusion
    from ldm.models.text import CLIP

    corpus = write_aspect_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=8, seed=CACHED_SEED)
    result = run_python([*ENCODE, "--file_list", corpus, "--vae_name_or_path", model, "--model_name_or_path", model,
                         "--output_dir", str(tmp_path / "cached"), "--resolution", str(RESOLUTION), "--dtype",
                         "float32", "--num_workers", "0", "--text_embeddings", "--text_dtype", "float32",
                         "--aspect_buckets", "auto", "--random_flip", "--center_crop"])
    assert result.returncode == 0, result.stderr[-3000:]
    buckets = model_buckets("auto", RESOLUTION, 2.0, model)
    shard = read_file_list(corpus)[0]
    latent_lines = {parse_latent_record(line)[0]: line for line in iter_lines(
        str(tmp_path / "cached" / "latents-000000.gz"))}
    meta = parse_latent_record(next(iter(latent_lines.values())))[1][1]
    c = build_components(model)
    diffusion = LatentDiffusion(c.unet, c.text_encoder, c.vae, c.noise_scheduler, freeze_text_encoder=True)
    tokenize = CaptionTokenizer(load_tokenizer_of(CLIP, f"{model}/tokenizer"), meta.text["shape"][0])
    diffusion.keep_empty_caption(tokenize(""))
    stream = CaptionImageStream(
        [shard], tokenize=tokenize, batch_size=8, caption_dropout_prob=0.5, seed=CACHED_SEED,
        transform=ImageTransform(RESOLUTION, center_crop=True, random_flip=True, buckets=buckets),
        latents=LatentTransform(random_flip=True, buckets=buckets, cached_text=meta.text["encoder"]))
    held = {"on the fly": [], "cached": []}
    for number, line in enumerate(iter_lines(shard.path), 1):
        for name, source in (("on the fly", line), ("cached", latent_lines[line.split(b"\t", 1)[0].decode()])):
            stream.kind = stream.text_kind = None  # one stream reads both kinds here, record by record
            record = Record(shard.path, number, 0, 0, source, shard.seed_key, (0, number))
            held[name].append((*stream.make_sample(record), record))
    shape = held["on the fly"][0][0].shape[:2]  # a batch holds one bucket's samples
    rows = [i for i, sample in enumerate(held["on the fly"]) if sample[0].shape[:2] == shape]
    stream.kind = True
    cache = stream.make_batch([held["cached"][i] for i in rows], {})
    stream.kind = False
    fly = stream.make_batch([held["on the fly"][i] for i in rows], {})

    geometry = cache["conditioning"]["added"][GEOMETRY]
    np.testing.assert_array_equal(geometry, fly["conditioning"]["added"][GEOMETRY])
    flipped = []
    for i, moments in zip(rows, cache["latent_moments"], strict=True):
        data, record_meta, _ = parse_latent_record(held["cached"][i][-1].line)[1]
        stored = from_bytes(data, "float32", list(record_meta.shape))
        flipped.append(bool(np.array_equal(moments, stored[1])))
        assert np.array_equal(moments, stored[int(flipped[-1])])
        assert tuple(geometry[len(flipped) - 1]) == record_meta.geometry[int(flipped[-1])]
    dropped = cache["conditioning"]["dropped"]
    assert any(flipped) and not all(flipped) and dropped.any() and not dropped.all()  # both ways of each
    # a flipped crop whose left edge moves when mirrored (an odd horizontal margin): a wrong mirror would show
    mirrored = [record_meta.geometry for i in rows
                for record_meta in [parse_latent_record(held["cached"][i][-1].line)[1][1]]]
    assert any(f and g[0][3] != g[1][3] for f, g in zip(flipped, mirrored, strict=True))
    with paddle.no_grad():
        a = diffusion.context(paddle.to_tensor(fly["input_ids"]), fly["conditioning"])
        b = diffusion.context(None, cache["conditioning"])
    # the same encoder on the same tokens, in batches of other sizes: float32 rounding of its few layers
    np.testing.assert_allclose(b.states.numpy(), a.states.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(b.added[GEOMETRY].numpy(), a.added[GEOMETRY].numpy())


CACHED_SEED = 6  # a corpus and seed whose first bucket holds a mirrored crop with an odd margin
