"""Stable Diffusion XL: ppdiffusers' `UNet2DConditionModel` with its added text and time embedding
(`addition_embed_type: text_time`), conditioned by cross-attention on CLIP-L's and OpenCLIP-bigG's penultimate states
side by side and, through the added embedding, on bigG's pooled projection and six numbers per image: the image's
geometry (`ldm.models.conditioning.GEOMETRY`: original size, crop corner, target size), its `add_time_ids`. Both text
encoders are frozen and read as one (`ldm.models.text_set.SDXLTextEncoders`); `StableDiffusionXLPipeline`.

The SDXL refiner (OpenCLIP-bigG alone, an aesthetic score in place of the target size) is refused: this framework
trains the base model's conditioning.
"""

from __future__ import annotations

import json
import os

from ldm.models.conditioning import GEOMETRY
from ldm.models.families.base import (
    LDM_GENERATE,
    PROMPT,
    ModelFamily,
    diffusers_lines,
    no_pipeline,
    trained_length,
)
from ldm.models.families.unet import UNetFamily
from ldm.models.text import SDXL_TEXT
from ldm.models.text_set import SDXLTextEncoders


class SDXLFamily(UNetFamily):
    name = "sdxl"
    text_kinds = (SDXL_TEXT,)
    pipeline_class = "StableDiffusionXLPipeline"
    pipeline_parts = ("vae", *SDXLTextEncoders.encoder_parts, *SDXLTextEncoders.tokenizer_parts, "unet", "scheduler")
    reads_pooled = True
    added_conditions = (GEOMETRY,)
    # its pipeline scales its first latents by `scheduler.init_noise_sigma`, which a flow-matching scheduler has not
    diffusers_samples_flow = False

    def reads_backbone(self, config):
        return ModelFamily.reads_backbone(self, config) and config.get("addition_embed_type") == "text_time"

    def has_shape(self, config):
        return config.get("addition_embed_type") == "text_time"

    def reads_text_parts(self, folder):
        """Its two text encoders, and no third (Stable Diffusion 3's)."""
        return SDXLTextEncoders.is_source(folder) and not os.path.lexists(os.path.join(folder, "text_encoder_3"))

    def unsupported(self, config):
        if not config.get("addition_time_embed_dim") or not config.get("projection_class_embeddings_input_dim"):
            return ("its UNet takes Stable Diffusion XL's added conditions (addition_embed_type 'text_time') without "
                    "addition_time_embed_dim and projection_class_embeddings_input_dim, which set their widths")
        return None

    def unsupported_source(self, source):
        """The SDXL refiner: its pipeline conditions on an aesthetic score (`requires_aesthetics_score`) and has
        OpenCLIP-bigG alone (`text_encoder_2/` without `text_encoder/`)."""
        try:
            with open(os.path.join(source, "model_index.json"), encoding="utf-8") as f:
                index = json.load(f)
        except (OSError, ValueError):
            index = {}
        alone = os.path.isdir(os.path.join(source, "text_encoder_2")) and not os.path.isdir(
            os.path.join(source, "text_encoder"))
        if (isinstance(index, dict) and index.get("requires_aesthetics_score")) or alone:
            return ("a Stable Diffusion XL refiner (an aesthetic score among its time ids, OpenCLIP-bigG alone as its "
                    "text encoder), which this framework does not train, sample or export: it trains the SDXL base "
                    "model's UNet, with both text encoders and the image's size and crop")
        return None

    def predict(self, backbone, sample, timesteps, conditioning):
        added = {"text_embeds": conditioning.pooled, "time_ids": conditioning.added[GEOMETRY]}
        return backbone(sample, timesteps, encoder_hidden_states=conditioning.states,
                        added_cond_kwargs=added).sample

    def pipeline(self, unet, text_encoder, vae, tokenizer, scheduler):
        """Without the invisible watermark: a pretraining framework's samples are its own."""
        import ppdiffusers

        from ldm.models.text import family_of

        if family_of(text_encoder) is not SDXL_TEXT:
            raise no_pipeline(unet, text_encoder)
        clip_l, clip_g = text_encoder.encoders
        first, second = tokenizer.tokenizers
        return ppdiffusers.StableDiffusionXLPipeline(
            vae=vae, text_encoder=clip_l, text_encoder_2=clip_g, tokenizer=first, tokenizer_2=second, unet=unet,
            scheduler=scheduler, add_watermarker=False,
            force_zeros_for_empty_prompt=bool(text_encoder.config.force_zeros_for_empty_prompt))

    def describe_backbone(self, backbone):
        c = backbone.config
        return (f"{super().describe_backbone(backbone)}; added embedding of the pooled text vector "
                f"({c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim} wide) and 6 time ids "
                f"(original size, crop corner, target size) of {c.addition_time_embed_dim} each")

    def loading_lines(self, tokens):
        length = trained_length(tokens)
        return [f"diffusers (PyTorch). The pipeline pads both prompts to the tokenizers' `model_max_length` "
                f"({length}), the caption length this model was trained with, and conditions on the requested size "
                "as original and target, crop (0, 0), as this model samples here:", "",
                *diffusers_lines(self.pipeline_class, f"{PROMPT}, num_inference_steps=30"),
                "ppdiffusers (PaddlePaddle) reads this layout:", "", "```python",
                "from ppdiffusers import StableDiffusionXLPipeline", "",
                'pipeline = StableDiffusionXLPipeline.from_pretrained("THIS_FOLDER", from_diffusers=True)', "```", "",
                "ldm-laion samples and converts it too:", "", *LDM_GENERATE]


SDXL = SDXLFamily()
