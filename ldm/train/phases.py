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

import contextlib
import io
import logging
import os
import time

logger = logging.getLogger("ldm.train")

PHASES = ("data", "forward", "backward", "sync", "clip", "vote", "optimizer", "ema", "checkpoint", "other")


def synchronize() -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    import paddle

    if paddle.device.get_device() != "cpu":  # gpu, xpu and custom devices alike
        paddle.device.synchronize()


class PhaseClock:
    def __init__(self, enabled: bool):
        self.enabled = self.logged = enabled  # a profile window (`ProfileWindow`) times its phases, unlogged
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.totals_since: dict[str, float] | None = None  # a profile window's, which the logs' reads leave alone
        self.on_restart = None
        self.window_start = self.last = time.perf_counter()

    def restart(self) -> None:
        """A new window from now: what came before the first update (a restore, the model's wrapping) is no phase.
        The drivers call it as their first update begins; so does `on_restart` (a profile window that starts with
        the run)."""
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.window_start = self.last = time.perf_counter()
        if self.on_restart is not None:
            self.on_restart()

    def lap(self, name: str) -> None:
        """The time since the previous lap was spent in phase `name`."""
        if not self.enabled:
            return
        synchronize()
        now = time.perf_counter()
        self.totals[name] += now - self.last
        if self.totals_since is not None:
            self.totals_since[name] += now - self.last
        self.last = now

    def read(self) -> dict[str, float]:
        """The window's fractions (`phase_<name>`), then a new window; {} when off."""
        if not self.logged:
            return {}
        self.lap("other")
        elapsed = max(self.last - self.window_start, 1e-9)
        fractions = {f"phase_{name}": total / elapsed for name, total in self.totals.items()}
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.window_start = self.last
        return fractions


class ProfileWindow:
    """`--profile_steps A-B`: Paddle's profiler over updates A to B, on every rank. It starts once update A - 1 is
    done, its log, evaluation and save included (or as the first update begins, when a run starts or resumes
    inside the window: from there), and stops once update B is done, or at the run's end inside the window; then
    each rank writes to `<output_dir>/profile/`: `rank<k>_time_<when>.paddle_trace.json`
    (Chrome trace format: Perfetto, chrome://tracing, VisualDL's profiler page; one ProfileStep an update),
    `rank<k>-operators.txt` (Paddle's summary: each event type's share, the operators by total time) and
    `rank<k>-phases.txt` (where the window's time went, phase by phase, as `--phase_timing` logs it: the phase
    clock runs during the window whatever that flag says, and logs only when it is given)."""

    def __init__(self, window: tuple[int, int] | None, folder: str, rank: int, phases: PhaseClock):
        self.window, self.folder, self.rank, self.phases = window, folder, rank, phases
        self.profiler, self.first, self.last, self.began = None, 0, 0, 0.0
        self.kept_enabled = phases.enabled

    def begin(self, step: int) -> None:
        """The run's first update begins after update `step` (its start or resume)."""
        if self.window is not None and self.profiler is None and self.window[0] - 1 <= step < self.window[1]:
            self._start(step)

    def after(self, step: int) -> None:
        """Update `step` is done, with everything that follows it before the next one."""
        if self.window is None:
            return
        if self.profiler is None:
            if step == self.window[0] - 1:
                self._start(step)
            return
        self.last = step
        self.profiler.step()  # the trace's ProfileStep of this update ends here
        if step >= self.window[1]:
            self.close()

    def _start(self, step: int) -> None:
        import paddle
        import paddle.profiler as profiler

        os.makedirs(self.folder, exist_ok=True)
        targets = [profiler.ProfilerTarget.CPU]
        if paddle.device.get_device().startswith("gpu"):
            targets.append(profiler.ProfilerTarget.GPU)
        self.profiler = profiler.Profiler(targets=targets, on_trace_ready=profiler.export_chrome_tracing(
            self.folder, worker_name=f"rank{self.rank}"))
        self.phases.enabled = True
        self.profiler.start()
        self.phases.lap("other")  # what came before is no phase of the window
        self.began = time.perf_counter()
        self.phases.totals_since = dict.fromkeys(PHASES, 0.0)
        self.first = self.last = step + 1

    def close(self) -> None:
        """Stop and write (once; nothing when the window was never reached). A failure here is a warning: it must not
        hide what ended the run."""
        if self.profiler is None:
            return
        try:
            self._write()
        except Exception as e:  # noqa: BLE001 - the profile is an aid; the run's own outcome comes first
            logger.warning("the profile of updates %d-%d was not written: %s", self.first, self.last, e)
        self.profiler, self.window = None, None
        self.phases.totals_since, self.phases.enabled = None, self.kept_enabled

    def _write(self) -> None:
        import paddle.profiler as profiler

        self.phases.lap("other")
        seconds = self.phases.last - self.began  # before the trace is written
        self.profiler.stop()
        spent = self.phases.totals_since
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            self.profiler.summary(sorted_by=profiler.SortedKeys.CPUTotal, op_detail=True, thread_sep=False,
                                  time_unit="ms")
        prefix = os.path.join(self.folder, f"rank{self.rank}")
        with open(f"{prefix}-operators.txt", "w") as f:
            f.write(table.getvalue())
        first, updates = self.first, max(1, self.last - self.first + 1)
        lines = [f"updates {first}-{self.last} on rank {self.rank}: {seconds:.4f} s, {seconds / updates:.4f} s an "
                 "update", f"{'phase':<12}{'seconds':>10}{'share':>9}"]
        lines += [f"{name:<12}{spent[name]:>10.4f}{spent[name] / max(seconds, 1e-9):>9.1%}" for name in PHASES]
        with open(f"{prefix}-phases.txt", "w") as f:
            f.write("\n".join(lines) + "\n")
        logger.info("profiled updates %d-%d in %.2f s: %s-phases.txt, %s-operators.txt and the trace in %s", first,
                    self.last, seconds, prefix, prefix, self.folder)
