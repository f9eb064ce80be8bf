"""A training run's output folder, shared by every entry point: what may be written where, and when.

    <output_dir>/
      run.json              marks a folder this project made (only such a folder is ever emptied)
      vqvae/                the frozen autoencoder of an LDM run, written once; checkpoints refer to it
      visualdl*/            logs
      checkpoint-<step>/    one resumable state; its manifest.json is written last
      ema_snapshots/step-<step>/
                            the post-hoc EMA's profiles at that update (`ldm.models.posthoc_ema`), sealed as a
                            checkpoint is and never rotated
      pipeline/ or vqvae/   the export at the end

This module is the filesystem and nothing else: it imports nothing of `ldm` but the lock, and what goes into a
checkpoint is decided elsewhere (`ldm.checkpoint.manager`, `ldm.checkpoint.format`).

Rules:
- Nothing is written before every input has been checked (`check` reads only): a failed start
  leaves nothing that blocks the corrected retry. A run that fails later, before its first checkpoint
  (a loader slot that finds no usable record), records why in `run.json`; the next start (not a
  resume) then starts afresh in its place with a warning. A run killed outright records nothing and
  is still refused: another process may still be writing there.
- One run at a time: rank 0 holds `.run.lock` (`ldm.checkpoint.lock`) from the check to the end of the run, and a
  second start into the same folder is refused, `--overwrite_output_dir` included, naming the holder.
- A non-empty folder is refused unless the run resumes (`--resume_from_checkpoint`) or starts over
  (`--overwrite_output_dir`, which empties it: nothing of the earlier run survives or is reused).
- A checkpoint is complete when its `manifest.json` (every file's size and sha256) is there and
  matches. `latest` resumes from the newest complete checkpoint and names any it skips; a damaged
  checkpoint named explicitly is an error. Checkpoints are written into a temporary sibling and
  renamed.
- `auto` resumes from the newest complete checkpoint when there is one and otherwise starts afresh
  (emptying a run folder that holds no checkpoint): one command for a job that is requeued after
  preemption. A folder whose checkpoints all fail verification is refused, never emptied: saves are
  atomic, so such a checkpoint was damaged, and it may be the run's only copy of weeks of training.
- Resuming from an older checkpoint while newer ones exist (they were skipped as damaged, or the
  user named an older one) renames the newer ones `checkpoint-<step>.abandoned`, so that neither
  `latest` nor rotation ever mixes the two histories. EMA snapshots newer than the checkpoint resumed are set aside
  alike when checkpoints were, and otherwise removed (a crash after them: the resumed run writes them again as it
  passes their updates), so that a reconstruction never mixes two histories either.
- Rotation keeps the `limit` newest complete checkpoints and never the one just written; a folder it
  cannot delete is reported.
- Rank 0 decides, and writes all but the checkpoints' large files (every rank writes its share of those, and rank
  0 seals); the other ranks learn its verdict (`Distributed.from_main`), so an error raised on rank 0 ends every
  rank with the same message instead of leaving them in a barrier.
- Checkpoints of runs made before manifests existed (their folder has no `run.json`) are accepted
  without one, with a warning.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from ldm.checkpoint.lock import LOCK_NAME, LockError, RunLock
from ldm.runtime.errors import UserError
from ldm.runtime.files import follow_umask_tree, temporary_folder

logger = logging.getLogger("ldm.train")

RUN_MARKER = "run.json"
RUN_CONFIG = "run_config.json"  # a checkpoint's record of the run that wrote it (`ldm.config.record`)
CHECKPOINT_PREFIX = "checkpoint-"
MANIFEST = "manifest.json"
TEMP_PREFIX = ".tmp-"
VAE_FOLDER = "vqvae"
SNAPSHOTS = "ema_snapshots"
SNAPSHOT_PREFIX = "step-"


# A disk or quota that is full, or a file-size limit: a save that cannot be completed here.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


DAMAGED_WAYS_OUT = ("Restore the damaged files from a copy (a checkpoint of an earlier version, with pickles and no "
                    "manifest: python -m ldm.checkpoint upgrade DIR), move the checkpoints out of the folder, or pass "
                    "--overwrite_output_dir to start afresh")


class CheckpointError(UserError, RuntimeError):
    """The output folder or a checkpoint cannot be used as asked."""


# -- files -----------------------------------------------------------------------------------------
def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_path(path: str) -> None:
    """Flush a file (or a folder's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: str, known: dict[str, dict] | None = None) -> dict:
    """Record every file of `folder` (size, sha256), flushed to disk, then write the manifest last. `known`: entries
    of files flushed and hashed as they were written (`ldm.checkpoint.background`), taken as they are."""
    known = known or {}
    paths = sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
                   if os.path.relpath(os.path.join(root, name), folder) not in (MANIFEST, *known))

    def describe(path: str) -> dict:
        fsync_path(path)
        return {"size": os.path.getsize(path), "sha256": sha256_file(path)}

    # hashlib and fsync release the GIL: the big files of a checkpoint are hashed side by side
    with ThreadPoolExecutor(max_workers=min(8, len(paths) or 1)) as pool:
        infos = list(pool.map(describe, paths))
    files = {os.path.relpath(path, folder): info for path, info in zip(paths, infos, strict=True)}
    for rel, entry in known.items():
        if os.path.getsize(os.path.join(folder, rel)) != entry["size"]:
            raise OSError(f"{rel} changed after it was written")
        files[rel] = entry
    manifest = {"files": dict(sorted(files.items())), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    temp = os.path.join(folder, MANIFEST + ".partial")
    with open(temp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, os.path.join(folder, MANIFEST))
    fsync_path(folder)
    return manifest


LEGACY_STATE_FILE = "training_state.pkl"  # the last file a checkpoint of the pre-manifest versions wrote


def is_legacy_run(output_dir: str) -> bool:
    """A run folder made before checkpoints had manifests (and run folders a marker)."""
    return not os.path.isfile(os.path.join(output_dir, RUN_MARKER))


def checkpoint_problem(folder: str, checksums: bool = True) -> str | None:
    """Why `folder` is not a complete checkpoint (None when it is)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        legacy = os.path.isfile(os.path.join(folder, LEGACY_STATE_FILE))
        if legacy and is_legacy_run(os.path.dirname(os.path.abspath(folder))):
            return None  # written before checkpoints had manifests: complete as far as can be told
        if os.path.isfile(os.path.join(folder, "model_index.json")):
            return ("an exported pipeline, not a training checkpoint: it holds weights only. Start a new run from it "
                    "with --init_from_checkpoint")
        if os.path.basename(os.path.normpath(folder)).startswith(TEMP_PREFIX):
            return "incomplete: no manifest.json (its writing was interrupted)"
        # a save writes into a temporary folder and renames it to checkpoint-<step> only once its manifest is in
        return "damaged: no manifest.json (a sealed checkpoint always has one: it was deleted or the folder modified)"
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable manifest.json ({e})"
    for rel, expected in files.items():
        file = os.path.join(folder, rel)
        if not os.path.isfile(file):
            return f"{rel} is missing"
        size = os.path.getsize(file)
        if size != expected["size"]:
            return f"{rel} has {size} bytes, the manifest says {expected['size']}"
        if checksums and (found := sha256_file(file)) != expected["sha256"]:
            # both digests: what the user compares with a copy of the file
            return f"{rel} does not match its checksum: its sha256 is {found}, the manifest says {expected['sha256']}"
    return None


def temporary_sibling(final: str) -> str:
    """A new empty folder beside `final`, named so that a start after a crash removes it."""
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    return temporary_folder(parent, TEMP_PREFIX + os.path.basename(final) + "-")


@contextmanager
def atomic_folder(final: str, path: str | None = None):
    """Yields a temporary sibling folder to fill (`path`: one made already by `temporary_sibling`); on success it
    replaces `final`, on error it is removed."""
    path = path or temporary_sibling(final)
    try:
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    follow_umask_tree(path)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(path, final)


# -- checkpoints -----------------------------------------------------------------------------------
def checkpoint_step(path: str) -> int | None:
    name = os.path.basename(os.path.normpath(path))
    step = name[len(CHECKPOINT_PREFIX):]
    return int(step) if name.startswith(CHECKPOINT_PREFIX) and step.isdigit() else None


def checkpoint_dirs(output_dir: str) -> list[str]:
    """checkpoint-<step> folders of `output_dir`, complete or not, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        step, path = name[len(CHECKPOINT_PREFIX):], os.path.join(output_dir, name)
        if name.startswith(CHECKPOINT_PREFIX) and step.isdigit() and os.path.isdir(path):
            found.append((int(step), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str, checksums: bool = True) -> str | None:
    """The newest complete checkpoint; every newer one that is not complete is named in a warning. Without
    `checksums`, a look (the launcher's guess of what a restart resumes: the run verifies them)."""
    for path in reversed(checkpoint_dirs(output_dir)):
        problem = checkpoint_problem(path, checksums=checksums)
        if problem is None:
            return path
        logger.warning("skipping %s: %s", path, problem)
    return None


def resolve_resume(output_dir: str, resume: str | None) -> str | None:
    """The checkpoint `--resume_from_checkpoint` names ('latest' or a folder), verified."""
    if not resume:
        return None
    if resume in ("latest", "auto"):
        found = latest_checkpoint(output_dir)
        if found is None and resume == "latest":
            damaged = checkpoint_dirs(output_dir)
            if damaged:
                raise CheckpointError(f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir}: its "
                                      f"{len(damaged)} checkpoint(s) fail verification (the newest: {damaged[-1]}); "
                                      f"nothing was deleted. {DAMAGED_WAYS_OUT}")
            raise CheckpointError(f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir} (use "
                                  "'auto' to start afresh when there is none)")
    else:
        if not os.path.isdir(resume):
            raise CheckpointError(f"--resume_from_checkpoint {resume}: no such folder")
        problem = checkpoint_problem(resume)
        if problem is not None:
            raise CheckpointError(f"--resume_from_checkpoint {resume}: not a usable checkpoint: {problem}")
        found = resume
    if found is not None and not os.path.isfile(os.path.join(found, MANIFEST)):
        logger.warning("%s predates checkpoint manifests: resuming it unverified", found)
    elif found is not None:
        extra = unlisted_files(found)
        if extra:
            logger.warning("%s holds %d file(s) its manifest does not name (%s%s): written into it after it was "
                           "sealed; they are not read", found, len(extra), ", ".join(extra[:3]),
                           ", ..." if len(extra) > 3 else "")
    return found


def unlisted_files(folder: str) -> list[str]:
    """Files of a sealed checkpoint that its manifest does not name (relative paths, sorted)."""
    with open(os.path.join(folder, MANIFEST)) as f:
        listed = set(json.load(f)["files"])
    found = []
    for root, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(rel for rel in found if rel != MANIFEST and rel not in listed)


class RunFolder:
    """The output folder of one run, on every rank; only rank 0 writes here (other ranks write their shares of a
    checkpoint into the folder `begin_save` made)."""

    def __init__(self, output_dir: str, dist, save_total_limit: int | None = None):
        self.output_dir, self.dist, self.limit = output_dir, dist, save_total_limit
        self.empty_first = ""  # why `check` decided that the run starts over (rank 0's decision), or ""
        self.created = False  # this run wrote the folder (`create`)
        self.lock = RunLock(output_dir)

    def path(self, *parts: str) -> str:
        return os.path.join(self.output_dir, *parts)

    # -- before anything is written ------------------------------------------------------------
    def check(self, resume: str | None, overwrite: bool) -> str | None:
        """Apply the folder policy without writing; returns the checkpoint to resume from, if any.

        Decided on rank 0 (one read of the checkpoints, one verdict for every rank).
        """
        return self.dist.from_main(lambda: self._locked_check(resume, overwrite))

    def _locked_check(self, resume: str | None, overwrite: bool) -> str | None:
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise CheckpointError(f"output_dir {self.output_dir} is a file")
        try:
            self.lock.acquire()
        except LockError as e:
            raise CheckpointError(str(e)) from None
        try:
            return self._check(resume, overwrite)
        except BaseException:
            self.lock.release()
            raise

    def release(self) -> None:
        """The end of the run: another may start in this folder (rank 0 holds the lock; a no-op elsewhere)."""
        self.lock.release()

    def _check(self, resume: str | None, overwrite: bool) -> str | None:
        checkpoint = resolve_resume(self.output_dir, resume)
        entries = ([n for n in os.listdir(self.output_dir) if not n.startswith(LOCK_NAME)]
                   if os.path.isdir(self.output_dir) else [])
        checkpoints = checkpoint_dirs(self.output_dir)
        ours = RUN_MARKER in entries or bool(checkpoints)
        if not entries:
            return checkpoint
        if checkpoint is not None:
            if not ours:
                raise CheckpointError(f"output_dir {self.output_dir} holds files this project did not write: resume "
                                      "into an empty folder or into the run's own folder")
            return checkpoint
        why = "--overwrite_output_dir" if overwrite else ""
        if resume == "auto" and not overwrite:
            damaged = checkpoints
            if damaged:  # saves are atomic: a checkpoint-<step> that fails verification was damaged, not interrupted
                # (its checksums were read already, by `latest`: the quick look names what it can)
                problem = checkpoint_problem(damaged[-1], checksums=False) or "a file does not match its checksum"
                raise CheckpointError(
                    f"--resume_from_checkpoint auto: {self.output_dir} holds {len(damaged)} checkpoint(s) and none is "
                    f"complete ({damaged[-1]}: {problem}); nothing was deleted. {DAMAGED_WAYS_OUT}")
            overwrite, why = True, "--resume_from_checkpoint auto, no checkpoint to resume"  # start afresh
        failed = failure_of(self.output_dir) if RUN_MARKER in entries and not checkpoints else None
        if failed and not overwrite and resume is None:
            logger.warning("%s holds a run that failed before its first checkpoint (%s): starting afresh in its place",
                           self.output_dir, failed)
            overwrite, why = True, "the run there failed before its first checkpoint"
        if not overwrite:
            if RUN_MARKER in entries and not checkpoints:
                raise CheckpointError(f"output_dir {self.output_dir} holds a run that saved no checkpoint (it failed "
                                      "early?): pass --overwrite_output_dir to start afresh")
            raise CheckpointError(
                f"output_dir {self.output_dir} is not empty (an earlier run?): pass --resume_from_checkpoint latest "
                "(or a checkpoint folder) to continue it, or --overwrite_output_dir to start afresh")
        if RUN_MARKER not in entries:
            raise CheckpointError(
                f"--overwrite_output_dir: {self.output_dir} holds files this project did not write (no {RUN_MARKER}); "
                "it is not emptied: choose another --output_dir or empty it yourself")
        self.empty_first = why
        return None

    # -- start ---------------------------------------------------------------------------------
    def create(self, resume: str | None, record: dict | None = None) -> None:
        """Make the folder (emptied first when `check` decided to start over); call after `check` and the inputs.

        `record` (a plain JSON-able dict: the run's configuration) goes into `run.json`; a resume adds its own
        record to the list `resumes` there, so the file tells every start of the run."""
        def make() -> None:
            if self.empty_first:
                names = [n for n in os.listdir(self.output_dir) if not n.startswith(LOCK_NAME)]
                for name in sorted(names, key=lambda n: n == RUN_MARKER):  # the marker last: a retry may finish
                    remove(self.path(name))
                logger.info("%s: emptied %s", self.empty_first, self.output_dir)
            os.makedirs(self.output_dir, exist_ok=True)
            for folder in (self.output_dir, self.path(SNAPSHOTS)):
                for name in os.listdir(folder) if os.path.isdir(folder) else []:
                    if name.startswith(TEMP_PREFIX):  # what a killed save left behind
                        remove(os.path.join(folder, name))
            if resume is not None:
                self._abandon_after(resume)
            marker = self.path(RUN_MARKER)
            if not os.path.isfile(marker):
                write_json(marker, {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(record or {})})
            elif record is not None:
                try:
                    with open(marker) as f:
                        run = json.load(f)
                except (OSError, ValueError) as e:
                    logger.warning("%s is unreadable (%s): written afresh", marker, e)
                    run = {}
                run.setdefault("resumes", []).append({**record, "resumed_from": resume})
                write_json(marker, run)

        self.dist.from_main(make)
        self.created = True

    def amend(self, entries: dict) -> None:
        """Replace `entries` of this start's record in `run.json` (the newest resume's, or the first start's): what a
        driver learns after the first write (the Trainer's update, built once its optimizer exists)."""
        def write() -> None:
            marker = self.path(RUN_MARKER)
            with open(marker) as f:
                run = json.load(f)
            (run["resumes"][-1] if run.get("resumes") else run).update(entries)
            write_json(marker, run)

        self.dist.from_main(write)

    def record_failure(self, error: BaseException) -> None:
        """After an error that ends the run: a run that wrote its folder but no checkpoint says so in `run.json`,
        so that the corrected command starts afresh in its place instead of being refused. Whichever rank fails
        writes it, with no collective (rank 0 may be waiting in one for the rank that failed); a folder this run
        did not create, or one with checkpoints, is left alone."""
        if not self.created or checkpoint_dirs(self.output_dir):
            return
        marker = self.path(RUN_MARKER)
        try:
            with open(marker) as f:
                run = json.load(f)
            run["failed"] = f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]
            write_json(marker, run, partial=f"{marker}.partial-{self.dist.rank}")
        except (OSError, ValueError) as e:
            logger.warning("could not record the failure in %s: %s", marker, e)

    def _abandon_after(self, resume: str) -> None:
        """Checkpoints of this folder newer than the one resumed belong to another history: set them aside."""
        step = checkpoint_step(resume)
        if step is None:
            return
        abandoned = False
        for folder in checkpoint_dirs(self.output_dir):
            if checkpoint_step(folder) > step:
                target = folder + ".abandoned"
                remove(target)
                os.replace(folder, target)
                abandoned = True
                logger.warning("resuming from %s: set the newer %s aside as %s", resume, folder, target)
        for snapshot_step, folder in snapshot_dirs(self.output_dir):
            if snapshot_step <= step:
                continue
            if abandoned:
                remove(folder + ".abandoned")
                os.replace(folder, folder + ".abandoned")
                logger.warning("resuming from %s: set the newer EMA snapshot %s aside", resume, folder)
            else:
                remove(folder)
                logger.warning("resuming from %s: removed the newer EMA snapshot %s (this run writes it again at "
                               "update %d)", resume, folder, snapshot_step)

    # -- checkpoints ---------------------------------------------------------------------------
    def begin_save(self, step: int) -> str:
        """The temporary folder of checkpoint-<step>, which every rank fills before `seal`."""
        return temporary_sibling(self.path(f"{CHECKPOINT_PREFIX}{step}"))

    def seal(self, step: int, folder: str, known: dict[str, dict] | None = None) -> str:
        """checkpoint-<step> from the temporary `folder` that `begin_save` made and every rank filled: the manifest
        over every file (`known`: entries of the files hashed as written), the rename, the rotation. Rank 0 only;
        on error the folder is removed."""
        final = self.path(f"{CHECKPOINT_PREFIX}{step}")
        with self.no_space_ends_the_run(final), atomic_folder(final, folder) as folder:
            write_manifest(folder, known)
        fsync_path(self.output_dir)
        self.rotate(keep=final)
        return final

    def snapshot_path(self, step: int) -> str:
        return self.path(SNAPSHOTS, f"{SNAPSHOT_PREFIX}{step:06d}")

    def begin_snapshot(self, step: int) -> str:
        """The temporary folder of the EMA snapshot of update `step`, which every rank fills before `seal_snapshot`."""
        return temporary_sibling(self.snapshot_path(step))

    def seal_snapshot(self, folder: str, final: str, known: dict[str, dict] | None = None) -> str:
        """The EMA snapshot `final` from the temporary `folder`, as `seal` does a checkpoint, outside rotation."""
        with self.no_space_ends_the_run(final), atomic_folder(final, folder) as folder:
            write_manifest(folder, known)
        fsync_path(os.path.dirname(final))
        return final

    @contextmanager
    def no_space_ends_the_run(self, folder: str):
        """Around the writing of checkpoint `folder`: no space to write it becomes a one-line CheckpointError
        (the temporary folder is removed already)."""
        try:
            yield
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            raise self.save_failed(folder, e.strerror, no_space=True) from None

    def save_failed(self, folder: str, cause: str, rank: int | None = None, no_space: bool = False) -> CheckpointError:
        """The one line that ends a run whose checkpoint `folder` could not be written (by `rank`, with several)."""
        newest = latest_checkpoint(self.output_dir)
        where = f" (rank {rank})" if rank is not None else ""
        if no_space:
            return CheckpointError(
                f"no space to write {os.path.basename(folder)} in {self.output_dir}{where} ({cause}); nothing of it "
                f"was kept. The newest complete checkpoint is {newest or 'none'}: free space, then run again with "
                "--resume_from_checkpoint auto")
        return CheckpointError(
            f"writing {os.path.basename(folder)} in {self.output_dir} failed{where}: {cause}; nothing of it was kept. "
            f"The newest complete checkpoint is {newest or 'none'}: run again with --resume_from_checkpoint auto "
            "once the cause is fixed")

    def rotate(self, keep: str | None = None) -> None:
        """Delete all but the `limit` newest complete checkpoints (incomplete ones older than those go too);
        `keep`, the checkpoint just written, stays whatever the others look like."""
        if not self.limit:
            return
        folders = checkpoint_dirs(self.output_dir)
        complete = [f for f in folders if checkpoint_problem(f, checksums=False) is None]
        if len(complete) <= self.limit:
            return
        oldest_kept = complete[-self.limit]
        for folder in folders[:folders.index(oldest_kept)]:
            if keep is None or os.path.abspath(folder) != os.path.abspath(keep):
                remove(folder)


