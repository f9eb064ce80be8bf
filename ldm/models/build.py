"""Where a model comes from: a shipped preset, a folder of configs, a pipeline folder, or the hub.

A source is laid out like a ppdiffusers pipeline folder: a backbone (`unet/`, or a DiT's `transformer/`: its
family's, `ldm.models.families`), a text encoder (`bert/` for LDMBert, or
`text_encoder/` + `tokenizer/` for a CLIP text model: `ldm.models.text`), `vqvae/` (or `vae/`), `scheduler/`
(and `tokenizer/` when exported). A part whose folder holds weights is loaded, in Paddle's layout or in
PyTorch's (a diffusers pipeline: `torch_layout`); a part with a config only is built and initialised from
scratch (`init.init_ldm_weights`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ldm.models.backbone import autoencoder_factor, context_width, reads_pooled
from ldm.models.families import FAMILIES, ModelFamily, config_family, folder_family
from ldm.models.text import LDMBERT, TextEncoderError, TextFamily, text_family
from ldm.models.text import family_of as text_family_of
from ldm.models.torch_layout import is_torch_layout, load_pretrained
from ldm.runtime.errors import UserError

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = sorted(p.name for p in PRESETS_DIR.iterdir() if p.is_dir())
HUB_PRESETS = {"CompVis/ldm_laion400M_pretrain": "ldm-32layer", "CompVis/ldm_12_laion400M_pretrain": "ldm-12layer",
               "runwayml/stable-diffusion-v1-5": "sd-1.5", "stable-diffusion-v1-5/stable-diffusion-v1-5": "sd-1.5",
               "stabilityai/stable-diffusion-2-base": "sd-2-base"}
# a pretrained text encoder's tokenizer files (CLIP's BPE, transformers 5's tokenizer.json, T5's SentencePiece)
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "spiece.model", "tokenizer_config.json",
                   "special_tokens_map.json")
WEIGHT_FILES = ("model_state.pdparams", "diffusion_paddle_model.safetensors", "model.safetensors",
                "diffusion_paddle_model.pdparams", "model_state.safetensors", "diffusion_pytorch_model.safetensors")

# Training noise schedule of the reference (used when a source carries no scheduler config).
DDPM_DEFAULTS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                 "num_train_timesteps": 1000, "clip_sample": False}

logger = logging.getLogger("ldm.models")


class ModelSourceError(UserError, RuntimeError):
    pass


def has_weights(folder: str | os.PathLike) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in WEIGHT_FILES) or is_torch_layout(str(folder))


def read_config(folder: str | os.PathLike, name: str = "config.json") -> dict:
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return json.load(f)


def unsupported_folder(folder: str) -> str | None:
    """Why the backbone whose config is in `folder` cannot be trained here (`unsupported_config`), read before its
    weights; None also when the config cannot be read: its loader then says what is wrong with it."""
    try:
        config = read_config(folder)
    except (OSError, ValueError):
        return None
    return config_family(config, folder=os.path.basename(os.path.normpath(folder))).unsupported(config)


# The classes a pipeline folder's parts are read as (`model_index.json` names them; any library's spelling): a part
# named as another class would be read as these all the same, and sample other images than its pipeline does.
PIPELINE_PARTS = {
    "unet": ("UNet2DConditionModel",),
    "transformer": tuple(name for family in FAMILIES if family.backbone_folder == "transformer"
                         for name in (family.backbone_class, *family.config_names)),
    "vae": ("AutoencoderKL",),
    "vqvae": ("AutoencoderKL",),
    "bert": ("LDMBertModel",),
    "text_encoder": ("CLIPTextModel", "T5EncoderModel"),
    "text_encoder_2": ("CLIPTextModelWithProjection",),
    "text_encoder_3": ("T5EncoderModel",),
    "tokenizer": ("BertTokenizer", "BertTokenizerFast", "CLIPTokenizer", "CLIPTokenizerFast", "T5Tokenizer",
                  "T5TokenizerFast"),
    "tokenizer_2": ("CLIPTokenizer", "CLIPTokenizerFast"),
    "tokenizer_3": ("T5Tokenizer", "T5TokenizerFast"),
}
# where a pipeline class's part is of other classes than `PIPELINE_PARTS` says (SD3's first CLIP has a projection)
CLASS_PARTS = {family.pipeline_class: family.class_parts for family in FAMILIES if family.class_parts}
# parts of a text-to-image pipeline that text-to-image sampling does not use
UNUSED_PARTS = ("safety_checker", "feature_extractor", "image_encoder")
# The pipeline classes this framework trains, samples and exports (`model_index.json`'s `_class_name`, the same in
# diffusers and ppdiffusers: its families'), with the parts each holds; any other class (Stable Diffusion XL's,
# DeepFloyd IF's, an image-to-image pipeline) is refused by name, rather than read as one of these without its other
# parts.
PIPELINE_CLASSES = {family.pipeline_class: family.pipeline_parts for family in FAMILIES if family.pipeline_class}


def check_model_index(folder: str) -> None:
    """Refuse a pipeline folder of a class this framework does not read (`PIPELINE_CLASSES`: Stable Diffusion XL's,
    named), or whose `model_index.json` names a part of a class it does not read, or a part it would leave out (a
    `text_encoder_2`): it would be read as another model, silently.
    The scheduler may be of any class: its noise schedule is trained with, and it samples (`sampling_scheduler`)."""
    check_source_family(folder)
    path = os.path.join(folder, "model_index.json")
    try:
        index = read_config(folder, "model_index.json")
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"{path}: not a readable model index ({e})") from None
    kind = index.get("_class_name", "a pipeline")
    if "_class_name" in index and kind not in PIPELINE_CLASSES:
        raise ModelSourceError(f"{path}: a {kind} folder, which this framework does not train, sample or export "
                               f"(it reads {', '.join(PIPELINE_CLASSES)} folders)")
    check_unread_parts(folder)
    for part, value in index.items():
        if part.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[1] is None:
            continue  # settings (requires_safety_checker), and parts the pipeline does not have ([null, null])
        library, name = value
        if part in UNUSED_PARTS or (part == "scheduler" and str(name).endswith("Scheduler")):
            continue
        if part not in PIPELINE_CLASSES.get(kind, PIPELINE_PARTS) or part == "scheduler":
            raise ModelSourceError(f"{path}: its {part} ({library} {name}) is a part this framework does not read, so "
                                   f"it would sample other images than {kind} does; use a Stable Diffusion or LDM "
                                   "text-to-image pipeline folder")
        classes = CLASS_PARTS.get(kind, {}).get(part, PIPELINE_PARTS[part])
        if name not in classes:
            raise ModelSourceError(f"{path}: its {part} is a {library} {name}, which this framework does not read "
                                   f"(its {part} is a {' or '.join(classes)}); use a Stable Diffusion or LDM "
                                   "text-to-image pipeline folder")


def check_source_family(folder: str) -> ModelFamily | None:
    """The family of a model folder's backbone, after it refuses what its parts or pipeline say it cannot train
    (`ModelFamily.unsupported_source`: the SDXL refiner), before any weight is read; None: no backbone."""
    family = folder_family(folder)
    if family is not None and (why := family.unsupported_source(folder)):
        raise ModelSourceError(f"{folder}: {why}")
    return family


EXTRA_TEXT_PART = re.compile(r"(text_encoder|tokenizer)_\d+")


def check_unread_parts(folder: str) -> None:
    """Refuse a model folder holding a second text encoder (or tokenizer: `text_encoder_2/`, Stable Diffusion XL's
    and 3's), with or without a model index naming it: trained or exported without it, the model would silently be
    another one. Stable Diffusion 3's three (`ldm.models.text_set`) are read."""
    family = check_source_family(folder)
    if family is not None and family.reads_text_parts(folder):
        return
    try:
        names = sorted(n for n in os.listdir(folder) if EXTRA_TEXT_PART.fullmatch(n))
    except OSError:
        return  # its loader says what is wrong with it
    if names:
        raise ModelSourceError(f"{folder}: its {', '.join(names)} {'are parts' if len(names) > 1 else 'is a part'} "
                               "this framework does not read (a second text encoder, as Stable Diffusion XL's), so it "
                               "would train and sample another model than this folder's; a Stable Diffusion 3 folder "
                               "is read with all three of its text encoders (text_encoder, _2 and _3) and an "
                               "SD3Transformer2DModel")


def resolve_source(name_or_path: str) -> str:
    """A preset name or a folder -> a local folder; a hub name -> a local snapshot (online only)."""
    if name_or_path in PRESETS:
        return str(PRESETS_DIR / name_or_path)
    if os.path.isdir(name_or_path):
        return name_or_path
    if not is_hub_name(name_or_path):
        raise ModelSourceError(f"model not found: {name_or_path!r} is neither a preset ({', '.join(PRESETS)}), "
                               "a folder, nor a hub name like 'org/name'")
    return download(name_or_path)


HUB_ATTEMPTS = 3
HUB_BACKOFF_SECONDS = 1.0  # doubled after each failed attempt


class HubDownloadError(ModelSourceError):
    pass


def hub_file(name: str, filename: str, subfolder: str) -> str | None:
    """A file of a hub model in the local cache; None when the repository does not have it.

    ppdiffusers reports a missing file and a failed download as the same EnvironmentError, and a
    part trained from scratch because of a network blip costs a run. So when its download fails,
    the file's URL is asked directly: 404 means missing; anything else (no connection, 5xx, a
    broken transfer) is retried with backoff, then raised as HubDownloadError.
    """
    import time

    import requests
    from ppdiffusers.utils.download_utils import bos_aistudio_hf_download, ppdiffusers_bos_url

    url = ppdiffusers_bos_url(name, filename, subfolder=subfolder)
    problem = ""
    for attempt in range(HUB_ATTEMPTS):
        if attempt:
            time.sleep(HUB_BACKOFF_SECONDS * 2 ** (attempt - 1))
        try:
            return bos_aistudio_hf_download(name, filename, subfolder=subfolder)
        except Exception as e:  # noqa: BLE001 - classified below by asking the URL itself
            problem = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        try:
            status = requests.head(url, timeout=30, allow_redirects=True).status_code
        except requests.RequestException as e:
            problem = f"{type(e).__name__} for {url}"
            continue
        if status == 404:
            return None
        problem = f"HTTP {status} for {url}" if status != 200 else problem
    raise HubDownloadError(f"cannot download {subfolder}/{filename} of {name!r} from the model hub after "
                           f"{HUB_ATTEMPTS} attempts ({problem})")


def fetch_weights(name: str, part: str) -> bool:
    """Whether `part/` of a hub model has weights (the first of WEIGHT_FILES it has is fetched into the
    cache); a failed download raises HubDownloadError."""
    return any(hub_file(name, weights, part) for weights in WEIGHT_FILES)


def download(name: str) -> str:
    """Fetch the configs (a pretrained text encoder's tokenizer too) and the weights each part has of a hub model
    into the ppdiffusers cache: an LDM pipeline (`bert/`, `vqvae/`) or a Stable Diffusion one (`text_encoder/`,
    `tokenizer/`, `vae/`)."""
    try:
        config = hub_file(name, "config.json", "unet")
        if config is None:
            raise ModelSourceError(f"{name!r} on the model hub has no unet/config.json: not a text-to-image pipeline")
        parts = ["unet"]
        for choices in (("bert", "text_encoder"), ("vqvae", "vae")):
            found = next((part for part in choices if hub_file(name, "config.json", part) is not None), None)
            if found is None:
                raise ModelSourceError(f"{name!r} on the model hub has no {' nor '.join(choices)}/config.json: not a "
                                       "text-to-image pipeline")
            parts.append(found)
        if "text_encoder" in parts:
            for filename in TOKENIZER_FILES:
                hub_file(name, filename, "tokenizer")
        hub_file(name, "scheduler_config.json", "scheduler")
    except HubDownloadError as e:
        same = HUB_PRESETS.get(name)
        frozen = " and --init_from_checkpoint a local copy of the pipeline (the text encoder's weights)" \
            if same and same.startswith("sd-") else ""
        hint = (f" The shipped preset '{same}' has the same architecture: pass it instead, with "
                f"--vae_name_or_path set to a pretrained autoencoder folder{frozen}." if same else
                f" Offline, pass a preset ({', '.join(PRESETS)}) or a local folder.")
        raise ModelSourceError(f"{e}.{hint}") from None
    for part in parts:
        if not fetch_weights(name, part):
            logger.warning("%s on the model hub has no weights for %s/ (none of %s): that part is built from its "
                           "config and trained from scratch", name, part, ", ".join(WEIGHT_FILES))
    return os.path.dirname(os.path.dirname(config))


def download_autoencoder(name: str) -> str:
    """The config and weights of a hub repository's autoencoder (`org/repo/subfolder`, or `org/repo` with
    vqvae/ or vae/) in the ppdiffusers cache; its folder."""
    parts = name.split("/")
    repo, subfolders = "/".join(parts[:2]), parts[2:] or list(AUTOENCODER_SUBFOLDERS)
    try:
        for subfolder in subfolders:
            config = hub_file(repo, "config.json", subfolder)
            if config is None:
                continue
            if not fetch_weights(repo, subfolder):
                raise ModelSourceError(f"{repo}/{subfolder} on the model hub has an autoencoder config but no "
                                       f"weights (none of {', '.join(WEIGHT_FILES)})")
            return os.path.dirname(config)
    except HubDownloadError as e:
        raise ModelSourceError(f"{e}. Offline, train one with train_autoencoder.py and pass its vqvae/ folder") \
            from None
    wanted = " or ".join(f"{subfolder}/config.json" for subfolder in subfolders)
    raise ModelSourceError(f"{repo!r} on the model hub has no {wanted}: not an autoencoder")


def model_buckets(value: str | None, resolution: int, max_aspect_ratio: float, model_name_or_path: str,
                  vae_config=None) -> tuple[tuple[int, int], ...] | None:
    """The aspect-ratio buckets `value` names for a model known by name or folder (its configs read, nothing built;
    with `vae_config`, that autoencoder with the model's UNet): what the data tools and the encode use."""
    from ldm.models.buckets import backbone_buckets, buckets_off

    if buckets_off(value):
        return None
    return backbone_buckets(value, resolution, max_aspect_ratio, *model_configs(model_name_or_path, vae_config))


def model_size_step(name_or_path: str, vae_config=None) -> int:
    """The size step of a model's aspect-ratio buckets (`ldm.models.buckets.size_step`), from its configs alone (with
    `vae_config`: that autoencoder's, with the model's UNet)."""
    from ldm.models.buckets import size_step

    return size_step(*model_configs(name_or_path, vae_config))


def model_configs(name_or_path: str, vae_config=None) -> tuple:
    """(autoencoder config, backbone config) of a model known by name or folder (with `vae_config`: that autoencoder
    with the model's backbone), read as attributes; what sets its buckets."""
    from types import SimpleNamespace

    folder = resolve_source(name_or_path)
    backbone = (folder_family(folder) or FAMILIES[0]).backbone_folder
    parts = {backbone: os.path.join(folder, backbone)}
    if vae_config is None:  # its vqvae/ or vae/
        parts["vae"] = next((os.path.join(folder, part) for part in AUTOENCODER_SUBFOLDERS
                             if os.path.isdir(os.path.join(folder, part))), os.path.join(folder, "vqvae"))
    configs = {}
    for part, path in parts.items():
        try:
            configs[part] = SimpleNamespace(**read_config(path))
        except (OSError, ValueError, TypeError) as e:
            raise ModelSourceError(f"{name_or_path}: cannot read its {os.path.basename(path)}/config.json ({e}), "
                                   "which sets the aspect-ratio buckets' size step: name the model they are for") \
                from None
    return vae_config or configs["vae"], configs[backbone]


def model_resolution(unet, vae) -> int:
    """The image size a UNet and autoencoder were made for: the UNet's latent size times the autoencoder's
    downsampling (2 per block after the first)."""
    return unet.config.sample_size * autoencoder_factor(vae.config)


@dataclass
class Components:
    unet: object  # the backbone: a UNet or a DiT (`ldm.models.families`)
    text_encoder: object
    vae: object
    noise_scheduler: object
    source: str
    vae_source: str
    pretrained: dict = field(default_factory=dict)  # part -> loaded weights?
    family: TextFamily = LDMBERT  # of the text encoder
    text_source: str = ""  # the folder the text encoder was read from
    model_family: ModelFamily = FAMILIES[0]

    def parameter_counts(self) -> dict[str, int]:
        return {name: sum(int(p.numel()) for p in getattr(self, name).parameters())
                for name in ("unet", "text_encoder", "vae")}

    def describe(self) -> str:
        counts = self.parameter_counts()
        parts = [f"{name} {counts[name] / 1e6:.2f}M ({'loaded' if self.pretrained[name] else 'from scratch'})"
                 for name in ("unet", "text_encoder", "vae")]
        return "parameters: " + ", ".join(parts)


def load_text_encoder(folder: str, vocab_size: int | None, max_length: int | None, pad_token_id: int = 0):
    from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertConfig, LDMBertModel

    if has_weights(folder):
        model = load_pretrained(LDMBertModel, folder)
        if vocab_size is not None and vocab_size > model.config.vocab_size:
            raise ModelSourceError(f"the tokenizer has {vocab_size} tokens but the text encoder in {folder} "
                                   f"knows {model.config.vocab_size}")
        return model, True
    config = read_config(folder)
    config.pop("architectures", None)
    # From scratch, the embeddings follow the tokenizer: any local vocabulary works with any preset.
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    if max_length is not None:
        config["max_position_embeddings"] = max_length
    config["pad_token_id"] = pad_token_id
    return LDMBertModel(LDMBertConfig(**config)), False


def load_frozen_text_encoder(family: TextFamily, folder: str):
    """(model, loaded) of a pretrained text encoder (CLIP's): its weights in either layout, or its config alone; SD3's
    set: each of its three so (loaded: all three had weights)."""
    if family.parts:
        from ldm.models.text_set import part_folders

        kind = family.set_class
        built = [load_frozen_text_encoder(part, f) for part, f in
                 zip(family.parts, part_folders(folder, kind.encoder_parts), strict=True)]
        return kind(*(model for model, _ in built), **kind.read_settings(folder)), all(loaded for _, loaded in built)
    model_class = family.model_class(folder)
    if has_weights(folder):
        return load_pretrained(model_class, folder), True
    config = read_config(folder)
    config.pop("architectures", None)
    return model_class(model_class.config_class(**config)), False


def load_caption_encoder(model_name_or_path: str, allow_untrained: bool = False):
    """(family, text encoder, tokenizer) of a model whose text encoder is frozen (CLIP's), in eval mode: what
    `encode --text_embeddings` computes the cached text states with. LDMBert, trained with the UNet, has none."""
    from ldm.models.text import check_vocabulary, load_text_tokenizer

    source = resolve_source(model_name_or_path)
    try:
        family = text_family(source)
        if family is LDMBERT:
            raise TextEncoderError("its LDMBert text encoder trains with the UNet: its states change at every update "
                                   "and cannot be cached. Cached text states are for a frozen encoder (CLIP's)")
        tokenizer = load_text_tokenizer(family, os.path.join(source, "tokenizer"))
    except TextEncoderError as e:
        raise ModelSourceError(f"{model_name_or_path}: {e}") from None
    encoder, loaded = load_frozen_text_encoder(family, os.path.join(source, family.folder))
    try:
        check_vocabulary(tokenizer, os.path.join(source, "tokenizer"), encoder, os.path.join(source, family.folder))
    except TextEncoderError as e:
        raise ModelSourceError(f"{model_name_or_path}: {e}") from None
    if not loaded and not allow_untrained:
        raise ModelSourceError(f"{model_name_or_path}: its text encoder has no trained weights; pass the model the "
                               "diffusion model will be trained with (--allow_untrained_text_encoder: tests)")
    encoder.eval()
    return family, encoder, tokenizer


def model_family(model_name_or_path: str) -> ModelFamily:
    """The family of a model known by name or folder (its configs read, nothing built)."""
    return source_families(resolve_source(model_name_or_path), model_name_or_path)[0]


def source_families(source: str, name: str) -> tuple[ModelFamily, TextFamily]:
    """(the model's family, its text encoder's) of a model folder (`name`: as the user gave it)."""
    if check_source_family(source) is None:
        raise ModelSourceError(f"{name}: no unet/config.json nor transformer/config.json (expected a preset, a "
                               "folder of configs or a pipeline folder)")
    try:
        text = text_family(source)
    except TextEncoderError as e:
        raise ModelSourceError(f"{name}: {e}") from None
    return folder_family(source, text), text


def part_class(part: str, config: dict | None = None):
    """The class a model's part (named as its folder: `unet`, `transformer`, `bert`, `text_encoder`, `vqvae`, `vae`)
    is built as, by its `config` (a backbone's `_class_name` or shape, a text encoder's `model_type`)."""
    from ppdiffusers import AutoencoderKL

    from ldm.models.text import FAMILIES as TEXT_FAMILIES

    config = config or {}
    if part in AUTOENCODER_SUBFOLDERS:
        return AutoencoderKL
    if any(family.backbone_folder == part for family in FAMILIES):
        return config_family(config, folder=part).model_class()
    return next(f for f in TEXT_FAMILIES if f.folder == part and config.get("model_type", f.model_types[0])
                in f.model_types).model_class()


def load_part(model_class, folder: str):
    """(model, loaded): a ppdiffusers model from its weights, or built from its config alone."""
    if has_weights(folder):
        return load_pretrained(model_class, folder), True
    return model_class.from_config(read_config(folder)), False


# A pretrained KL-f8 autoencoder (4 latent channels, scaling factor 0.18215) on the hub, as the runs'
# refusal of an untrained one names it: the CompVis text-to-image LDM's own.
PRETRAINED_VAE = "CompVis/ldm-text2im-large-256/vqvae"
AUTOENCODER_SUBFOLDERS = ("vqvae", "vae")


def is_hub_name(name: str, max_parts: int = 2) -> bool:
    parts = name.split("/")
    return not name.startswith(("/", ".", "~")) and 2 <= len(parts) <= max_parts and all(parts)


def vae_folder(name_or_path: str) -> str:
    """A folder holding an AutoencoderKL config (and weights): itself, or its `vqvae/` / `vae/`; a hub name
    `org/repo[/subfolder]` fetches that repository's autoencoder alone (not its whole pipeline)."""
    if name_or_path not in PRESETS and not os.path.isdir(name_or_path) and is_hub_name(name_or_path, 3):
        try:
            return download_autoencoder(name_or_path)
        except ModelSourceError as e:
            raise ModelSourceError(f"{name_or_path!r} is not a local folder, and as a hub name: {e}") from None
    folder = resolve_source(name_or_path)
    for sub in ("", "vqvae", "vae"):
        if os.path.isfile(os.path.join(folder, sub, "config.json")):
            return os.path.join(folder, sub) if sub else folder
    raise ModelSourceError(f"no autoencoder config in {name_or_path} (looked in ., vqvae/, vae/)")


def noise_scheduler_config(source: str, prediction_type: str | None = None, flow_shift: float | None = None) -> dict:
    """The training noise schedule: the source's own settings (a pipeline continued keeps its betas and
    prediction type; a flow-matching scheduler makes it a flow-matching model), the reference's where it has none;
    `prediction_type` overrides when given (`flow_matching`: a `FlowMatchEulerDiscreteScheduler` of the source's
    number of timesteps), `flow_shift` a flow scheduler's resolution shift."""
    from ldm.models.noise import FLOW_SCHEDULERS, is_flow

    folder = os.path.join(source, "scheduler")
    saved = {}
    if os.path.isfile(os.path.join(folder, "scheduler_config.json")):
        saved = read_config(folder, "scheduler_config.json")
    flow = prediction_type == "flow_matching" or (prediction_type is None and is_flow(saved))
    if flow:
        steps = saved.get("num_train_timesteps", DDPM_DEFAULTS["num_train_timesteps"])
        shift = flow_shift if flow_shift is not None else saved.get("shift", 1.0) if is_flow(saved) else 1.0
        return {"_class_name": FLOW_SCHEDULERS[0], "num_train_timesteps": steps, "shift": float(shift)}
    config = {**DDPM_DEFAULTS, "prediction_type": "epsilon"}
    if not is_flow(saved):
        config.update({k: v for k, v in saved.items() if not k.startswith("_")})
    if prediction_type is not None:
        config["prediction_type"] = prediction_type
    if saved.get("_class_name") not in (None, "DDPMScheduler", *FLOW_SCHEDULERS):
        # the source's own sampler (a pipeline's DPM-Solver, PNDM, DDIM), kept for sampling and the export
        config["_sampler"] = {k: v for k, v in saved.items() if k not in ("_diffusers_version", "_ppdiffusers_version")}
    return config


def build_components(
    model_name_or_path: str,
    *,
    vae_name_or_path: str | None = None,
    vocab_size: int | None = None,
    model_max_length: int | None = None,
    pad_token_id: int = 0,
    prediction_type: str | None = None,
    flow_shift: float | None = None,
    seed: int | None = None,
    text_encoder_from: str | None = None,
    resolution: int | None = None,
) -> Components:
    """Build or load the UNet, text encoder, frozen VAE and DDPM noise scheduler of a model source. `vocab_size`,
    `model_max_length` and `pad_token_id` shape an LDMBert built from scratch (its tokenizer is chosen apart);
    `text_encoder_from`: a folder whose pretrained text encoder replaces the source's (a resumed run's own copy);
    `resolution`: the square image side it is trained at (`check_fit`)."""
    import paddle
    from ppdiffusers import AutoencoderKL

    from ldm.models.init import init_ldm_weights
    from ldm.models.noise import training_scheduler

    source = resolve_source(model_name_or_path)
    if os.path.isfile(os.path.join(source, "model_index.json")):
        check_model_index(source)
    check_unread_parts(source)
    model_family, family = source_families(source, model_name_or_path)
    if seed is not None:
        paddle.seed(seed)
    vae_source = vae_name_or_path or source
    backbone = os.path.join(source, model_family.backbone_folder)
    check_fit(model_name_or_path, backbone, vae_name_or_path, resolution)
    unet, unet_loaded = load_part(model_family.model_class(), backbone)
    text_source = text_encoder_from or os.path.join(source, family.folder)
    if family is LDMBERT:
        text_encoder, text_loaded = load_text_encoder(text_source, vocab_size, model_max_length, pad_token_id)
    else:
        text_encoder, text_loaded = load_frozen_text_encoder(family, text_source)
    check_context(unet, text_encoder, model_name_or_path)
    if not unet_loaded:
        model_family.init_weights(unet)
    model_family.freeze_unexported(unet)
    if family is LDMBERT and not text_loaded:
        init_ldm_weights(None, text_encoder)
    vae, vae_loaded = load_part(AutoencoderKL, vae_folder(vae_source))
    scheduler = training_scheduler(noise_scheduler_config(source, prediction_type, flow_shift))
    return Components(unet, text_encoder, vae, scheduler, source, vae_source,
                      {"unet": unet_loaded, "text_encoder": text_loaded, "vae": vae_loaded}, family, text_source,
                      model_family)


def check_fit(name: str, backbone_folder: str, vae_name_or_path: str | None, resolution: int | None = None) -> None:
    """Before any weight is read (a 2 B-parameter model takes minutes to load): refuse a backbone this framework does
    not train as it was made (`unsupported_folder`), an autoencoder whose latents it cannot read, and a `resolution`
    they cannot make (`ldm.models.backbone.check_image_size`). An unreadable config is left to its loader."""
    from types import SimpleNamespace

    from ldm.models.backbone import ImageSizeError, autoencoder_misfit, check_image_size

    if why := unsupported_folder(backbone_folder):
        raise ModelSourceError(f"{name}: {why}")
    try:
        config = SimpleNamespace(**read_config(backbone_folder))
        vae = SimpleNamespace(**read_config(vae_folder(vae_name_or_path or os.path.dirname(backbone_folder))))
    except (OSError, ValueError, TypeError):
        return
    given = f"the autoencoder of --vae_name_or_path {vae_name_or_path}" if vae_name_or_path else "its autoencoder"
    if why := autoencoder_misfit(config, vae, given):
        raise ModelSourceError(f"{name}: {why}")
    if resolution is not None:
        try:
            check_image_size(config, vae, resolution, resolution, f"--resolution {resolution}")
        except ImageSizeError as e:
            raise ModelSourceError(f"{name}: {e}") from None


def check_context(unet, text_encoder, name: str) -> None:
    """The backbone's cross-attention reads states as wide as the text encoder makes them."""
    width = getattr(text_encoder.config, "hidden_size", None) or text_encoder.config.d_model
    if context_width(unet.config) != width:
        raise ModelSourceError(f"{name}: the {type(unet).__name__} reads text states {context_width(unet.config)} "
                               f"wide and its text encoder's are {width} wide: they cannot work together")
    pooled = reads_pooled(unet.config)
    made = text_encoder.config.projection_dim if text_family_of(text_encoder).parts else None
    if pooled != made:
        raise ModelSourceError(f"{name}: the {type(unet).__name__} reads a pooled text vector {pooled or 'no'} wide "
                               f"and its text encoders make {made or 'none'}: they cannot work together (an SD3 "
                               "transformer reads SD3's three text encoders)")


def check_autoencoder_source(model_name_or_path: str, vae_name_or_path: str | None, allowed: bool) -> None:
    """Before anything is built (a 1.4 B-parameter model takes most of a minute on a CPU): refuse a local
    autoencoder that has no trained weights (a preset's, a folder of configs), as `check_autoencoder_trained` would
    once it is built. A hub name is left to the build, which downloads it."""
    source = vae_name_or_path or model_name_or_path
    if allowed or not (source in PRESETS or os.path.isdir(source)):
        return
    try:
        folder = vae_folder(source)
    except ModelSourceError:
        return  # the build names what is wrong with the source
    check_autoencoder_trained(has_weights(folder), source, allowed)


def check_autoencoder_trained(loaded: bool, source: str, allowed: bool) -> None:
    """Refuse a frozen autoencoder with no trained weights (a multi-day run would learn nothing), unless
    `--allow_untrained_vae` says it is meant."""
    if loaded:
        return
    if not allowed:
        raise ModelSourceError(
            f"the autoencoder from {source} has no trained weights: the diffusion model would learn "
            f"random projections. Pass --vae_name_or_path with a pretrained KL autoencoder: online the hub name "
            f"{PRETRAINED_VAE}; offline a folder trained by train_autoencoder.py (its OUTPUT_DIR/vqvae). "
            "--allow_untrained_vae trains on it anyway (tests)")
    logger.warning("--allow_untrained_vae: the autoencoder from %s has NO TRAINED WEIGHTS; what this run learns is "
                   "useful for tests only", source)
