"""Metrics: VisualDL scalars and images plus a console line, on rank 0 only.

Other ranks hold a `NullWriter` that does nothing, so callers never test the rank.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

logger = logging.getLogger("ldm.train")


class NullWriter:
    active = False

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def image(self, tag: str, image: np.ndarray, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class VisualDLWriter(NullWriter):
    active = True

    def __init__(self, logdir: str):
        from visualdl import LogWriter

        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self.writer = LogWriter(logdir=logdir)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag=tag, value=float(value), step=step)
        shown = "  ".join(f"{tag.split('/')[-1]} {value:.4g}" for tag, value in values.items())
        logger.info("step %d  %s", step, shown)

    def image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.writer.add_image(tag=tag, img=image, step=step)

    def close(self) -> None:
        self.writer.close()


def make_writer(logdir: str, is_main: bool) -> NullWriter:
    return VisualDLWriter(logdir) if is_main else NullWriter()


class StepClock:
    """Time spent waiting for data vs. total, and samples seen, between two `reset()` calls."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.data_wait = 0.0
        self.samples = 0

    def waited(self, seconds: float, samples: int) -> None:
        self.data_wait += seconds
        self.samples += samples

    def read(self) -> tuple[float, float, int]:
        """(elapsed seconds, fraction waiting for data, samples)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return elapsed, self.data_wait / elapsed, self.samples


def quiet_libraries() -> None:
    """PaddleNLP and ppdiffusers log every save and load at INFO: keep their warnings only."""
    from paddlenlp.utils.log import logger as paddlenlp_logger
    from ppdiffusers.utils import logging as ppdiffusers_logging

    paddlenlp_logger.set_level("WARNING")
    ppdiffusers_logging.set_verbosity_warning()


def read_scalars(logdir: str, tag: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one scalar from a run's VisualDL log folder (every log file in it, by step)."""
    from visualdl import LogReader

    points: dict[int, float] = {}
    for name in sorted(os.listdir(logdir)):
        reader = LogReader(file_path=os.path.join(logdir, name))
        if tag in reader.get_tags().get("scalar", []):
            points.update({int(v.id): float(v.value) for v in reader.get_data("scalar", tag)})
    return sorted(points), [points[k] for k in sorted(points)]
