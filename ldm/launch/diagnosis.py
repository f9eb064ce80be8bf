"""How a try of the job ended, from what it left: Paddle's launcher's exit code, the ranks it named as failed (by
their place in the node) and the ranks' own reports and heartbeats (`ldm.runtime.heartbeat.read_try`). Pure: no
process, no file, no output; `ldm.launch.supervisor` hands it what it read and says what it found."""

from __future__ import annotations

import re
import signal

from ldm.runtime.heartbeat import PEER_LOST

STOPPED_ON_PURPOSE = 2  # a user error, the non-finite guard (`ldm.runtime.errors`)
GAVE_UP = 3  # the restarts given were spent
CRASH_LOOP = 4  # the same failure twice in a row
AGREED_STOPS = (130, 143)  # a rank's exit after the stop every rank agreed on (SIGINT, SIGTERM)


def signal_name(code: int) -> str:
    number = -code if code < 0 else code - 128
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "ended without a report (killed, or its node lost)"
    if code == 143:
        return "stopped by SIGTERM"
    if code < 0 or 128 < code < 160:
        return f"killed by {signal_name(code)}"
    if code == 124:
        return "stopped by the data watchdog (no batch for --data_timeout seconds)"
    return f"exit {code}"


def own_update(report: dict) -> int | None:
    """The update a rank was in when it ended: the one after the last it finished (None: before its first)."""
    return report["step"] + 1 if report.get("step") is not None else None


def who(failure: dict) -> str:
    return f"rank {failure['rank']}" if failure["rank"] is not None else "a rank"


def where(failure: dict) -> str:
    return f"update {failure['update']}" if failure["update"] is not None else "its start"


def resumed_from(reports: dict[int, dict]) -> int | None:
    """The update the try's ranks started at, as they report it (rank 0's, else the lowest one's)."""
    started = {rank: r["started"] for rank, r in reports.items() if r["started"] is not None}
    return started.get(0, min(started.values(), default=None))


def global_rank(local: int, reports: dict[int, dict]) -> int | None:
    """The global rank of the node's `local`-th rank, from the ranks' own heartbeats."""
    return next((rank for rank, r in reports.items() if r["local_rank"] == local), None)


def verdict(code: int, reports: dict[int, dict], *, signalled: bool, several_nodes: bool) -> tuple[int | None, str]:
    """(the job's exit code, why) when the job is not restarted; (None, "") for a failure. `signalled`: this process
    was asked to stop."""
    if signalled:
        return code, ""
    if code == 0:
        return 0, ""
    codes = {rank: r["exit_code"] for rank, r in reports.items()}
    on_purpose = [rank for rank, c in codes.items() if c == STOPPED_ON_PURPOSE]
    if on_purpose:
        cause = reports[on_purpose[0]]["cause"] or "a user error"
        return STOPPED_ON_PURPOSE, f"rank {on_purpose[0]} stopped the run on purpose ({cause}): not restarted"
    stops = set(codes.values())
    # every rank stopped together on SIGTERM/SIGINT sent to them, not to this process; a launcher that was killed
    # (a negative code) stops its ranks the same way, and that is a failure. On several nodes, a peer's failure on
    # another node looks the same.
    if codes and code > 0 and not several_nodes and stops <= set(AGREED_STOPS):
        return max(stops), ""
    return None, ""


