"""Weight initialisation matching the PyTorch/CompVis LDM this project reproduces.

Paddle's default initialisers differ from PyTorch's (Xavier for Linear, etc.), which is the
public example's open TODO "sync PyTorch init". Here: PyTorch defaults for every Linear and
Conv (weight and bias uniform within +-1/sqrt(fan_in), which is what kaiming_uniform(a=sqrt(5))
gives), Embedding N(0, 1), norms 1/0; then LDMBert's token and position embeddings N(0, 0.02)
and the original LDM's `zero_module` choices in the UNet.
"""

from __future__ import annotations

import math

import paddle
from paddle import nn
from paddle.nn.initializer import Constant, Normal, Uniform
from ppdiffusers.models.resnet import ResnetBlock2D
from ppdiffusers.models.transformer_2d import Transformer2DModel

CONVS = (nn.Conv1D, nn.Conv2D, nn.Conv3D, nn.Conv1DTranspose, nn.Conv2DTranspose, nn.Conv3DTranspose)
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1D, nn.BatchNorm2D, nn.InstanceNorm2D)


def fan_in(layer: nn.Layer) -> int:
    shape = layer.weight.shape
    if isinstance(layer, nn.Linear):  # Paddle stores Linear weights as [in, out]
        return shape[0]
    # Conv [out, in/groups, *k]; ConvTranspose [in, out/groups, *k]: PyTorch takes dim 1 in both
    return math.prod(shape[1:])


@paddle.no_grad()
def pytorch_default_init(model: nn.Layer) -> None:
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, (nn.Linear, *CONVS)):
            bound = 1.0 / math.sqrt(fan_in(layer))
            Uniform(-bound, bound)(layer.weight)
            if layer.bias is not None:
                Uniform(-bound, bound)(layer.bias)
        elif isinstance(layer, nn.Embedding):
            Normal(0.0, 1.0)(layer.weight)
        elif isinstance(layer, NORMS):
            if getattr(layer, "weight", None) is not None:
                Constant(1.0)(layer.weight)
            if getattr(layer, "bias", None) is not None:
                Constant(0.0)(layer.bias)


@paddle.no_grad()
def zero_(layer: nn.Layer) -> None:
    for parameter in layer.parameters():
        Constant(0.0)(parameter)


def unet_zero_init_layers(unet: nn.Layer) -> list[nn.Layer]:
    """conv_out, every ResNet block's second conv, every transformer block's output projection."""
    layers = [unet.conv_out]
    for layer in unet.sublayers():
        if isinstance(layer, ResnetBlock2D):
            layers.append(layer.conv2)
        elif isinstance(layer, Transformer2DModel):
            layers.append(layer.proj_out)
    return layers


@paddle.no_grad()
def init_ldm_weights(unet: nn.Layer | None, text_encoder: nn.Layer | None) -> None:
    if unet is not None:
        pytorch_default_init(unet)
        for layer in unet_zero_init_layers(unet):
            zero_(layer)
    if text_encoder is not None:
        pytorch_default_init(text_encoder)
        encoder = text_encoder.model
        Normal(0.0, 0.02)(encoder.embed_tokens.weight)
        Normal(0.0, 0.02)(encoder.embed_positions.weight)
