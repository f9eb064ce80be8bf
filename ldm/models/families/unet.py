"""The UNet families: ppdiffusers' `UNet2DConditionModel` conditioned by cross-attention on text states.

- `LDM`: the CompVis latent diffusion model, its LDMBert text encoder trained with the UNet (`LDMTextToImagePipeline`);
- `SD`: Stable Diffusion 1.x and 2.x, a frozen CLIP text encoder (`StableDiffusionPipeline`), or a T5 one (padding
  masked in the cross-attention; no pipeline class gives a UNet the mask).
"""

from __future__ import annotations

import logging

from ldm.models.families.base import (
    LDM_GENERATE,
    PROMPT,
    ModelFamily,
    PipelineError,
    diffusers_lines,
    no_pipeline,
    parameters,
    trained_length,
)
from ldm.models.text import CLIP, LDMBERT, T5

logger = logging.getLogger("ldm.models")


class UNetFamily(ModelFamily):
    backbone_folder = "unet"
    backbone_class = "UNet2DConditionModel"

    def reads_backbone(self, config):
        """Stable Diffusion XL's UNet (`addition_embed_type: text_time`) is its own family's."""
        return super().reads_backbone(config) and config.get("addition_embed_type") != "text_time"

    def has_shape(self, config):
        return not (config.get("pos_embed_max_size") or config.get("joint_attention_dim")
                    or config.get("norm_type") == "ada_norm_single")

    def unsupported(self, config):
        added = config.get("addition_embed_type")
        if added:
            return (f"its UNet takes added conditions, addition_embed_type {added!r}, which this framework does not "
                    "give it: it trains Stable Diffusion 1.x, 2.x and XL UNets")
        return None

    def init_weights(self, backbone):
        """As the original LDM (`ldm.models.init`)."""
        from ldm.models.init import init_ldm_weights

        init_ldm_weights(backbone, None)

    def follow_resolution(self, backbone, latent):
        """A UNet's `sample_size` follows the training resolution: the size an exported pipeline samples at by
        default."""
        if backbone.config.sample_size != latent:
            logger.info("UNet sample_size %d -> %d", backbone.config.sample_size, latent)
            backbone.register_to_config(sample_size=latent)

    def predict(self, backbone, sample, timesteps, conditioning):
        return backbone(sample, timesteps, encoder_hidden_states=conditioning.states,
                        encoder_attention_mask=conditioning.mask).sample

    def describe_backbone(self, backbone):
        c = backbone.config
        return (f"UNet2DConditionModel: {parameters(backbone)}, channels {list(c.block_out_channels)}, "
                f"{c.layers_per_block} ResNet layers per block, {c.attention_head_dim} attention heads, "
                f"cross-attention width {c.cross_attention_dim}, latents {c.in_channels}x{c.sample_size}x"
                f"{c.sample_size}")


class LDMFamily(UNetFamily):
    name = "ldm"
    text_kinds = (LDMBERT,)
    pipeline_class = "LDMTextToImagePipeline"
    pipeline_parts = ("vqvae", "bert", "tokenizer", "unet", "scheduler")
    fixed_diffusers_prompt = True

    def pipeline(self, unet, text_encoder, vae, tokenizer, scheduler):
        import ppdiffusers

        return ppdiffusers.LDMTextToImagePipeline(vqvae=vae, bert=text_encoder, tokenizer=tokenizer, unet=unet,
                                                  scheduler=scheduler)

    def loading_lines(self, tokens):
        return ["diffusers (PyTorch; its pipeline gives the text encoder 77 tokens, which this one reads: ldm-laion "
                "refuses to export a model of fewer for diffusers):", "",
                *diffusers_lines(self.pipeline_class, f"{PROMPT}, num_inference_steps=50"),
                "ppdiffusers (PaddlePaddle), with ldm-laion, which reads this layout (ppdiffusers' own "
                "`from_pretrained(..., from_diffusers=True)` fails for the LDMBert text encoder in 0.29):", "",
                *LDM_GENERATE]


class SDFamily(UNetFamily):
    name = "sd"
    text_kinds = (CLIP, T5)
    pipeline_class = "StableDiffusionPipeline"
    diffusers_samples_flow = False
    pipeline_parts = ("vae", "text_encoder", "tokenizer", "unet", "scheduler")

    def pipeline(self, unet, text_encoder, vae, tokenizer, scheduler):
        """No safety checker: a pretraining framework's own samples need none."""
        import ppdiffusers

        from ldm.models.text import family_of

        if family_of(text_encoder) is T5:
            raise PipelineError("a UNet with a T5 text encoder is not exported as a pipeline: neither ppdiffusers' nor "
                                "diffusers' UNet pipelines give it the encoder's mask. Sample from the checkpoint with "
                                "python -m ldm.generate --model CHECKPOINT")
        if family_of(text_encoder) is not CLIP:
            raise no_pipeline(unet, text_encoder)
        if hasattr(text_encoder, "text_projection"):
            raise PipelineError("StableDiffusionPipeline gives its UNet the text encoder's first output, which a "
                                "CLIPTextModelWithProjection makes its pooled projection, not its states: such a model "
                                "is not exported as a pipeline. Sample from the checkpoint with python -m ldm.generate")
        return ppdiffusers.StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                                   requires_safety_checker=False)

    def loading_lines(self, tokens):
        length = trained_length(tokens)
        return [f"diffusers (PyTorch). The pipeline pads prompts to the tokenizer's `model_max_length` ({length}), "
                "the caption length this model was trained with; it loads without a safety checker:", "",
                *diffusers_lines(self.pipeline_class, f"{PROMPT}, num_inference_steps=50"),
                "ppdiffusers (PaddlePaddle), with ldm-laion, which reads this layout and writes ppdiffusers' own, "
                "which ppdiffusers' `StableDiffusionPipeline.from_pretrained` loads:", "", *LDM_GENERATE]


LDM = LDMFamily()
SD = SDFamily()
