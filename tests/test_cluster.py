"""The cluster launchers: the SLURM batch script run as SLURM runs it (two nodes of one process each on this machine),
and the Kubernetes manifests checked for what docs/cluster.md says they hold."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT
from corpus import write_corpus

from ldm.checkpoint.run_folder import checkpoint_step, latest_checkpoint
from ldm.runtime.heartbeat import read_try

# What SLURM does around a batch script, for what the script calls: srun runs a step of one task per node, each
# with its node's variables (`--overlap`: beside the running step), and given a SIGTERM it ends its tasks at once
# ("forcing job termination"); scontrol names the nodes and requeues the job.
SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
trap 'kill -KILL "${pids[@]}" 2>/dev/null' TERM
code=0
for pid in "${pids[@]}"; do
    while true; do
        wait "$pid"
        c=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    if (( c != 0 )); then code=$c; fi
done
exit "$code"
"""
SCONTROL = """#!/usr/bin/env bash
case "$1" in
    show) echo 127.0.0.1; echo 127.0.0.1 ;;
    requeue) echo "$2" >> "$SCONTROL_LOG" ;;
esac
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)  # two jobs of two nodes of real interpreters
def test_the_slurm_script_trains_on_two_nodes_stops_before_the_limit_and_its_requeue_continues(tmp_path, vocab_dir):
    listing = write_corpus(str(tmp_path / "corpus"), num_records=24, records_per_shard=6)
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    out, logs, requeued = tmp_path / "run", tmp_path / "logs", tmp_path / "requeued"
    first_logs = logs / "job42-0"  # one log folder per job and requeue
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
           "SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_SUBMIT_DIR": str(ROOT), "SCONTROL_LOG": str(requeued), "MASTER_PORT": str(free_port()),
           "GPUS_PER_NODE": "1", "OUTPUT_DIR": str(out), "LOG_DIR": str(logs), "FILE_LIST": listing,
           "MODEL": "ldm-tiny", "TOKENIZER_NAME": vocab_dir, "MODEL_MAX_LENGTH": "16", "TRAIN_BATCH_SIZE": "2",
           "GRADIENT_ACCUMULATION_STEPS": "1", "MAX_TRAIN_STEPS": "10", "SAVE_STEPS": "100", "LOGGING_STEPS": "1",
           "NUM_WORKERS": "0", "REPORT_TO": "none", "MAX_RESTARTS": "1"}
    command = ["bash", str(ROOT / "scripts" / "slurm" / "pretrain.sbatch"), "--allow_untrained_vae",
               "--resolution", "32"]

    # the first allocation: SIGTERM to the batch script (--signal=B:TERM) once both nodes trained two updates
    env["LDM_DATA_CONSUMED_LOG"] = str(tmp_path / "ledger-first")
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    deadline = time.monotonic() + 240
    steps = []
    while time.monotonic() < deadline and job.poll() is None:
        steps = [read_try(str(first_logs / f"node{n}" / "ldm-launch" / "try-0")).get(n, {}).get("step") for n in (0, 1)]
        if None not in steps and min(steps) >= 2:
            job.send_signal(signal.SIGTERM)
            break
        time.sleep(0.1)
    first, _ = job.communicate(timeout=240)
    assert job.returncode != 0 and None not in steps, first[-5000:]
    assert requeued.read_text().split() == ["42"], first[-5000:]
    assert "requeued, to continue from the checkpoint just saved" in first
    stopped = checkpoint_step(latest_checkpoint(str(out)))
    assert 2 <= stopped < 10, first[-5000:]
    reports = [read_try(str(first_logs / f"node{n}" / "ldm-launch" / "try-0"))[n] for n in (0, 1)]
    assert [r["exit_code"] for r in reports] == [143, 143] and [r["step"] for r in reports] == [stopped] * 2
    assert "master 127.0.0.1:" in first

    assert (first_logs / "node0" / "ldm-launch.pid").is_file() and (first_logs / "node1" / "ldm-launch.pid").is_file()

    # the requeued job: the same script, resumed by `auto`, to the end, in a log folder of its own
    env["LDM_DATA_CONSUMED_LOG"] = str(tmp_path / "ledger-second")
    env["SLURM_RESTART_COUNT"] = "1"
    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-5000:] + second.stderr[-3000:]
    assert requeued.read_text().split() == ["42"]  # not requeued again
    assert (logs / "job42-1" / "node0" / "ldm-launch" / "try-0").is_dir()
    assert latest_checkpoint(str(out)).endswith("checkpoint-10")
    run = json.loads((out / "run.json").read_text())
    assert run["world"]["nodes"] == 2 and len(run["resumes"]) == 1
    assert run["resumes"][0]["resumed_from"].endswith(f"checkpoint-{stopped}")

    taken = []  # each record of the pass once: the first job's up to its checkpoint, then the second's
    for name, start in (("ledger-first", 0), ("ledger-second", stopped)):
        for row in (tmp_path / name).read_text().splitlines():
            pass_index, _, shard, line, _, _, batch = row.split()
            if start + int(batch) + 1 <= (stopped if start == 0 else 10):
                taken.append((pass_index, shard, line))
    assert len(taken) == 10 * 2 * 2 and len(set(taken)) == len(taken)


# A stand-in for `python -m ldm.launch` on each node: it runs until the batch script's stop reaches it (by the pid
# file, and only while that pid is an ldm.launch), then exits with the code the test gives.
FAKE_LAUNCH = """#!/usr/bin/env bash
trap 'exit "$FAKE_EXIT"' TERM
echo "$$ $*" >> "$FAKE_LOG"
while true; do sleep 0.1; done
"""


@pytest.mark.parametrize(("exit_code", "requeue"), [(143, True), (3, True), (2, False), (4, False)])
def test_the_slurm_script_requeues_a_stop_only_when_a_new_allocation_can_fix_it(tmp_path, exit_code, requeue):
    """A stop (exit 143) or spent restarts are requeued; a user error (2) or a crash loop (4) would fail again."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("python", FAKE_LAUNCH)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    (tmp_path / "stale").mkdir()
    stale = subprocess.Popen(["sleep", "60"])  # an earlier job's pid file in the old shared layout: never signalled
    (tmp_path / "logs" / "node0").mkdir(parents=True)
    (tmp_path / "logs" / "node0" / "ldm-launch.pid").write_text(str(stale.pid))
    launched, requeued = tmp_path / "launched", tmp_path / "requeued"
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "PYTHON": str(tools / "python"),
           "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_SUBMIT_DIR": str(ROOT), "SCONTROL_LOG": str(requeued), "LOG_DIR": str(tmp_path / "logs"),
           "FAKE_EXIT": str(exit_code), "FAKE_LOG": str(launched), "GPUS_PER_NODE": "1"}
    job = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm" / "pretrain.sbatch")], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        pid_files = [tmp_path / "logs" / "job7-2" / f"node{n}" / "ldm-launch.pid" for n in (0, 1)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (launched.exists() and len(launched.read_text().splitlines()) == 2
                                                   and all(p.exists() for p in pid_files)):
            time.sleep(0.05)
        time.sleep(0.3)  # the exec after the pid file
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
        alive = stale.poll() is None
        stale.kill()
    assert job.returncode == exit_code, output
    assert alive, "a stale pid file of another job was signalled"
    assert (requeued.read_text().split() if requeued.exists() else []) == (["7"] if requeue else []), output
    assert ("not requeued" in output) != requeue


