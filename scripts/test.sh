#!/usr/bin/env bash
# Run the whole test suite: bash scripts/test.sh [pytest arguments]
# Three test processes (pytest-xdist) by default: most tests wait on a training subprocess's Paddle import
# or on a launched pair of ranks, so three at once take less time on 2 cores than one or two (docs/benchmarks.md).
# TEST_PROCESSES=0 runs everything in this process (and shows the output of print-debugging).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
# numpy's and scipy's BLAS on one thread per process: three test processes and their runs already share 2 cores, and
# OpenBLAS threads that spin-wait for a core taken by another process made a 2048 x 2048 eigendecomposition 3.5x
# slower on a loaded machine (183 s against 52 s on one thread, measured). Paddle sets its own threads.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
# The project's own bytecode, as setup_venv.sh writes the installed modules': every test starts interpreters that import
# ldm, and one that may not write bytecode (PYTHONDONTWRITEBYTECODE) compiles it afresh each time.
"$PYTHON" -m compileall -q -j 0 ldm apps scripts tests ./*.py >/dev/null || true
exec "$PYTHON" -m pytest -n "${TEST_PROCESSES:-3}" --dist worksteal "$@"
