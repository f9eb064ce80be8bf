#!/usr/bin/env bash
# The embedded default: install if needed, then run the demo end to end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
echo "error: the demo (synthetic corpus -> autoencoder -> LDM -> samples) is not implemented yet; the install is ready in .venv" >&2
exit 2