MANIFESTS = ROOT / "scripts" / "kubernetes"


def documents(name: str) -> list[dict]:
    with open(MANIFESTS / name) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "PaddleJob":
        return [doc["spec"]["worker"]["template"]["spec"]]
    return [doc["spec"]["template"]["spec"]]


@pytest.mark.parametrize("name", ["paddlejob.yaml", "indexed-job.yaml"])
def test_the_kubernetes_manifests_parse_and_hold_what_the_docs_name(name):
    docs = documents(name)
    kinds = {d["kind"] for d in docs}
    assert ("PaddleJob" in kinds) == (name == "paddlejob.yaml") and ("Job" in kinds) == (name == "indexed-job.yaml")
    for spec in (s for d in docs if d["kind"] in ("PaddleJob", "Job") for s in pod_specs(d)):
        # the grace period covers a stop's save (docs/cluster.md: measured stop-save time, with margin)
        assert spec["terminationGracePeriodSeconds"] >= 300
        container = spec["containers"][0]
        command = " ".join(container["command"] + container.get("args", []))
        assert "ldm.launch" in command and "--max_restarts" in command and "--resume_from_checkpoint=auto" in command
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/runs" in mounts and "/dev/shm" in mounts
        claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert claims and claims[0]["persistentVolumeClaim"]["claimName"] == "ldm-runs"
        secrets = [e for e in container.get("envFrom", []) if "secretRef" in e]
        assert secrets and secrets[0]["secretRef"]["name"] == "ldm-object-store"
        assert "--output_dir=/runs/" in command
        # the launch logs beside the run folder, not in it (a start over empties it), and one folder a pod
        output_dir = next(a for a in container["args"] if a.startswith("--output_dir=")).split("=", 1)[1]
        log_dir = next(a for a in container["args"] if a.startswith("--log_dir=")).split("=", 1)[1]
        assert not (log_dir + "/").startswith(output_dir.rstrip("/") + "/") and "$(" in log_dir
        assert any(a.startswith("--nnodes=") for a in container["args"])
    if name == "indexed-job.yaml":
        job = next(d for d in docs if d["kind"] == "Job")
        assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"]
        assert any(d["kind"] == "Service" and d["spec"]["clusterIP"] == "None" for d in docs)  # the nodes' names
        # a pod that fails is restarted by ldm.launch inside it, and the job itself is not retried blindly
        assert job["spec"]["backoffLimit"] <= 3


