"""FLOPs of one training sample, counted from the model itself, and what they make of the measured speed.

Counted per layer while the model runs one sample: every Linear (2 x inputs x outputs per token), every
Conv2D (2 x input channels per group x kernel area per output element) and, in each attention layer,
the two products of its scores and their mixing (2 x queries x keys x width each). Norms, activations,
softmax and other elementwise work are not counted, as in the usual definition of model FLOPs
utilisation (PaLM's appendix B, torchtitan, MosaicML). A training sample costs its forward once and its
backward twice (gradients of inputs and of weights) for every trained part; a frozen text encoder
(`--freeze_text_encoder`) and the frozen autoencoder, which runs its encoder only and only on image
shards, cost their forward alone.

`train/tflops_per_device` = FLOPs per sample x samples per second per device; `train/mfu` divides it by
`--peak_tflops` (the device's dense peak in the training precision).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import paddle
from paddle import nn

# The projections an attention layer applies to its queries, keys and values, by naming scheme: ppdiffusers'
# `Attention` (UNet, autoencoder) and LDMBert's attention.
ATTENTION_PROJECTIONS = (("to_q", "to_k", "to_v"), ("q_proj", "k_proj", "v_proj"))


def _tokens(output: paddle.Tensor) -> int:
    """Rows of a projection's output: batch x sequence."""
    return int(output.numel()) // int(output.shape[-1])


def forward_flops(layer: nn.Layer, run: Callable[[], object]) -> dict[str, int]:
    """FLOPs of the matrix products `run()` executes inside `layer`, by the name of `layer`'s direct child
    that holds them ("" for `layer`'s own). Hooks are removed afterwards, and the random state (which `run()`
    may draw from) and `layer`'s training mode are left as they were: `run()` runs in eval mode."""
    counts: dict[str, int] = {}
    hooks = []

    def add(name: str, flops: int) -> None:
        part = name.split(".")[0]
        counts[part] = counts.get(part, 0) + int(flops)

    def linear_hook(name):
        def hook(sub, inputs, output):
            add(name, 2 * _tokens(output) * sub.weight.shape[0] * sub.weight.shape[1])
        return hook

    def conv_hook(name):
        def hook(sub, inputs, output):
            out_channels, in_per_group, kh, kw = sub.weight.shape
            add(name, 2 * int(output.numel()) * in_per_group * kh * kw)
        return hook

    def attention_hooks(name, q, k, v):
        seen: dict[str, paddle.Tensor] = {}

        def keep(key):
            def hook(sub, inputs, output):
                seen[key] = output.shape
            return hook

        def mix(sub, inputs, output):
            q_shape, k_shape = seen["q"], seen["k"]
            batch = q_shape[0]
            queries, keys = _tokens_of(q_shape) // batch, _tokens_of(k_shape) // batch
            # scores (queries x keys, over the query width) and mixing (over the value width)
            add(name, 2 * batch * queries * keys * (q_shape[-1] + output.shape[-1]))
        return [q.register_forward_post_hook(keep("q")), k.register_forward_post_hook(keep("k")),
                v.register_forward_post_hook(mix)]

    for name, sub in layer.named_sublayers():
        if isinstance(sub, nn.Linear):
            hooks.append(sub.register_forward_post_hook(linear_hook(name)))
        elif isinstance(sub, nn.Conv2D):
            hooks.append(sub.register_forward_post_hook(conv_hook(name)))
        for names in ATTENTION_PROJECTIONS:
            parts = [getattr(sub, n, None) for n in names]
            if all(isinstance(p, nn.Linear) for p in parts):
                hooks.extend(attention_hooks(name, *parts))
    state, was_training = paddle.get_rng_state(), layer.training
    layer.eval()
    try:
        with paddle.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
        paddle.set_rng_state(state)
        if was_training:
            layer.train()
    return counts


def _tokens_of(shape) -> int:
    total = 1
    for size in shape[:-1]:
        total *= int(size)
    return total


def ldm_training_flops(model, *, resolution: int | tuple[int, int], text_length: int,
                       on_latents: bool = False, added: dict | None = None) -> dict[str, int]:
    """FLOPs of one training sample of a `LatentDiffusion` at `resolution` (a side, or (height, width) for an
    aspect-ratio bucket), with the `added` conditions its backbone reads (`Conditioning.added`, one row each):
    {"unet", "text_encoder", "vae_encode", "total"}, each with its backward where it trains. The random state is left
    as it was."""
    height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
    pixels = paddle.zeros([1, 3, height, width], dtype="float32")
    # a set of encoders (`ldm.models.text_set`) reads each one's ids end to end
    ids = paddle.zeros([1, text_length * getattr(model.text_encoder, "id_groups", 1)], dtype="int64")
    # the added conditions its backbone reads (an image's geometry: SDXL's time ids, PixArt-α's resolution), as sampled
    if added is None:
        added = model.family.sampling_added(height, width, 1, model.unet)
    forward = forward_flops(model, lambda: model(pixels, ids, conditioning={"added": added}))
    text_trains = any(not p.stop_gradient for p in model.text_encoder.parameters())
    flops = {
        "unet": 3 * forward.get("unet", 0),
        "text_encoder": (3 if text_trains else 1) * forward.get("text_encoder", 0),
        "vae_encode": 0 if on_latents else forward.get("vae", 0),
    }
    flops["total"] = sum(flops.values())
    return flops


@dataclass
class SampleFlops:
    """FLOPs of one training sample: at the run's square resolution, and at each aspect-ratio bucket's shape."""

    square: int
    by_bucket: dict[str, int] = field(default_factory=dict)

    def mean(self, metrics: dict) -> float:
        """Per sample of a logged window: each bucket's FLOPs weighted by its share of the window's samples
        (`data_bucket_<name>`, `ldm.train.metrics`); the square count without buckets."""
        shares = {name: metrics.get(f"data_bucket_{name}") or 0.0 for name in self.by_bucket}
        if not sum(shares.values()):
            return float(self.square)
        return sum(self.by_bucket[name] * share for name, share in shares.items()) / sum(shares.values())


def throughput_metrics(flops_per_sample: float | None, samples_per_second: float, world_size: int,
                       peak_tflops: float | None) -> dict[str, float]:
    """`tflops_per_device` (and `mfu` given the peak) at a measured global speed."""
    if not flops_per_sample:
        return {}
    tflops = flops_per_sample * samples_per_second / world_size / 1e12
    metrics = {"tflops_per_device": tflops}
    if peak_tflops:
        metrics["mfu"] = tflops / peak_tflops
    return metrics
