"""The checkpointer: the one owner of a run's state on every path (the loop, the Trainer, the autoencoder).

It is handed the objective (its weights save and load themselves in the pipeline layout) and named
parts, each a pair of functions that give and take a state tree: the optimizer, the learning-rate
schedule, the loss scaler, the EMA, and per rank the random state, the data position and a weights
fingerprint. It decides when a checkpoint is due, writes it (into a temporary folder sealed by its manifest,
`ldm.checkpoint.run_folder`: rank 0 writes, and under sharding every rank first writes its own shard of the
optimizer state and EMA), keeps `save_total_limit` of them, and resumes from one. The loop
never assembles a state dict. Formats: `ldm.checkpoint.format` (JSON and safetensors, never pickle).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle

from ldm.checkpoint.format import EMA, OPTIMIZER, TRAINING_STATE, read_training_state
from ldm.checkpoint.run_folder import CheckpointError, RunFolder, write_json
from ldm.checkpoint.serialization import (
    has_state,
    load_state,
    save_state,
    save_state_shard,
    to_paddle,
    write_state_index,
)
from ldm.config.record import RUN_CONFIG
from ldm.runtime.compat import sharding_owners
from ldm.runtime.distributed import Distributed, weights_checksum
from ldm.train.health import check_weights
from ldm.train.objective import Objective, rank_seed

logger = logging.getLogger("ldm.train")

OWN_FILES = (OPTIMIZER, EMA)  # parts written to a file of their own (inference reads the EMA alone)
WEIGHTS = "weights"  # under sharding, every rank also writes a share of the trained weights


@dataclass
class Part:
    """One piece of run state: `state()` gives a tree of numbers, strings and arrays, `load(tree)` takes it.

    A part `per_rank` is gathered from every rank and `load` receives every saved rank's tree (the saved
    world size may differ from this run's). `load=None`: saved for the record or restored elsewhere.
    """

    state: Callable[[], Any]
    load: Callable[[Any], None] | None = None
    per_rank: bool = False
    missing: Callable[[dict], None] | None = None  # a checkpoint written before this part existed: given its state
    # a part that may be held in shards (a sharded optimizer's state, a sharded EMA): asked at each save and load,
    # it says which of the state's arrays (by key) this rank holds, or None when this rank holds them all
    owned: Callable[[], Callable[[str], bool] | None] | None = None


def stateful(obj, set_name: str = "set_state_dict", tensors: bool = False) -> Part:
    """A part of an object with `state_dict()` and a setter (Paddle optimizers and schedules name it
    `set_state_dict`, the scaler and the EMA `load_state_dict`); `tensors`: the setter wants Paddle tensors."""
    setter = getattr(obj, set_name)
    return Part(obj.state_dict, (lambda tree: setter(to_paddle(tree))) if tensors else setter)


def parameter_of(key: str, names: set[str]) -> str | None:
    """The parameter an optimizer's state entry belongs to: Paddle names them `<parameter>_<accumulator>_<n>`
    (`linear_3.w_0_moment1_0`) and master weights `master_weights/<parameter>`."""
    if key.startswith("master_weights/"):
        key = key[len("master_weights/"):]
        return key if key in names else None
    cut = key.find("_")
    while cut != -1:
        if key[:cut] in names:
            return key[:cut]
        cut = key.find("_", cut + 1)
    return None


def optimizer_part(optimizer: Callable[[], Any]) -> Part:
    """The optimizer's state (`optimizer()` gives the optimizer: the Trainer makes its own late). Under sharding
    each rank holds the state of its own parameters (`ldm.runtime.compat.sharding_owners`), saved and read as
    such, so that it resumes on another number of ranks, sharded or not."""
    def owned():
        shards = sharding_owners(optimizer())
        if shards is None:
            return None
        owners, rank, _ = shards
        mine, every = {name for name, r in owners.items() if r == rank}, set(owners)
        return lambda key: parameter_of(key, every) in mine

    return Part(lambda: optimizer().state_dict(), lambda tree: optimizer().set_state_dict(to_paddle(tree)),
                owned=owned)


def ema_part(ema) -> Part:
    """The EMA; sharded (`EMA.shard`), each rank saves and reads the averages it keeps."""
    part = stateful(ema, "load_state_dict")

    def owned():
        if ema.owner is None:
            return None
        return lambda key: key.startswith("shadow.") and key[len("shadow."):] in ema.shadow

    return Part(part.state, part.load, owned=owned)


def shard_ema(ema, model, optimizer) -> None:
    """Under sharding, the EMA follows the optimizer's partition: each rank keeps the averages of the weights whose
    optimizer state it keeps (`ldm.models.ema.EMA.shard`). Nothing to do unsharded or without EMA."""
    shards = sharding_owners(optimizer)
    if ema is None or shards is None or ema.owner is not None:
        return
    owners, rank, group = shards
    owner = {name: owners[p.name] for name, p in model.named_parameters() if name in ema.parameters}
    ema.shard(owner, rank, lambda tensor, src: paddle.distributed.broadcast(tensor, src=group.ranks[src], group=group))
    logger.info("EMA sharded like the optimizer state: this rank keeps %d of %d averages", len(ema.shadow),
                len(ema.parameters))


def scaler_part(scaler) -> Part:
    """The loss scaler. A checkpoint of a run without fp16 scaling (fp32, bf16, or a device without fp16)
    holds no scaler state, or an empty one: resuming it with fp16 keeps this run's fresh scaler."""
    part = stateful(scaler, "load_state_dict")

    def load(tree) -> None:
        if tree:
            part.load(tree)

    return Part(part.state, load, missing=lambda state: None)


