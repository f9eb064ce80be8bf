"""Backbones, by family: the network that denoises latents, read from a model folder's `unet/` or `transformer/`.

- `unet`: ppdiffusers' `UNet2DConditionModel` (the CompVis LDM, Stable Diffusion);
- `pixart`: ppdiffusers' `Transformer2DModel` in its PixArt-α form (a DiT: patches, adaLN-single
  `norm_type="ada_norm_single"`, cross-attention to T5 states projected from `caption_channels`). With
  `out_channels` = 2 × `in_channels` it predicts the noise and, in the other half, the interpolation of the variance
  PixArt learns with improved DDPM's variational bound ("learned sigma": `predict_with_variance`, trained by
  `ldm.models.noise.variational_bound`); sampling reads the noise half (`predict`), as PixArt's pipelines do. Its
  position embedding is 2-D sin-cos over the patch grid of `sample_size`; ppdiffusers' `PatchEmbed`
  recomputes it for another grid (an aspect-ratio bucket), its positions scaled to the trained grid's span, so a DiT
  takes any latent shape that is a multiple of its patch. `sample_size` sets that span, so it is not changed to
  follow `--resolution` (`follow_resolution`);
- `sd3`: ppdiffusers' `SD3Transformer2DModel` (Stable Diffusion 3's MMDiT: text and image tokens in joint attention,
  conditioned on the pooled text vector as well). Its position embedding is a crop of a `pos_embed_max_size` grid,
  centred, for any patch grid up to it: a bucket takes its own crop.

Everything outside `ldm/models` asks the backbone through these functions, never which family it is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import paddle

from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.models")


@dataclass(frozen=True)
class BackboneFamily:
    name: str
    folder: str  # the part's folder in a pipeline
    class_name: str  # ppdiffusers' class, which this framework builds
    # the `_class_name`s of the configs read as this family: diffusers 0.28 on saves PixArt-α's transformer as a
    # `PixArtTransformer2DModel` (the same weights, less the unused `caption_projection.y_embedding`)
    config_names: tuple[str, ...] = ()

    def model_class(self):
        import ppdiffusers

        from ldm.runtime.compat import buildable_caption_projection, joint_attention_everywhere, sd3_recompute_unpacks

        buildable_caption_projection()
        joint_attention_everywhere()
        sd3_recompute_unpacks()
        return getattr(ppdiffusers, self.class_name)

    def reads(self, config_name: str | None) -> bool:
        return config_name in (self.class_name, *self.config_names)


UNET = BackboneFamily("unet", "unet", "UNet2DConditionModel")
PIXART = BackboneFamily("pixart", "transformer", "Transformer2DModel", ("PixArtTransformer2DModel",))
SD3 = BackboneFamily("sd3", "transformer", "SD3Transformer2DModel")
FAMILIES = (UNET, PIXART, SD3)


def backbone_family_of(source: str) -> BackboneFamily | None:
    """The family of the backbone a model folder holds (its `unet/`, or its `transformer/` told by its config's
    `_class_name`; read or not: an unreadable one is said to be so by its loader); None: neither."""
    found = [f for f in FAMILIES if os.path.lexists(os.path.join(source, f.folder))]
    if len(found) > 1:
        return next((f for f in found if f.reads(config_class_name(os.path.join(source, f.folder)))), found[0])
    return found[0] if found else None


def config_class_name(folder: str) -> str | None:
    import json

    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None


def family_of(backbone) -> BackboneFamily:
    names = {cls.__name__ for cls in type(backbone).__mro__}
    return next(f for f in FAMILIES if f.class_name in names)


def config_family(config: dict) -> BackboneFamily:
    """The family of the backbone a config describes: by its `_class_name`, else by its shape."""
    named = next((f for f in FAMILIES if f.reads(config.get("_class_name"))), None)
    if named is not None:
        return named
    if config.get("pos_embed_max_size") or config.get("joint_attention_dim"):
        return SD3
    return PIXART if config.get("norm_type") == "ada_norm_single" else UNET


def unsupported_config(config: dict) -> str | None:
    """Why this framework cannot train or sample the backbone a config describes as it was made (read before its
    weights: a model variant ppdiffusers' class does not build, or conditions this framework does not give), or
    None. Every command asks this, through `ldm.models.build.unsupported_folder`."""
    return UNSUPPORTED[config_family(config).name](config)


def unsupported_unet(config: dict) -> str | None:
    added = config.get("addition_embed_type")
    if added:
        sdxl = " (Stable Diffusion XL's pooled text and image sizes)" if added == "text_time" else ""
        return (f"its UNet takes added conditions, addition_embed_type {added!r}{sdxl}, which this framework does not "
                "give it: it trains Stable Diffusion 1.x and 2.x UNets")
    return None


def unsupported_pixart(config: dict) -> str | None:
    """ppdiffusers' `Transformer2DModel` gives a PixArt DiT the resolution and aspect-ratio conditions exactly when its
    sample_size is 128 and its position embedding's interpolation scale sample_size // 64 (at least 1); diffusers'
    class reads both from the config (`use_additional_conditions`, `interpolation_scale`; None: those defaults)."""
    norm = config.get("norm_type", "ada_norm_single")
    if norm != "ada_norm_single":
        return (f"its transformer is a Transformer2DModel with norm_type {norm!r}, not PixArt-α's text-conditioned DiT "
                "(adaLN-single, ada_norm_single), the only Transformer2DModel this framework trains")
    size = int(config.get("sample_size") or 0)
    conditions = config.get("use_additional_conditions")
    if conditions or (conditions is None and size == 128):
        return ("its transformer takes resolution and aspect-ratio conditions (use_additional_conditions: PixArt-α's "
                "1024 px models), which this framework does not give it; the 512 px PixArt-α (sample_size 64) trains")
    if size == 128:
        return ("its transformer is a PixArt DiT at sample_size 128 without resolution and aspect-ratio conditions "
                "(use_additional_conditions false, as PixArt-Σ's 1024 px models), which ppdiffusers' "
                "Transformer2DModel, the one this framework trains, cannot build: it gives every sample_size-128 DiT "
                "those conditions")
    scale, built = config.get("interpolation_scale"), max(size // 64, 1)
    if scale is not None and float(scale) != built:
        return (f"its transformer's position embedding has interpolation_scale {scale:g}, which ppdiffusers' "
                f"Transformer2DModel, the one this framework trains, does not read (it takes sample_size // 64, "
                f"{built}, and would place the patches elsewhere than the model learned)")
    return None


def unsupported_sd3(config: dict) -> str | None:
    """Stable Diffusion 3.5's MMDiT normalises queries and keys (`qk_norm`) and, in Medium, adds a second self-attention
    to its first blocks (`dual_attention_layers`, MMDiT-X): ppdiffusers 0.29's `SD3Transformer2DModel` has neither."""
    norm, dual = config.get("qk_norm"), list(config.get("dual_attention_layers") or ())
    features = ([f"qk_norm {norm!r}"] if norm else []) + (
        [f"dual attention in layers {dual[0]}-{dual[-1]}" if dual == list(range(dual[0], dual[-1] + 1))
         else f"dual attention in layers {', '.join(map(str, dual))}"] if dual else [])
    if features:
        return (f"its transformer is a Stable Diffusion 3.5 MMDiT ({' and '.join(features)}), which ppdiffusers' "
                "SD3Transformer2DModel, the one this framework trains, does not have: it trains Stable Diffusion 3 "
                "Medium's MMDiT")
    return None


UNSUPPORTED = {"unet": unsupported_unet, "pixart": unsupported_pixart, "sd3": unsupported_sd3}


class ImageSizeError(UserError, ValueError):
    """An image size the backbone and autoencoder cannot make."""


def autoencoder_factor(vae_config) -> int:
    """The autoencoder's downsampling: 2 per block after the first."""
    return 2 ** (len(getattr(vae_config, "block_out_channels", None) or (64,)) - 1)


def largest_side(config, vae_config) -> int | None:
    """The largest image side (pixels) the backbone takes: SD3's position embedding is a crop of a
    `pos_embed_max_size`-patch grid, so no more patches than that fit on a side; None: no limit."""
    grid = getattr(config, "pos_embed_max_size", None)
    return int(grid) * int(config.patch_size) * autoencoder_factor(vae_config) if grid else None


def check_image_size(config, vae_config, height: int, width: int, what: str) -> None:
    """Refuse an image size (pixels; `what` names it) the backbone and autoencoder cannot make, in one line naming the
    step or the largest side: every side a multiple of the autoencoder's downsampling, times a DiT's patch (whole
    patches of whole latents; a UNet resizes between its levels), and within `largest_side`."""
    factor = autoencoder_factor(vae_config)
    patch = int(getattr(config, "patch_size", None) or 1)
    step, largest = factor * patch, largest_side(config, vae_config)
    if height < step or width < step or height % step or width % step:
        how = (f"the DiT's size step: patch {patch} x the autoencoder's downsampling {factor}" if patch > 1 else
               "the autoencoder's downsampling")
        raise ImageSizeError(f"{what}: each side must be a positive multiple of {step} ({how})")
    if largest is not None and max(height, width) > largest:
        raise ImageSizeError(f"{what}: the largest side this {type_name(config)} takes is {largest} "
                             f"px (its position embedding spans pos_embed_max_size {config.pos_embed_max_size} "
                             f"patches of {config.patch_size} latents, {factor} px each)")


def autoencoder_misfit(config, vae_config, autoencoder: str = "the autoencoder") -> str | None:
    """Why the backbone cannot read the latents of the `autoencoder` (their channels), or None."""
    reads, made = int(getattr(config, "in_channels", 4)), int(getattr(vae_config, "latent_channels", 4))
    if reads == made:
        return None
    return (f"its {type_name(config)} reads latents of {reads} channels and {autoencoder} makes {made}: they cannot "
            "work together (Stable Diffusion 3's autoencoder makes 16 channels, SD 1/2's and PixArt-α's 4); pass the "
            "autoencoder the backbone was trained with")


def type_name(config) -> str:
    return getattr(config, "_class_name", None) or "backbone"


def predict(backbone, sample: paddle.Tensor, timesteps: paddle.Tensor, states: paddle.Tensor,
            mask: paddle.Tensor | None, pooled: paddle.Tensor | None = None) -> paddle.Tensor:
    """The backbone's prediction (of `sample`'s channels) for latents at `timesteps` (a scalar or one per sample),
    conditioned on text `states` (their `mask`: None, or 1 for a real token) and, for a backbone that reads one
    (`reads_pooled`), the pooled text vector."""
    return predict_with_variance(backbone, sample, timesteps, states, mask, pooled)[0]


def predict_with_variance(backbone, sample, timesteps, states, mask, pooled=None):
    """(prediction, the learned variance's values in [-1, 1] or None: a backbone with twice the latents' channels)."""
    family = family_of(backbone)
    if family is UNET:
        out = backbone(sample, timesteps, encoder_hidden_states=states, encoder_attention_mask=mask).sample
    else:
        if timesteps.ndim == 0:
            timesteps = timesteps.expand([sample.shape[0]])
        if family is SD3:
            out = backbone(sample, encoder_hidden_states=states, pooled_projections=pooled, timestep=timesteps).sample
        else:
            out = backbone(sample, encoder_hidden_states=states, timestep=timesteps, encoder_attention_mask=mask,
                           added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
    channels = sample.shape[1]
    if out.shape[1] == 2 * channels:  # learned sigma: the second half is no prediction of the latents
        return out[:, :channels], out[:, channels:]
    return out, None


def freeze_unexported(backbone) -> list[str]:
    """Freeze the parameters diffusers' class of the backbone does not have, so that a trained model samples in
    diffusers as here; their names. ppdiffusers' SD3 transformer gives a layer norm without affine parameters
    (`elementwise_affine=False`: the last block's context norm, the output norm) a bias, which diffusers' does not
    have and ignores on loading: it stays as built or read (zero from scratch and from a diffusers folder)."""
    from ldm.models.torch_layout import unexported_biases

    if family_of(backbone) is not SD3:
        return []
    parameters = dict(backbone.named_parameters())
    frozen = unexported_biases(backbone)
    for name in frozen:
        parameters[name].stop_gradient = True
    return frozen


def size_step(config) -> int:
    """How many latent rows one step of the backbone's grid takes: 2 per UNet level after the first, a DiT's patch."""
    if getattr(config, "patch_size", None):
        return int(config.patch_size)
    return 2 ** (len(config.block_out_channels) - 1)


def context_width(config) -> int:
    """The width of the text states the backbone reads."""
    return int(getattr(config, "joint_attention_dim", None) or getattr(config, "caption_channels", None)
               or config.cross_attention_dim)


def reads_pooled(config) -> int | None:
    """The width of the pooled text vector the backbone reads (SD3's `pooled_projections`), or None."""
    width = getattr(config, "pooled_projection_dim", None)
    return int(width) if width else None


def follow_resolution(backbone, latent: int) -> None:
    """A UNet's `sample_size` follows the training resolution (the size an exported pipeline samples at by default);
    a DiT's stays: it sets the span of its position embedding, and a reloaded model would embed positions otherwise."""
    config = backbone.config
    if config.sample_size == latent:
        return
    if family_of(backbone) is not UNET:
        logger.info("%s sample_size stays %d at latents of %d (it sets the span of the position embedding)",
                    type(backbone).__name__, config.sample_size, latent)
        return
    logger.info("UNet sample_size %d -> %d", config.sample_size, latent)
    backbone.register_to_config(sample_size=latent)


@paddle.no_grad()
def init_backbone(backbone) -> None:
    """From scratch: a UNet as the original LDM (`ldm.models.init`); a DiT as PixArt's `initialize_weights`: Xavier-
    uniform linear layers and patch projection (biases 0), N(0, 0.02) for the timestep MLP, adaLN-single's projection
    and the caption projection, zero for each block's cross-attention output and the final projection; an MMDiT (SD3's
    code ships no initialisation) as DiT's blocks: N(0, 0.02) for the timestep and pooled-text MLPs, zero for every
    adaLN modulation (each block starts as the identity) and the final projection."""
    from paddle.nn.initializer import Normal

    from ldm.models.init import init_ldm_weights, zero_

    family = family_of(backbone)
    if family is UNET:
        init_ldm_weights(backbone, None)
        return
    init_linear_and_patches(backbone)
    if family is SD3:
        embedder = backbone.time_text_embed
        normal = (embedder.timestep_embedder.linear_1, embedder.timestep_embedder.linear_2,
                  embedder.text_embedder.linear_1, embedder.text_embedder.linear_2)
        zeroed = [norm.linear for block in backbone.transformer_blocks for norm in (block.norm1, block.norm1_context)]
        zeroed.append(backbone.norm_out.linear)
    else:
        single, caption = backbone.adaln_single, backbone.caption_projection
        normal = (single.emb.timestep_embedder.linear_1, single.emb.timestep_embedder.linear_2, single.linear,
                  caption.linear_1, caption.linear_2)
        zeroed = [block.attn2.to_out[0] for block in backbone.transformer_blocks]
    for layer in normal:
        Normal(0.0, 0.02)(layer.weight)
    for layer in [*zeroed, backbone.proj_out]:
        zero_(layer)


def init_linear_and_patches(backbone) -> None:
    """A DiT's Xavier-uniform linear layers and patch projection (as a linear layer over the flattened patch, PixArt's
    x_embedder), biases 0."""
    from paddle.nn.initializer import Constant, XavierUniform

    for layer in backbone.sublayers():
        if isinstance(layer, paddle.nn.Linear):
            XavierUniform()(layer.weight)
            if layer.bias is not None:
                Constant(0.0)(layer.bias)
    proj = backbone.pos_embed.proj
    fan_in, fan_out = proj.weight.shape[1] * proj.weight.shape[2] * proj.weight.shape[3], proj.weight.shape[0]
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    proj.weight.set_value(paddle.uniform(proj.weight.shape, min=-bound, max=bound))
    Constant(0.0)(proj.bias)


class PipelineError(ValueError):
    """A model no text-to-image pipeline class of ppdiffusers or diffusers samples as it was trained."""


def text_to_image_pipeline(unet, text_encoder, vae, tokenizer, scheduler):
    """The ppdiffusers pipeline of a backbone and a text encoder: `LDMTextToImagePipeline` (a UNet, LDMBert),
    `StableDiffusionPipeline` (a UNet, CLIP; no safety checker, as a pretraining framework's own samples need none),
    `PixArtAlphaPipeline` (a DiT, T5: it gives the transformer the encoder's mask), `StableDiffusion3Pipeline` (an
    MMDiT, SD3's three encoders). A UNet with T5 has none: neither library's UNet pipelines pass the mask."""
    import ppdiffusers

    from ldm.models.text import CLIP, LDMBERT, SD3_TEXT, T5
    from ldm.models.text import family_of as text_family_of

    pair = (family_of(unet), text_family_of(text_encoder))
    if pair == (SD3, SD3_TEXT):
        clip_l, clip_g, t5 = text_encoder.encoders
        first, second, third = tokenizer.tokenizers
        return ppdiffusers.StableDiffusion3Pipeline(
            transformer=unet, scheduler=scheduler, vae=vae, text_encoder=clip_l, tokenizer=first,
            text_encoder_2=clip_g, tokenizer_2=second, text_encoder_3=t5, tokenizer_3=third)
    if pair == (UNET, LDMBERT):
        return ppdiffusers.LDMTextToImagePipeline(vqvae=vae, bert=text_encoder, tokenizer=tokenizer, unet=unet,
                                                  scheduler=scheduler)
    if pair == (UNET, CLIP) and hasattr(text_encoder, "text_projection"):
        raise PipelineError("StableDiffusionPipeline gives its UNet the text encoder's first output, which a "
                            "CLIPTextModelWithProjection makes its pooled projection, not its states: such a model is "
                            "not exported as a pipeline. Sample from the checkpoint with python -m ldm.generate")
    if pair == (UNET, CLIP):
        return ppdiffusers.StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                                   requires_safety_checker=False)
    if pair == (PIXART, T5):
        return ppdiffusers.PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                                               transformer=unet, scheduler=scheduler)
    if pair[1] is T5:
        raise PipelineError("a UNet with a T5 text encoder is not exported as a pipeline: neither ppdiffusers' nor "
                            "diffusers' UNet pipelines give it the encoder's mask. Sample from the checkpoint with "
                            "python -m ldm.generate --model CHECKPOINT")
    raise PipelineError(f"a {type(unet).__name__} with a {pair[1].name} text encoder has no text-to-image pipeline "
                        "class in ppdiffusers or diffusers; sample from the checkpoint with python -m ldm.generate")


