"""The run's restarts, as `run.json` records them (`restarts`): this job's, after those of the earlier jobs of the
same run when its scheduler requeued it. The ledger alone writes them. The earlier jobs' list is read once, at the
start; after each try the ledger reads the rest of `run.json` (which the ranks write, never while the ledger does:
no rank runs between tries), to write its list back into it and to see whether the folder still holds the same run
(`created`: a start over makes another, whose restarts begin again)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from ldm.launch.diagnosis import resumed_from

IN_MEMORY = ("failed_at", "said")  # an entry's fields that stay out of run.json


def run_record(output_dir: str | None) -> dict | None:
    """The run folder's `run.json`, or None."""
    try:
        with open(os.path.join(output_dir or "", "run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def checkpoint_sealed_at(output_dir: str | None, step: int | None) -> float | None:
    """When checkpoint-`step` of the run folder was sealed (its folder's time), or None."""
    if not output_dir or step is None:
        return None
    try:
        return os.path.getmtime(os.path.join(output_dir, f"checkpoint-{step}"))
    except OSError:
        return None


class RestartLedger:
    def __init__(self, output_dir: str | None):
        self.output_dir = output_dir
        self.run = run_record(output_dir)  # run.json as the last try left it
        record = self.run or {}
        self.earlier, self.created = record.get("restarts", []), record.get("created")
        self.restarts: list[dict] = []  # this job's

    def looked(self) -> None:
        """A try has ended: `run.json` as it left it."""
        self.run = run_record(self.output_dir)

    def earlier_of_this_run(self) -> list[dict]:
        """The restarts of earlier jobs of the same run (none when the folder now holds another run)."""
        return self.earlier if self.run is not None and self.run.get("created") == self.created else []

    def count(self) -> int:
        """The run's restarts so far, earlier jobs' included: the metric `restarts` the ranks log."""
        return len(self.earlier_of_this_run()) + len(self.restarts)

    def previous(self) -> dict | None:
        return self.restarts[-1] if self.restarts else None

    def start_step(self) -> int:
        """The update the next try is expected to resume from (0: the start)."""
        return (self.restarts[-1]["resumed_from"] or 0) if self.restarts else 0

    def add(self, failure: dict) -> dict:
        """A restart after `failure`, and its entry. The checkpoint is, until the restarted ranks say which one they
        resumed (`resumed`), the newest that looks complete."""
        now = time.time()
        from ldm.checkpoint.run_folder import checkpoint_step, latest_checkpoint

        newest = latest_checkpoint(self.output_dir, checksums=False) if self.output_dir else None
        resumed, sealed_at = (checkpoint_step(newest), os.path.getmtime(newest)) if newest else (None, None)
        entry = {"restart": self.count() + 1, "update": failure["update"],
                 "rank": failure["rank"], "exit_code": failure["exit_code"], "cause": failure["cause"],
                 "time": datetime.datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds"),
                 "resumed_from": resumed,
                 "updates_lost": None if failure["update"] is None else failure["update"] - 1 - (resumed or 0),
                 "seconds_since_checkpoint": round(now - sealed_at, 1) if sealed_at else None,
                 "seconds_to_next_update": None, "seconds_lost": None, "failed_at": now}
        self.restarts.append(entry)
        return entry

    def resumed(self, reports: dict[int, dict], first_update_at: float | None) -> str | None:
        """The last restart's checkpoint as the restarted ranks report it, and what follows from it; the line that
        says so, the first time it is known."""
        started = resumed_from(reports)
        if not self.restarts or started is None:
            return None
        entry = self.restarts[-1]
        resumed = started or None  # 0: from the start
        entry["resumed_from"] = resumed
        entry["updates_lost"] = None if entry["update"] is None else entry["update"] - 1 - (resumed or 0)
        sealed_at = checkpoint_sealed_at(self.output_dir, resumed)
        entry["seconds_since_checkpoint"] = round(entry["failed_at"] - sealed_at, 1) if sealed_at else None
        if first_update_at is not None:
            entry["seconds_to_next_update"] = round(first_update_at - entry["failed_at"], 1)
            # the updates since the checkpoint are done again, in about the time they took
            entry["seconds_lost"] = round(entry["seconds_to_next_update"] + (entry["seconds_since_checkpoint"] or 0),
                                          1)
        if entry.get("said"):
            return None
        entry["said"] = True
        lost = f", {entry['updates_lost']} update(s) done again" if entry["updates_lost"] is not None else ""
        return (f"restart {len(self.restarts)} resumed from "
                f"{'the start' if resumed is None else f'checkpoint-{resumed}'}{lost}")

    def write(self) -> None:
        """`restarts` in run.json: between tries only (no rank writes it then), by one node (the one of rank 0)."""
        if not self.restarts or self.run is None:
            return
        from ldm.checkpoint.run_folder import write_json

        mine = [{k: v for k, v in r.items() if k not in IN_MEMORY} for r in self.restarts]
        marker = os.path.join(self.output_dir, "run.json")
        self.run = {**self.run, "restarts": self.earlier_of_this_run() + mine}
        try:
            write_json(marker, self.run)
        except OSError as e:
            print(f"ldm.launch: could not record the restarts in {marker}: {e}", file=sys.stderr)
