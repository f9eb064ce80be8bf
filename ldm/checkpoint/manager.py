"""The checkpoint manager: the one owner of a run's state on disk on every path (the loop, the Trainer, the
autoencoder).

It is handed the model (what a checkpoint holds of it saves and loads itself in the pipeline layout) and named
parts, each a pair of functions that give and take a state tree: the optimizer, the learning-rate
schedule, the loss scaler, the EMA, the clock of samples, and per rank the random state, the data position and a
weights fingerprint. It decides when a checkpoint is due, writes it (every rank its share: its own shard of a sharded
optimizer state and EMA, else a share of the state every rank holds, and a share of the weights), keeps
`save_total_limit` of them, and resumes from one. The loop never assembles a state dict. Formats:
`ldm.checkpoint.format` (JSON and safetensors, never pickle).

A save runs in three steps: a snapshot into host buffers while the updates wait, the files written beside
training by a thread of each rank (`ldm.checkpoint.background`), and the seal by rank 0 (the manifest, from every
rank's receipt, and the rename into place: `ldm.checkpoint.run_folder`). The ranks learn that every rank has
written its files, or that one failed, from the ballots the manager casts in the update's one vote
(`ldm.runtime.vote`): a failure ends the run at the next update, on every rank, with one line.

A resume is one call, `restore`, from the checkpoint read once (`ldm.checkpoint.resume.Resume`): the weights load
and every part is handed its saved state. A part whose object the run gets at a later step (`Late`: the driver's
optimizer, schedule and scaler, which PaddleNLP's Trainer makes inside `trainer.train`; the EMA, laid out with the
update) holds that state until its object is handed over (`hand`), then loads itself; the random state is applied
when the updates begin (`begin`), after anything that seeds the generators (PaddleNLP's `set_seed`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle

from ldm.checkpoint.background import BackgroundWriter, FileJob, HostBuffers, read_receipts, write_files
from ldm.checkpoint.format import EMA, SNAPSHOT_RECORD, TRAINING_STATE, share_out, weight_jobs
from ldm.checkpoint.resume import Resume
from ldm.checkpoint.run_folder import (
    NO_SPACE,
    RUN_CONFIG,
    CheckpointError,
    RunFolder,
    checkpoint_problem,
    remove,
    write_json,
)
from ldm.checkpoint.serialization import (
    array_sizes,
    has_state,
    load_state,
    shard_name,
    split_state,
    to_paddle,
    write_state_index,
)
from ldm.models.posthoc_ema import profile_name
from ldm.runtime.compat import sharding_owners
from ldm.runtime.distributed import Distributed, rank_seed, weights_checksum
from ldm.runtime.errors import NonFiniteStop

logger = logging.getLogger("ldm.train")

WEIGHTS = "weights"  # under sharding, every rank also writes a share of the trained weights


@dataclass
class Part:
    """One piece of run state: `state()` gives a tree of numbers, strings and arrays, `load(tree)` takes it.

    A part `per_rank` is gathered from every rank and `load` receives every saved rank's tree (the saved
    world size may differ from this run's). A part written to files of its own (`own_file`) is handed a reader of
    them instead (`read(owned)`): it reads once its object is there, since under sharding the arrays it keeps are
    known only then. `load=None`: saved for the record only (the weights fingerprint).
    """

    state: Callable[[], Any]
    load: Callable[[Any], None] | None = None
    per_rank: bool = False
    missing: Callable[[dict], None] | None = None  # a checkpoint written before this part existed: given its state
    # a part that may be held in shards (a sharded optimizer's state, a sharded EMA): asked at each save and load,
    # it says which of the state's arrays (by key) this rank holds, or None when this rank holds them all
    owned: Callable[[], Callable[[str], bool] | None] | None = None
    # written to files of its own (the optimizer state, the EMA, the post-hoc EMA's profiles: inference and the
    # EMA snapshots read them alone), not into the training state; `flag`: what asks for it, said when a
    # checkpoint lacks it
    own_file: bool = False
    flag: str = ""


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

    return Part(lambda: optimizer().state_dict(), lambda read: optimizer().set_state_dict(to_paddle(read(owned()))),
                owned=owned, own_file=True)


def ema_part(ema, flag: str = "--use_ema") -> Part:
    """The EMA, or a post-hoc EMA's profile; sharded (`EMA.shard`), each rank saves and reads the averages it
    keeps."""
    part = stateful(ema, "load_state_dict")

    def owned():
        if ema.owner is None:
            return None
        return lambda key: key.startswith("shadow.") and key[len("shadow."):] in ema.shadow

    return Part(part.state, lambda read: part.load(read(owned())), owned=owned, own_file=True, flag=flag)


def scaler_part(scaler) -> Part:
    """The loss scaler. A checkpoint of a run without fp16 scaling (fp32, bf16, or a device without fp16)
    holds no scaler state, or an empty one: resuming it with fp16 keeps this run's fresh scaler."""
    part = stateful(scaler, "load_state_dict")

    def load(tree) -> None:
        if tree:
            part.load(tree)

    return Part(part.state, load, missing=lambda state: None)