def read_only_home_runs(tmp_path):
    """(HOME, the command's prefix) pairs of homes that cannot hold a cache, each meaningful as root too: a regular
    file (`os.access` calls it writable, so Paddle itself does not step aside), and a read-only folder, read-only
    for root as well where root's override of file modes is dropped (setpriv)."""
    as_file = tmp_path / "home-file"
    as_file.write_text("")
    read_only = tmp_path / "home-read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    homes = [(as_file, [])]
    if os.getuid() != 0:
        homes.append((read_only, []))
    elif shutil.which("setpriv"):
        caps = "-dac_override,-dac_read_search"
        homes.append((read_only, ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]))
    return homes


@pytest.mark.slow
@pytest.mark.timeout(900)  # fresh interpreters: the import under the home is what is tested
def test_a_run_under_a_read_only_home_starts_with_the_caches_moved_aside_in_one_line(tmp_path, vocab_dir):
    listing = write_corpus(str(tmp_path / "corpus"), num_records=8, records_per_shard=8)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    # two runs of fresh interpreters (the import under the home is what is tested): the read-only folder where root
    # can be denied one (else the file) on one process, fused; the file under the launcher, 2 ranks, one note
    home, prefix = read_only_home_runs(tmp_path)[-1]
    runs = [(home, [*prefix, sys.executable], "fused"),
            (tmp_path / "home-file", [sys.executable, "-m", "ldm.launch", "--max_restarts", "0", "--nproc_per_node",
                                      "2", "--log_dir", str(tmp_path / "logs")], "auto")]
    for i, (home, runner, form) in enumerate(runs):
        out = tmp_path / f"run-{i}"
        command = [*runner, str(ROOT / "train_txt2img_laion400m_no_trainer.py"),
                   "--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
                   "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32",
                   "--train_batch_size", "2", "--max_train_steps", "1", "--num_workers", "0", "--report_to", "none",
                   "--progress", "none", "--flat_update", form, "--output_dir", str(out)]
        env = {key: value for key, value in os.environ.items() if key not in ("PPNLP_HOME", "LDM_KERNEL_CACHE")}
        result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                                env={**env, "HOME": str(home), "TMPDIR": str(temporary), "PYTHONPATH": str(ROOT)})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        said = result.stdout + result.stderr  # Paddle's launcher passes rank 0's output on to its stdout
        notes = [line for line in said.splitlines() if line.startswith(f"note: HOME ({home})")]
        assert len(notes) == 1 and "Traceback" not in said, said[-3000:]
        folder = temporary / f"ldm-caches-{os.getuid()}"
        assert notes[0].startswith(f"note: HOME ({home}) cannot hold the caches of Paddle, VisualDL, PaddleNLP and "
                                   "the fused kernel (") and f"they go to {folder} for this run" in notes[0], notes[0]
        assert latest_checkpoint(str(out)) is not None
        if form == "fused":
            assert "one fused pass" in result.stderr and list((folder / "ldm" / "kernels").glob("*.so"))
    assert not any((tmp_path / "home-read-only").iterdir())
