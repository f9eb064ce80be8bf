"""What a training checkpoint holds, in formats that load without running code (writing: `ldm.checkpoint.manager`).

A checkpoint folder (`<output_dir>/checkpoint-<step>/`, see `ldm.checkpoint.run_folder`) holds:
  unet/, bert/                   the trained weights in the pipeline layout, as safetensors, once (`transformer/` for
                                 a DiT; `text_encoder/` for a CLIP text encoder trained with --train_text_encoder)
  tokenizer/, scheduler/         the tokenizer and the noise scheduler config (DDPM with the source's sampler, or
                                 flow matching's): the folder describes itself
  ldm_model.json                 where the frozen autoencoder is (relative to this folder) and its identity; the
                                 same for a frozen text encoder
  ema.json, ema.safetensors      EMA weights and update counter (with --use_ema)
  ema_sigma_rel-<σ>.json, .safetensors
                                 each post-hoc EMA profile's averages and update counter (with --ema_sigma_rels;
                                 an EMA snapshot holds these files alone, with snapshot.json)
  optimizer.json, .safetensors   the optimizer's moments and counters
  training_state.json, .safetensors
                                 step, world size, learning-rate schedule, loss scaler, every rank's data
                                 position, random states and weights fingerprint (`trainer_state.json` too
                                 on the Trainer path, which PaddleNLP reads back itself)
  manifest.json                  every file's size and sha256, written last
An autoencoder run's checkpoints hold `vqvae/` and the same training files. The frozen autoencoder is
written once per run to `<output_dir>/vqvae/` rather than into every checkpoint (it is large: docs/checkpoints.md),
and a frozen text encoder to `<output_dir>/text_encoder/`.

Nothing here unpickles. Checkpoints of earlier versions (`training_state.pkl`, `*.pdparams`, `*.pdopt`)
are refused with the command that converts them: `python -m ldm.checkpoint upgrade DIR`, which does
unpickle, once, the files of a run the user wrote.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import shutil
import sys

from ldm.checkpoint.background import FileJob, HostBuffers
from ldm.checkpoint.run_folder import (
    LEGACY_STATE_FILE,
    MANIFEST,
    TEMP_PREFIX,
    VAE_FOLDER,
    CheckpointError,
    atomic_folder,
    checkpoint_problem,
    write_manifest,
)
from ldm.checkpoint.serialization import (
    has_state,
    load_state,
    save_state,
    writes_failing_as_os_errors,
)
from ldm.runtime.files import follow_umask_tree, temporary_folder

logger = logging.getLogger("ldm.train")

MODEL_JSON = "ldm_model.json"
SNAPSHOT_RECORD = "snapshot.json"  # an EMA snapshot's step, dtype and profiles (`CheckpointManager.save_ema_snapshot`)
EMA = "ema"
OPTIMIZER = "optimizer"
TRAINING_STATE = "training_state"
# files an earlier version pickled
PICKLED = (LEGACY_STATE_FILE, "ema.pdparams", "optimizer.pdopt", "model_state.pdparams",
           "diffusion_paddle_model.pdparams", "scheduler.pdparams", "scaler.pdparams", "rng_state.pth",
           "training_args.bin")
UPGRADE = "python -m ldm.checkpoint upgrade"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MODEL_JSON))


def pickled_files(folder: str) -> list[str]:
    """Files of `folder` (and its model part folders) that only pickle can read."""
    names = [os.path.relpath(p, folder) for p in glob.glob(os.path.join(folder, "**", "*"), recursive=True)]
    return sorted(n for n in names if os.path.basename(n) in PICKLED or n.endswith((".pdparams", ".pdopt", ".pkl")))


def refuse_pickles(folder: str, what: str = "checkpoint") -> None:
    """A folder whose weights or state are pickles is refused before anything of it is loaded."""
    found = pickled_files(folder)
    if found:
        raise CheckpointError(
            f"{folder} is a {what} in the pickle format of an earlier version ({', '.join(found[:3])}"
            f"{', ...' if len(found) > 3 else ''}): loading a pickle runs whatever code it carries, so it is not "
            f"loaded. If you wrote it yourself, convert it once with `{UPGRADE} {folder}`")


# -- model parts -------------------------------------------------------------------------------------
# The trained parts' weight files as their libraries name them, and the `format` each writes into the safetensors
# metadata (ppdiffusers reads "pt" as PyTorch's layout and transposes: never write that here)
WEIGHT_FILES = {"unet": ("diffusion_paddle_model", "pd"), "transformer": ("diffusion_paddle_model", "pd"),
                "bert": ("model", "np"), "text_encoder": ("model", "np"), "vqvae": ("diffusion_paddle_model", "pd")}
TEXT_ENCODER_FOLDER = "text_encoder"  # a run's frozen text encoder, beside its vqvae/


def share_out(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Tensors (name -> bytes) dealt to `world_size` writers, largest first to the least loaded: the same on
    every rank, so each knows its share without asking."""
    loads, shares = [0] * world_size, [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += sizes[name]
    return [sorted(share) for share in shares]


def weight_shard_file(part: str, rank: int, world_size: int) -> str:
    """The weights of `part` as `from_pretrained` finds them: one file, or Hugging Face's numbered shares."""
    stem = WEIGHT_FILES[part][0]
    return f"{stem}.safetensors" if world_size == 1 else f"{stem}-{rank + 1:05d}-of-{world_size:05d}.safetensors"


def weight_jobs(parts: dict, rank: int, world_size: int, buffers: HostBuffers) -> tuple[list[FileJob], dict]:
    """This rank's share of the weights of each part (`{"unet": layer, "bert": layer}`), snapshot into `buffers`,
    as files to write; and the names in each part's share, for `write_part_configs`."""
    jobs, written = [], {}
    for part, layer in parts.items():
        state = layer.state_dict()
        mine = share_out({n: int(t.numel()) * t.element_size() for n, t in state.items()}, world_size)[rank]
        path = f"{part}/{weight_shard_file(part, rank, world_size)}"
        take = buffers.taker(path)
        jobs.append(FileJob(path, {n: take(n, state[n]) for n in mine}, {"format": WEIGHT_FILES[part][1]}))
        written[part] = mine
    return jobs, written


def write_part_configs(folder: str, parts: dict, shares: list[dict[str, list[str]]]) -> None:
    """The configurations of the parts whose weights every rank wrote (`weight_jobs`; `shares`: each rank's names),
    and with several ranks each part's index of its shares."""
    for part, layer in parts.items():
        target = os.path.join(folder, part)
        os.makedirs(target, exist_ok=True)
        if hasattr(layer, "save_config"):  # ppdiffusers' models
            layer.save_config(target)
        else:  # PaddleNLP's
            layer.config.save_pretrained(target)
        if len(shares) > 1:
            _write_weight_index(folder, part, [share[part] for share in shares], parts[part])


def _write_weight_index(folder: str, part: str, shares: list[list[str]], layer) -> None:
    stem, world_size = WEIGHT_FILES[part][0], len(shares)
    files = [weight_shard_file(part, rank, world_size) for rank in range(world_size)]
    total = sum(int(t.numel()) * t.element_size() for t in layer.state_dict().values())
    index = {"metadata": {"total_size": total},
             "weight_map": dict(sorted((n, files[r]) for r, names in enumerate(shares) for n in names))}
    with open(os.path.join(folder, part, f"{stem}.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1)


def save_model(folder: str, *, parts: dict, tokenizer, noise_scheduler, vae_folder: str, vae_identity: dict,
               final_folder: str | None = None, shares: list[dict[str, list[str]]] | None = None,
               frozen_text: tuple[str, dict] | None = None) -> None:
    """Write the model of a checkpoint into `folder` (created; existing files replaced): the trained `parts`
    (`{"unet": layer, "bert": layer}`), the tokenizer, the noise schedule and the record of the frozen parts.

    `final_folder` is where the checkpoint will live when `folder` is a temporary one: the paths to the frozen
    autoencoder and text encoder (`frozen_text`: its folder and identity) are written relative to it. `shares`: the
    ranks write the weights (`weight_jobs`, each rank's names): only the configurations and indexes are written here.
    """
    os.makedirs(folder, exist_ok=True)
    if shares is not None:
        write_part_configs(folder, parts, shares)
    else:
        with writes_failing_as_os_errors(folder):
            for name, layer in parts.items():
                layer.save_pretrained(os.path.join(folder, name), safe_serialization=True)  # else a pickle
    tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))
    noise_scheduler.save_pretrained(os.path.join(folder, "scheduler"))
    here = os.path.abspath(final_folder or folder)
    record = {"vae": os.path.relpath(os.path.abspath(vae_folder), here), "vae_identity": vae_identity}
    if frozen_text is not None:
        record.update(text_encoder=os.path.relpath(os.path.abspath(frozen_text[0]), here),
                      text_encoder_identity=frozen_text[1])
    with open(os.path.join(folder, MODEL_JSON), "w") as f:
        json.dump(record, f, indent=2)


def write_frozen_autoencoder(run_dir, vae, identity: dict) -> str:
    """The frozen autoencoder of an LDM run (`identity`: its `autoencoder_identity`), written once to
    `<output_dir>/vqvae`: its folder. A resumed run finds it there and checks that it is the same autoencoder.
    """
    from ppdiffusers import AutoencoderKL

    from ldm.models.autoencoder import autoencoder_identity

    folder = run_dir.path(VAE_FOLDER)

    def write() -> None:
        if os.path.isfile(os.path.join(folder, "config.json")):
            refuse_pickles(folder, "autoencoder")
            check_own_part(folder, "frozen autoencoder")
            if autoencoder_identity(AutoencoderKL.from_pretrained(folder)) != identity:
                raise CheckpointError(
                    f"{folder} holds another autoencoder than this run's --vae_name_or_path; resume with the "
                    "autoencoder the run started with")
        else:
            with atomic_folder(folder) as temp, writes_failing_as_os_errors(folder):
                vae.save_pretrained(temp, safe_serialization=True)
                write_manifest(temp)  # its digest: a damaged or modified copy is told apart from another model

    run_dir.dist.from_main(write)
    return folder


def write_frozen_text_encoder(run_dir, text_encoder, identity: dict, identify) -> str:
    """A frozen text encoder, written once to `<output_dir>/text_encoder` (as `write_frozen_autoencoder`; `identify`
    gives the identity of the one found there): its folder."""
    from ldm.models.torch_layout import load_pretrained

    folder = run_dir.path(TEXT_ENCODER_FOLDER)

    def write() -> None:
        if os.path.isfile(os.path.join(folder, "config.json")):
            refuse_pickles(folder, "text encoder")
            check_own_part(folder, "frozen text encoder")
            if identify(load_pretrained(type(text_encoder), folder)) != identity:
                raise CheckpointError(
                    f"{folder} holds another text encoder than this run's: the run started with another model; "
                    "resume with the model it started with, or start a new run in another --output_dir")
        else:
            with atomic_folder(folder) as temp, writes_failing_as_os_errors(folder):
                text_encoder.save_pretrained(temp, safe_serialization=True)
                write_manifest(temp)

    run_dir.dist.from_main(write)
    return folder


def recorded_text_encoder_folder(path: str, model: dict | None = None) -> str | None:
    """The folder of the frozen text encoder checkpoint `path` was trained with (its run's `text_encoder/`), if it
    recorded one and it is there, checked against the manifest the run wrote beside it: every reader (generate,
    export, evaluate, a resume, a new stage) would otherwise use a damaged copy silently, as it is in no checkpoint's
    own manifest."""
    try:
        relative = (model or read_model_record(path)).get("text_encoder")
    except (OSError, ValueError, AttributeError):
        return None
    folder = os.path.normpath(os.path.join(path, relative)) if isinstance(relative, str) else None
    if not (folder and os.path.isfile(os.path.join(folder, "config.json"))):
        return None
    check_own_part(folder, "frozen text encoder")
    return folder


def text_identity_difference(recorded: dict, found: dict) -> str:
    """How the identity of a frozen text encoder `found` differs from the one a checkpoint `recorded`, for a
    message: the fields that differ, with both values."""
    differ = [key for key in sorted(set(recorded) | set(found)) if recorded.get(key) != found.get(key)]
    return "; ".join(f"{key} {found.get(key)}, the checkpoint recorded {recorded.get(key)}" for key in differ)


def check_own_part(folder: str, what: str) -> None:
    """A frozen part the run wrote (`vqvae/`, `text_encoder/`) as it wrote it, checked against its manifest."""
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        return
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise CheckpointError(
            f"{folder}, the {what} this run wrote, was damaged or modified after it was written ({problem}): restore "
            "it from a copy, or start the run anew with the model it was made from")


def recorded_autoencoder_folder(path: str, model: dict | None = None) -> str | None:
    """The folder of the autoencoder checkpoint `path` was trained with (its run's `vqvae/`), if it is there;
    `model`: its model record, when read already (`read_model_record`)."""
    try:
        folder = os.path.normpath(os.path.join(path, (model or read_model_record(path))["vae"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return folder if os.path.isfile(os.path.join(folder, "config.json")) else None


def checkpoint_autoencoder(path: str):
    """The frozen autoencoder a checkpoint was trained with, refused if it is not the recorded one."""
    from ppdiffusers import AutoencoderKL

    from ldm.models.autoencoder import autoencoder_identity

    with open(os.path.join(path, MODEL_JSON)) as f:
        recorded = json.load(f)
    vae_path = os.path.normpath(os.path.join(path, recorded["vae"]))
    if not os.path.isfile(os.path.join(vae_path, "config.json")):
        raise CheckpointError(f"{path} was trained with the autoencoder in {vae_path}, which is gone")
    refuse_pickles(vae_path, "autoencoder")
    vae = AutoencoderKL.from_pretrained(vae_path)
    check_autoencoder(path, recorded.get("vae_identity"), autoencoder_identity(vae), vae_path)
    return vae


def check_autoencoder(checkpoint: str, recorded: dict | None, identity: dict, source: str,
                      folder: str | None = None) -> None:
    """`identity` (the autoencoder of `source`, a description; `folder`: its folder when `source` is not one) against
    the one `checkpoint` `recorded`."""
    if recorded is None:  # written before checkpoints recorded it
        logger.warning("%s does not record which autoencoder it was trained with: make sure %s is that one",
                       checkpoint, source)
        return
    if recorded != identity:
        changed = " and ".join(k.split("_")[0] for k in ("config_sha256", "weights_sha256")
                               if recorded.get(k) != identity.get(k))
        own = recorded_autoencoder_folder(checkpoint)
        if own is not None and os.path.realpath(own) == os.path.realpath(folder or source):
            check_own_part(own, "frozen autoencoder")  # damaged: says so
            raise CheckpointError(f"{source}, the autoencoder {checkpoint} was trained with, no longer holds it (its "
                                  f"{changed} differ: modified or replaced after the run wrote it): restore it from a "
                                  "copy")
        way_out = f"; the run's own is {own}: pass --vae_name_or_path {own}" if own else ""
        raise CheckpointError(f"{checkpoint} was trained with another autoencoder than {source} (its {changed} "
                              f"differ): the UNet learned that autoencoder's latents{way_out}")


def read_model_record(path: str) -> dict:
    """What a checkpoint records of its model (`ldm_model.json`: the autoencoder it was trained with)."""
    with open(os.path.join(path, MODEL_JSON)) as f:
        return json.load(f)


def recorded_autoencoder(path: str) -> dict | None:
    return read_model_record(path).get("vae_identity")


def load_ldm_weights(path: str, parts: dict) -> None:
    """The trained parts' weights of a checkpoint (`{"unet": layer, "bert": layer}`) into them."""
    from ldm.models.torch_layout import load_pretrained

    refuse_pickles(path)
    for name, layer in parts.items():
        layer.set_state_dict(load_pretrained(type(layer), os.path.join(path, name)).state_dict())


def load_initial_weights(path: str, parts: dict, model, ema, vae_identity: dict,
                         frozen_text: tuple | None = None) -> dict:
    """A new stage's starting weights: the trained `parts`' (`{"unet": layer, "bert": layer}`) of a training
    checkpoint or a pipeline `path` (ours, or a diffusers Stable Diffusion folder), and its EMA (a checkpoint's, with
    its update counter; else the loaded weights) into `ema`. Refused in one line when the architecture, the
    autoencoder or the frozen text encoder differ (`frozen_text`: this run's identity of it, the function that gives
    a text encoder's identity, its class and its folder in a pipeline). Returns the lineage for run.json:
    where the weights came from, the parent run, the step and the sha256 of the checkpoint's manifest (a
    pipeline's model_index.json)."""
    import hashlib

    from ppdiffusers import AutoencoderKL

    from ldm.checkpoint.run_folder import MANIFEST, checkpoint_dirs, checkpoint_problem, checkpoint_step
    from ldm.models.autoencoder import autoencoder_identity
    from ldm.models.build import ModelSourceError, check_model_index, vae_folder
    from ldm.models.noise import prediction_type_of
    from ldm.models.torch_layout import load_pretrained  # a pipeline in either layout: ppdiffusers' or diffusers'

    pipeline = os.path.isfile(os.path.join(path, "model_index.json"))
    if not os.path.isdir(path):
        raise CheckpointError(f"--init_from_checkpoint {path}: no such folder")
    if not (pipeline or is_checkpoint(path)):
        found = checkpoint_dirs(path)
        raise CheckpointError(f"--init_from_checkpoint {path}: " + (
            f"a run folder: name one of its checkpoints (the newest is {found[-1]}) or its pipeline/" if found else
            f"neither a training checkpoint ({MODEL_JSON}) nor an exported pipeline (model_index.json)"))
    refuse_pickles(path, "pipeline" if pipeline else "checkpoint")
    if not pipeline:
        problem = checkpoint_problem(path)
        if problem:
            raise CheckpointError(f"--init_from_checkpoint {path}: not a usable checkpoint: {problem}")
        check_autoencoder(path, recorded_autoencoder(path), vae_identity, "this run's autoencoder")
    else:
        check_model_index(path)
        try:
            own_vae = vae_folder(path)
        except ModelSourceError:
            raise CheckpointError(f"--init_from_checkpoint {path}: a pipeline without an autoencoder (vqvae/ or "
                                  "vae/)") from None
        if autoencoder_identity(load_pretrained(AutoencoderKL, own_vae)) != vae_identity:
            raise CheckpointError(f"--init_from_checkpoint {path} was trained with another autoencoder than this "
                                  f"run's: the UNet learned that autoencoder's latents (pass {own_vae} as "
                                  "--vae_name_or_path)")
    if frozen_text is not None:
        check_initial_text_encoder(path, pipeline, *frozen_text)
    scheduler_config = os.path.join(path, "scheduler", "scheduler_config.json")
    if os.path.isfile(scheduler_config):
        with open(scheduler_config) as f:
            prediction = prediction_type_of(json.load(f))
        if prediction != model.prediction_type:
            raise CheckpointError(f"--init_from_checkpoint {path} predicts {prediction} and this run "
                                  f"{model.prediction_type}: pass --prediction_type {prediction} (another target needs "
                                  "another model, not a new stage)")
    for part, target in parts.items():
        if not os.path.isfile(os.path.join(path, part, "config.json")):
            raise CheckpointError(f"--init_from_checkpoint {path} has no {part}/, which this run trains: it is another "
                                  "kind of model (a text encoder of another family, or one it kept frozen)")
        state = load_pretrained(type(target), os.path.join(path, part)).state_dict()
        expected = {name: tuple(value.shape) for name, value in target.state_dict().items()}
        got = {name: tuple(value.shape) for name, value in state.items()}
        if got != expected:
            differ = sorted(set(got) ^ set(expected)) or [n for n in expected if got[n] != expected[n]]
            raise CheckpointError(f"--init_from_checkpoint {path}: its {part} is another architecture than this "
                                  f"run's --model_name_or_path ({differ[0]}: {got.get(differ[0])} vs "
                                  f"{expected.get(differ[0])}); start from the same model")
        target.set_state_dict(state)
    saved_ema = None if pipeline else read_ema(path)
    if ema is not None:
        ema.reset_to(model)
        if saved_ema is not None:  # its counter too: the average goes on, not a fresh warm-up
            ema.load_matching(saved_ema)  # weights it has no average of (a text encoder it froze) start afresh
    identity_file = os.path.join(path, "model_index.json" if pipeline else MANIFEST)
    with open(identity_file, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    parent = os.path.dirname(os.path.abspath(path))
    parent_run = None
    if os.path.isfile(os.path.join(parent, "run.json")):
        with open(os.path.join(parent, "run.json")) as f:
            parent_run = {"output_dir": parent, "created": json.load(f).get("created")}
    return {"init_from": os.path.abspath(path), "kind": "pipeline" if pipeline else "checkpoint",
            "step": None if pipeline else checkpoint_step(path), "parent_run": parent_run,
            f"{os.path.basename(identity_file).replace('.json', '')}_sha256": digest,
            "ema": "checkpoint" if saved_ema is not None and ema is not None else "loaded weights"}


def text_encoder_folder_of(path: str, part: str) -> str | None:
    """The text encoder of a pipeline or a checkpoint: the frozen one its run wrote (recorded), else its own `part/`
    (`bert/`, `text_encoder/`); None when it has neither."""
    recorded = recorded_text_encoder_folder(path) if is_checkpoint(path) else None
    own = os.path.join(path, part)
    return recorded or (own if os.path.isfile(os.path.join(own, "config.json")) else None)


def check_initial_text_encoder(path: str, pipeline: bool, identity: dict, identify, model_class, part: str) -> None:
    """The frozen text encoder of a new stage's source is this run's: the UNet learned that encoder's states."""
    from ldm.models.torch_layout import load_pretrained

    recorded = None if pipeline else read_model_record(path).get("text_encoder_identity")
    if recorded is not None:
        theirs = recorded
    else:
        folder = text_encoder_folder_of(path, part)
        if folder is None:
            raise CheckpointError(f"--init_from_checkpoint {path} has no {part}/: not a model of this run's text "
                                  f"encoder family ({identity['family']})")
        theirs = identify(load_pretrained(model_class, folder))
    if theirs != identity:
        differ = [k for k in identity if (theirs or {}).get(k) != identity[k]] or ["family"]
        raise CheckpointError(f"--init_from_checkpoint {path} was trained with another text encoder than this run's "
                              f"({', '.join(differ)} differ): the UNet learned that encoder's states. Pass its model "
                              "as --model_name_or_path")


def read_ema(path: str) -> dict | None:
    """The EMA state of a checkpoint (arrays as numpy), None when it has none."""
    return load_state(path, EMA) if has_state(path, EMA) else None


# -- training state ----------------------------------------------------------------------------------
def read_training_state(folder: str) -> dict:
    """Step, world size and per-rank states of a checkpoint (`ldm.checkpoint.manager` writes them)."""
    if not has_state(folder, TRAINING_STATE):
        refuse_pickles(folder)
        raise CheckpointError(f"{folder} has no {TRAINING_STATE}.json: not a training checkpoint")
    return load_state(folder, TRAINING_STATE)


def upgrade(folder: str) -> list[str]:
    """Rewrite a checkpoint of an earlier version (pickles) in today's format; returns the files replaced.

    Unpickles: for checkpoints the user wrote. The new checkpoint is built beside the old one (unchanged files
    hard-linked, converted ones written anew, the manifest last) and swapped in at the end: a conversion that
    fails, or is killed, leaves the checkpoint as it found it. A kill between the two renames of the swap (a
    moment) leaves the original as `<folder>.pre-upgrade`, which the next upgrade names instead of going on.
    """
    import pickle

    import paddle

    found = pickled_files(folder)
    if not found:
        return []
    final = os.path.abspath(folder)
    backup = final + ".pre-upgrade"
    if os.path.exists(backup):
        raise CheckpointError(f"{backup} exists: an earlier upgrade was interrupted while it swapped the folders. "
                              f"{backup} is the original: check {folder} against it, then remove one of them")
    work = temporary_folder(os.path.dirname(final), f"{TEMP_PREFIX}{os.path.basename(final)}-upgrade-")
    try:
        shutil.copytree(final, work, dirs_exist_ok=True, copy_function=_link_or_copy,
                        ignore=lambda root, names: [n for n in names if n == "manifest.json" or os.path.relpath(
                            os.path.join(root, n), final) in found])
        for part in ("unet", "bert", "vqvae"):
            if any(n.startswith(part + os.sep) for n in found):
                _resave_part(os.path.join(final, part), os.path.join(work, part))
        legacy = os.path.join(final, LEGACY_STATE_FILE)
        if os.path.isfile(legacy):
            with open(legacy, "rb") as f:
                state = pickle.load(f)
            if not isinstance(state, dict):
                raise ValueError(f"{LEGACY_STATE_FILE} holds a {type(state).__name__}, not a training state")
            world = state.get("world_size", 1)
            if "rng" in state:  # the loop's: three per-rank generator lists
                state["random"] = [{"paddle": [list(g.__getstate__()) for g in state["rng"][r]],
                                    "numpy": state["numpy"][r], "python": state["python"][r]} for r in range(world)]
                for key in ("rng", "numpy", "python"):
                    state.pop(key)
            for name, key in (("scheduler.pdparams", "lr_scheduler"), ("scaler.pdparams", "scaler")):
                path = os.path.join(final, name)
                if os.path.isfile(path):  # the Trainer path's, written by PaddleNLP
                    state[key] = paddle.load(path)
            save_state(work, TRAINING_STATE, state)
        for name, target in (("ema.pdparams", EMA), ("optimizer.pdopt", OPTIMIZER)):
            path = os.path.join(final, name)
            if os.path.isfile(path):
                save_state(work, target, paddle.load(path))
        write_manifest(work)
        follow_umask_tree(work)
        os.replace(final, backup)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    os.replace(work, final)
    try:
        shutil.rmtree(backup)
    except OSError as e:
        logger.warning("%s is converted; its original copy %s could not be deleted: %s", folder, backup, e)
    return found


def _link_or_copy(src: str, dst: str) -> None:
    """A file the upgrade keeps as it is: a hard link (no second copy of gigabytes of weights), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _resave_part(source: str, target: str) -> None:
    from ldm.models.build import part_class, read_config

    cls = part_class(os.path.basename(source), read_config(source))
    shutil.rmtree(target, ignore_errors=True)  # its configs were linked in with the rest
    cls.from_pretrained(source).save_pretrained(target, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ldm.checkpoint", description="Checkpoint maintenance.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("upgrade", help="convert checkpoints of an earlier version (pickles) to safetensors "
                                             "and JSON; unpickles them once: only for checkpoints you wrote")
    up.add_argument("folders", nargs="+", help="checkpoint-<step> folders, or a run folder (all its checkpoints)")
    args = parser.parse_args(argv)
    from ldm.checkpoint.run_folder import checkpoint_dirs, checkpoint_problem

    status = 0
    for folder in args.folders:
        targets = [folder] if is_checkpoint(folder) or os.path.isfile(os.path.join(folder, LEGACY_STATE_FILE)) \
            else checkpoint_dirs(folder)
        if not targets:
            print(f"error: {folder} is neither a checkpoint nor a run folder with checkpoints", file=sys.stderr)
            status = 2
        for target in targets:
            try:
                replaced = upgrade(target)
            except Exception as e:  # noqa: BLE001 - an old pickle can fail in any way; the checkpoint is left as it was
                print(f"error: {target} cannot be converted ({type(e).__name__}: {' '.join(str(e).split())}); it is "
                      "left as it was", file=sys.stderr)
                status = 2
                continue
            if not replaced and (problem := checkpoint_problem(target)) is not None:
                print(f"error: {target} holds no pickles to convert, but it is not complete: {problem}; upgrade cannot "
                      "repair it (restore it from a copy)", file=sys.stderr)
                status = 2
                continue
            print(f"{target}: " + (f"converted {len(replaced)} pickled file(s)" if replaced else "already current"))
    return status
