"""What every backbone's config says, whichever family it is of (`ldm.models.families`): the image sizes it makes with
an autoencoder, the size step of its grid, the width of the text states and of the pooled vector it reads.
"""

from __future__ import annotations

from ldm.runtime.errors import UserError


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


def size_step(config) -> int:
    """How many latent rows one step of the backbone's grid takes: 2 per UNet level after the first, a DiT's patch."""
    if getattr(config, "patch_size", None):
        return int(config.patch_size)
    return 2 ** (len(config.block_out_channels) - 1)


def context_width(config) -> int:
    """The width of the text states the backbone reads."""
    return int(getattr(config, "joint_attention_dim", None) or getattr(config, "caption_channels", None)
               or config.cross_attention_dim)


# Stable Diffusion XL's time ids: an image's original size, crop corner and target size (`conditioning.GEOMETRY`)
TIME_IDS = 6


def reads_pooled(config) -> int | None:
    """The width of the pooled text vector the backbone reads (SD3's `pooled_projections`; Stable Diffusion XL's
    UNet's `text_embeds`, beside its six time ids in its added embedding's input), or None."""
    if getattr(config, "addition_embed_type", None) == "text_time":
        return int(config.projection_class_embeddings_input_dim) - TIME_IDS * int(config.addition_time_embed_dim)
    width = getattr(config, "pooled_projection_dim", None)
    return int(width) if width else None
