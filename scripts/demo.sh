#!/usr/bin/env bash
# The embedded default, on CPU, offline: install if needed, then corpus -> autoencoder -> LDM ->
# export -> samples -> evaluation, everything under outputs/demo/.
#   bash scripts/demo.sh [--quick] [--output_dir DIR]     (LDM_DEMO_QUICK=1 is the same as --quick)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
exec "$PYTHON" -m apps.demo "$@"
