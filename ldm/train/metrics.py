"""The scalars both paths log every `logging_steps` (the window of updates), and the held-out evaluation's place
in the run's time."""

from __future__ import annotations

import logging
import time

import paddle

from ldm.runtime.distributed import Distributed
from ldm.train.batches import TimedBatches
from ldm.train.objective import Objective

logger = logging.getLogger("ldm.train")


class MetricsWindow:
    """The scalars logged every `logging_steps`, the same names on both paths (the trackers show train/<name>).

    Loss and gradient norm stay on the device until `read`: no host synchronisation per micro-step. An
    update the non-finite guard skipped (`ldm.train.health`) is left out of the means: its NaN would hide
    the window's other updates.
    """

    def __init__(self):
        self.reset()
        self.pending_loss, self.pending_extra = 0.0, {}

    def reset(self) -> None:
        self.loss, self.grad_norm, self.updates, self.extra, self.ratios = 0.0, 0.0, 0, {}, {}

    def add_micro_step(self, loss: paddle.Tensor, extra: dict, weight: float) -> None:
        self.pending_loss += loss.detach() * weight
        for name, value in extra.items():
            if isinstance(value, tuple):  # (sum, count)
                total, count = self.pending_extra.get(name, (0.0, 0.0))
                self.pending_extra[name] = (total + value[0].detach(), count + value[1].detach())
            else:
                self.pending_extra[name] = self.pending_extra.get(name, 0.0) + value.detach() * weight

    def update_loss(self):
        """The loss of the update being accumulated (on the device), for the guard."""
        return self.pending_loss

    def add_update(self, grad_norm: paddle.Tensor, skipped: bool = False) -> None:
        if not skipped:
            self.loss += self.pending_loss
            for name, value in self.pending_extra.items():
                if isinstance(value, tuple):
                    total, count = self.ratios.get(name, (0.0, 0.0))
                    self.ratios[name] = (total + value[0], count + value[1])
                else:
                    self.extra[name] = self.extra.get(name, 0.0) + value
            self.grad_norm += grad_norm
            self.updates += 1
        self.pending_loss, self.pending_extra = 0.0, {}

    def read(self, dist: Distributed, batches: TimedBatches, *, with_loss: bool = True) -> dict[str, float]:
        """The window's means over updates and ranks, and the data path's figures; then a new window.
        `with_loss=False`: the loss is logged by someone else (PaddleNLP's Trainer)."""
        updates = max(1, self.updates)
        samples_per_second, wait_fraction, counts, shapes = batches.window(dist)
        nothing = float("nan") if self.updates == 0 else 0.0  # every update of the window was skipped
        metrics = {"loss": dist.mean(float(self.loss) / updates + nothing)} if with_loss else {}
        metrics.update({
            "grad_norm": dist.mean(float(self.grad_norm) / updates + nothing),
            "global_samples_per_second": samples_per_second,  # the Trainer's own name for it
            "data_wait_fraction": wait_fraction,
        })
        metrics.update({name: dist.mean(float(value) / updates) for name, value in sorted(self.extra.items())})
        for name, (total, count) in sorted(self.ratios.items()):
            total, count = dist.sum(float(total)), dist.sum(float(count))
            metrics[name] = total / count if count else float("nan")
        metrics.update({f"data_{reason}": count for reason, count in sorted(counts.items())})
        if batches.buckets:  # the bucket mix: each bucket's share of the window's samples
            total = sum(shapes.values()) or 1
            metrics.update({f"data_bucket_{name}": shapes.get(name, 0) / total for name in batches.buckets})
        self.reset()
        return metrics


class EvalClock:
    """Time spent evaluating against the time since the run (or the last evaluation) started."""

    def __init__(self):
        self.since = time.perf_counter()


def evaluate(objective: Objective, dist: Distributed, step: int, clock: EvalClock,
             batches: TimedBatches) -> dict[str, float]:
    """The objective's held-out metrics at update `step`, with `eval_time_fraction`: the evaluation's share of the
    wall time since the last one (its cost, for the trackers). Its time is left out of the training speed."""
    start = time.perf_counter()
    metrics = objective.evaluate(dist)
    end = time.perf_counter()
    batches.exclude(end - start)
    metrics["eval_time_fraction"] = (end - start) / max(end - clock.since, 1e-9)
    clock.since = end
    shown = " ".join(f"{name[len('eval_'):]} {metrics[name]:.5g}" for name in ("eval_loss", "eval_fid",
                                                                               "eval_clip_score") if name in metrics)
    logger.info("validation at update %d: %s (%.1f s, %.1f%% of the time since the last)", step, shown,
                end - start, 100 * metrics["eval_time_fraction"])
    return metrics
