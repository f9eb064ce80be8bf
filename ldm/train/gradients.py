"""Gradient norms and clipping: one global L2 norm over every trained parameter, computed on the device, and the
rescaling the loop applies once its non-finite guard has read the clip factor along with its verdict."""

from __future__ import annotations

import math

import paddle

from ldm.runtime.compat import scale_in_place, squared_l2_norm
from ldm.runtime.distributed import sync_gradients


class TensorGradients:
    """The gradients' side of an update, tensor by tensor: the all-reduce, the global norm, the rescaling and the
    clearing (`ldm.train.flat.FlatParameters` does the same over flat buffers)."""

    def __init__(self, parameters):
        self.parameters = parameters

    def sync(self, world_size: int) -> None:
        sync_gradients(self.parameters, world_size)

    def norm(self) -> paddle.Tensor:
        return global_grad_norm(self.parameters)

    def scale(self, factor: float) -> None:
        scale_gradients(self.parameters, factor)

    def clear(self) -> None:
        """Each gradient to zero, as Paddle's optimizers clear them (`clear_grad`)."""
        for parameter in self.parameters:
            parameter.clear_gradient(True)

    def release(self) -> None:
        release_gradients(self.parameters)


def release_gradients(parameters) -> None:
    """Free the gradients once the updates are over (Paddle keeps them allocated, zeroed, from update to update): the
    export at the end loads its copy of the model into their memory instead of beside the whole training state."""
    for parameter in parameters:
        parameter.clear_gradient(False)


def release_optimizer_state(optimizer) -> None:
    """Free the optimizer's moments once the updates are over and the last save holds them (`TrainingRun.finish`):
    the export at the end loads its copy of the model into their memory. `ldm-12layer`'s AdamW moments are 7 GB beside
    3.7 GB of weights; with them the end-of-run export passed 22 GiB on a 24 GiB host."""
    from ldm.runtime.compat import innermost_optimizer
    from ldm.train.flat import FreedMemory

    if optimizer is None:
        return
    inner = innermost_optimizer(optimizer)
    for accumulators in (getattr(inner, "_accumulators", None) or {}).values():
        accumulators.clear()
    if isinstance(getattr(inner, "moments", None), dict):  # the flat update's moment buffers
        inner.moments = {}
    FreedMemory().release()


@paddle.no_grad()
def global_grad_norm(parameters) -> paddle.Tensor:
    """Global L2 norm of the gradients, fp32, on the device (0 without gradients). The squared norms are
    Paddle's kernel called without its Python wrapper, whose cost per call dominates for small models on a
    CPU (`scripts/bench_step.py`, `scripts/bench_train.py`)."""
    grads = [p.grad_ for p in parameters if p.grad_ is not None]  # grad_: the gradient itself, writable
    if not grads:
        return paddle.zeros([], dtype="float32")
    return paddle.sqrt(paddle.add_n([squared_l2_norm(g) for g in grads])).reshape([])


@paddle.no_grad()
def clip_factor(total: paddle.Tensor, max_norm: float) -> paddle.Tensor | None:
    """What clipping to `max_norm` multiplies the gradients by (on the device; exactly 1 when within it);
    None when `max_norm` is infinite."""
    return paddle.clip(max_norm / (total + 1e-6), max=1.0) if math.isfinite(max_norm) else None


@paddle.no_grad()
def scale_gradients(parameters, factor: float) -> None:
    """Multiply every gradient by `factor`, a number already on the host (the loop's clip factor, read with
    the guard's verdict): one kernel per gradient and no device read."""
    for p in parameters:
        if p.grad_ is not None:
            scale_in_place(p.grad_, factor)
