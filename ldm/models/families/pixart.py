"""PixArt-α: ppdiffusers' `Transformer2DModel` in its PixArt-α form (a DiT: patches, adaLN-single
`norm_type="ada_norm_single"`, cross-attention to T5 states projected from `caption_channels`), with a frozen T5
(`PixArtAlphaPipeline`), or LDMBert trained with it (the demo's `dit-demo`, which no pipeline class samples).

With `out_channels` = 2 x `in_channels` it predicts the noise and, in the other half, the interpolation of the
variance PixArt learns with improved DDPM's variational bound ("learned sigma": `predict_with_variance`, trained by
`ldm.models.noise.variational_bound`); sampling reads the noise half (`predict`), as PixArt's pipelines do. Its
position embedding is 2-D sin-cos over the patch grid of `sample_size`; ppdiffusers' `PatchEmbed` recomputes it for
another grid (an aspect-ratio bucket), its positions scaled to the trained grid's span, so a DiT takes any latent
shape that is a multiple of its patch. `sample_size` sets that span, so it is not changed to follow `--resolution`.

PixArt-α's multi-scale models (1024 px, `use_additional_conditions`) also embed each image's resolution and aspect
ratio in adaLN-single's timestep embedding. They come from the image's geometry (`GEOMETRY`), as PixArt-α's
multi-scale data (`InternalDataMS`) gives them: the resolution is the image's size before any resize (`img_hw`: its
original height and width), the aspect ratio its bucket's height over width (`closest_ratio`: PixArt's table lists
each bucket's ratio rounded to two decimals, this project's buckets are its own, so the ratio is the crop's exact
one); sampling gives the requested (height, width) and height / width, as diffusers' `PixArtAlphaPipeline` does.
"""

from __future__ import annotations

import paddle

from ldm.models.conditioning import GEOMETRY
from ldm.models.families.base import (
    LDM_GENERATE,
    PROMPT,
    ModelFamily,
    diffusers_lines,
    init_linear_and_patches,
    no_pipeline,
    parameters,
    per_sample,
    trained_length,
)
from ldm.models.text import LDMBERT, T5
from ldm.runtime.compat import private


