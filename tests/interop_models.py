"""The seeded tiny pipeline the interop fixtures are made from (tests/reference/make_interop_fixtures.py runs this
in the project's venv; tests/test_inference_interop.py makes the same one): the same weights on every machine,
set from numpy's generator rather than Paddle's initialisers, and none of them zero (the training initialisation
zeroes the UNet's output layers, which would make its prediction 0 whatever the layout).

    .venv/bin/python tests/interop_models.py FOLDER    writes FOLDER/ppdiffusers (the pipeline) and FOLDER/vocab
    .venv/bin/python tests/interop_models.py FOLDER --sd    writes FOLDER/ppdiffusers, the seeded sd-tiny pipeline
    .venv/bin/python tests/interop_models.py FOLDER --sd3   writes FOLDER/diffusers, the seeded sd3-tiny pipeline
    .venv/bin/python tests/interop_models.py FOLDER --pixart   writes FOLDER/diffusers, the seeded pixart-tiny one
    .venv/bin/python tests/interop_models.py FOLDER --objective PRESET PREDICTION   writes FOLDER/ppdiffusers, the
        seeded tiny PRESET (ldm-tiny, sd-tiny, pixart-tiny, sd3-tiny, sdxl-tiny) trained for PREDICTION (epsilon,
        v_prediction, flow_matching)
"""

from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["a", "an", "the", "photo", "of", "red", "green", "blue", "circle", "square", "on", "background"]
MAX_LENGTH = 16
PROMPT = "a red circle on a blue background"


def fill_seeded(layer, seed: int) -> None:
    """Every parameter from numpy's generator, in name order: matrices N(0, 0.1), norm scales 1 + N(0, 0.1),
    vectors N(0, 0.1)."""
    import paddle

    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, parameter in sorted(layer.named_parameters()):
            shape = tuple(parameter.shape)
            value = rng.normal(0, 0.1, shape)
            if len(shape) == 1 and name.endswith("weight"):
                value += 1
            parameter.set_value(value.astype("float32"))


def tiny_pipeline(folder: str) -> str:
    """The ldm-tiny pipeline with seeded weights and a 12-word vocabulary, as a ppdiffusers folder: its path."""
    sys.path.insert(0, ROOT)
    from ldm.data.tokenize import load_tokenizer, write_vocab
    from ldm.inference.export import export_pipeline
    from ldm.models.build import build_components

    vocab = os.path.join(folder, "vocab")
    write_vocab(WORDS, vocab)
    tokenizer = load_tokenizer(vocab, MAX_LENGTH)
    c = build_components("ldm-tiny", vocab_size=tokenizer.vocab_size, model_max_length=MAX_LENGTH)
    for seed, part in enumerate((c.unet, c.text_encoder, c.vae)):
        fill_seeded(part, seed)
    return export_pipeline(c.unet, c.text_encoder, c.vae, tokenizer, dict(c.noise_scheduler.config),
                           os.path.join(folder, "ppdiffusers"))


def tiny_sd_pipeline(folder: str) -> str:
    """The sd-tiny pipeline (a CLIP text encoder, its own tokenizer) with seeded weights, as a ppdiffusers folder."""
    sys.path.insert(0, ROOT)
    from ldm.inference.export import export_pipeline
    from ldm.inference.load import load_tokenizer_of
    from ldm.models.build import build_components

    c = build_components("sd-tiny")
    for seed, part in enumerate((c.unet, c.text_encoder, c.vae)):
        fill_seeded(part, 20 + seed)
    tokenizer = load_tokenizer_of(c.family, os.path.join(c.source, "tokenizer"))
    return export_pipeline(c.unet, c.text_encoder, c.vae, tokenizer, dict(c.noise_scheduler.config),
                           os.path.join(folder, "ppdiffusers"))


