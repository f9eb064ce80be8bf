"""Optimizer-side pieces of the hand-written loop: global-norm gradient clipping, the LR schedule."""

from __future__ import annotations

import math

import paddle
from paddlenlp.trainer.trainer_utils import get_scheduler

from ldm.compat import squared_l2_norm


@paddle.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> paddle.Tensor:
    """Global L2 norm of the gradients (fp32); gradients are scaled in place to `max_norm` if above it.

    The result of `paddle.nn.utils.clip_grad_norm_`, computed the way Paddle's own
    `ClipGradByGlobalNorm` does (one squared-norm kernel per gradient, one sum) instead of a norm
    per gradient, a stack and a second norm; no rescaling pass when `max_norm` is infinite. Per-op
    cost dominates for small models on a CPU: see `scripts/bench_step.py`.
    """
    grads = [p.grad_ for p in parameters if p.grad_ is not None]  # grad_: the gradient itself, writable
    if not grads:
        return paddle.zeros([], dtype="float32")
    total = paddle.sqrt(paddle.add_n([squared_l2_norm(g).astype("float32").reshape([]) for g in grads]))
    if math.isfinite(max_norm):
        scale = paddle.clip(max_norm / (total + 1e-6), max=1.0)
        scales = {dtype: scale.astype(dtype) for dtype in {g.dtype for g in grads}}  # one cast per dtype
        for g in grads:
            g.multiply_(scales[g.dtype])
    return total


def lr_schedule(name: str, learning_rate: float, warmup_steps: int, total_steps: int):
    """PaddleNLP's schedules, counted in optimizer updates."""
    return get_scheduler(name, learning_rate=learning_rate, num_warmup_steps=warmup_steps,
                         num_training_steps=total_steps)
