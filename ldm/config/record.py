"""The whole configuration of a run, written where a reader will look for it weeks later.

`describe_run` gathers every argument of every group as resolved (defaults included), the command
line, the world (ranks, hosts, loader workers per rank), the versions of Python, Paddle, PaddleNLP,
ppdiffusers and this project, the git commit and the model and autoencoder identity. It goes to
`<output_dir>/run.json`, into every checkpoint (`run_config.json`) and to the trackers as
hyperparameters. A resume compares the checkpoint's record with this run's (`compare_resume`): each
difference is logged on a line of its own, and the settings a run cannot change halfway (the model,
the resolution, the prediction type) are refused unless `--allow_config_change` is given.

`--config FILE` (YAML or JSON) holds any flags; `expand_config` puts them in front of the command
line, whose flags then win (argparse keeps the last value of a flag).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time

from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.train")

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A run changed halfway in these is another run: the weights, the latents or the target no longer fit.
FIXED = {
    "arguments.model_name_or_path": "the model",
    "arguments.resolution": "the latent size",
    "model.prediction_type": "the prediction type",
    "model.text_encoder_trained": "whether the text encoder trains (a frozen one is in no checkpoint)",
}
# Expected to differ between a run and its resume, or a record of the moment rather than a setting.
NOT_SETTINGS = ("arguments.resume_from_checkpoint", "arguments.overwrite_output_dir", "arguments.config",
                "arguments.logging_dir", "arguments.phase_timing", "command", "created", "step", "world.hosts",
                "lineage", "memory")


class ConfigError(UserError, ValueError):
    """A `--config` file that cannot be read or holds something that is not a flag value."""


# -- --config FILE -----------------------------------------------------------------------------------
def read_config_file(path: str) -> dict:
    """{flag name: value} of a YAML or JSON file (a leading `--` on a name is allowed)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    if path.endswith(".json"):
        try:
            values = json.loads(text, object_pairs_hook=_no_repeats)
        except ValueError as e:
            raise ConfigError(f"--config {path}: not valid JSON: {e}") from None
    else:
        import yaml

        try:
            values = yaml.load(text, Loader=yaml12_loader())
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML: {' '.join(str(e).split())}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, not a {type(values).__name__}")
    return {str(name).removeprefix("--"): value for name, value in values.items()}


def yaml12_loader():
    """PyYAML's safe loader, made to hand every value over as it is written: only `true`/`false` are booleans
    and `null`/`~`/nothing is the flag's default (YAML 1.2's core schema); every other scalar stays its text, which
    the flag's own type then reads. YAML 1.1 would read `no` as False, `010` as 8, `0x18` (a text flag's value) as
    24 and `1:30` as 90. A key given twice is an error, not the last one silently."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    kept = ("tag:yaml.org,2002:null",)
    Loader.yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag in kept]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    return Loader


def _no_repeats(pairs):
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{', '.join(map(repr, repeated))} given twice")
    return dict(pairs)


JOINED = ("aspect_buckets",)  # flags whose one value is a comma-separated list: a YAML list of them is joined


def config_flags(values: dict, path: str) -> list[str]:
    """The command-line spelling of a config file's values."""
    argv: list[str] = []
    for name, value in values.items():
        if name == "config" and value is not None:  # read, it would be ignored: the command line names one file
            raise ConfigError(f"--config {path} names another config file ({value}): a config file holds flags, "
                              "not files to read; put every flag in one file")
        if value is None:
            continue  # the flag's default
        if isinstance(value, dict):
            raise ConfigError(f"--config {path}: {name} is a mapping; flags take a value or a list")
        if name in JOINED and isinstance(value, list | tuple):
            value = ",".join(map(str, value))
        argv.append(f"--{name}")
        if isinstance(value, bool):
            argv.append(str(value).lower())
        elif isinstance(value, list | tuple):
            if not value:
                raise ConfigError(f"--config {path}: {name} is an empty list")
            argv.extend(str(v) for v in value)
        else:
            argv.append(str(value))
    return argv


def expand_config(argv: list[str]) -> list[str]:
    """`argv` with the flags of `--config FILE` in front (the command line's own flags come later and win);
    a lone `FILE.json`/`.yaml` argument is the same as `--config FILE`. The `--config` flag stays, so the
    run records which file it read."""
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")) and not argv[0].startswith("-"):
        argv = ["--config", argv[0]]
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                path, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
            elif i + 1 < len(argv):
                path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
            else:
                raise ConfigError("--config needs a file")
            if any(a == "--config" or a.startswith("--config=") for a in rest):
                raise ConfigError("--config given twice: put every flag in one file")
            return config_flags(read_config_file(path), path) + rest + ["--config", path]
    return list(argv)


