"""What a rank tells `python -m ldm.launch`, which restarts a job whose rank died (`ldm.launch`).

`ldm.launch` names a folder in `LDM_LAUNCH_STATUS` for each try. Rank k (the global rank) keeps `rank-k.step`
there: the last update it finished and its rank within its node, written in place at each update (one `pwrite` of
a few bytes, no sync: the page cache keeps it when the process is killed; the file's time is the last beat). Once
its run has started it writes `rank-k.start`: the update it resumed from (0: from the start), which `ldm.launch`
records as the checkpoint really resumed (a damaged newer one is set aside by the rank, not by a look at file sizes).
At its exit it writes `rank-k.json`: `{"exit_code", "cause", "step"}`. A rank killed by a signal, or one whose node
is lost, writes no `rank-k.json`: that silence is itself what `ldm.launch` reads.

A rank whose collective failed because a peer is gone or silent (`PEER_LOST`) also says what it saw of each peer on
its node at that moment (`peers`: `{"k": {"alive", "exit_code"}}`, from `/proc` and the pid the peer left in
`rank-k.pid` at its start): a peer already ended died first, and Linux keeps its exit status (a signal: -N) until its
parent collects it; one still alive stopped answering. Paddle's launcher names only the first failed rank in rank
order, and gloo may call a closed connection a timeout, so neither tells a killed rank from a hung one.
Outside `ldm.launch` (no `LDM_LAUNCH_STATUS`) every function here does nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time

from ldm.runtime.files import atomic_write

STATUS_ENV = "LDM_LAUNCH_STATUS"
RESTARTS_ENV = "LDM_LAUNCH_RESTARTS"
STEP_WIDTH = 20  # the heartbeat's fields' fixed width: rewritten in place, never truncated

PEER_LOST = "lost its peers"  # the start of a rank's cause when a collective failed because another rank is gone
# how gloo and NCCL say a peer is gone or silent: "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
# "Timed out waiting 30000ms for recv operation to complete", "... TIMEOUT ...", NCCL's watchdog
_PEER_ERROR = re.compile(r"gloo|nccl|ProcessGroup", re.IGNORECASE)
_PEER_GONE = re.compile(r"closed by peer|reset by peer|connection refused|broken pipe|connection closed|"
                        r"socket closed|end of file", re.IGNORECASE)
_PEER_SILENT = re.compile(r"timeout|timed out", re.IGNORECASE)

_state: dict = {"fd": None, "step": None, "cause": None}
SETTLE_SECONDS = 1.0  # how long a peer seen alive is watched: one whose connections just closed may still be exiting
OUTLAST_SECONDS = 5.0  # a rank that lost its peers outlives them this long: Paddle's launcher looks once a second


def peer_lost(error: BaseException) -> str | None:
    """The one line a rank says when a collective failed because a peer vanished or stopped answering (the rank or
    launcher that went first is the one to look at), or None for any other error."""
    text = f"{type(error).__name__}: {error}"
    # a peer that is gone (its connections closed) before one that is silent: gloo's messages may name a timeout
    # beside a closed connection
    symptom = _PEER_GONE.search(text) or _PEER_SILENT.search(text)
    if not (_PEER_ERROR.search(text) and symptom):
        return None
    return (f"{PEER_LOST} ({symptom.group(0)} in a collective): another rank or its launcher stopped first; its log "
            "says why")


def _folder() -> str | None:
    return os.environ.get(STATUS_ENV) or None


def _rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def register() -> None:
    """`rank-k.pid`: this rank's process and node, for the peers that look at it when it stops answering."""
    folder = _folder()
    if folder is None:
        return
    with contextlib.suppress(OSError), atomic_write(os.path.join(folder, f"rank-{_rank()}.pid"), "w") as f:
        json.dump({"pid": os.getpid(), "host": os.uname().nodename}, f)


