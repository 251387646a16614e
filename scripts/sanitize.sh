#!/usr/bin/env bash
# fusefs's native parts under AddressSanitizer and UndefinedBehaviorSanitizer: the fetch
# reads (fusefs/_fetchio.c), the FUSE binding with its fast path (fusefs/pyfuse3,
# fusefs/_fastpath.h) and the loop's cores (fusefs/_cachecore.c, _plancore.c, _eventscore.c),
# built from the working tree's tracked files in a private temporary
# folder with -fsanitize=address,undefined, then run under the venv's Python with both
# runtimes preloaded (daemons the tests start inherit them): the unit tier, and the mount
# tests that drive the native parts hardest (several fast-path threads, several readers,
# evictions under a tenth-of-the-set cache, corrupt chunks and checksum failures, a reader
# killed mid-read; test_fastpath_threads.py's fetch stress test, all of them at once; and
# test_misses.py's, the same through the miss engine).
# Any sanitizer report fails the run (UBSan halts on its first).
#
# usage: bash scripts/sanitize.sh [PYTEST ARGS]   (after scripts/setup.sh; about 10 minutes)
#
# Left out: leak detection (CPython's own allocations at exit would drown it), and
# tests/test_units.py::test_the_daemons_heap_grows_in_few_steps, which measures glibc's
# malloc, which AddressSanitizer replaces (so does the stress test's check of the daemon's
# resident memory, which it leaves out under AddressSanitizer).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=$repo/.venv/bin/python
[ -x "$py" ] || { echo "sanitize: run scripts/setup.sh first (no .venv)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z | (cd "$repo" && xargs -0 cp --parents -t "$work")
cd "$work"
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
echo "sanitize: building the native parts with $san"
CFLAGS="$san" LDFLAGS="-fsanitize=address,undefined" "$py" setup.py -q build_ext --inplace >build.log 2>&1 \
    || { tail -30 build.log >&2; echo "sanitize: the build failed" >&2; exit 1; }
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONPATH=$work
"$py" -c 'import fusefs, fusefs._fetchio as f, fusefs.pyfuse3 as p, sys; assert fusefs.__file__.startswith(sys.argv[1]), fusefs.__file__; print("sanitize: fusefs from", fusefs.__file__)' "$work"
for part in _fetchio _cachecore _plancore _eventscore; do
    nm -D fusefs/$part.*.so | grep -q __asan || { echo "sanitize: $part is not instrumented" >&2; exit 1; }
done
"$py" -m pytest -q -p no:cacheprovider -m unit --deselect tests/test_units.py::test_the_daemons_heap_grows_in_few_steps "$@"
"$py" -m pytest -q -p no:cacheprovider tests/test_fastpath_threads.py tests/test_trust.py tests/test_fetchio.py tests/test_misses.py \
    tests/test_hints.py::test_a_reader_killed_mid_read_leaves_the_daemon_serving \
    tests/test_hints.py::test_four_loader_workers_and_a_tenth_of_the_set_cached_fetch_each_sample_once "$@"
echo "sanitize: clean (AddressSanitizer, UndefinedBehaviorSanitizer)"