# -- the record --------------------------------------------------------------------------------------
def plain(value):
    """`value` as JSON can hold it (enums by value, other objects by their text)."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [plain(v) for v in value]
    if hasattr(value, "value") and type(value).__module__ != "builtins":  # an Enum
        return plain(value.value)
    return str(value)


def arguments_of(group) -> dict:
    """Every field of an argument group as resolved (PaddleNLP's TrainingArguments hides its secrets)."""
    if hasattr(group, "to_dict"):
        values = group.to_dict()
    else:
        values = {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}
    return {name: plain(value) for name, value in values.items()}


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def project_version() -> str | None:
    version = package_version("ldm-laion")
    if version is None:  # run from a clone that is not installed
        import tomllib

        try:
            with open(os.path.join(PROJECT_ROOT, "pyproject.toml"), "rb") as f:
                version = tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, ValueError):
            return None
    return version


def versions() -> dict:
    import paddle

    return {
        "python": platform.python_version(),
        "paddle": paddle.__version__,
        "paddle_commit": getattr(paddle.version, "commit", None),
        "paddlenlp": package_version("paddlenlp"),
        "ppdiffusers": package_version("ppdiffusers"),
        "ldm-laion": project_version(),
    }


def git_commit(folder: str = PROJECT_ROOT) -> dict | None:
    """{"commit", "dirty"} of the project's clone, or None outside one (an installed package)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


DEFAULT_SEED = 23  # the recipe's
# settings both entry points have, under the Trainer path's name -> the loop's
TRAINER_TO_LOOP = {"per_device_train_batch_size": "train_batch_size", "max_steps": "max_train_steps",
                   "dataloader_num_workers": "num_workers", "lr_scheduler_type": "lr_scheduler",
                   "warmup_steps": "lr_warmup_steps", "save_total_limit": "checkpoints_total_limit",
                   "weight_decay": "adam_weight_decay"}


def recorded_seed(record: dict | None) -> int | None:
    """The --seed a checkpoint's run trained with, as its record (`run_config.json`) says (either entry point's)."""
    groups = record.get("arguments", {}) if isinstance(record, dict) else {}
    groups = groups if isinstance(groups, dict) else {}
    seeds = [group["seed"] for group in groups.values()
             if isinstance(group, dict) and isinstance(group.get("seed"), int)]
    return seeds[0] if seeds else None


def resolve_seed(given: int | None, resume) -> int:
    """The run's seed: `given` (--seed on the command line or in --config); else, resuming (`resume`, the checkpoint's
    `ldm.checkpoint.resume.Resume`), the checkpoint's, so the interrupted pass goes on in its order; else the recipe's
    23. A given seed that differs from the checkpoint's is kept, with one warning: the interrupted pass ends there and
    the next starts in the new order."""
    recorded = recorded_seed(resume.record) if resume else None
    checkpoint = resume.path if resume else None
    if given is None:
        if recorded is not None:
            logger.info("resuming %s with its seed %d", checkpoint, recorded)
            return recorded
        return DEFAULT_SEED
    if recorded is not None and recorded != given:
        logger.warning("--seed %d is not the seed %d of %s: the interrupted pass ends there and the next pass starts "
                       "in the order of seed %d", given, recorded, checkpoint, given)
    return given


def describe_run(groups, *, dist, num_workers: int, model: dict | None = None, argv: list[str] | None = None,
                 precision: str | None = None, update: str | None = None) -> dict:
    """The record of this run (a collective: every rank names its host). `groups`: the argument dataclasses;
    `precision`: the mixed precision actually used (`ldm.runtime.device.resolve_precision`), which may not be the one
    asked for; `update`: the form of the update `--flat_update` resolved to (`ldm.train.native`)."""
    import paddle

    arguments: dict[str, dict] = {}
    for group in groups:
        arguments[type(group).__name__] = arguments_of(group)
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [sys.executable, *(sys.argv if argv is None else argv)],
        "arguments": arguments,
        "world": {
            "world_size": dist.world_size,
            "hosts": dist.gather(socket.gethostname()),
            "nodes": int(os.environ.get("PADDLE_NNODES", "1")),
            "device": paddle.device.get_device(),
            "dataloader_workers_per_rank": num_workers,
            **({"precision": precision} if precision else {}),
            **({"update": update} if update else {}),
        },
        "versions": versions(),
        "git": git_commit(),
        "model": model or {},
    }


def flatten(record: dict) -> dict[str, object]:
    """{"arguments.<flag>" (every group merged), "model.<key>", "versions.<name>", …: value} of a record."""
    flat: dict[str, object] = {}
    for group in record.get("arguments", {}).values():
        flat.update({f"arguments.{name}": value for name, value in group.items()})
    for section, values in record.items():
        if section == "arguments":
            continue
        if isinstance(values, dict):
            flat.update({f"{section}.{key}": value for key, value in values.items()})
        else:
            flat[section] = values
    return flat


def hyperparameters(record: dict) -> dict[str, object]:
    """The record as one flat mapping of scalars, for a tracker's hyperparameters."""
    return {name: value if isinstance(value, bool | int | float | str) else json.dumps(value)
            for name, value in flatten(record).items()}


