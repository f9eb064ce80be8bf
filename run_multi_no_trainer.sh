#!/usr/bin/env bash
# Multi-card pretraining with the hand-written loop: GPUS=0,1,2,3,4,5,6,7 bash run_multi_no_trainer.sh
# Multi-node: run the same command on every node with IPS=ip1,ip2 (the first is the master).
# A rank that dies restarts the job from the newest checkpoint, up to MAX_RESTARTS (3) times (python -m ldm.launch;
# MAX_RESTARTS=0: none). SLURM and Kubernetes: scripts/slurm/, scripts/kubernetes/ and docs/cluster.md.
# Settings and extra arguments as in run_single_no_trainer.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/no_trainer_args.sh
launch=(-m ldm.launch --max_restarts "${MAX_RESTARTS:-3}" --gpus "${GPUS:-0,1,2,3,4,5,6,7}" --log_dir "${LOG_DIR:-./log_no_trainer}")
if [[ -n "${IPS:-}" ]]; then launch+=(--ips "$IPS"); fi
exec "$PYTHON" "${launch[@]}" train_txt2img_laion400m_no_trainer.py "${ARGS[@]}" "$@"