def pipeline_class_name(unet, text_encoder) -> str:
    from ldm.models.text import family_of as text_family_of

    if family_of(unet) is PIXART:
        return "PixArtAlphaPipeline"
    if family_of(unet) is SD3:
        return "StableDiffusion3Pipeline"
    return "LDMTextToImagePipeline" if text_family_of(text_encoder).name == "ldmbert" else "StableDiffusionPipeline"


def describe_backbone(backbone) -> str:
    """One line of a model card: the backbone's class, size and shape."""
    c = backbone.config
    parameters = f"{sum(int(p.numel()) for p in backbone.parameters()) / 1e6:.2f} M parameters"
    latents = f"latents {c.in_channels}x{c.sample_size}x{c.sample_size}"
    if family_of(backbone) is SD3:
        return (f"SD3Transformer2DModel (MMDiT): {parameters}, {c.num_layers} joint blocks of {c.num_attention_heads} "
                f"heads x {c.attention_head_dim}, patch {c.patch_size}, text states {c.joint_attention_dim} wide "
                f"projected to {c.caption_projection_dim}, pooled text {c.pooled_projection_dim}, {latents}")
    if family_of(backbone) is PIXART:
        return (f"Transformer2DModel (PixArt-α DiT): {parameters}, {c.num_layers} blocks of {c.num_attention_heads} "
                f"heads x {c.attention_head_dim}, patch {c.patch_size}, adaLN-single, caption channels "
                f"{c.caption_channels}, {latents}, {c.out_channels} output channels (the first {c.in_channels} "
                "sampled)")
    return (f"UNet2DConditionModel: {parameters}, channels {list(c.block_out_channels)}, {c.layers_per_block} ResNet "
            f"layers per block, {c.attention_head_dim} attention heads, cross-attention width "
            f"{c.cross_attention_dim}, {latents}")