def failure(code: int, failed: dict[int, int], reports: dict[int, dict]) -> dict:
    """The rank that failed, its exit code, the cause and the update it was in (its own last update + 1; None:
    before its first). `failed`: the node's ranks Paddle's launcher named as failed, in the order it saw them
    ({rank within the node: exit code}). A rank whose collective failed because a peer was gone (`PEER_LOST`) is a
    victim: the rank that stopped answering is named instead."""
    steps = [r["step"] for r in reports.values() if r["step"] is not None]
    update = max(steps) + 1 if steps else None  # no rank to name: the furthest any rank went
    crashed = [rank for rank, r in reports.items() if r["exit_code"] not in (None, 0, *AGREED_STOPS)]
    silent = [rank for rank, r in reports.items() if r["exit_code"] is None]
    named = [global_rank(local, reports) for local in failed]
    if named and named[0] is not None:  # the first rank the launcher saw fail: the others may be its victims
        rank, launcher_code = named[0], next(iter(failed.values()))  # (a broken collective)
    elif crashed or silent:
        rank, launcher_code = min(crashed or silent), None
    elif failed:  # named before any heartbeat of its own (it never started): its exit code only
        local, launcher_code = next(iter(failed.items()))
        return {"rank": None, "exit_code": launcher_code, "update": update,
                "cause": f"the node's rank {local}, before its first update: {describe_exit(launcher_code)}"}
    elif code < 0:
        return {"rank": None, "exit_code": code, "update": update,
                "cause": f"paddle.distributed.launch was {describe_exit(code)} (its ranks stopped with it)"}
    else:
        return {"rank": None, "exit_code": code, "cause": f"the launcher exited {code}", "update": update}
    report = reports.get(rank, {})
    if (report.get("cause") or "").startswith(PEER_LOST):  # (the launcher names the first in rank order)
        culprit = unresponsive(reports)
        if culprit is not None and culprit != rank:
            return lost_peer(culprit, rank, reports)
    exit_code = report.get("exit_code") if report.get("exit_code") is not None else launcher_code
    return {"rank": rank, "exit_code": exit_code, "cause": report.get("cause") or describe_exit(exit_code),
            "update": own_update(report)}


def lost_peer(rank: int, victim: int, reports: dict[int, dict]) -> dict:
    """The failure of `rank`, which `victim`'s collective lost. Its own report first; else what its peers saw of it
    then: ended (its exit code, a signal's, when Linux still held it), or alive, so it stopped answering; only a
    peer on another node, which no rank here could see, is judged by gloo's words."""
    other, said = reports[rank], reports[victim]["cause"]
    seen = [r["peers"][str(rank)] for r in reports.values() if str(rank) in (r.get("peers") or {})]
    ended = [s["exit_code"] for s in seen if not s["alive"]]
    timed_out = re.search(r"timeout|timed out", said, re.IGNORECASE)
    exit_code = other["exit_code"]
    if other["cause"]:
        cause = other["cause"]
    elif ended:
        exit_code = next((code for code in ended if code is not None), None)
        cause = describe_exit(exit_code)
    elif seen or timed_out:
        cause = (f"stopped answering after update {other['step']}: rank {victim}'s collective "
                 f"{'waited for it and timed out' if timed_out else 'lost it'}")
    else:  # its peers saw its connections close: it died without a word
        cause = describe_exit(exit_code)
    return {"rank": rank, "exit_code": exit_code, "cause": cause, "update": own_update(other)}


def unresponsive(reports: dict[int, dict]) -> int | None:
    """The rank that stopped advancing first among those that are not victims of a lost peer: the fewest updates,
    then the oldest heartbeat."""
    suspects = [(r["step"] if r["step"] is not None else -1, r["beat_at"] or 0.0, rank)
                for rank, r in reports.items()
                if r["exit_code"] not in (0, *AGREED_STOPS) and not (r["cause"] or "").startswith(PEER_LOST)]
    return min(suspects)[2] if suspects else None


def give_up(failure: dict, previous: dict | None, restarts: int, max_restarts: int) -> tuple[str | None, int]:
    """Why the job is not restarted after `failure` (a crash loop: the same update and cause as the `previous`
    restart's; the `restarts` this job made reached `max_restarts`) and its exit code, or (None, 0)."""
    if previous is not None and (previous["update"], previous["cause"]) == (failure["update"], failure["cause"]):
        return (f"the run failed twice at {where(failure)} ({who(failure)}: {failure['cause']}): not restarted "
                "again (a crash loop: the same failure would repeat)"), CRASH_LOOP
    if restarts >= max_restarts:
        return (f"{who(failure)} failed at {where(failure)} ({failure['cause']}) after {restarts} restart(s), the "
                "--max_restarts given"), GAVE_UP
    return None, 0
