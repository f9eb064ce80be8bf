#!/usr/bin/env bash
# Create or reuse .venv at the repository root from requirements.lock.
# Sourced by scripts/test.sh and scripts/demo.sh; afterwards $PYTHON is the venv's interpreter.
#
# GPU users: set PADDLE_PACKAGE to the wheel Paddle's install guide names for your CUDA
# (for example PADDLE_PACKAGE=paddlepaddle-gpu==3.3.1 and
# PADDLE_INDEX_URL=https://www.paddlepaddle.org.cn/packages/stable/cu126/); every other pin stays.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
LOCK="$ROOT/requirements.lock"
PADDLE_PACKAGE="${PADDLE_PACKAGE:-}"
PADDLE_INDEX_URL="${PADDLE_INDEX_URL:-}"

stamp_of() {
    cat "$LOCK" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1
    echo "$PADDLE_PACKAGE $PADDLE_INDEX_URL bytecode"
}

want="$(stamp_of)"
if [[ -x "$VENV/bin/python" && -f "$VENV/.installed" && "$(cat "$VENV/.installed")" == "$want" ]]; then
    PYTHON="$VENV/bin/python"
    return 0 2>/dev/null || exit 0
fi

if ! command -v python3.11 >/dev/null && ! python3 -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
    echo "error: Python 3.11 is required (python3 is $(python3 --version 2>&1))" >&2
    exit 1
fi
PY_BOOT="$(command -v python3.11 || command -v python3)"

start=$(date +%s)
echo "==> setting up $VENV from requirements.lock (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PY_BOOT" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "pip>=23"

# The lock is a complete, resolved set: install it without re-resolving (--no-deps), so that the
# pins that make paddlenlp 2.8.1 and ppdiffusers 0.29.0 work together are exactly what is installed.
lock="$LOCK"
if [[ -n "$PADDLE_PACKAGE" ]]; then
    lock="$(mktemp)"
    grep -v '^paddlepaddle==' "$LOCK" > "$lock"
    idx=()
    [[ -n "$PADDLE_INDEX_URL" ]] && idx=(--extra-index-url "$PADDLE_INDEX_URL")
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${idx[@]}" "$PADDLE_PACKAGE"
fi
# uv installs the same pins in a tenth of pip's time (11 s against 100 s here); pip is the fallback.
if "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv==0.13.9" 2>/dev/null \
        && "$VENV/bin/python" -m uv pip install --quiet --python "$VENV/bin/python" --no-deps -r "$lock"; then
    :
else
    echo "==> uv was not usable: installing with pip"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$lock"
fi
# Bytecode for every installed module, written once here (32 s on 2 cores): an interpreter that may not write it
# (PYTHONDONTWRITEBYTECODE, a read-only venv) compiles paddle, paddlenlp and ppdiffusers from source at every start,
# which made a tiny two-update training run cost 16.5 CPU-seconds against 7.9 with bytecode (docs/benchmarks.md).
# Every rank, restart, command and test pays that start. The packages' own test suites and pip, which no run
# imports, are left out: a fifth of the files (3.8 of 18 thousand).
SITE="$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
"$VENV/bin/python" -m compileall -q -j 0 -x "/tests/|^$SITE/pip/" "$SITE" \
    >/dev/null || echo "==> warning: some installed modules did not compile to bytecode (they still import)"
# The project itself is used in place (a .pth entry), so edits need no reinstall.
"$VENV/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/ldm-laion.pth", "w").write(sys.argv[1] + "\n")' "$ROOT"
"$VENV/bin/python" -c "import paddle, paddlenlp, ppdiffusers, visualdl, fastcore, PIL, ldm" 2>/dev/null \
    || { echo "error: the installed stack does not import; see the traceback below" >&2;
         "$VENV/bin/python" -c "import paddle, paddlenlp, ppdiffusers, visualdl, fastcore, PIL, ldm"; exit 1; }
echo "$want" > "$VENV/.installed"
echo "==> .venv ready in $(( $(date +%s) - start )) s"
PYTHON="$VENV/bin/python"