def tiny_pixart_pipeline(folder: str, to_diffusers: bool = True, preset: str = "pixart-tiny") -> str:
    """The pixart-tiny PixArtAlphaPipeline (a DiT, a T5 text encoder, its own tokenizer) with seeded weights and the
    DPM-Solver++ sampler PixArt-alpha's pipelines ship, in diffusers' layout (or ppdiffusers'); `preset`
    pixart-ms-tiny: the multi-scale DiT."""
    sys.path.insert(0, ROOT)
    from ldm.inference.export import export_pipeline
    from ldm.inference.load import load_tokenizer_of
    from ldm.models.build import build_components
    from ldm.models.noise import scheduler_config

    c = build_components(preset)
    for seed, part in enumerate((c.unet, c.text_encoder, c.vae)):
        fill_seeded(part, 60 + seed)
    # a buffer, not a parameter, saved with the weights: diffusers' unconditional caption, drawn at building
    y_embedding = c.unet.caption_projection.y_embedding
    y_embedding.set_value(np.random.default_rng(63).normal(0, 0.1, y_embedding.shape).astype("float32"))
    tokenizer = load_tokenizer_of(c.family, os.path.join(c.source, "tokenizer"))
    sampler = {"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "dpmsolver++", "beta_end": 0.02,
               "beta_schedule": "linear", "beta_start": 0.0001, "lower_order_final": True, "num_train_timesteps": 1000,
               "prediction_type": "epsilon", "solver_order": 2, "solver_type": "midpoint", "steps_offset": 0,
               "thresholding": False, "timestep_spacing": "linspace", "use_karras_sigmas": False}
    return export_pipeline(c.unet, c.text_encoder, c.vae, tokenizer,
                           {**scheduler_config(c.noise_scheduler), "_sampler": sampler},
                           os.path.join(folder, "diffusers" if to_diffusers else "ppdiffusers"), to_diffusers)


def tiny_sd3_pipeline(folder: str) -> str:
    """The sd3-tiny StableDiffusion3Pipeline (an MMDiT; CLIP-L, CLIP-G and T5 with their tokenizers; the 16-channel
    autoencoder with its shift) with seeded weights, flow matching, in diffusers' layout."""
    sys.path.insert(0, ROOT)
    import paddle

    from ldm.inference.export import export_pipeline
    from ldm.inference.load import load_tokenizer_of
    from ldm.models.build import build_components
    from ldm.models.noise import scheduler_config

    c = build_components("sd3-tiny")
    for seed, part in enumerate((c.unet, c.text_encoder, c.vae)):
        fill_seeded(part, 80 + seed)
    # parameters diffusers' SD3 transformer does not have: as it reads them
    for name in c.model_family.freeze_unexported(c.unet):
        parameter = dict(c.unet.named_parameters())[name]
        parameter.set_value(paddle.zeros_like(parameter))
    tokenizer = load_tokenizer_of(c.family, os.path.join(c.source, "tokenizer"))
    tokenizer.model_max_length = MAX_LENGTH
    return export_pipeline(c.unet, c.text_encoder, c.vae, tokenizer, scheduler_config(c.noise_scheduler),
                           os.path.join(folder, "diffusers"), to_diffusers=True)


