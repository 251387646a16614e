#!/usr/bin/env bash
# fusefs as built here, on the GPU node: pyfuse3 with fusefs's patches (the fast path
# included) and fusefs/_fetchio, where ../shared/device/fusefs-on-device.sh alone gives
# stock pyfuse3 and reads in Python. The node has no package index and no Cython, so the C
# is made here and compiled there with gcc.
#
# Here, once (needs .venv: scripts/setup.sh):
#     bash scripts/device.sh prepare
#   runs the shared script's prepare (Debian's libfuse3, pyfuse3's sdist, trio's wheels into
#   .device/), adds Debian's libxxhash0 and libxxhash-dev (unpacked there into /tmp/fx with the
#   rest) and the patched pyfuse3 sources with the C Cython generates from
#   them (scripts/pyfuse3_patched.py --emit .device).
# There, at the start of each call of the device tool (carry: [".device"]):
#     source scripts/device.sh setup && python3 scripts/bench/bench_node.py --python python3
#   runs the shared setup (libfuse3 into /tmp/fx, never into /; stock pyfuse3 and trio into
#   /tmp/site), compiles the patched pyfuse3 into /tmp/site-fusefs (first on PYTHONPATH) and
#   fusefs/_fetchio in place, and checks both with scripts/pyfuse3_patched.py --check.
set -u

# python3's headers and extension suffix: $inc, $suf
python_build_vars() {
    inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    suf=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
}

# build_pyfuse3 SRC SITE: compile the patched sources SRC (.device/pyfuse3-*) into SITE/pyfuse3
# with gcc alone, against the libfuse3 of $FUSE3_CFLAGS and $FUSE3_LIBS (default: pkg-config's),
# optimised with ${OPT:--O2}; tests/test_pyfuse3_patched.py builds it here the same way
build_pyfuse3() {
    local src=$1 site=$2 inc suf
    python_build_vars
    mkdir -p "$site/pyfuse3"
    cp "$src"/src/pyfuse3/*.py "$src"/src/pyfuse3/*.pyi "$src"/src/pyfuse3/py.typed "$site/pyfuse3/"
    gcc -shared -fPIC ${OPT:--O2} -DFUSE_USE_VERSION=32 -I"$inc" ${FUSE3_CFLAGS:-$(pkg-config --cflags fuse3)} \
        -I"$src"/Include -I"$src"/src/pyfuse3 "$src"/src/pyfuse3/__init__.c \
        -o "$site/pyfuse3/__init__$suf" ${FUSE3_LIBS:-$(pkg-config --libs fuse3)} -lpthread -lrt
}

case "${1:-}" in
prepare)
    set -e
    root=$(git rev-parse --show-toplevel); cd "$root"
    [ -x .venv/bin/python ] || { echo "device.sh: run scripts/setup.sh first"; exit 1; }
    mkdir -p .git/info  # (the shared script adds /.device/ to .git/info/exclude)
    bash ../shared/device/fusefs-on-device.sh prepare
    (cd .device/debs && apt-get download libxxhash-dev libxxhash0 >/dev/null 2>&1)
    rm -rf .device/pyfuse3-*/
    .venv/bin/python scripts/pyfuse3_patched.py --emit .device
    du -sh .device
    ;;
setup)
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    [ -d "$here/.device/debs" ] || { echo "device.sh: no .device (prepare it here, carry it there)"; return 1; }
    source "$here/.device/fusefs-on-device.sh" setup || return 1
    fx=/tmp/fx; lib=$fx/lib/x86_64-linux-gnu; site=/tmp/site-fusefs
    python_build_vars
    src=$(ls -d "$here"/.device/pyfuse3-*/ | head -1)
    if [ ! -f $site/.ready ] || [ "$src/src/pyfuse3/__init__.c" -nt $site/.ready ]; then
        FUSE3_CFLAGS="-I$fx/usr/include/fuse3" FUSE3_LIBS="-L$lib -l:libfuse3.so.3 -Wl,-rpath,$lib" \
            build_pyfuse3 "$src" $site || { echo "device.sh: the patched pyfuse3 did not build"; return 1; }
        touch $site/.ready
    fi
    if [ ! -f $fx/usr/lib/x86_64-linux-gnu/libxxhash.so.0 ]; then  # (a /tmp/fx of an older prepare)
        for d in "$here"/.device/debs/libxxhash*.deb; do dpkg -x "$d" $fx; done
    fi
    if [ ! -f "$here/fusefs/_fetchio$suf" ] || [ "$here/fusefs/_fetchio.c" -nt "$here/fusefs/_fetchio$suf" ]; then
        gcc -shared -fPIC -O2 -I"$inc" -I$fx/usr/include "$here/fusefs/_fetchio.c" \
            -o "$here/fusefs/_fetchio$suf" -L$fx/usr/lib/x86_64-linux-gnu -l:libxxhash.so.0 \
            -Wl,-rpath,$fx/usr/lib/x86_64-linux-gnu \
            || { echo "device.sh: fusefs/_fetchio.c did not build"; return 1; }
    fi
    export PYTHONPATH=$site:$PYTHONPATH
    python3 "$here/scripts/pyfuse3_patched.py" --check \
        || { echo "device.sh: pyfuse3 lacks fusefs's patches"; return 1; }
    python3 -c "import fusefs._fetchio" || { echo "device.sh: fusefs._fetchio does not import"; return 1; }
    echo "device.sh: ready (pyfuse3 with fusefs's patches, fusefs._fetchio)"
    ;;
build-pyfuse3)
    build_pyfuse3 "$2" "$3" ;;
*)
    echo "usage: bash scripts/device.sh prepare   (here)  |  source scripts/device.sh setup   (there)"
    return 2 2>/dev/null || exit 2 ;;
esac