def process_state(pid: int) -> tuple[str, int | None]:
    """`pid`'s state as Linux's /proc has it ("R", "S", "T" stopped, ..., "Z" ended and not yet collected by its
    parent, "" gone), and its exit code while it is "Z" (-N: killed by signal N)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after "pid (command)"
    except OSError:
        return "", None
    if fields[0] != "Z" or len(fields) < 50:
        return fields[0], None
    status = int(fields[49])  # field 52, exit_code: the status waitpid would give
    return "Z", -(status & 0x7F) if status & 0x7F else status >> 8


def peers_seen() -> dict[str, dict]:
    """What this rank sees of the other ranks of its node: {"k": {"alive", "exit_code"}}. A peer alive and not
    stopped is watched for `SETTLE_SECONDS`: the kernel closes a killed process's connections before it ends."""
    folder = _folder()
    if folder is None:
        return {}
    pids = {}
    for name in os.listdir(folder):
        stem, _, kind = name.partition(".")
        if kind != "pid" or not stem.startswith("rank-") or stem == f"rank-{_rank()}":
            continue
        with contextlib.suppress(OSError, ValueError, KeyError), open(os.path.join(folder, name)) as f:
            told = json.load(f)
            if told["host"] == os.uname().nodename:
                pids[stem[5:]] = int(told["pid"])
    seen, deadline = {}, time.monotonic() + SETTLE_SECONDS
    for rank, pid in sorted(pids.items()):
        state, code = process_state(pid)
        while state not in ("", "Z", "T", "t") and time.monotonic() < deadline:
            time.sleep(0.02)
            state, code = process_state(pid)
        seen[rank] = {"alive": state not in ("", "Z"), "exit_code": code}
    return seen


def outlast_peers() -> None:
    """After a lost peer: stay alive a few seconds (or until the launcher's stop), so that Paddle's launcher, which
    names the first failed rank in rank order, sees the peer that ended first as the failed one."""
    if _folder() is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(OUTLAST_SECONDS)


def beat(step: int) -> None:
    """Update `step` is finished (or, at the start, the update a run resumes from)."""
    folder = _folder()
    if folder is None:
        return
    _state["step"] = step
    try:
        if _state["fd"] is None:
            _state["fd"] = os.open(os.path.join(folder, f"rank-{_rank()}.step"), os.O_WRONLY | os.O_CREAT, 0o644)
        local = os.environ.get("PADDLE_LOCAL_RANK", "0")  # Paddle's launcher names a failed rank by it
        os.pwrite(_state["fd"], f"{step:<{STEP_WIDTH}}{local:<{STEP_WIDTH}}".encode(), 0)
    except OSError:  # the launcher's folder is gone: the run itself goes on
        _state["fd"] = None


def started(step: int) -> None:
    """The run has started at update `step` (the checkpoint it resumed, or 0): the first beat and `rank-k.start`."""
    folder = _folder()
    if folder is None:
        return
    with contextlib.suppress(OSError), atomic_write(os.path.join(folder, f"rank-{_rank()}.start"), "w") as f:
        json.dump({"step": step, "pid": os.getpid()}, f)
    beat(step)


def note_cause(cause: str) -> None:
    """Why the rank is about to exit (a user error's line), for its report."""
    _state["cause"] = " ".join(cause.split())[:500]


def report_exit(code: int, cause: str | None = None, peers: dict | None = None) -> None:
    """The rank's last word: its exit code, why, the last update it finished, and (`peers_seen`) what it saw of its
    peers when they were lost."""
    folder = _folder()
    if folder is None:
        return
    report = {"exit_code": code, "cause": cause or _state["cause"], "step": _state["step"]}
    if peers:
        report["peers"] = peers
    with contextlib.suppress(OSError), atomic_write(os.path.join(folder, f"rank-{_rank()}.json"), "w") as f:
        json.dump(report, f)


def restarts_so_far() -> dict[str, float]:
    """The metric `restarts` (how many times `ldm.launch` restarted this job), when it runs the job."""
    value = os.environ.get(RESTARTS_ENV)
    return {"restarts": float(value)} if value is not None and value.isdigit() else {}


def read_try(folder: str) -> dict[int, dict]:
    """Each rank's report of one try (`ldm.launch`'s side): {global rank: {"exit_code" (None: no report), "cause",
    "step", "local_rank", "started" (the update its run started at, None before), "beat_at" (its last beat's
    time), "peers" (what it saw of its node's other ranks when it lost them, `peers_seen`; {} else)}}."""
    ranks: dict[int, dict] = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        stem, _, kind = name.partition(".")
        if not stem.startswith("rank-") or not stem[5:].isdigit() or kind not in ("step", "json", "start"):
            continue
        entry = ranks.setdefault(int(stem[5:]), {"exit_code": None, "cause": None, "step": None, "local_rank": None,
                                                 "started": None, "beat_at": None, "peers": {}})
        try:
            path = os.path.join(folder, name)
            with open(path) as f:
                text = f.read()
            if kind == "step":
                step, local = text.split()
                entry["step"] = entry["step"] if entry["step"] is not None else int(step)
                entry["local_rank"], entry["beat_at"] = int(local), os.path.getmtime(path)
            elif kind == "start":
                entry["started"] = int(json.loads(text)["step"])
            else:
                entry.update({k: v for k, v in json.loads(text).items() if v is not None or k == "exit_code"})
        except (OSError, ValueError):
            continue
    return ranks