def snapshot_dirs(output_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of the EMA snapshots of a run folder, complete or not, oldest first."""
    folder = os.path.join(output_dir, SNAPSHOTS)
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        step = name[len(SNAPSHOT_PREFIX):]
        if name.startswith(SNAPSHOT_PREFIX) and step.isdigit() and os.path.isdir(os.path.join(folder, name)):
            found.append((int(step), os.path.join(folder, name)))
    return sorted(found)


def failure_of(output_dir: str) -> str | None:
    """What ended the run of `output_dir` before its first checkpoint, as `RunFolder.record_failure` recorded it."""
    try:
        with open(os.path.join(output_dir, RUN_MARKER)) as f:
            failed = json.load(f).get("failed")
    except (OSError, ValueError, AttributeError):
        return None
    return failed if isinstance(failed, str) else None


def write_json(path: str, value: dict, partial: str | None = None) -> None:
    """Replace `path` by `value` as JSON, whole or not at all (written first to `partial`, default `path.partial`:
    writers that may run at once each name their own)."""
    partial = partial or path + ".partial"
    with open(partial, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
    os.replace(partial, path)


def remove(path: str) -> None:
    """Delete a file or folder; a failure is reported, not ignored."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    except OSError as e:
        logger.warning("could not delete %s: %s", path, e)
