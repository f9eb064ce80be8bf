#!/usr/bin/env bash
# Run the whole test suite: bash scripts/test.sh [pytest arguments]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
exec "$PYTHON" -m pytest "$@"
