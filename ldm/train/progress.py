"""Progress output that suits where it goes: a redrawn bar on a terminal, plain lines in a log file.

Under SLURM or Kubernetes stderr is a file: a tqdm bar redraws there several times a second and a
week-long run writes hundreds of megabytes of it. `--progress auto` (the default) draws the bar on a
terminal and otherwise prints one line at each logging step and at most every `--progress_seconds`;
`bar`, `lines` and `none` choose explicitly. Rank 0 only.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

logger = logging.getLogger("ldm.train")


def resolve_mode(mode: str, stream=None) -> str:
    """bar, lines or none: `auto` is a bar when `stream` (stderr, where tqdm and the logs go) is a terminal."""
    if mode != "auto":
        return mode
    stream = sys.stderr if stream is None else stream
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # no stream, or a closed one
        return "lines"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


class Progress:
    """Counts updates toward `total` (the end of the run, or the next checkpoint of an endless one)."""

    def __init__(self, mode: str, *, total: int, initial: int, label: str, enabled: bool, seconds: float = 60.0,
                 unit: str = "upd"):
        self.mode = resolve_mode(mode) if enabled else "none"
        self.total, self.step, self.label, self.seconds = total, initial, label, seconds
        self.bar = tqdm(total=total, initial=initial, desc=label, unit=unit) if self.mode == "bar" else None
        self.started, self.start_step = time.monotonic(), initial
        self.last_line = self.started
        self.postfix: dict[str, str] = {}
        self.saving = ""  # the checkpoint being written in the background, shown beside the figures

    def update(self, step: int, *, logging_step: bool = False, saving: str = "") -> None:
        """After update `step`; `logging_step`: metrics were logged at it (a line is due in `lines` mode); `saving`:
        the checkpoint being written in the background, if any."""
        if self.bar is not None:
            if saving != self.saving:
                self.bar.set_postfix({**self.postfix, "saving": saving} if saving else self.postfix, refresh=False)
            self.bar.update(step - self.step)
        self.saving = saving
        self.step = step
        if self.mode == "lines":
            now = time.monotonic()
            if logging_step or now - self.last_line >= self.seconds:
                self.last_line = now
                logger.info("%s", self.line(now))

    def line(self, now: float) -> str:
        done = self.step - self.start_step
        rate = done / max(now - self.started, 1e-9)
        left = self.total - self.step
        eta = duration(left / rate) if rate > 0 else "?"
        return (f"progress {self.label}: update {self.step}/{self.total} ({100 * self.step / max(self.total, 1):.1f}%)"
                f", {rate:.3g} upd/s, {left} to go, ETA {eta}" + (f", saving {self.saving}" if self.saving else ""))

    def show(self, values: dict[str, str]) -> None:
        """Figures beside the bar (the logged metrics are printed by the tracker in `lines` mode)."""
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix({**values, "saving": self.saving} if self.saving else values)

    def retarget(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        if self.bar is not None:
            self.bar.total = total
            self.bar.set_description(label)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
