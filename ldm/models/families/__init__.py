"""The model families, one object each (`base.ModelFamily`), in one registry (`FAMILIES`): everything outside
`ldm/models` asks a model's family through these functions, never which family it is.

- `ldm` and `sd` (`unet`): ppdiffusers' `UNet2DConditionModel`, with LDMBert trained jointly (the CompVis LDM), or
  a frozen CLIP or T5 (Stable Diffusion 1.x and 2.x);
- `pixart` (`pixart`): PixArt-α's DiT, with a frozen T5 (or LDMBert, the demo's);
- `sdxl` (`sdxl`): Stable Diffusion XL's UNet (`addition_embed_type: text_time`) with CLIP-L and OpenCLIP-bigG
  frozen, conditioned on the pooled vector and each image's size and crop;
- `sd3` (`sd3`): Stable Diffusion 3's MMDiT with its three frozen text encoders.

A family is found from a model folder (`folder_family`: its backbone's folder and config, and its text encoder), from
a backbone config (`config_family`) or from the built parts (`family_of`). Where two families read the same backbone
(a UNet), the text encoder tells them apart; the backbone alone gives the first, which predicts as the others do.
"""

from __future__ import annotations

import os

import paddle

from ldm.models.conditioning import Conditioning
from ldm.models.families.base import ModelFamily, PipelineError
from ldm.models.families.pixart import PIXART
from ldm.models.families.sd3 import SD3
from ldm.models.families.sdxl import SDXL
from ldm.models.families.unet import LDM, SD
from ldm.models.text import TextFamily
from ldm.models.text import family_of as text_kind_of
from ldm.runtime.files import read_json_object

# SDXL's UNet (a narrower config) before SD's
FAMILIES: tuple[ModelFamily, ...] = (LDM, SDXL, SD, PIXART, SD3)

__all__ = ["FAMILIES", "ModelFamily", "PipelineError", "config_family", "family_of", "folder_family", "predict",
           "predict_with_variance"]


def config_family(config: dict, text: TextFamily | None = None, folder: str | None = None) -> ModelFamily:
    """The family of a backbone config (a `config.json`, read as a dict: `_class_name`, else its shape), of the
    text encoder `text` when two families read that backbone, and with its part's `folder` when given (an unreadable
    config: the first family of that folder)."""
    candidates = [f for f in FAMILIES if folder is None or f.backbone_folder == folder]
    reading = [f for f in candidates if f.reads_backbone(config)] or candidates[:1] or [FAMILIES[0]]
    return next((f for f in reading if text is not None and f.takes(text)), reading[0])


def read_backbone_config(folder: str) -> dict:
    return read_json_object(os.path.join(folder, "config.json"))


def folder_family(source: str, text: TextFamily | None = None) -> ModelFamily | None:
    """The family of a model folder (a preset, configs, a pipeline or a checkpoint): its backbone's folder (`unet/`,
    `transformer/`) and that config (read or not: an unreadable one is said to be so by its loader), with its text
    encoder `text` when known; None: it holds no backbone."""
    folders = [f for f in dict.fromkeys(f.backbone_folder for f in FAMILIES)
               if os.path.lexists(os.path.join(source, f))]
    if not folders:
        return None
    configs = {folder: read_backbone_config(os.path.join(source, folder)) for folder in folders}

    def read(folder: str) -> bool:
        return any(f.backbone_folder == folder and f.reads_backbone(configs[folder]) for f in FAMILIES)

    folder = next((f for f in folders if configs[f] and read(f)), folders[0])
    return config_family(configs[folder], text, folder)


def family_of(backbone, text_encoder=None) -> ModelFamily:
    """The family of a built backbone (by its class, and its config), and of its text encoder: two families read a
    UNet."""
    names = {cls.__name__ for cls in type(backbone).__mro__}
    built = next((f.backbone_class for f in FAMILIES if f.backbone_class in names), type(backbone).__name__)
    return config_family({**dict(backbone.config), "_class_name": built},
                         None if text_encoder is None else text_kind_of(text_encoder))


def predict(backbone, sample: paddle.Tensor, timesteps: paddle.Tensor, conditioning: Conditioning) -> paddle.Tensor:
    """The backbone's prediction (of `sample`'s channels) for latents at `timesteps` (a scalar or one per sample),
    conditioned on `conditioning` (the fields its family reads)."""
    return predict_with_variance(backbone, sample, timesteps, conditioning)[0]


def predict_with_variance(backbone, sample, timesteps, conditioning: Conditioning):
    """(prediction, the learned variance's values in [-1, 1] or None: a backbone with twice the latents' channels)."""
    out = family_of(backbone).predict(backbone, sample, timesteps, conditioning)
    channels = sample.shape[1]
    if out.shape[1] == 2 * channels:  # learned sigma: the second half is no prediction of the latents
        return out[:, :channels], out[:, channels:]
    return out, None


def text_to_image_pipeline(unet, text_encoder, vae, tokenizer, scheduler):
    """The ppdiffusers pipeline of a backbone and a text encoder (its family's `pipeline_class`); PipelineError for a
    model that no pipeline class samples as it was trained."""
    from ldm.models.families.base import no_pipeline

    family = family_of(unet, text_encoder)
    if not family.takes(text_kind_of(text_encoder)):
        raise no_pipeline(unet, text_encoder)
    return family.pipeline(unet, text_encoder, vae, tokenizer, scheduler)
