"""What every model family says, and what most say alike (`ModelFamily`): a family's module overrides what its own
backbone, text encoders and pipeline do otherwise."""

from __future__ import annotations

import logging

import paddle

from ldm.models.conditioning import GEOMETRY, Conditioning, sampling_geometry
from ldm.models.text import TextFamily

logger = logging.getLogger("ldm.models")


class PipelineError(ValueError):
    """A model no text-to-image pipeline class of ppdiffusers or diffusers samples as it was trained."""


PROMPT = '"a red circle on a blue background"'
LDM_GENERATE = ["```bash", f"python -m ldm.generate --model THIS_FOLDER --prompt {PROMPT}",
                "python -m ldm.export --checkpoint THIS_FOLDER --output PADDLE_FOLDER   # ppdiffusers' own layout",
                "```", ""]


def diffusers_lines(pipeline_class: str, call: str) -> list[str]:
    """How diffusers loads and calls an exported folder of `pipeline_class`."""
    return ["```python", f"from diffusers import {pipeline_class}", "",
            f'pipeline = {pipeline_class}.from_pretrained("THIS_FOLDER")', f"image = pipeline({call}).images[0]",
            "```", ""]


def trained_length(tokens: int | None) -> str:
    """The caption length a model was trained with, as a model card says it."""
    return f"{tokens} tokens" if tokens else "its tokenizer's `model_max_length`"


def parameters(model) -> str:
    return f"{sum(int(p.numel()) for p in model.parameters()) / 1e6:.2f} M parameters"


