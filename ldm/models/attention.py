"""Attention through `paddle.nn.functional.scaled_dot_product_attention` (`--attention sdpa`).

ppdiffusers' own switch (`enable_xformers_memory_efficient_attention`) needs Paddle's fp16
`memory_efficient_attention` kernel and refuses to run anywhere else, and its `AttnProcessor2_5` calls a
function only a patched Paddle has. Paddle's public `scaled_dot_product_attention` picks a fused kernel
(FlashAttention on a GPU in fp16/bf16: memory linear in sequence length) and falls back to the same
math elsewhere, so one processor serves every device. It computes what ppdiffusers' `AttnProcessor`
does (the default), for the attention the LDM UNet has: no mask, no spatial or group norm.
"""

from __future__ import annotations

import logging

import paddle
import paddle.nn.functional as F
from ppdiffusers.models.attention_processor import AttnProcessor

logger = logging.getLogger("ldm.models")


class SDPAttnProcessor:
    """ppdiffusers' `AttnProcessor` with its score/softmax/matmul replaced by one fused call."""

    def __init__(self):
        self.fallback = AttnProcessor()

    def __call__(self, attn, hidden_states: paddle.Tensor, encoder_hidden_states=None, attention_mask=None,
                 temb=None, scale: float = 1.0, **kwargs) -> paddle.Tensor:
        if attention_mask is not None or attn.spatial_norm is not None or attn.group_norm is not None:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, temb, scale, **kwargs)
        residual = hidden_states
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.reshape([batch, channel, height * width]).transpose([0, 2, 1])
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        def heads(x: paddle.Tensor) -> paddle.Tensor:  # [B, L, H * D] -> [B, L, H, D], Paddle's SDPA layout
            return x.reshape([x.shape[0], x.shape[1], attn.heads, x.shape[2] // attn.heads])

        out = F.scaled_dot_product_attention(heads(query), heads(key), heads(value), scale=attn.scale,
                                             training=attn.training)
        hidden_states = out.reshape([out.shape[0], out.shape[1], -1])
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # projection, dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose([0, 2, 1]).reshape([batch, channel, height, width])
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def set_attention(unet, kind: str) -> None:
    """Use `kind` ('default' or 'sdpa') in every attention layer of `unet` (a backbone that has processors)."""
    if kind == "sdpa":
        if not hasattr(unet, "set_attn_processor") or type(unet).__name__ == "SD3Transformer2DModel":
            from ldm.runtime.errors import UserError

            raise UserError(f"--attention sdpa: ppdiffusers' {type(unet).__name__} takes no attention processor of "
                            "this kind (SD3's joint attention has its own); use --attention default")
        unet.set_attn_processor(SDPAttnProcessor())
        logger.info("attention: paddle.nn.functional.scaled_dot_product_attention (--attention sdpa)")
