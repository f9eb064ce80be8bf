"""The export of a checkpoint to a ppdiffusers `LDMTextToImagePipeline` folder (`python -m ldm.export`, and every
training run at its end)."""

from __future__ import annotations

from ppdiffusers import LDMTextToImagePipeline

from ldm.checkpoint.run_folder import atomic_folder
from ldm.checkpoint.serialization import writes_failing_as_os_errors
from ldm.inference.load import load_for_inference
from ldm.inference.sampling import ddim_scheduler


def export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config: dict, output: str) -> str:
    pipeline = LDMTextToImagePipeline(vqvae=vae, bert=text_encoder, tokenizer=tokenizer, unet=unet,
                                      scheduler=ddim_scheduler(scheduler_config))
    with atomic_folder(output) as folder, writes_failing_as_os_errors(folder):
        pipeline.save_pretrained(folder)
    return output


def export_checkpoint(checkpoint: str, output: str, use_ema: bool = True) -> tuple[str, bool]:
    unet, text_encoder, vae, tokenizer, scheduler_config, used_ema = load_for_inference(checkpoint, use_ema)
    return export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config, output), used_ema
