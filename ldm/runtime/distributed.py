"""Rank and world, collective helpers, and the gradient sync of the hand-written loop.

Launch with `python -m paddle.distributed.launch --gpus 0,1,... script.py` (or `--nproc_per_node N`
on CPU, which uses gloo). Everything else in the project asks this module, never the environment.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn


def launched_world_size() -> int:
    """How many ranks `paddle.distributed.launch` started (1 when run directly)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def exit_process(code: int) -> NoReturn:
    """End an entry point with `code`; a launched rank skips the interpreter's teardown.

    On CPU/gloo, Paddle's teardown at interpreter exit has aborted rank 0 (SIGABRT, exit -6) after every
    file of a finished run was written, and the launcher then reports the whole run as failed. It is rare
    (seen twice, both times with loader workers) and its cause is not known. When an entry point returns,
    its ranks have met at the final barrier and closed their writers and loaders, so a launched rank
    flushes its output and leaves with `os._exit`.
    """
    if launched_world_size() == 1:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_with_launcher() -> None:
    """A launched rank gets SIGTERM when its launcher dies, and so stops as after any SIGTERM: it finishes the
    update it is in, saves it, and exits. `paddle.distributed.launch` starts each rank in a session of its own,
    so a SIGKILL of the launcher (a scheduler that kills the main process only) would otherwise leave the ranks
    training and writing checkpoints beside the job started in its place. Linux only (prctl PR_SET_PDEATHSIG);
    elsewhere nothing changes."""
    import signal

    parent = os.getppid()
    if not terminate_with_parent():
        return
    if os.getppid() != parent:  # the launcher died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # <linux/prctl.h>


def prctl(option: int, value: int) -> bool:
    """Linux's prctl(option, value) for this process; False where it failed or there is none (not Linux)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def terminate_with_parent() -> bool:
    """Ask Linux for a SIGTERM to this process when its parent dies (prctl PR_SET_PDEATHSIG); False elsewhere."""
    import signal

    return prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def run_main(main) -> NoReturn:
    """`exit_process(main())` for an entry point, also when `main` ends with SystemExit (a user error's exit 2,
    an argparse error, the non-finite guard's stop): a launched rank then skips the teardown as well, and stops
    with its launcher (`stop_with_launcher`). Under `python -m ldm.launch` the exit is reported to it first
    (`ldm.runtime.heartbeat`)."""
    from ldm.runtime import heartbeat

    if launched_world_size() > 1:
        stop_with_launcher()
        heartbeat.register()
    try:
        code = main()
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("message"): printed, status 1, as the interpreter does
            print(e.code, file=sys.stderr)
            heartbeat.note_cause(e.code)
            code = 1
        else:
            code = e.code or 0
    except BaseException as e:  # told to `python -m ldm.launch`, then raised as the interpreter would
        lost = heartbeat.peer_lost(e) if launched_world_size() > 1 else None
        if lost is None:
            heartbeat.report_exit(1, f"{type(e).__name__}: {e}")
            raise
        # the victim of another rank's end: one line, not gloo's traceback, which would read as the cause
        print(f"error: rank {os.environ.get('PADDLE_TRAINER_ID', '0')} {lost}", file=sys.stderr)
        heartbeat.report_exit(1, lost, heartbeat.peers_seen())
        heartbeat.outlast_peers()
        exit_process(1)
    heartbeat.report_exit(code)
    exit_process(code)


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def init(cls) -> Distributed:
        if launched_world_size() > 1:
            import paddle.distributed as dist

            dist.init_parallel_env()
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def mean(self, value: float) -> float:
        """Mean of a Python float over ranks."""
        return self.sum(value) / self.world_size

    def sum(self, value: float) -> float:
        """Sum of a Python float over ranks."""
        if self.world_size == 1:
            return float(value)
        import paddle
        import paddle.distributed as dist

        tensor = paddle.to_tensor([float(value)], dtype="float64")
        dist.all_reduce(tensor)
        return float(tensor.item())

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), on every rank."""
        if self.world_size == 1:
            return [obj]
        import paddle.distributed as dist

        out: list = []
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, fn):
        """`fn()` run on rank 0 only; its result, or its exception raised, on every rank (a collective).

        For decisions and writes that only rank 0 makes: the other ranks learn the outcome instead of
        waiting in a barrier for a rank that failed. The other ranks wait in a collective meanwhile, and gloo (CPU)
        gives up on one after 30 s, a limit Paddle sets no way to change: `fn` must be short (a check, a rename,
        small files), never a computation every rank could do itself.
        """
        if self.world_size == 1:
            return fn()
        outcome = None
        if self.is_main:
            try:
                outcome = ("value", fn())
            except Exception as e:  # noqa: BLE001 - raised again below, on every rank
                outcome = ("error", e)
        kind, value = self.gather(outcome)[0]
        if kind == "error":
            raise value
        return value

    def barrier(self) -> None:
        if self.world_size > 1:
            import paddle.distributed as dist

            dist.barrier()


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The noise seed of a rank: the same weights everywhere (built before), different noise per rank; a
    resume that cannot restore a rank's random state (the world size changed) derives it from the step."""
    return seed + 1000 * rank + step


def weights_checksum(parameters) -> float:
    """A fingerprint of the weights (the sum of |w|, each tensor's in float32, together in float64), read to the host
    once: ranks that drifted apart differ here, and a NaN or inf weight shows. Part of a save's stall: summing in
    float64 cast every weight first, 30 times slower (0.78 s against 0.026 s for 120 M weights on this CPU)."""
    import paddle

    sums = [paddle.sum(p.abs(), dtype="float32") for p in parameters]
    return float(paddle.stack(sums).astype("float64").sum()) if sums else 0.0


def sync_gradients(parameters, world_size: int) -> None:
    """All-reduce (mean) the gradients once per optimizer update.

    The loop runs every micro-step under DataParallel's `no_sync`, recompute or not, and calls this
    once before the optimizer step: gradients are synchronised exactly once per update in every mode
    (the public example skipped it under recompute and let ranks drift).
    """
    if world_size == 1:
        return
    from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

    fused_allreduce_gradients([p for p in parameters if p.grad is not None], None)