def tiny_t5_model(folder: str) -> str:
    """A model folder whose text encoder is a seeded tiny T5 (with a SentencePiece tokenizer trained here on a few
    words) beside sd-tiny's UNet and autoencoder, with weights: what the T5 tests train and encode with."""
    import json
    import shutil

    import sentencepiece

    sys.path.insert(0, ROOT)
    from ppdiffusers import AutoencoderKL, UNet2DConditionModel
    from ppdiffusers.transformers import T5Config, T5EncoderModel

    from ldm.models.build import PRESETS_DIR, read_config

    root = os.path.join(folder, "t5-tiny")
    tokenizer = os.path.join(root, "tokenizer")
    os.makedirs(tokenizer)
    text = os.path.join(folder, "words.txt")
    with open(text, "w") as f:
        f.write("\n".join(f"{a} {b} {c}" for a in WORDS for b in WORDS[::3] for c in ("photo 1", "photo 22")))
    sentencepiece.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(tokenizer, "spiece"),
                                             vocab_size=64, model_type="bpe", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                             hard_vocab_limit=False, minloglevel=2)
    os.remove(os.path.join(tokenizer, "spiece.vocab"))
    with open(os.path.join(tokenizer, "tokenizer_config.json"), "w") as f:
        json.dump({"extra_ids": 0, "model_max_length": 77, "tokenizer_class": "T5Tokenizer"}, f)
    preset = PRESETS_DIR / "sd-tiny"
    shutil.copytree(preset / "scheduler", os.path.join(root, "scheduler"))
    t5 = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1))
    unet = UNet2DConditionModel.from_config(read_config(preset / "unet"))
    vae = AutoencoderKL.from_config(read_config(preset / "vae"))
    for seed, (name, part) in enumerate((("unet", unet), ("text_encoder", t5), ("vae", vae))):
        fill_seeded(part, 40 + seed)
        part.save_pretrained(os.path.join(root, name), safe_serialization=True)
    return root


def tiny_objective_pipeline(folder: str, preset: str, prediction_type: str) -> str:
    """The seeded tiny pipeline of `preset` with the noise schedule a run of `--prediction_type prediction_type`
    (flow matching: `--flow_shift 3`) trains, in ppdiffusers' layout: what `ldm.export --format diffusers` converts
    in the model-card checks (tests/reference/run_model_cards.py, tests/test_inference_export.py)."""
    sys.path.insert(0, ROOT)
    from ldm.data.tokenize import load_tokenizer, write_vocab
    from ldm.inference.export import export_pipeline
    from ldm.inference.load import load_tokenizer_of
    from ldm.models.build import build_components
    from ldm.models.noise import scheduler_config

    flow_shift = 3.0 if prediction_type == "flow_matching" else None
    if preset == "ldm-tiny":  # at diffusers' 77 tokens, which its LDMTextToImagePipeline always gives LDMBert
        write_vocab(WORDS, os.path.join(folder, "vocab"))
        tokenizer = load_tokenizer(os.path.join(folder, "vocab"), 77)
        c = build_components(preset, vocab_size=tokenizer.vocab_size, model_max_length=77,
                             prediction_type=prediction_type, flow_shift=flow_shift)
    else:
        c = build_components(preset, prediction_type=prediction_type, flow_shift=flow_shift)
        tokenizer = load_tokenizer_of(c.family, os.path.join(c.source, "tokenizer"))
        tokenizer.model_max_length = MAX_LENGTH
    for seed, part in enumerate((c.unet, c.text_encoder, c.vae)):
        fill_seeded(part, 100 + seed)
    return export_pipeline(c.unet, c.text_encoder, c.vae, tokenizer, scheduler_config(c.noise_scheduler),
                           os.path.join(folder, "ppdiffusers"))


def plant_code(weights_file, key: str, marker) -> None:
    """Replace a torch `.bin` by one whose unpickling runs `echo PWNED > marker`: what a malicious download holds."""
    import pickle
    import zipfile

    class Payload:
        def __reduce__(self):
            return os.system, (f"echo PWNED > {marker}",)

    with zipfile.ZipFile(weights_file, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({key: Payload()}, protocol=2))


if __name__ == "__main__":
    if "--objective" in sys.argv[2:]:
        print(tiny_objective_pipeline(sys.argv[1], *sys.argv[3:5]))
    elif "--sd3" in sys.argv[2:]:
        print(tiny_sd3_pipeline(sys.argv[1]))
    elif "--pixart" in sys.argv[2:]:
        print(tiny_pixart_pipeline(sys.argv[1]))
    else:
        print(tiny_sd_pipeline(sys.argv[1]) if "--sd" in sys.argv[2:] else tiny_pipeline(sys.argv[1]))