def folder_bytes(folder: str, rank: int, world_size: int) -> int:
    """The bytes of the shards `rank` wrote into `folder` (named `-<rank + 1>-of-<world>.`)."""
    tag = f"-{rank + 1:05d}-of-{world_size:05d}."
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder)
               for name in names if tag in name)


@dataclass
class Shards:
    """What every rank wrote of a sharded checkpoint: {part: each rank's keys}, each rank's bytes, or the first
    rank's error."""

    keys: dict[str, list]
    sizes: list[int]
    error: Exception | None = None


class RandomState:
    """A rank's generators (Paddle's, numpy's, Python's) as JSON-able trees."""

    def __init__(self, dist: Distributed, seed: int):
        self.dist, self.seed = dist, seed
        self.step = 0  # set by the checkpointer before `load`: what a new rank's seed derives from

    def state(self) -> dict:
        return {"paddle": [list(g.__getstate__()) for g in paddle.get_rng_state()],
                "numpy": np.random.get_state(), "python": random.getstate()}

    def load(self, saved: list[dict]) -> None:
        if len(saved) != self.dist.world_size:  # ranks that did not exist have no state: derived for every rank
            logger.warning("resuming a %d-rank run on %d ranks: each rank's noise continues from a seed derived "
                           "from its rank and the step", len(saved), self.dist.world_size)
            paddle.seed(rank_seed(self.seed, self.dist.rank, self.step))
            return
        mine = saved[self.dist.rank]
        generators = []
        for values in mine["paddle"]:
            generator = paddle.get_rng_state()[0].__class__.__new__(paddle.get_rng_state()[0].__class__)
            generator.__setstate__(tuple(values))
            generators.append(generator)
        paddle.set_rng_state(generators)
        np.random.set_state(tuple(mine["numpy"]))
        version, internal, gauss = mine["python"]
        random.setstate((version, tuple(internal), gauss))