class Late(Part):
    """A part whose object comes at a later step of the run (`of(obj)` makes the part of it): the restore hands it
    its saved state, which it holds until `hand(obj)`, when it loads itself. One never handed (the Trainer's scaler
    without fp16 scaling) is not saved."""

    def __init__(self, of: Callable[[Any], Part], **fields):
        super().__init__(state=self._state, load=self._load, owned=self._owned, **fields)
        self.of, self.given, self.held = of, None, None

    @property
    def handed(self) -> bool:
        return self.given is not None

    def hand(self, obj) -> None:
        self.given = self.of(obj)
        if self.held is not None:
            held, self.held = self.held, None
            self.given.load(held)

    def _state(self):
        return self.given.state()

    def _load(self, saved) -> None:
        if self.given is None:
            self.held = saved
        else:
            self.given.load(saved)

    def _owned(self):
        return self.given.owned() if self.given is not None and self.given.owned is not None else None


def state_jobs(file: str, tree: Any, buffers: HostBuffers, mine: Callable[[str], bool] | None = None,
               dtype: str | None = None) -> tuple[list[FileJob], list[str]]:
    """A state tree (or the arrays of it `mine` accepts) as the files `<file>.json` and `<file>.safetensors`, its
    arrays copied into `buffers` (cast to `dtype` when given); and the keys of those arrays."""
    structure, arrays = split_state(tree, buffers.taker(file, dtype), mine)
    files = [FileJob(f"{file}.json", data=structure)] + ([FileJob(f"{file}.safetensors", arrays)] if arrays else [])
    return files, sorted(arrays)