class PixArtFamily(ModelFamily):
    name = "pixart"
    backbone_folder = "transformer"
    backbone_class = "Transformer2DModel"
    # diffusers 0.28 on saves PixArt-α's transformer as a `PixArtTransformer2DModel` (the same weights, less the
    # unused `caption_projection.y_embedding`)
    config_names = ("PixArtTransformer2DModel",)
    text_kinds = (T5, LDMBERT)
    pipeline_class = "PixArtAlphaPipeline"
    diffusers_samples_flow = False
    pipeline_parts = ("vae", "text_encoder", "tokenizer", "transformer", "scheduler")

    def has_shape(self, config):
        return config.get("norm_type") == "ada_norm_single" and not (config.get("pos_embed_max_size")
                                                                      or config.get("joint_attention_dim"))

    def unsupported(self, config):
        """ppdiffusers' `Transformer2DModel` takes a PixArt DiT's position embedding's interpolation scale as
        sample_size // 64 (at least 1), and gives it the resolution and aspect-ratio conditions when its sample_size is
        128; diffusers' class reads both from the config (`use_additional_conditions`, `interpolation_scale`; None:
        those defaults). The conditions are built as the config says (`buildable_additional_conditions`)."""
        norm = config.get("norm_type", "ada_norm_single")
        if norm != "ada_norm_single":
            return (f"its transformer is a Transformer2DModel with norm_type {norm!r}, not PixArt-α's text-conditioned "
                    "DiT (adaLN-single, ada_norm_single), the only Transformer2DModel this framework trains")
        size = int(config.get("sample_size") or 0)
        if size == 128 and config.get("use_additional_conditions") is False:
            return ("its transformer is a PixArt DiT at sample_size 128 without resolution and aspect-ratio conditions "
                    "(use_additional_conditions false, as PixArt-Σ's 1024 px models), which this framework does not "
                    "train: PixArt-α's 1024 px models (with them) and 512 px models (sample_size 64) train")
        width = int(config.get("num_attention_heads") or 0) * int(config.get("attention_head_dim") or 0)
        if additional_conditions(config) and width % 3:
            return (f"its transformer takes resolution and aspect-ratio conditions at a width of {width}, which "
                    "adaLN-single cannot split in three (two thirds for the resolution, one for the aspect ratio)")
        scale, built = config.get("interpolation_scale"), max(size // 64, 1)
        if scale is not None and float(scale) != built:
            return (f"its transformer's position embedding has interpolation_scale {scale:g}, which ppdiffusers' "
                    f"Transformer2DModel, the one this framework trains, does not read (it takes sample_size // 64, "
                    f"{built}, and would place the patches elsewhere than the model learned)")
        return None

    def prepare_library(self):
        buildable_caption_projection()
        buildable_additional_conditions()

    def reads_added(self, backbone):
        return (GEOMETRY,) if backbone.use_additional_conditions else ()

    @paddle.no_grad()
    def init_weights(self, backbone):
        """As PixArt's `initialize_weights`: Xavier-uniform linear layers and patch projection (biases 0), N(0, 0.02)
        for the timestep MLP, adaLN-single's projection and the caption projection, zero for each block's
        cross-attention output and the final projection."""
        from paddle.nn.initializer import Normal

        from ldm.models.init import zero_

        init_linear_and_patches(backbone)
        single, caption = backbone.adaln_single, backbone.caption_projection
        for layer in (single.emb.timestep_embedder.linear_1, single.emb.timestep_embedder.linear_2, single.linear,
                      caption.linear_1, caption.linear_2):
            Normal(0.0, 0.02)(layer.weight)
        for layer in [*(block.attn2.to_out[0] for block in backbone.transformer_blocks), backbone.proj_out]:
            zero_(layer)

    def predict(self, backbone, sample, timesteps, conditioning):
        """The resolution and aspect-ratio conditions of PixArt-α's multi-scale models come from the geometry: the
        original (height, width) and the target's height / width (None: a backbone without them)."""
        added = {"resolution": None, "aspect_ratio": None}
        if backbone.use_additional_conditions:
            self.check_conditioning(conditioning, backbone)
            added = size_conditions(conditioning.added[GEOMETRY])
        return backbone(sample, encoder_hidden_states=conditioning.states, timestep=per_sample(timesteps, sample),
                        encoder_attention_mask=conditioning.mask, added_cond_kwargs=added).sample

    def pipeline(self, unet, text_encoder, vae, tokenizer, scheduler):
        """`PixArtAlphaPipeline` gives the transformer the T5's mask."""
        import ppdiffusers

        from ldm.models.text import family_of

        if family_of(text_encoder) is not T5:
            raise no_pipeline(unet, text_encoder)
        return ppdiffusers.PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                                               transformer=unet, scheduler=scheduler)

    def describe_backbone(self, backbone):
        c = backbone.config
        return (f"Transformer2DModel (PixArt-α DiT): {parameters(backbone)}, {c.num_layers} blocks of "
                f"{c.num_attention_heads} heads x {c.attention_head_dim}, patch {c.patch_size}, adaLN-single, caption "
                f"channels {c.caption_channels}, latents {c.in_channels}x{c.sample_size}x{c.sample_size}, "
                f"{c.out_channels} output channels (the first {c.in_channels} sampled)")

    def loading_lines(self, tokens):
        length = trained_length(tokens)
        call = (f"{PROMPT}, num_inference_steps=20, {f'max_sequence_length={tokens}, ' if tokens else ''}"
                "use_resolution_binning=False, clean_caption=False")
        return ["diffusers (PyTorch). The pipeline pads prompts to `max_sequence_length` (120 unless given): this "
                f"model was trained on {length} (the T5's padding is masked, so the length only bounds a prompt); "
                "`use_resolution_binning=False` samples at sizes other than its bins, `clean_caption=False` needs no "
                "`bs4` or `ftfy`:", "", *diffusers_lines(self.pipeline_class, call),
                "ppdiffusers (PaddlePaddle) reads this layout (its pipeline pads prompts to 120 tokens, whatever the "
                "model; call it without `max_sequence_length`). ppdiffusers 0.29 cannot build PixArt's transformer as "
                "it ships; ldm-laion's family prepares it:", "", "```python",
                "from ppdiffusers import PixArtAlphaPipeline", "",
                "from ldm.models.families.pixart import PIXART", "",
                "PIXART.prepare_library()",
                'pipeline = PixArtAlphaPipeline.from_pretrained("THIS_FOLDER", from_diffusers=True)', "```", "",
                "ldm-laion samples and converts it too:", "", *LDM_GENERATE]