def other_entry_point(saved: dict, current: dict) -> bool:
    """Whether two records come from different entry points (the loop's argument groups against the Trainer's)."""
    return set(saved.get("arguments", {})) != set(current.get("arguments", {}))


def _shared_names(flat: dict) -> dict:
    """The loop's names for the settings the Trainer path spells otherwise (`--max_steps` is `--max_train_steps`)."""
    return {f"arguments.{TRAINER_TO_LOOP.get(name[10:], name[10:])}" if name.startswith("arguments.") else name: value
            for name, value in flat.items()}


def _same(a, b) -> bool:
    return a == b or (a in ("", None, [], ()) and b in ("", None, [], ()))  # unset, however a path spells it


def differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(name, saved value, current value) of every setting that differs, sorted by name. Across entry points only
    the settings both have are compared (under the loop's names); `one_sided` counts the rest."""
    old, new = flatten(saved), flatten(current)
    missing = "(absent)"
    names = set(old) | set(new)
    if other_entry_point(saved, current):
        old, new = _shared_names(old), _shared_names(new)
        names = set(old) & set(new)
    return [(name, old.get(name, missing), new.get(name, missing)) for name in sorted(names)
            if not name.startswith(NOT_SETTINGS) and not _same(old.get(name, missing), new.get(name, missing))]


def one_sided(saved: dict, current: dict) -> list[str]:
    """The settings of a resume on the other entry point that only one of the two paths has."""
    old, new = _shared_names(flatten(saved)), _shared_names(flatten(current))
    return sorted(name.partition(".")[2] for name in set(old) ^ set(new)
                  if name.startswith("arguments.") and not name.startswith(NOT_SETTINGS))


def flag_as_given(name: str, command: list[str]) -> str:
    """`--name`, or the other spelling of that setting where the command line used it (`--save_total_limit` for
    the loop's `--checkpoints_total_limit`): a message names the flag the user wrote."""
    spellings = [other for other, loop_name in TRAINER_TO_LOOP.items() if loop_name == name]
    return next((f"--{other}" for other in spellings if f"--{other}" in command), f"--{name}")


def compare_resume(checkpoint: str, saved: dict | None, current: dict, *, allow_change: bool,
                   log: bool = True) -> list[str]:
    """Compare the record `saved` of `checkpoint` (its `run_config.json`, read once: `ldm.checkpoint.resume`; None
    when it has none) with this run's: every difference logged (one line each), those of `FIXED` refused (a
    ConfigError naming them all) unless `allow_change`. Returns the lines."""
    if saved is None:
        if log:
            logger.warning("%s records no configuration (written before run records existed): nothing to compare",
                           checkpoint)
        return []
    lines, refused = [], []
    given = [str(a).split("=", 1)[0] for a in current.get("command", [])]
    for name, old, new in differences(saved, current):
        section, _, key = name.partition(".")
        label = flag_as_given(key, given) if section == "arguments" else name
        lines.append(f"resume changes {label}: {old!r} -> {new!r}")
        if name in FIXED and old != "(absent)":  # a record from before the setting was recorded: logged only
            refused.append(f"{label} ({FIXED[name]}: {old!r} -> {new!r})")
    if log:
        for line in lines:
            logger.warning("%s", line)
        if other_entry_point(saved, current):
            others = one_sided(saved, current)
            logger.info("resuming on the other entry point: %d settings exist on one path only (%s%s); the shared "
                        "ones that changed are listed above", len(others), ", ".join(others[:6]),
                        ", ..." if len(others) > 6 else "")
    if refused and not allow_change:
        raise ConfigError(f"{checkpoint} was trained with other settings that a run cannot change halfway: "
                          f"{'; '.join(refused)}. Pass the checkpoint's values, or --allow_config_change to continue "
                          "anyway")
    return lines