class ModelFamily:
    """A model family: its backbone (the class this framework builds from a folder's `backbone_folder`, which configs
    it reads and which it refuses, how it is initialised and how it predicts), the text encoders it trains with
    (`text_kinds`, `ldm.models.text`), the conditioning it reads (`ldm.models.conditioning`), the pipeline class it
    reads and writes with its model card, its FLOPs and what its cached text states keep. One instance per family,
    in the registry (`ldm.models.families.FAMILIES`)."""

    name: str  # as a run records it
    backbone_folder: str  # the backbone's folder in a pipeline
    backbone_class: str  # ppdiffusers' class, which this framework builds
    config_names: tuple[str, ...] = ()  # other `_class_name`s of configs read as this backbone
    text_kinds: tuple[TextFamily, ...] = ()  # the text encoders it trains with
    pipeline_class: str | None = None  # the pipeline class it reads and writes
    pipeline_parts: tuple[str, ...] = ()  # that pipeline's parts (`model_index.json`)
    class_parts: dict[str, tuple[str, ...]] = {}  # a part of other classes than `build.PIPELINE_PARTS` says
    reads_pooled: bool = False  # its backbone reads the pooled text vector (so its cached text states keep it)
    added_conditions: tuple[str, ...] = ()  # the added conditions (`Conditioning.added`) a batch must give it
    # diffusers' pipeline gives the text encoder a fixed number of tokens, whatever its tokenizer says (LDM's 77:
    # `ldm.inference.export.check_diffusers_context`)
    fixed_diffusers_prompt: bool = False
    # diffusers' pipeline steps a flow-matching sampler: StableDiffusionPipeline and PixArtAlphaPipeline scale their
    # first latents by `scheduler.init_noise_sigma`, which FlowMatchEulerDiscreteScheduler has not
    # (`ldm.inference.export.check_diffusers_sampler`; each model card's snippet run in diffusers 0.42:
    # tests/fixtures/model_cards.json)
    diffusers_samples_flow: bool = True

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # -- what it reads, builds and refuses ---------------------------------------------------------------------------
    def reads_backbone(self, config: dict) -> bool:
        """A backbone config (a `config.json`) is this family's: by its `_class_name`, else by its shape."""
        name = config.get("_class_name")
        return name in (self.backbone_class, *self.config_names) if name else self.has_shape(config)

    def has_shape(self, config: dict) -> bool:
        """A config without `_class_name` is this family's backbone."""
        return False

    def takes(self, text: TextFamily) -> bool:
        return text in self.text_kinds

    def reads_text_parts(self, folder: str) -> bool:
        """A model folder's extra text encoders (`text_encoder_2/`, ...) are this family's own, read with it."""
        return False

    def unsupported(self, config: dict) -> str | None:
        """Why this framework cannot train or sample the backbone a config describes as it was made (read before its
        weights: a variant ppdiffusers' class does not build, or conditions this framework does not give), or None."""
        return None

    def unsupported_source(self, source: str) -> str | None:
        """Why this framework cannot train or sample the model folder `source` of this family's backbone (a variant
        its pipeline or parts say: Stable Diffusion XL's refiner), read before any weight, or None."""
        return None

    def prepare_library(self) -> None:
        """Make ppdiffusers' class of the backbone buildable and trainable here (`ldm.runtime.compat.private`)."""

    def model_class(self):
        import ppdiffusers

        self.prepare_library()
        return getattr(ppdiffusers, self.backbone_class)

    def init_weights(self, backbone) -> None:
        """Initialise a backbone built from scratch."""
        raise NotImplementedError

    def freeze_unexported(self, backbone) -> list[str]:
        """Freeze the parameters diffusers' class of the backbone does not have, so that a trained model samples in
        diffusers as here; their names."""
        return []

    def follow_resolution(self, backbone, latent: int) -> None:
        """A DiT's `sample_size` stays whatever the training resolution: it sets the span of its position embedding,
        and a reloaded model would embed positions otherwise (a UNet's follows it)."""
        if backbone.config.sample_size != latent:
            logger.info("%s sample_size stays %d at latents of %d (it sets the span of the position embedding)",
                        type(backbone).__name__, backbone.config.sample_size, latent)

    # -- conditioning and prediction ---------------------------------------------------------------------------------
    def reads_added(self, backbone) -> tuple[str, ...]:
        """The added conditions a built backbone of this family reads: the family's `added_conditions`, or, where its
        configs differ (PixArt-α's multi-scale DiT), this one's."""
        return self.added_conditions

    def check_conditioning(self, conditioning: Conditioning, backbone=None) -> None:
        """Refuse a batch that lacks the added conditions this family's backbone (`backbone`, when given) reads."""
        needed = self.added_conditions if backbone is None else self.reads_added(backbone)
        missing = [name for name in needed if name not in conditioning.added]
        if missing:
            raise ValueError(f"the {self.name} family's backbone reads the added conditions {', '.join(missing)}, "
                             "which the batch does not carry")

    def sampling_added(self, height: int, width: int, rows: int, backbone) -> dict[str, paddle.Tensor]:
        """The added conditions of `rows` images sampled at `height` x `width` pixels (`generate`, validation images,
        the evaluation, the FLOPs count) by `backbone`, as it reads them (`reads_added`: one family's configs may
        differ): the requested size as original and target, crop (0, 0)."""
        if GEOMETRY not in self.reads_added(backbone):
            return {}
        return {GEOMETRY: paddle.to_tensor(sampling_geometry(height, width, rows))}

    def predict(self, backbone, sample: paddle.Tensor, timesteps: paddle.Tensor,
                conditioning: Conditioning) -> paddle.Tensor:
        """The backbone's whole output (all its channels) for latents at `timesteps` (a scalar or one per sample)."""
        raise NotImplementedError

    # -- pipelines and the model card --------------------------------------------------------------------------------
    def pipeline(self, unet, text_encoder, vae, tokenizer, scheduler):
        """The ppdiffusers pipeline of the model; PipelineError for a model no pipeline class samples as trained."""
        raise no_pipeline(unet, text_encoder)

    def describe_backbone(self, backbone) -> str:
        """One line of a model card: the backbone's class, size and shape."""
        raise NotImplementedError

    def loading_lines(self, tokens: int | None) -> list[str]:
        """How its exported folder loads, in diffusers and in ppdiffusers: what each library's pipeline does with the
        caption length (`tokens`, trained with), and what it cannot read. (A flow-matching model is exported for
        diffusers only where its pipeline steps the sampler: `ldm.inference.export.check_diffusers_sampler`.)"""
        raise NotImplementedError

    # -- FLOPs and cached text states --------------------------------------------------------------------------------
    def training_flops(self, model, *, resolution, text_length: int, on_latents: bool = False) -> dict[str, int]:
        """FLOPs of one training sample of a `LatentDiffusion` of this family (`ldm.models.flops`)."""
        from ldm.models.flops import ldm_training_flops

        # with the added conditions its backbone reads, as sampled at that size (`sampling_added`)
        return ldm_training_flops(model, resolution=resolution, text_length=text_length, on_latents=on_latents)

    def cached_text(self, entry: dict) -> dict:
        """What its cached text states keep of what its text encoder makes (`ldm.models.text.cache_entry`): the
        pooled vector only where its backbone reads one."""
        return {k: v for k, v in entry.items() if k != "pooled" or self.reads_pooled}


def no_pipeline(unet, text_encoder) -> PipelineError:
    from ldm.models.text import family_of

    return PipelineError(f"a {type(unet).__name__} with a {family_of(text_encoder).name} text encoder has no "
                         "text-to-image pipeline class in ppdiffusers or diffusers; sample from the checkpoint with "
                         "python -m ldm.generate")


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


def per_sample(timesteps: paddle.Tensor, sample: paddle.Tensor) -> paddle.Tensor:
    """A DiT's timesteps, one per sample (a sampler's step gives one for all)."""
    return timesteps.expand([sample.shape[0]]) if timesteps.ndim == 0 else timesteps