def first_line(error: BaseException) -> str:
    """What an error says, on one line (Paddle's carry C++ stacks below their first)."""
    text = (error.strerror if isinstance(error, OSError) and error.strerror else str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


def readable(error: BaseException | None):
    """An error as it can travel to the other ranks (pickled by the gather): itself, or its first line."""
    if error is None or isinstance(error, OSError | CheckpointError):
        return error
    return RuntimeError(f"{type(error).__name__}: {first_line(error)}")


class RandomState:
    """A rank's generators (Paddle's, numpy's, Python's) as JSON-able trees. The saved ones are held from the
    restore to `begin`, when the updates begin: whatever seeds the generators before (PaddleNLP's `set_seed`) is
    then overwritten; a fresh run seeds each rank's noise there."""

    def __init__(self, dist: Distributed, seed: int):
        self.dist, self.seed = dist, seed
        self.step = 0  # set by the manager at the restore: what a new rank's seed derives from
        self.held: list[dict] | None = None

    def state(self) -> dict:
        return {"paddle": [list(g.__getstate__()) for g in paddle.get_rng_state()],
                "numpy": np.random.get_state(), "python": random.getstate()}

    def load(self, saved: list[dict]) -> None:
        self.held = saved

    def begin(self) -> None:
        saved, self.held = self.held, None
        if saved is None:
            paddle.seed(rank_seed(self.seed, self.dist.rank))
            return
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


@dataclass
class PendingSave:
    """A checkpoint being written: every rank writes its files (`phase` "write"), then rank 0 seals it ("seal")."""

    step: int
    temp: str
    final: str
    started: float  # when `save` was called
    kind: str = "checkpoint"  # or "snapshot": an EMA snapshot (`save_ema_snapshot`)
    snapshot_seconds: float = 0.0  # the snapshot alone (after any wait for the previous save)
    stall_seconds: float = 0.0
    phase: str = "write"
    sealed_at: float | None = None  # rank 0: when the manifest and the rename were done
    bytes: int = 0  # rank 0: the checkpoint's size, once sealed
    written_from: float = 0.0  # when the snapshot ended and the writing began

    @property
    def seconds(self) -> float:
        """From the call of `save` to the seal (as far as this rank knows)."""
        return (self.sealed_at or time.perf_counter()) - self.started

    @property
    def write_seconds(self) -> float:
        """From the end of the snapshot to the seal (as far as this rank knows)."""
        return (self.sealed_at or time.perf_counter()) - self.written_from


def snapshot_bytes(memory: dict, rank: int, world_size: int) -> int:
    """The host memory rank `rank`'s snapshot takes, from the run's memory record (`ldm.train.memory`): its share of
    the weights (every rank writes 1/world of them), of the optimizer state and of the EMA (its own shard where they
    are sharded, else 1/world of the replicated whole)."""
    mine = memory["ranks"][rank]
    sharded = memory.get("sharding_degree", 1) > 1
    weights = mine["weights"] // world_size
    kept = mine["optimizer"] + mine["ema"] + mine.get("ema_profiles", 0)
    return weights + (kept if sharded else kept // world_size)


def check_weights(checksums: list[float], step: int, last_checkpoint: str | None) -> None:
    """Refuse to save weights whose fingerprint (sum of |w| per rank, `ldm.runtime.distributed.weights_checksum`) is
    not finite: such a checkpoint could only poison a resume."""
    if not all(math.isfinite(value) for value in checksums):
        raise NonFiniteStop(f"the weights are not finite at update {step}: checkpoint-{step} is not written. The last "
                            f"good checkpoint is {last_checkpoint or 'none'}; lower the learning rate before resuming")


class CheckpointManager:
    def __init__(self, run_dir: RunFolder, dist: Distributed, objective, *, save_steps: int,
                 parts: dict[str, Part], seed: int, trained: Sequence[paddle.Tensor],
                 data_position: Part, record: dict | None = None, async_save: bool = True):
        """`objective`: what a checkpoint holds of the model (`ldm.train.objective.Objective`: `trained_parts()`,
        `save`, `load`, `ema`). `parts` beyond the ones every run has: the random state, the data position
        (`data_position`, one per rank), the weights fingerprint and, with EMA, the EMA and the post-hoc EMA's
        profiles (`Late`: handed over once laid out like the update, `hand_averages`).
        `record`: the run's configuration (`ldm.config.record.describe_run`), written into every checkpoint.
        `async_save`: files are written beside training (`ldm.checkpoint.background`); else each save is waited for."""
        self.run_dir, self.dist, self.objective, self.save_steps = run_dir, dist, objective, save_steps
        self.record = record
        self.last: str | None = None  # the newest checkpoint sealed or resumed by this run
        self.load_seconds = 0.0
        self.random = RandomState(dist, seed)
        self.parts = {
            **parts,
            "random": Part(self.random.state, self.random.load, per_rank=True),
            "stream": dataclasses.replace(data_position, per_rank=True),
            "weights_checksum": Part(lambda: weights_checksum(trained), per_rank=True),
        }
        if objective.ema is not None:
            self.parts[EMA] = Late(ema_part, own_file=True, flag="--use_ema")
        self.profiles = getattr(objective, "ema_profiles", None)
        for profile in self.profiles.profiles if self.profiles is not None else ():
            self.parts[profile_name(profile.sigma_rel)] = Late(lambda p: ema_part(p, "--ema_sigma_rels"),
                                                              own_file=True, flag="--ema_sigma_rels")
        self.async_save = async_save
        self.buffers = HostBuffers(copy=async_save)  # the snapshot's, reused from save to save
        if async_save and record and record.get("memory"):
            reserved = snapshot_bytes(record["memory"], dist.rank, dist.world_size)
            self.buffers.reserve(reserved)
            logger.info("asynchronous saves: %.2f GiB of host memory per rank for the checkpoint snapshot, reserved "
                        "now (the first save then stalls as briefly as the later ones)", reserved / 2**30)
        self.writer = BackgroundWriter()
        self.pending: PendingSave | None = None
        self.sealed: PendingSave | None = None  # the newest save this run completed
        self._finished: list[dict] = []  # metrics of sealed saves, for `take_metrics`

    def hand(self, name: str, obj) -> None:
        """The object of the part `name` (a `Late`), at the run's step where it exists: it loads what the restore
        held for it."""
        self.parts[name].hand(obj)

    def hand_averages(self) -> None:
        """The EMA and the post-hoc EMA's profiles, once laid out like the update (sharded, flat)."""
        if self.objective.ema is not None:
            self.hand(EMA, self.objective.ema)
        for profile in self.profiles.profiles if self.profiles is not None else ():
            self.hand(profile_name(profile.sigma_rel), profile)

    def begin(self) -> None:
        """The updates begin: the random state restored (a fresh run's seeded)."""
        self.random.begin()

    @property
    def saved_parts(self) -> dict[str, Part]:
        """The parts a checkpoint holds: all but a `Late` one never handed over."""
        return {name: part for name, part in self.parts.items() if not isinstance(part, Late) or part.handed}

    def due(self, step: int, *, last: bool = False, stopping: bool = False) -> bool:
        return step % self.save_steps == 0 or last or stopping

    @property
    def in_flight(self) -> str:
        """The checkpoint being written in the background ("" when none), for the progress line."""
        return os.path.basename(self.pending.final) if self.pending is not None else ""

    def has(self, step: int) -> bool:
        """Whether checkpoint-<step> was saved (or is being saved) by this run, or is complete on disk."""
        if self.pending is not None and self.pending.step == step and self.pending.kind == "checkpoint":
            return True
        folder = self.run_dir.path(f"checkpoint-{step}")
        return self.dist.from_main(lambda: checkpoint_problem(folder, checksums=False) is None)

    # -- saving ------------------------------------------------------------------------------------------
    def save(self, step: int, also: Callable[[str], None] | None = None) -> str:
        """checkpoint-<step>, on every rank together; `also(folder)` writes more files into it (rank 0).

        The loop waits for the previous save still in flight (at most one), then for the snapshot: every rank
        copies what it writes into host buffers (per-rank parts are gathered, and rank 0 writes the small files:
        configurations, indexes, the run's record). The files are then written in the background and the
        checkpoint is sealed once every rank wrote its own (`settle`); with `async_save` off, here. Returns the
        checkpoint's path (complete once sealed: `self.last`)."""
        started = self._wait_for_the_save_in_flight(f"checkpoint-{step}")
        snapshot_started = time.perf_counter()
        gathered = {name: self.dist.gather(part.state()) for name, part in self.saved_parts.items() if part.per_rank}
        check_weights(gathered["weights_checksum"], step, self.last)  # never a checkpoint of NaN weights
        return self._write(PendingSave(step, "", self.run_dir.path(f"checkpoint-{step}"), started),
                           lambda: self.run_dir.begin_save(step), lambda: self._snapshot(step, gathered),
                           lambda temp, final, keys: self._write_small_files(temp, final, step, keys, also),
                           snapshot_started)

    def save_ema_snapshot(self, step: int) -> str:
        """`ema_snapshots/step-<step>/`: every post-hoc EMA profile (`ldm.models.posthoc_ema`), each a part's files
        as a checkpoint holds them, in the snapshot's dtype, and `snapshot.json`; written and sealed as a checkpoint
        is (every rank its share, in the background, a manifest last), outside rotation."""
        started = self._wait_for_the_save_in_flight(f"the EMA snapshot of update {step}")
        snapshot_started = time.perf_counter()
        names = [profile_name(profile.sigma_rel) for profile in self.profiles.profiles]
        dtype = self.profiles.dtype

        def files():
            jobs, keys = [], {}
            for name in names:
                jobs_of_part, keys[name] = self._part_files(name, self.parts[name], dtype)
                jobs += jobs_of_part
            return jobs, keys

        def record(temp: str, final: str, keys: list[dict]) -> None:
            self._write_indexes(temp, names, keys)
            write_json(os.path.join(temp, SNAPSHOT_RECORD), {
                "step": step, "dtype": dtype, "world_size": self.dist.world_size,
                "profiles": [{"name": name, "sigma_rel": p.sigma_rel, "gamma": p.gamma, "num_updates": p.num_updates}
                             for name, p in zip(names, self.profiles.profiles, strict=True)]})

        return self._write(PendingSave(step, "", self.run_dir.snapshot_path(step), started, kind="snapshot"),
                           lambda: self.run_dir.begin_snapshot(step), files, record, snapshot_started)

    def _wait_for_the_save_in_flight(self, what: str) -> float:
        """Every rank together: the previous save sealed (at most one in flight); when this save was asked for."""
        started = time.perf_counter()
        if self.pending is not None and self.writer.busy:
            logger.info("%s waits for %s, still being written", what, self.in_flight)
        self.wait()
        return started

    def _write(self, pending: PendingSave, begin, files, small_files, snapshot_started: float) -> str:
        """A save on every rank: the temporary folder (`begin()`, rank 0's), this rank's files (`files()`: jobs and
        the keys of the parts it writes a share of) snapshot into host buffers, rank 0's small files
        (`small_files(temp, final, every rank's keys)`), then the writing in the background (waited for without
        `async_save`)."""
        temp = self.dist.from_main(begin)
        rank, world = self.dist.rank, self.dist.world_size
        try:
            jobs, keys = files()
            outcome = ("ok", keys)
        except Exception as e:  # noqa: BLE001 - every rank's outcome goes to rank 0, which raises the first
            outcome = ("error", readable(e))
        outcomes = self.dist.gather(outcome)
        errors = [value for kind, value in outcomes if kind == "error"]

        def write_small_files() -> None:
            if errors:
                remove(temp)
                raise errors[0]
            try:
                small_files(temp, pending.final, [keys for _, keys in outcomes])
            except BaseException:
                remove(temp)
                raise

        with self.run_dir.no_space_ends_the_run(pending.final):
            self.dist.from_main(write_small_files)
        now = time.perf_counter()
        pending.temp, pending.snapshot_seconds, pending.written_from = temp, now - snapshot_started, now
        self.pending = pending
        self.writer.start(os.path.basename(pending.final), lambda: write_files(temp, jobs, rank, world))
        if self.async_save:
            pending.stall_seconds = time.perf_counter() - pending.started
        else:
            self.wait()  # its stall is all of it (`_done`)
        return pending.final

    def _part_files(self, name: str, part: Part, dtype: str | None = None) -> tuple[list[FileJob], list | None]:
        """This rank's files of a part written to files of its own (its arrays cast to `dtype` when given): its own
        shard where the part is sharded, else a share of the state every rank holds; and the keys of the arrays it
        writes (None on one rank)."""
        rank, world = self.dist.rank, self.dist.world_size
        tree = part.state()
        if part.owned is not None and part.owned() is not None:  # a shard of its own: all of this rank's
            file, mine = shard_name(name, rank, world), None
        elif world > 1:  # the same on every rank: each writes its share
            share = set(share_out(array_sizes(tree), world)[rank])
            file, mine = shard_name(name, rank, world), share.__contains__
        else:
            file, mine = name, None
        files, arrays = state_jobs(file, tree, self.buffers, mine, dtype)
        return files, None if world == 1 else arrays

    def _snapshot(self, step: int, gathered: dict) -> tuple[list[FileJob], dict]:
        """This rank's files of checkpoint-<step>, their arrays copied into host buffers, and the keys of what it
        holds of each part written in shares. Every rank writes a share of the weights and of each state part
        (its own shard under sharding; the same state dealt among the ranks otherwise); rank 0 also writes the
        training state (step, gathered per-rank parts, the small parts)."""
        rank, world = self.dist.rank, self.dist.world_size
        jobs, keys = weight_jobs(self.objective.trained_parts(), rank, world, self.buffers)
        keys = {WEIGHTS: keys}
        state = {"step": step, "world_size": world, **gathered}
        for name, part in self.saved_parts.items():
            if part.per_rank:
                continue
            if not part.own_file:
                state[name] = part.state()
                continue
            files, keys[name] = self._part_files(name, part)
            jobs += files
        if rank == 0:
            jobs += state_jobs(TRAINING_STATE, state, self.buffers)[0]
        return jobs, keys

    def _write_indexes(self, folder: str, names, keys: list[dict]) -> None:
        """The index of every part of `names` the ranks wrote in shares (`keys`: each rank's keys by part)."""
        for name in names:
            if name in keys[0] and keys[0][name] is not None:
                write_state_index(folder, name, [k[name] for k in keys])

    def _write_small_files(self, folder: str, final: str, step: int, keys: list[dict], also) -> None:
        """Rank 0, at the snapshot: the model's configurations, the indexes of what the ranks write in shares,
        the run's record, `also`'s files."""
        self.objective.save(folder, final, [k[WEIGHTS] for k in keys])
        self._write_indexes(folder, [name for name, part in self.saved_parts.items() if part.own_file], keys)
        if self.record is not None:
            write_json(os.path.join(folder, RUN_CONFIG), {**self.record, "step": step})
        if also is not None:
            also(folder)

    def _seal(self, pending: PendingSave) -> None:
        """Rank 0: the manifest from every rank's receipt, the rename, the rotation; a failure is one line (and the
        temporary folder gone)."""
        try:
            receipts = read_receipts(pending.temp, self.dist.world_size)
            if pending.kind == "snapshot":
                self.run_dir.seal_snapshot(pending.temp, pending.final, receipts)
            else:
                self.run_dir.seal(pending.step, pending.temp, receipts)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - what failed is said in one line, as for a failed write
            remove(pending.temp)
            raise self.run_dir.save_failed(pending.final, first_line(e)) from None
        pending.sealed_at = time.perf_counter()
        pending.bytes = sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(pending.final)
                            for n in names)

    # -- the background save, agreed at every update -------------------------------------------------
    def ballots(self) -> dict[str, float]:
        """This rank's ballots in the update's vote (`ldm.runtime.vote`): whether its writer is busy, and its rank + 1
        when its writing failed (0 otherwise)."""
        if self.pending is None:
            return {"writer_busy": 0.0, "write_failed": 0.0}
        busy, task = self.writer.busy, self.writer.task  # busy first: a task that ends now is seen at the next vote
        failed = not busy and task is not None and task.error is not None
        return {"writer_busy": float(busy), "write_failed": float(self.dist.rank + 1 if failed else 0)}

    def settle(self, votes: dict[str, float]) -> None:
        """After the vote, on every rank with the same figures: a failed write ends the run (one line naming the
        newest complete checkpoint); once every rank wrote its files, rank 0 seals in the background; once no
        rank is busy after that, the checkpoint is complete."""
        if self.pending is None:
            return
        busy, failed_rank = bool(votes["writer_busy"]), int(votes["write_failed"])
        if failed_rank:  # every rank is here: each waits for its writer, then all learn the failed rank's cause
            task = self.writer.wait()
            self._fail(self.dist.gather(readable(task.error) if task is not None else None))
        if busy:
            return
        if self.pending.phase == "write":
            self.pending.phase = "seal"
            if self.dist.is_main:
                pending = self.pending
                self.writer.start(f"seal of checkpoint-{pending.step}", lambda: self._seal(pending))
        else:
            self._done()

    def wait(self) -> PendingSave | None:
        """Every rank together: the save in flight finished and sealed (the next save, the end of the run, a stop
        on a signal); it is returned, None when there was none."""
        pending = self.pending
        if pending is None:
            return None
        task = self.writer.wait()
        self._fail(self.dist.gather(readable(task.error) if task is not None else None))
        if pending.phase == "write":
            try:
                self.dist.from_main(lambda: self._seal(pending))
            except BaseException:
                self.pending = None
                raise
        return self._done()

    def _done(self) -> PendingSave:
        pending, self.pending = self.pending, None
        if not pending.stall_seconds:  # sealed within `save` (waited for): the updates waited for all of it
            pending.stall_seconds = time.perf_counter() - pending.started
        if pending.kind == "snapshot":
            if self.dist.is_main:
                logger.info("saved the EMA snapshot %s (%.2f GiB); the updates waited %.2f s", pending.final,
                            pending.bytes / 2**30, pending.stall_seconds)
            return pending
        self.last, self.sealed = pending.final, pending
        if self.dist.is_main:
            self._finished.append({"checkpoint/stall_seconds": pending.stall_seconds,
                                   "checkpoint/write_seconds": pending.write_seconds,
                                   "checkpoint/bytes": pending.bytes})
            logger.info("saved %s (%.2f GiB): snapshot %.2f s, written and sealed %.2f s later; the updates waited "
                        "%.2f s", pending.final, pending.bytes / 2**30, pending.snapshot_seconds,
                        pending.write_seconds, pending.stall_seconds)
        return pending

    def _fail(self, errors: list) -> None:
        """With every rank's writer done and its error gathered (`errors`, by rank): the first failure ends the run
        on every rank with the same line, the temporary folder removed. Nothing when none failed."""
        failed = [rank for rank, error in enumerate(errors) if error is not None]
        if not failed:
            return
        pending, self.pending = self.pending, None
        if self.dist.is_main:
            remove(pending.temp)
        rank, error = failed[0], errors[failed[0]]
        if isinstance(error, CheckpointError):
            raise error
        raise self.run_dir.save_failed(pending.final, first_line(error), rank if self.dist.world_size > 1 else None,
                                       no_space=isinstance(error, OSError) and error.errno in NO_SPACE)

    def take_metrics(self) -> list[dict]:
        """The metrics of the saves sealed since the last call (rank 0), for the trackers."""
        finished, self._finished = self._finished, []
        return finished

    def close(self) -> None:
        """At any exit, on each rank alone (no collective: another rank may be gone): wait for the save in flight;
        rank 0 seals it when every rank's files are there, else it is removed (it never counts as a checkpoint)."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        task = self.writer.wait()
        if not self.dist.is_main:
            return
        if task is None or task.error is not None:
            remove(pending.temp)
            return
        if pending.phase == "seal":
            self.last = pending.final if pending.kind == "checkpoint" else self.last
            return
        try:
            self._seal(pending)
            self.last = pending.final if pending.kind == "checkpoint" else self.last
            logger.warning("sealed %s on the way out", pending.final)
        except Exception as e:  # noqa: BLE001 - the run is ending on another error: this one is reported only
            remove(pending.temp)
            logger.warning("%s was not completed (%s): it is not a checkpoint", pending.final, e)

    def restore(self, resume: Resume) -> int:
        """The one restore of a run: the objective's weights and every part from the checkpoint `resume` (a `Late`
        part holds its state until its object is handed over; the random state until `begin`); returns its step."""
        started = time.perf_counter()
        checkpoint, state = resume.path, resume.training_state
        self.random.step = state["step"]
        self.last = checkpoint
        self.objective.load(checkpoint)
        for name, part in self.parts.items():
            if part.load is None:
                continue
            if part.own_file:
                if not has_state(checkpoint, name):
                    raise CheckpointError(f"{checkpoint} has no {name} state" +
                                          (f" but {part.flag} is on" if part.flag else ""))
                part.load(lambda owned, name=name: load_state(checkpoint, name, owned))
            elif name not in state and part.missing is not None:
                part.missing(state)
            elif name not in state:
                raise CheckpointError(f"{checkpoint} has no {name} state to resume")
            else:
                part.load(state[name])
        self.load_seconds = time.perf_counter() - started
        return state["step"]
