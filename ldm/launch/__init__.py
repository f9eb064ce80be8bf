"""Paddle's launcher, run again from the newest sealed checkpoint when a rank dies: a job that heals itself.

    python -m ldm.launch --max_restarts 3 [--restart_pause 10] [paddle.distributed.launch's flags] SCRIPT [flags]

It runs `python -m paddle.distributed.launch [its flags] SCRIPT [flags]` (never a copy of its job: rendezvous,
ranks, logs and the stop of every rank when one fails stay Paddle's) and reads how each rank ended from the
reports the ranks leave in `<log_dir>/ldm-launch/try-<n>/` (`ldm.runtime.heartbeat`). Paddle's own
`--max_restart` restarts ranks only in its elastic mode, which needs an etcd server (given `--master etcd://...`,
it is used as it is); in collective mode its launcher exits at the first rank that dies.

- The run ended (every rank 0), or stopped on purpose: a user error or the non-finite guard (exit 2), a stop every
  rank agreed on after SIGTERM/SIGINT (128 + the signal), or this process was signalled (a scheduler's stop: the
  signal goes to the ranks, which save the update they are in and exit; the launcher runs in a session of its
  own, so a terminal's Ctrl-C takes the same way): not restarted, its exit code is this one's.
- Anything else (a rank killed: out of memory, a segfault, a lost peer; an exception; a data stall the watchdog
  ended, 124) is a failure: after a pause that doubles each time (`--restart_pause`, at most 5 minutes) the same
  command runs again with `--resume_from_checkpoint auto`, up to `--max_restarts` times.
- A failure at the same update and of the same cause as the one before (a crash loop: a record that kills a
  decoder, a kernel that always faults there, the out-of-memory killer) stops after the second time, in one line
  naming the update and the cause.

Before it reads how a try ended, every process of that try is gone: the ranks run in sessions of their own and
outlive a launcher that was killed (they stop, saving the update they are in), so this process adopts them
(Linux's child subreaper) and waits for them, at most `--stop_grace` seconds before it kills what is left. Only
then is the next try started: it never meets the run lock of the try before it. One job per `--log_dir`: a second
job given the same folder is refused before it writes anything there.

Exit codes: 0 the run ended; 2 stopped on purpose (a user error, the non-finite guard); 3 the restarts given were
spent; 4 a crash loop; 128 + N stopped by signal N (a stop asked for, the update saved); any other code is
Paddle's launcher's, when no rank's report explains it.

Each restart goes into the run's `run.json` as `restarts`: the update, the rank, its exit code and the cause, the
checkpoint resumed and the updates lost, the seconds from that checkpoint's save to the failure and from the
failure to the restarted job's first update, and their sum, `seconds_lost`; the checkpoint is the one the restarted
ranks report they resumed (a damaged newer one is set aside by them). The ranks log the count as the metric
`restarts`; trackers continue the same run, as after any resume. A job its scheduler requeues continues the list.
On several nodes each node runs its own `ldm.launch` (the same command with its `--rank`); the one whose ranks
include rank 0 writes `run.json`. Paddle's launcher names a failed rank by its place in the node; the ranks'
heartbeats give the global rank.

The package in three parts, composed by `supervisor` (the command line and the loop of tries): `diagnosis` (how a
try ended, from its exit code, the ranks Paddle's launcher named and the ranks' reports: pure, tested without
processes), `ledger` (the restarts, and their record in `run.json`) and `processes` (a try's processes, the child
subreaper, the grace before a kill, the signals passed on); `command` reads the command line.
"""
