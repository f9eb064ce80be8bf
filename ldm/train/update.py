"""The update, made once for its form: per tensor, flat or fused (`--flat_update`, resolved by `ldm.train.native`).

`build_update` is the one place that knows the forms: handed the driver's optimizer (sharded already when the run
shards) and the averages of the weights (the EMA, the post-hoc EMA's profiles), it lays the weights out flat when
the optimizer is a `FlatAdamW` (`ldm.train.flat`), moves the averages onto the same spans, fuses the pass when it
was asked and can be, and returns the `Update` it built. `Update.form` is what runs, which the run's record says
(`run.json`, each checkpoint's `run_config.json`): a fused pass asked for and not possible (weights of several
dtypes, AMSGrad) is "flat", a driver's optimizer that is no AdamW (PaddleNLP's `--optim adafactor`) "per_tensor".

The loop calls the same five methods whatever the form: `sync` (the mean over ranks), `norm`, `clip` (the factor
the update's vote agreed), `step` (through the loss scaler), `clear`; `release` at the end. PaddleNLP's Trainer
steps and clears itself and asks only the `norm`.
"""

from __future__ import annotations

import dataclasses
import logging

from ldm.runtime.compat import innermost_optimizer, sharding_owners
from ldm.train.flat import FlatAdamW, FlatEMA, FlatParameters
from ldm.train.gradients import TensorGradients, release_optimizer_state
from ldm.train.native import load as load_kernel

logger = logging.getLogger("ldm.train")

PER_TENSOR, FLAT, FUSED = "per_tensor", "flat", "fused"


@dataclasses.dataclass
class Update:
    """One optimizer update's steps around the driver's optimizer, over `gradients` (tensor by tensor, or the flat
    buffers)."""

    form: str  # PER_TENSOR, FLAT or FUSED: what runs
    optimizer: object
    gradients: TensorGradients | FlatParameters

    def sync(self, world_size: int) -> None:
        self.gradients.sync(world_size)

    def norm(self):
        """The global L2 norm of the gradients (fp32, on the device)."""
        return self.gradients.norm()

    def clip(self, factor: float) -> None:
        """Multiply the gradients by `factor` (a host number: the vote's); the fused form carries it into its pass."""
        self.gradients.scale(factor)

    def step(self, scaler) -> None:
        """The optimizer's step through `scaler` (which unscales and skips as the guard prepared it)."""
        scaler.step(self.optimizer)
        scaler.update()

    def clear(self) -> None:
        """The gradients to zero for the next update (the flat ones in place: their views stay)."""
        self.gradients.clear()

    def release(self) -> None:
        """Free the gradients and the optimizer's moments once the last save holds them: the export loads into their
        memory."""
        self.gradients.release()
        release_optimizer_state(self.optimizer)


def build_update(requested: str | None, optimizer, trained: list, averages=()) -> Update:
    """The update of `requested` ("fused", "flat" or None: `ldm.train.native.agreed_flat_update`) over `optimizer`'s
    `trained` parameters, with `averages` (`ldm.models.ema.EMA`s, sharded like the optimizer already) laid out on the
    same spans. Before the optimizer's first step."""
    inner = innermost_optimizer(optimizer)
    if requested is None or not isinstance(inner, FlatAdamW):
        if requested is not None:
            logger.warning("flat update: the optimizer is a %s, not AdamW: it steps tensor by tensor",
                           type(inner).__name__)
        return Update(PER_TENSOR, optimizer, TensorGradients(trained))
    shards = sharding_owners(optimizer)
    flat = inner.flatten(trained, shards[0] if shards else None)
    for ema in averages:
        FlatEMA.adopt(ema, flat)
    fused = requested == FUSED and inner.fuse(load_kernel()[0], [ema.flat for ema in averages])
    if requested == FUSED and not fused:
        logger.warning("flat update: Paddle's kernels, not the fused one (it steps fp32 AdamW only)")
    logger.info("flat update: %d trained tensors in %d spans%s", len(trained), len(flat.spans),
                f", one fused pass on {flat.kernel.threads} thread(s)" if fused else "")
    return Update(FUSED if fused else FLAT, optimizer, flat)
