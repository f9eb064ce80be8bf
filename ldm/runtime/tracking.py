"""Metrics and images of a run, on rank 0 only, through PaddleNLP's tracker integrations.

`--report_to visualdl|tensorboard|wandb|all|none` (several allowed) picks the trackers on both paths.
The Trainer path builds them itself; the hand-written loop drives the same PaddleNLP callbacks
(`paddlenlp.trainer.integrations`) through `Tracker`, so the two write the same files the same way.
Those callbacks log scalars only: `Tracker.image` adds images to each backend, and writes every image
as a PNG under `<output_dir>/images/<tag>/<step>.png` as well. Other ranks hold a `NullWriter` that
does nothing, so callers never test the rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

import numpy as np

from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.train")

TRACKERS = ("visualdl", "tensorboard", "wandb")
# Read by PaddleNLP's wandb callback for Trainer-only features (logging a Trainer's model, watching one).
WANDB_TRAINER_ONLY = ("WANDB_LOG_MODEL", "WANDB_WATCH")


class TrackerError(UserError, RuntimeError):
    """A tracker named by --report_to cannot be used here."""


def tracker_problem(name: str) -> str | None:
    """Why tracker `name` cannot be used in this environment, or None (checked before a run writes)."""
    from importlib.util import find_spec

    if name == "tensorboard" and not (find_spec("tensorboardX") or find_spec("tensorboard")):
        return "tensorboard needs tensorboardX: pip install tensorboardX"
    if name == "wandb":
        if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes", "on"):
            return "wandb is disabled by WANDB_DISABLED"
        if not find_spec("wandb"):
            return "wandb is not installed: pip install 'wandb<0.19'"
        if os.environ.get("WANDB_MODE", "").lower() not in ("offline", "dryrun", "disabled"):
            import wandb

            if not wandb.api.api_key:
                return ("wandb has no login here: run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline "
                        "(and `wandb sync` the run later)")
    return None


def resolve_report_to(report_to) -> list[str]:
    """The trackers a `--report_to` value names ('all': every one usable here; 'none': none). A named one
    that cannot be used is an error before anything is written."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if names in (["none"], []):
        return []
    if names == ["all"]:
        return [name for name in TRACKERS if tracker_problem(name) is None]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"--report_to: unknown tracker(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(TRACKERS)}, all or none")
    for name in names:
        problem = tracker_problem(name)
        if problem:
            raise ValueError(f"--report_to {name}: {problem}")
    return names


METRICS_FILE = "metrics.jsonl"


def metrics_records(path: str):
    """The records of a metrics file, in order (`MetricsFile` writes them); a line cut short by a kill is left out."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
                int(record["step"])
            except (ValueError, KeyError, TypeError):
                continue
            yield record


class MetricsFile:
    """`<output_dir>/metrics.jsonl`: one JSON object per logging step, `{"step": N, "time": unix seconds,
    "train/<name>": value, ...}`, whatever `--report_to` says: a run can be grepped, plotted or compared
    without a tracker. A resumed run continues the file: lines past the resumed step (an abandoned
    history) are dropped first, so every step appears once."""

    def __init__(self, output_dir: str, resume_step: int | None = None):
        self.path = os.path.join(output_dir, METRICS_FILE)
        if resume_step is not None and os.path.isfile(self.path):
            with open(self.path) as f:
                kept = [line for line in f if (step := self._step(line)) is not None and step <= resume_step]
            with open(self.path + ".partial", "w") as f:
                f.writelines(kept)
            os.replace(self.path + ".partial", self.path)
        self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 - open for the run; closed by close()

    @staticmethod
    def _step(line: str) -> int | None:
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            return None  # a line cut short by a kill: dropped

    def write(self, step: int, values: dict[str, float]) -> None:
        record = {"step": int(step), "time": round(time.time(), 3)}
        # NaN and inf (an empty window's quantile, a diverged loss) as null: strict JSON, which every parser reads
        record.update({name: float(value) if math.isfinite(float(value)) else None for name, value in values.items()})
        self.file.write(json.dumps(record, allow_nan=False) + "\n")

    def close(self) -> None:
        self.file.close()


def tracker_name(name: str) -> str:
    """The name a tracker shows for a scalar logged by bare name, as PaddleNLP's callbacks rewrite it: `loss` ->
    `train/loss`, `eval_loss` -> `eval/loss`."""
    if "/" in name:
        return name
    return f"eval/{name[len('eval_'):]}" if name.startswith("eval_") else f"train/{name}"


class NullWriter:
    active = False

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def image(self, tag: str, image: np.ndarray, step: int) -> None:
        pass

    def add_config(self, record: dict, flat: dict) -> None:
        pass

    def close(self) -> None:
        pass


class RunArguments:
    """What PaddleNLP's integration callbacks read of a `TrainingArguments`, for the hand-written loop."""

    run_name = None
    wandb_api_key = None
    load_best_model_at_end = False

    def __init__(self, logging_dir: str, output_dir: str, config: dict):
        self.logging_dir, self.output_dir, self._config = logging_dir, output_dir, config

    def to_dict(self) -> dict:
        return dict(self._config)

    def to_sanitized_dict(self) -> dict:
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self._config.items()}

    def to_json_string(self) -> str:
        return json.dumps(self._config, indent=2, sort_keys=True, default=str)


