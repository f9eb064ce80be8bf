"""The export of a checkpoint or a pipeline to an `LDMTextToImagePipeline` folder: ppdiffusers' layout (`python -m
ldm.export`, and every training run at its end) or diffusers' (`--format diffusers`, for PyTorch users)."""

from __future__ import annotations

import json
import os

from ppdiffusers import LDMTextToImagePipeline

from ldm.checkpoint.run_folder import atomic_folder
from ldm.checkpoint.serialization import writes_failing_as_os_errors
from ldm.inference.load import load_for_inference
from ldm.inference.model_card import model_card
from ldm.inference.sampling import ddim_scheduler
from ldm.models.torch_layout import save_torch_layout


def export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config: dict, output: str,
                    to_diffusers: bool = False, card: str | None = None) -> str:
    pipeline = LDMTextToImagePipeline(vqvae=vae, bert=text_encoder, tokenizer=tokenizer, unet=unet,
                                      scheduler=ddim_scheduler(scheduler_config))
    with atomic_folder(output) as folder, writes_failing_as_os_errors(folder):
        # ppdiffusers converts the UNet and the autoencoder, and names diffusers' classes in model_index.json
        pipeline.save_pretrained(folder, to_diffusers=to_diffusers)
        if to_diffusers:  # but leaves bert/ in Paddle's layout: rewritten in PyTorch's, as transformers reads it
            _write_torch_text_encoder(text_encoder, os.path.join(folder, "bert"))
        if card is not None:
            with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
                f.write(card)
    return output


def _write_torch_text_encoder(text_encoder, folder: str) -> None:
    for name in os.listdir(folder):
        if name != "config.json":
            os.remove(os.path.join(folder, name))
    save_torch_layout(text_encoder, folder, "model.safetensors")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.pop("paddlenlp_version", None)
    config["torch_dtype"] = "float32"
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def export_checkpoint(checkpoint: str, output: str, use_ema: bool = True, to_diffusers: bool = False
                      ) -> tuple[str, bool]:
    """A checkpoint or a pipeline (either layout) exported to `output`; diffusers' layout with a model card."""
    unet, text_encoder, vae, tokenizer, scheduler_config, used_ema = load_for_inference(checkpoint, use_ema)
    card = model_card(checkpoint, unet, text_encoder, vae, scheduler_config, used_ema) if to_diffusers else None
    return export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config, output, to_diffusers,
                           card), used_ema
