"""Stable Diffusion 3: ppdiffusers' `SD3Transformer2DModel` (an MMDiT: text and image tokens in joint attention,
conditioned on the pooled text vector as well) with SD3's three frozen text encoders, CLIP-L, CLIP-G and T5, read as
one (`ldm.models.text_set`; `StableDiffusion3Pipeline`). Its position embedding is a crop of a `pos_embed_max_size`
grid, centred, for any patch grid up to it: a bucket takes its own crop.
"""

from __future__ import annotations

import paddle

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
from ldm.models.text import SD3_TEXT
from ldm.models.text_set import SD3TextEncoders
from ldm.runtime.compat import private


class SD3Family(ModelFamily):
    name = "sd3"
    backbone_folder = "transformer"
    backbone_class = "SD3Transformer2DModel"
    text_kinds = (SD3_TEXT,)
    pipeline_class = "StableDiffusion3Pipeline"
    pipeline_parts = ("vae", *SD3TextEncoders.encoder_parts, *SD3TextEncoders.tokenizer_parts, "transformer",
                      "scheduler")
    class_parts = {"text_encoder": ("CLIPTextModelWithProjection",)}  # its first CLIP has a projection
    reads_pooled = True

    def has_shape(self, config):
        return bool(config.get("pos_embed_max_size") or config.get("joint_attention_dim"))

    def reads_text_parts(self, folder):
        return SD3TextEncoders.is_source(folder)

    def unsupported(self, config):
        """Stable Diffusion 3.5's MMDiT normalises queries and keys (`qk_norm`) and, in Medium, adds a second
        self-attention to its first blocks (`dual_attention_layers`, MMDiT-X): ppdiffusers 0.29's
        `SD3Transformer2DModel` has neither."""
        norm, dual = config.get("qk_norm"), list(config.get("dual_attention_layers") or ())
        features = ([f"qk_norm {norm!r}"] if norm else []) + (
            [f"dual attention in layers {dual[0]}-{dual[-1]}" if dual == list(range(dual[0], dual[-1] + 1))
             else f"dual attention in layers {', '.join(map(str, dual))}"] if dual else [])
        if features:
            return (f"its transformer is a Stable Diffusion 3.5 MMDiT ({' and '.join(features)}), which ppdiffusers' "
                    "SD3Transformer2DModel, the one this framework trains, does not have: it trains Stable Diffusion 3 "
                    "Medium's MMDiT")
        return None

    def prepare_library(self):
        joint_attention_everywhere()
        sd3_recompute_unpacks()

    @paddle.no_grad()
    def init_weights(self, backbone):
        """SD3's code ships no initialisation: as DiT's blocks, Xavier-uniform linear layers and patch projection,
        N(0, 0.02) for the timestep and pooled-text MLPs, zero for every adaLN modulation (each block starts as the
        identity) and the final projection."""
        from paddle.nn.initializer import Normal

        from ldm.models.init import zero_

        init_linear_and_patches(backbone)
        embedder = backbone.time_text_embed
        for layer in (embedder.timestep_embedder.linear_1, embedder.timestep_embedder.linear_2,
                      embedder.text_embedder.linear_1, embedder.text_embedder.linear_2):
            Normal(0.0, 0.02)(layer.weight)
        zeroed = [norm.linear for block in backbone.transformer_blocks for norm in (block.norm1, block.norm1_context)]
        for layer in [*zeroed, backbone.norm_out.linear, backbone.proj_out]:
            zero_(layer)

    def freeze_unexported(self, backbone):
        """ppdiffusers' SD3 transformer gives a layer norm without affine parameters (`elementwise_affine=False`: the
        last block's context norm, the output norm) a bias, which diffusers' does not have and ignores on loading: it
        stays as built or read (zero from scratch and from a diffusers folder)."""
        from ldm.models.torch_layout import unexported_biases

        parameters_by_name = dict(backbone.named_parameters())
        frozen = unexported_biases(backbone)
        for name in frozen:
            parameters_by_name[name].stop_gradient = True
        return frozen

    def predict(self, backbone, sample, timesteps, conditioning):
        return backbone(sample, encoder_hidden_states=conditioning.states, pooled_projections=conditioning.pooled,
                        timestep=per_sample(timesteps, sample)).sample

    def pipeline(self, unet, text_encoder, vae, tokenizer, scheduler):
        import ppdiffusers

        from ldm.models.text import family_of

        if family_of(text_encoder) is not SD3_TEXT:
            raise no_pipeline(unet, text_encoder)
        clip_l, clip_g, t5 = text_encoder.encoders
        first, second, third = tokenizer.tokenizers
        return ppdiffusers.StableDiffusion3Pipeline(
            transformer=unet, scheduler=scheduler, vae=vae, text_encoder=clip_l, tokenizer=first,
            text_encoder_2=clip_g, tokenizer_2=second, text_encoder_3=t5, tokenizer_3=third)

    def describe_backbone(self, backbone):
        c = backbone.config
        return (f"SD3Transformer2DModel (MMDiT): {parameters(backbone)}, {c.num_layers} joint blocks of "
                f"{c.num_attention_heads} heads x {c.attention_head_dim}, patch {c.patch_size}, text states "
                f"{c.joint_attention_dim} wide projected to {c.caption_projection_dim}, pooled text "
                f"{c.pooled_projection_dim}, latents {c.in_channels}x{c.sample_size}x{c.sample_size}")

    def loading_lines(self, tokens):
        length = trained_length(tokens)
        call = f"{PROMPT}, num_inference_steps=28{f', max_sequence_length={tokens}' if tokens else ''}"
        return ["diffusers (PyTorch). The pipeline pads the CLIP prompts to the tokenizers' `model_max_length` "
                f"and T5's to `max_sequence_length` (256 unless given): this model was trained on {length} for each "
                "(T5's padding is not masked in SD3, so pass its length):", "",
                *diffusers_lines(self.pipeline_class, call),
                "ppdiffusers (PaddlePaddle) reads this layout (its pipeline pads every prompt to the first "
                "tokenizer's `model_max_length`, as trained):", "", "```python",
                "from ppdiffusers import StableDiffusion3Pipeline", "",
                'pipeline = StableDiffusion3Pipeline.from_pretrained("THIS_FOLDER", from_diffusers=True)', "```", "",
                "ldm-laion samples and converts it too:", "", *LDM_GENERATE]