class Tracker(NullWriter):
    """Scalars to every tracker; images to every tracker and to PNG files."""

    active = True

    def __init__(self, callbacks: list, image_dir: str, owned: bool = False, args=None,
                 metrics: MetricsFile | None = None):
        from paddlenlp.trainer.trainer_callback import TrainerControl, TrainerState

        self.callbacks, self.image_dir, self.owned, self.metrics = callbacks, image_dir, owned, metrics
        self.args = args or {}
        self.state, self.control = TrainerState(), TrainerControl()

    @classmethod
    def start(cls, report_to: list[str], output_dir: str, config: dict, resume_step: int | None = None) -> Tracker:
        """The hand-written loop's trackers (names resolved by `resolve_report_to`), each writing under
        `<output_dir>/<tracker>/` (wandb: its offline run or its cache there), and the metrics file."""
        from paddlenlp.trainer.integrations import INTEGRATION_TO_CALLBACK

        if "wandb" in report_to:
            for variable in WANDB_TRAINER_ONLY:
                if os.environ.pop(variable, None) is not None:
                    logger.warning("%s is for the Trainer path only (it needs a PaddleNLP Trainer): ignored", variable)
        keep_wandb_run(report_to, output_dir)
        tracker = cls([], os.path.join(output_dir, "images"), owned=True, args={},
                      metrics=MetricsFile(output_dir, resume_step))
        for name in report_to:
            callback = INTEGRATION_TO_CALLBACK[name]()
            folder = os.path.join(output_dir, name)
            os.makedirs(folder, exist_ok=True)
            tracker.args[id(callback)] = RunArguments(folder, output_dir, config)
            try:
                callback.on_train_begin(tracker.args[id(callback)], tracker.state, tracker.control)
            except Exception as e:  # noqa: BLE001 - a tracker's own error (a network, a login): one line
                tracker.close()
                raise TrackerError(f"cannot start the {name} tracker: {type(e).__name__}: {e}") from None
            tracker.callbacks.append(callback)
        return tracker

    @classmethod
    def of_trainer(cls, trainer, output_dir: str) -> Tracker:
        """Images for the trackers a PaddleNLP Trainer runs (it logs the scalars itself)."""
        from paddlenlp.trainer.integrations import INTEGRATION_TO_CALLBACK

        kinds = tuple(INTEGRATION_TO_CALLBACK[name] for name in TRACKERS)
        return cls([c for c in trainer.callback_handler.callbacks if isinstance(c, kinds)],
                   os.path.join(output_dir, "images"))

    def scalars(self, values: dict[str, float], step: int) -> None:
        """`values` by bare name: trackers show them as `train/<name>`, like the Trainer path's."""
        self.state.global_step = step
        logs = {name: float(value) for name, value in values.items()}
        for callback in self.callbacks if self.owned else []:  # a Trainer logs its scalars itself
            callback.on_log(self.args[id(callback)], self.state, self.control, logs=logs)
        if self.metrics is not None:
            self.metrics.write(step, {tracker_name(name): value for name, value in logs.items()})
        logger.info("step %d  %s", step, "  ".join(f"{name} {value:.4g}" for name, value in logs.items()))

    def add_config(self, record: dict, flat: dict) -> None:
        """The run's whole configuration (`ldm.config.record.describe_run`) beside what the Trainer gives its trackers
        (its own TrainingArguments): as text, and to wandb as its config (`flat`: one level of scalars)."""
        text = json.dumps(record, indent=1, sort_keys=True, default=str)
        for callback in self.callbacks:
            if getattr(callback, "vdl_writer", None) is not None:
                callback.vdl_writer.add_text("run_config", text, 0)
            elif getattr(callback, "tb_writer", None) is not None:
                callback.tb_writer.add_text("run_config", text, 0)
            elif getattr(callback, "_wandb", None) is not None and callback._wandb.run is not None:
                callback._wandb.config.update(flat, allow_val_change=True)

    def image(self, tag: str, image: np.ndarray, step: int) -> None:
        from PIL import Image

        path = os.path.join(self.image_dir, *tag.split("/"), f"{step:08d}.png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(image).save(path)
        for callback in self.callbacks:
            if getattr(callback, "vdl_writer", None) is not None:
                callback.vdl_writer.add_image(tag=tag, img=image, step=step)
            elif getattr(callback, "tb_writer", None) is not None:
                callback.tb_writer.add_image(tag, image, step, dataformats="HWC")
                callback.tb_writer.flush()
            elif getattr(callback, "_wandb", None) is not None and callback._wandb.run is not None:
                callback._wandb.log({tag: callback._wandb.Image(image), "train/global_step": step})

    def close(self) -> None:
        failed = sys.exc_info()[0] is not None  # closed while an error propagates: the run failed
        for callback in self.callbacks:
            if self.owned:
                callback.on_train_end(self.args[id(callback)], self.state, self.control)
            wandb = getattr(callback, "_wandb", None)
            if wandb is not None and wandb.run is not None:
                # a launched rank leaves with os._exit: wandb's exit hook would not run
                wandb.finish(exit_code=1 if failed else 0)
        self.callbacks = []
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


WANDB_RUN_ID_FILE = os.path.join("wandb", "run_id")
_WANDB_RUN_ID_SET: str | None = None


def keep_wandb_run(report_to, output_dir: str) -> None:
    """A run resumed in its folder continues its wandb run instead of starting another: the run's id is made on
    the first start, kept in `<output_dir>/wandb/run_id` (a folder emptied to start afresh loses it: a new run),
    and handed to `wandb.init` through WANDB_RUN_ID with WANDB_RESUME=allow. A WANDB_RUN_ID the user set wins.
    Rank 0, before the trackers start (both paths)."""
    import uuid

    global _WANDB_RUN_ID_SET
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    given = os.environ.get("WANDB_RUN_ID")
    if not ({"wandb", "all"} & set(names)) or (given and given != _WANDB_RUN_ID_SET):
        return
    path = os.path.join(output_dir, WANDB_RUN_ID_FILE)
    try:
        with open(path) as f:
            run_id = f.read().strip()
    except FileNotFoundError:
        run_id = ""
    if not run_id:
        run_id = uuid.uuid4().hex[:8]  # wandb's own ids are 8 lowercase letters and digits
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(run_id + "\n")
    os.environ["WANDB_RUN_ID"] = _WANDB_RUN_ID_SET = run_id  # ours: another run in this process sets its own
    os.environ.setdefault("WANDB_RESUME", "allow")


def make_writer(report_to: list[str], output_dir: str, config: dict, is_main: bool,
                resume_step: int | None = None) -> NullWriter:
    """Rank 0's trackers and metrics file (`resume_step`: the file continues from there); others write nothing."""
    if not is_main:
        return NullWriter()
    return Tracker.start(resolve_report_to(report_to), output_dir, config, resume_step)


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
    """PaddleNLP and ppdiffusers log every save and load at INFO: keep their warnings only (and no progress bar for
    weights loaded in shares)."""
    from paddlenlp.utils.log import logger as paddlenlp_logger
    from ppdiffusers.utils import logging as ppdiffusers_logging

    from ldm.runtime.compat import quiet_shard_loading

    paddlenlp_logger.set_level("WARNING")
    ppdiffusers_logging.set_verbosity_warning()
    quiet_shard_loading()


def read_scalars(logdir: str, tag: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one scalar from a run's VisualDL log folder (every log file in it, by step)."""
    from visualdl import LogReader

    points: dict[int, float] = {}
    for name in sorted(n for n in os.listdir(logdir) if n.startswith("vdlrecords")):
        reader = LogReader(file_path=os.path.join(logdir, name))
        if tag in reader.get_tags().get("scalar", []):
            points.update({int(v.id): float(v.value) for v in reader.get_data("scalar", tag)})
    return sorted(points), [points[k] for k in sorted(points)]
