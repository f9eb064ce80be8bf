"""Where an update's time goes (`--phase_timing`): each logging step adds the fraction of the window's wall time
spent in each phase of the updates, `phase_<name>` (the trackers show train/phase_<name>; rank 0's figures, so a
wait for a slower rank shows in its sync, vote or backward). A window runs from one log to the next: what follows
a log (evaluation, sample images, a save) counts in the next window.

The driver marks the end of each phase with `lap(name)`: the time since the previous lap is that phase's. Laps
follow the update in order (data, forward, backward for every micro-step; then sync, clip, vote, optimizer, ema;
checkpoint stalls and the rest, `other`), so the fractions of a window add up to 1. Device work is asynchronous:
with the timing on, each lap first waits for the device (a synchronisation per phase, which slows a GPU run a
little and is why the timing is off by default); off, a lap is one attribute test and the run is unchanged.

On the loop, `sync` is the explicit gradient all-reduce and `clip` the unscale, the global norm and, when it binds,
the rescaling. The Trainer path runs its own update and its laps come from its hooks: its `backward` ends where
PaddleNLP's training step does, and under plain DataParallel holds the gradient all-reduce (made during the last
micro-step's backward; `sync` is then the hooks' gap, near 0; with sharding or recompute PaddleNLP all-reduces
after the step, in `sync`); its `clip` is the global norm the guard and the logs use, and its `optimizer` holds
the clipping PaddleNLP does inside its step.
"""

from __future__ import annotations

import time

PHASES = ("data", "forward", "backward", "sync", "clip", "vote", "optimizer", "ema", "checkpoint", "other")


def synchronize() -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    import paddle

    if paddle.device.get_device() != "cpu":  # gpu, xpu and custom devices alike
        paddle.device.synchronize()


class PhaseClock:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.window_start = self.last = time.perf_counter()

    def restart(self) -> None:
        """A new window from now: what came before the first update (a restore, the model's wrapping) is no phase."""
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.window_start = self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        """The time since the previous lap was spent in phase `name`."""
        if not self.enabled:
            return
        synchronize()
        now = time.perf_counter()
        self.totals[name] += now - self.last
        self.last = now

    def read(self) -> dict[str, float]:
        """The window's fractions (`phase_<name>`), then a new window; {} when off."""
        if not self.enabled:
            return {}
        self.lap("other")
        elapsed = max(self.last - self.window_start, 1e-9)
        fractions = {f"phase_{name}": total / elapsed for name, total in self.totals.items()}
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.window_start = self.last
        return fractions