def buildable_caption_projection() -> None:
    """ppdiffusers 0.29's `CaptionProjection` (PixArt-α's `Transformer2DModel`) draws its `y_embedding` buffer with
    `paddle.randn(num_tokens, in_features)`, which ppdiffusers' own patched `paddle.randn` (`randn_pt(shape, dtype)`)
    reads as a dtype: no PixArt transformer can be built. Its constructor is replaced by the same one with the shape
    as a list (the buffer is diffusers' unconditional caption, kept in the state dict as in their checkpoints)."""
    from ppdiffusers.models import embeddings

    projection = private(embeddings, "CaptionProjection", "building PixArt-α's Transformer2DModel")
    if getattr(projection, "_ldm_buildable", False):
        return

    def __init__(self, in_features, hidden_size, num_tokens=120):
        paddle.nn.Layer.__init__(self)
        self.linear_1 = paddle.nn.Linear(in_features=in_features, out_features=hidden_size)
        self.act_1 = paddle.nn.GELU(approximate="tanh")
        self.linear_2 = paddle.nn.Linear(in_features=hidden_size, out_features=hidden_size)
        self.register_buffer("y_embedding", paddle.randn([num_tokens, in_features]) / in_features ** 0.5)

    projection.__init__ = __init__
    projection._ldm_buildable = True


def size_conditions(geometry: paddle.Tensor) -> dict[str, paddle.Tensor]:
    """A multi-scale DiT's `added_cond_kwargs` of images' geometry ([B, 6]): the resolution, their (height, width)
    before any resize ([B, 2]), and the aspect ratio, their crop's height / width ([B, 1])."""
    geometry = geometry.astype("float32")
    return {"resolution": geometry[:, 0:2], "aspect_ratio": geometry[:, 4:5] / geometry[:, 5:6]}


def additional_conditions(config: dict) -> bool:
    """A PixArt DiT config's resolution and aspect-ratio conditions, as diffusers reads it (None: sample_size 128)."""
    conditions = config.get("use_additional_conditions")
    return int(config.get("sample_size") or 0) == 128 if conditions is None else bool(conditions)


def buildable_additional_conditions() -> None:
    """ppdiffusers 0.29's `Transformer2DModel` gives a PixArt DiT the resolution and aspect-ratio embeddings exactly
    when its sample_size is 128 and takes no `use_additional_conditions`, which diffusers' reads from the config
    (PixArt-α's multi-scale models at any size, a tiny one for tests). Its constructor is wrapped to take it: the
    embeddings are built as the config says (the same layers as at 128, `AdaLayerNormSingle`) and it is kept in the
    config, so the model saves and reloads as it was read."""
    import functools
    import inspect

    import ppdiffusers
    from ppdiffusers.models import normalization

    model = private(ppdiffusers, "Transformer2DModel", "building PixArt-α's multi-scale Transformer2DModel")
    single = private(normalization, "AdaLayerNormSingle", "building PixArt-α's multi-scale Transformer2DModel")
    if getattr(model.__init__, "_ldm_additional_conditions", False):
        return
    built = model.__init__
    signature = inspect.signature(built)

    @functools.wraps(built)
    def __init__(self, *args, use_additional_conditions=None, **kwargs):
        built(self, *args, **kwargs)
        if use_additional_conditions is None or self.adaln_single is None:
            return
        if bool(use_additional_conditions) != self.use_additional_conditions:
            self.use_additional_conditions = bool(use_additional_conditions)
            self.adaln_single = single(self.inner_dim, use_additional_conditions=self.use_additional_conditions)
        self.register_to_config(use_additional_conditions=self.use_additional_conditions)

    parameters = list(signature.parameters.values())
    keyword = inspect.Parameter("use_additional_conditions", inspect.Parameter.KEYWORD_ONLY, default=None)
    __init__.__signature__ = signature.replace(parameters=[*parameters, keyword])
    __init__._ldm_additional_conditions = True
    model.__init__ = __init__


PIXART = PixArtFamily()