def joint_attention_everywhere() -> None:
    """ppdiffusers 0.29's `JointAttnProcessor2_5` (every `SD3Transformer2DModel` block) calls
    `paddle.nn.functional.scaled_dot_product_attention_`, which ppdiffusers defines only where its fused attention
    kernels are (a GPU build): elsewhere no SD3 transformer runs. Where it is missing, it is given the plain form
    ppdiffusers' own "math" branch computes (inputs and output [batch, tokens, heads, head dim])."""
    import math

    import paddle.nn.functional as F

    if hasattr(F, "scaled_dot_product_attention_"):
        return

    def scaled_dot_product_attention_(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                      training=True, attention_op=None):
        if is_causal or attention_op not in (None, "auto", "math"):
            raise NotImplementedError("only non-causal attention in the math form is provided off the GPU build")
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        q, k, v = (paddle.transpose(t, [0, 2, 1, 3]) for t in (query, key, value))
        scores = paddle.matmul(q * scale, k, transpose_y=True)
        if attn_mask is not None:
            scores = scores + attn_mask.cast(scores.dtype)
        weights = F.softmax(scores, axis=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, dropout_p, training=training, mode="upscale_in_train")
        return paddle.transpose(paddle.matmul(weights, v), [0, 2, 1, 3])

    F.scaled_dot_product_attention_ = scaled_dot_product_attention_


def sd3_recompute_unpacks() -> None:
    """ppdiffusers 0.29's `SD3Transformer2DModel.sd3_origin_transformer` (the blocks' loop) takes a block's output
    under gradient checkpointing (`--recompute`) as the image tokens alone, though a block returns (text tokens, image
    tokens): no SD3 transformer trains with recompute. Replaced by the same loop that unpacks both, as diffusers'
    does."""
    from ppdiffusers.models import transformer_sd3
    from ppdiffusers.utils import recompute_use_reentrant, use_old_recompute

    model = private(transformer_sd3, "SD3Transformer2DModel", "training SD3 with --recompute")
    if getattr(model, "_ldm_recompute_unpacks", False):
        return
    private(model, "sd3_origin_transformer", "training SD3 with --recompute")

    def sd3_origin_transformer(self, hidden_states, encoder_hidden_states, temb):
        for block in self.transformer_blocks:
            if self.training and self.gradient_checkpointing and not use_old_recompute():
                kwargs = {} if recompute_use_reentrant() else {"use_reentrant": False}
                encoder_hidden_states, hidden_states = transformer_sd3.recompute(
                    block, hidden_states, encoder_hidden_states, temb, **kwargs)
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb)
        return encoder_hidden_states, hidden_states

    model.sd3_origin_transformer = sd3_origin_transformer
    model._ldm_recompute_unpacks = True


SD3 = SD3Family()