class Checkpointer:
    def __init__(self, run_dir: RunFolder, dist: Distributed, objective: Objective, *, save_steps: int,
                 parts: dict[str, Part], seed: int, trained: Sequence[paddle.Tensor],
                 data_position: Callable[[], dict], record: dict | None = None):
        """`parts` beyond the ones every run has: the random state, the data position (restored when the
        batches are built, `objective.start_batches`), the weights fingerprint and, with EMA, the EMA.
        `record`: the run's configuration (`ldm.config.record.describe_run`), written into every checkpoint."""
        self.run_dir, self.dist, self.objective, self.save_steps = run_dir, dist, objective, save_steps
        self._read: tuple[str, dict] | None = None  # (checkpoint, its training state) last read
        self.record = record
        self.last: str | None = None  # the newest checkpoint saved or resumed by this run
        self.random = RandomState(dist, seed)
        self.parts = {
            **parts,
            "random": Part(self.random.state, self.random.load, per_rank=True),
            "stream": Part(data_position, per_rank=True),
            "weights_checksum": Part(lambda: weights_checksum(trained), per_rank=True),
        }
        if objective.ema is not None:
            self.parts[EMA] = ema_part(objective.ema)

    def due(self, step: int, *, last: bool = False, stopping: bool = False) -> bool:
        return step % self.save_steps == 0 or last or stopping

    def save(self, step: int, also: Callable[[str], None] | None = None) -> str:
        """checkpoint-<step> on every rank together (per-rank parts are gathered; rank 0 writes); `also(folder)`
        writes more files into it before the manifest seals it. Returns the checkpoint's path."""
        started = time.perf_counter()
        gathered = {name: self.dist.gather(part.state()) for name, part in self.parts.items() if part.per_rank}
        check_weights(gathered["weights_checksum"], step, self.last)  # never a checkpoint of NaN weights
        sharded = [name for name, part in self.parts.items() if part.owned is not None and part.owned() is not None]
        temp, shards = self._write_shards(step, sharded) if sharded else (None, None)

        def write(folder: str, final_folder: str) -> None:
            if shards is not None and shards.error is not None:
                raise shards.error
            weight_shares = shards.keys[WEIGHTS] if shards is not None else None
            self.objective.save(folder, final_folder, None if weight_shares is None or None in weight_shares
                                else weight_shares)
            state = {"step": step, "world_size": self.dist.world_size, **gathered}
            for name, part in self.parts.items():
                if part.per_rank:
                    continue
                if name in sharded:
                    write_state_index(folder, name, shards.keys[name])
                elif name in OWN_FILES:
                    save_state(folder, name, part.state())
                else:
                    state[name] = part.state()
            save_state(folder, TRAINING_STATE, state)
            if self.record is not None:
                write_json(os.path.join(folder, RUN_CONFIG), {**self.record, "step": step})
            if also is not None:
                also(folder)

        path = self.dist.from_main(lambda: self.run_dir.save(step, write, folder=temp))
        shares = "" if shards is None else " (bytes written by rank: " + ", ".join(
            f"{size / 2**20:.1f} MiB" for size in shards.sizes) + ")"
        logger.info("saved %s in %.2f s%s", path, time.perf_counter() - started, shares)
        self.last = path
        return path

    def _write_shards(self, step: int, sharded: list[str]) -> tuple[str, Shards]:
        """Under sharding, before rank 0 seals the checkpoint: every rank writes its shards of the parts `sharded`
        and its share of the weights into the temporary folder (returned, with what each rank wrote; a rank's
        failure is handed to rank 0, which raises it where the folder is cleaned up)."""
        temp = self.dist.from_main(lambda: self.run_dir.begin_save(step))
        rank, world = self.dist.rank, self.dist.world_size
        try:
            keys = {name: save_state_shard(temp, name, self.parts[name].state(), rank, world) for name in sharded}
            keys[WEIGHTS] = self.objective.save_shard(temp, rank, world)
            outcome = ("ok", keys, folder_bytes(temp, rank, world))
        except Exception as e:  # noqa: BLE001 - every rank's outcome goes to rank 0, which raises the first
            outcome = ("error", e, 0)
        outcomes = self.dist.gather(outcome)
        errors = [value for kind, value, _ in outcomes if kind == "error"]
        if errors:
            return temp, Shards({}, [], errors[0])
        return temp, Shards({name: [value[name] for _, value, _ in outcomes] for name in [*sharded, WEIGHTS]},
                            [size for _, _, size in outcomes])

    def load(self, checkpoint: str, names: Sequence[str] | None = None, *, weights: bool = True) -> int:
        """Restore the objective's weights (`weights`) and the parts `names` (all that can be) from
        `checkpoint`; returns its step."""
        started = time.perf_counter()
        if self._read is None or self._read[0] != checkpoint:  # the Trainer path loads its parts in two calls
            self._read = (checkpoint, read_training_state(checkpoint))
        state = self._read[1]
        self.random.step = state["step"]
        self.last = checkpoint
        if weights:
            self.objective.load(checkpoint)
        for name in names if names is not None else self.parts:
            part = self.parts.get(name)
            if part is None or part.load is None:
                continue
            if name in OWN_FILES:
                if not has_state(checkpoint, name):
                    raise CheckpointError(f"{checkpoint} has no {name} state" +
                                          (" but --use_ema is on" if name == EMA else ""))
                part.load(load_state(checkpoint, name, part.owned() if part.owned is not None else None))
            elif name not in state and part.missing is not None:
                part.missing(state)
            elif name not in state:
                raise CheckpointError(f"{checkpoint} has no {name} state to resume")
            else:
                part.load(state[name])
        self.load_seconds = time.perf_counter() - started
        return state["step"]
