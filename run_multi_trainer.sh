#!/usr/bin/env bash
# The PaddleNLP Trainer entry point is not implemented yet (see README, "Status"); use
# run_single_no_trainer.sh / run_multi_no_trainer.sh meanwhile.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python)}"
exec "$PYTHON" train_txt2img_laion400m_trainer.py "$@"
