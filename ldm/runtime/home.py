"""The caches Paddle and its libraries make under `$HOME` when they are imported, moved aside when HOME cannot hold
them.

`import paddle` makes `~/.cache/paddle/dataset` (it takes the temporary folder only where `os.access` says HOME is
not writable, which a read-only mount or a security module's refusal may not show), PaddleNLP (and ppdiffusers
through it) `~/.paddlenlp`, VisualDL `~/.visualdl`, and the fused update keeps its kernels in `~/.cache/ldm/kernels`.
Under a read-only HOME (a container's, a home mounted read-only on a cluster's nodes) the first of those imports
fails in a traceback before anything of the run is checked. `writable_caches` looks first, and only where HOME
cannot hold them points them at a folder of this user's in the temporary folder, saying so in one line: PaddleNLP's
and the kernels' by their variables (`PPNLP_HOME`, `LDM_KERNEL_CACHE`, which the ranks a launcher starts inherit),
Paddle's and VisualDL's, which read HOME alone, by importing them with HOME pointed there for the import only. HOME
itself is left as it is: the credentials and settings read from it (`~/.aws`, `~/.netrc`) still are.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile

from ldm.runtime.errors import UserError
from ldm.runtime.heartbeat import STATUS_ENV


def _blocked(path: str) -> str | None:
    """Why a folder cannot be made at `path` and written in, or None. Nothing is left behind: the test is a
    temporary folder made in the nearest folder that exists."""
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        probe = tempfile.mkdtemp(dir=existing)
    except OSError as error:
        return f"{existing}: {error.strerror or error}"
    shutil.rmtree(probe, ignore_errors=True)
    return None


def _fallback() -> str:
    """This user's folder for the caches, in the temporary folder (`$TMPDIR`)."""
    folder = os.path.join(tempfile.gettempdir(), f"ldm-caches-{os.getuid()}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        mine = os.stat(folder).st_uid == os.getuid() and _blocked(folder) is None
    except OSError:
        mine = False
    if not mine:
        raise UserError(f"{folder} cannot hold the caches either (it is another user's or not writable): set HOME "
                        "to a writable folder")
    return folder


def writable_caches(import_now: bool = True) -> str | None:
    """Before Paddle is imported: where HOME cannot hold the caches made at import, point them at a folder of this
    user's and say so in one line; that folder, or None where nothing moved. A UserError when no folder can.
    `import_now=False`: a process that imports neither Paddle nor VisualDL itself (`ldm.launch`) sets the variables
    its children inherit and leaves the imports to them."""
    home = os.path.expanduser("~")
    by_home = {"Paddle": (os.path.join(home, ".cache", "paddle", "dataset"), "paddle.dataset.common"),
               "VisualDL": (os.path.join(home, ".visualdl", "conf"), "visualdl")}
    by_variable = {"PaddleNLP": ("PPNLP_HOME", os.path.join(home, ".paddlenlp"), "paddlenlp"),
                   "the fused kernel": ("LDM_KERNEL_CACHE", os.path.join(home, ".cache", "ldm", "kernels"),
                                                  os.path.join("ldm", "kernels"))}
    reasons = {name: _blocked(path) for name, (path, module) in by_home.items()
               if module.partition(".")[0] not in sys.modules and importlib.util.find_spec(module.partition(".")[0])}
    reasons.update({name: _blocked(path) for name, (variable, path, _) in by_variable.items()
                    if not os.environ.get(variable)})
    moved = [name for name, reason in reasons.items() if reason]
    if not moved:
        return None
    folder = _fallback()
    for name in moved:
        if name in by_variable:
            variable, _, inside = by_variable[name]
            os.environ[variable] = os.path.join(folder, inside)
    with _home(folder):  # what reads HOME once, at its import
        for name in moved:
            if name in by_home and import_now:
                importlib.import_module(by_home[name][1])
    if os.environ.get("PADDLE_TRAINER_ID", "0") == "0" and not os.environ.get(STATUS_ENV):  # said once a job
        names = ", ".join(moved[:-1]) + (" and " if len(moved) > 1 else "") + moved[-1]
        print(f"note: HOME ({home}) cannot hold the caches of {names} ({reasons[moved[0]]}): they go to {folder} "
              "for this run (HOME, PPNLP_HOME or LDM_KERNEL_CACHE choose another)", file=sys.stderr, flush=True)
    return folder


def writable_caches_or_exit() -> None:
    """`writable_caches` for a command's start: a folder that cannot be had is one line and exit 2."""
    try:
        writable_caches()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


@contextlib.contextmanager
def _home(folder: str):
    before = os.environ.get("HOME")
    os.environ["HOME"] = folder
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = before
