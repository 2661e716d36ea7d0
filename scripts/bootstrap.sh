#!/usr/bin/env bash
# Creates .venv with a Python >= 3.11 (3.12 preferred: newer jax needs it) and installs
# hbm_guard with libtpu, flax/optax and the test tools, pinned by constraints.txt.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
pick_python() {
  for c in "${HBM_GUARD_PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/3.12"*/bin/python python3.11 python3; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  echo "hbm_guard needs Python >= 3.11" >&2; return 1
}
venv=${HBM_GUARD_VENV:-.venv}  # CI also builds a 3.11 one beside it (.ci/run)
if [ ! -x "$venv/bin/python" ]; then
  py=$(pick_python)
  echo "bootstrap: creating $venv with $("$py" --version)" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
"$venv/bin/python" -m pip install -q -c constraints.txt -e '.[tpu,flax,orbax,dev]'
