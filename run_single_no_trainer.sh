#!/usr/bin/env bash
# Single-card pretraining with the hand-written loop. Settings: environment variables named in
# scripts/no_trainer_args.sh (original defaults); extra arguments are passed through, e.g.
#   MAX_TRAIN_STEPS=1000 bash run_single_no_trainer.sh --use_ema --mixed_precision bf16
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/no_trainer_args.sh
exec "$PYTHON" train_txt2img_laion400m_no_trainer.py "${ARGS[@]}" "$@"
