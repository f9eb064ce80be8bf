#!/usr/bin/env bash
# Single-card pretraining with the PaddleNLP Trainer. Settings: environment variables named in
# scripts/trainer_args.sh (original defaults); extra arguments are passed through, e.g.
#   MAX_STEPS=1000 bash run_single_trainer.sh --use_ema --bf16
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/trainer_args.sh
exec "$PYTHON" train_txt2img_laion400m_trainer.py "${ARGS[@]}" "$@"
