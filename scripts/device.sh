#!/usr/bin/env bash
# fusefs as built here, on the GPU node, and the run that measures its figures there. The
# node has no package index, no pyfuse3, no trio and no libfuse3, so what it needs is
# gathered here into .device/ (git ignores it) and built there with gcc.
#
# Here, once (needs .venv: scripts/setup.sh):
#     bash scripts/device.sh prepare
#   downloads Debian's libfuse3 (library, headers, fusermount3) and libxxhash, trio's wheels
#   for the node's Python (3.12), and writes the patched pyfuse3 sources with the C Cython
#   generates from them (scripts/pyfuse3_patched.py --emit .device).
# There, in one call of the device tool (carry: [".device"]):
#     bash scripts/device.sh check
#   sets up (below) and runs the GPU node's benchmarks, each under its own timeout, each
#   appending its figures to $OUT as JSON lines as it measures them (a run cut short keeps
#   what it measured). Or, for a command of your own:
#     source scripts/device.sh setup && python3 scripts/bench/bench_node.py --python python3
#   unpacks the Debian packages into /tmp/fx (never into /), installs the wheels into
#   /tmp/site, compiles the patched pyfuse3 into /tmp/site-fusefs and fusefs/_fetchio in
#   place, and refuses to go on unless scripts/pyfuse3_patched.py --check passes.
set -u

# the node's Python and the Debian packages it needs
NODE_PYTHON=3.12
DEBS="libfuse3-3 libfuse3-dev fuse3 libxxhash0 libxxhash-dev"
WHEELS="trio outcome sniffio"

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
    gcc -shared -fPIC ${OPT:--O2} -Wno-incompatible-pointer-types -DFUSE_USE_VERSION=32 -I"$inc" ${FUSE3_CFLAGS:-$(pkg-config --cflags fuse3)} \
        -I"$src"/Include -I"$src"/src/pyfuse3 "$src"/src/pyfuse3/__init__.c \
        -o "$site/pyfuse3/__init__$suf" ${FUSE3_LIBS:-$(pkg-config --libs fuse3)} -lpthread -lrt
}

# part NAME SECONDS COMMAND...: one part of the check under its own timeout; its exit status
# and seconds as a JSON line in $OUT/figures.jsonl
part() {
    local name=$1 limit=$2 t0 rc
    shift 2
    [[ " ${PARTS:-swap node_raw node_decode hybrid} " == *" $name "* ]] || return 0
    t0=$(date +%s)
    echo "== $name (at most $limit s): $*"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "{\"part\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/figures.jsonl"
    echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s"
}

case "${1:-}" in
prepare)
    set -e
    root=$(git rev-parse --show-toplevel); cd "$root"
    [ -x .venv/bin/python ] || { echo "device.sh: run scripts/setup.sh first"; exit 1; }
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.device/' >> .git/info/exclude; }
    rm -rf .device && mkdir -p .device/debs .device/wheels
    (cd .device/debs && apt-get download $DEBS >/dev/null)
    # trio's own needs that the node lacks (attrs, idna and sortedcontainers are there)
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version $NODE_PYTHON \
        --implementation cp --platform manylinux2014_x86_64 -d .device/wheels \
        $(for w in $WHEELS; do .venv/bin/python -c "import importlib.metadata as m; print('$w==' + m.version('$w'))"; done)
    .venv/bin/python scripts/pyfuse3_patched.py --emit .device
    du -sh .device
    ;;
setup)
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    [ -d "$here/.device/debs" ] || { echo "device.sh: no .device (prepare it here, carry it there)"; return 1; }
    fx=/tmp/fx; site=/tmp/site-fusefs
    if [ ! -f $fx/.ready ]; then
        for d in "$here"/.device/debs/*.deb; do dpkg -x "$d" $fx || return 1; done
        touch $fx/.ready
    fi
    lib=$(dirname "$(ls $fx/lib/x86_64-linux-gnu/libfuse3.so.3 $fx/usr/lib/x86_64-linux-gnu/libfuse3.so.3 2>/dev/null | head -1)")
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        "$here"/.device/wheels/*.whl || { echo "device.sh: trio's wheels did not install"; return 1; }
    export FUSE3_CFLAGS="-I$fx/usr/include/fuse3" FUSE3_LIBS="-L$lib -l:libfuse3.so.3 -Wl,-rpath,$lib"
    python_build_vars
    src=$(ls -d "$here"/.device/pyfuse3-*/ | head -1)
    if [ ! -f $site/.ready ] || [ "$src/src/pyfuse3/__init__.c" -nt $site/.ready ]; then
        build_pyfuse3 "$src" $site || { echo "device.sh: the patched pyfuse3 did not build"; return 1; }
        touch $site/.ready
    fi
    xx=$fx/usr/lib/x86_64-linux-gnu
    if [ ! -f "$here/fusefs/_fetchio$suf" ] || [ "$here/fusefs/_fetchio.c" -nt "$here/fusefs/_fetchio$suf" ]; then
        gcc -shared -fPIC -O2 -I"$inc" -I$fx/usr/include "$here/fusefs/_fetchio.c" \
            -o "$here/fusefs/_fetchio$suf" -L$xx -l:libxxhash.so.0 -Wl,-rpath,$xx \
            || { echo "device.sh: fusefs/_fetchio.c did not build"; return 1; }
    fi
    # fusermount3 (the unmounts) from Debian's fuse3, found before any other
    export PATH=$fx/bin:$fx/usr/bin:$PATH
    export PYTHONPATH=$site:/tmp/site:$here${PYTHONPATH:+:$PYTHONPATH}
    python3 "$here/scripts/pyfuse3_patched.py" --check \
        || { echo "device.sh: pyfuse3 lacks fusefs's patches"; return 1; }
    python3 -c "import fusefs._fetchio" || { echo "device.sh: fusefs._fetchio does not import"; return 1; }
    echo "device.sh: ready (pyfuse3 with fusefs's patches, fusefs._fetchio; $(python3 --version))"
    ;;
check)
    # The GPU node's figures (issue 47), about 9 minutes on 16 cores: bench_swap (ResNet-50,
    # batch 128; it needs no mount, so it runs even if the setup fails), bench_node (raw and
    # decoded, 4 / 8 / 16 workers) and bench_hybrid (the small CNN and ResNet-18). Back in
    # $OUT: figures.jsonl (every benchmark's lines, and each part's exit status and
    # seconds), check.log and the PNGs. Sizes and timeouts from the environment, for a
    # rehearsal on a small machine: FILES, EPOCHS, WORKERS, HYBRID_EPOCHS, SWAP_MODELS,
    # SWAP_BATCH, SWAP_ROUNDS, LIMITS (seconds of each part: swap, node raw, node
    # decode, hybrid) and PARTS (which of swap node_raw node_decode hybrid to run). The tree there has no .git: FUSEFS_COMMIT names the commit.
    here=$(cd "$(dirname "$0")/.." && pwd); cd "$here"
    OUT=${OUT:?"device.sh check: set OUT to the folder for the figures"}
    exec > >(tee -a "$OUT/check.log") 2>&1
    export PYTHONUNBUFFERED=1
    t0=$(date +%s)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "$(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB"
    python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
    read -r l_swap l_raw l_decode l_hybrid <<< "${LIMITS:-110 120 160 140}"
    work=/tmp/fusefs-check
    mkdir -p $work
    swap="python3 scripts/bench/bench_swap.py --models ${SWAP_MODELS:-resnet50} --batch ${SWAP_BATCH:-128}
          --rounds ${SWAP_ROUNDS:-40} --memory-limit 0.1 --largest-rows no_swap,checkpoint,learned
          --out $work/swap --jsonl $OUT/figures.jsonl"
    if source scripts/device.sh setup; then
        echo "{\"part\": \"setup\", \"rc\": 0, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/figures.jsonl"
    else
        echo "{\"part\": \"setup\", \"rc\": 1, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/figures.jsonl"
        PYTHONPATH=$here part swap "$l_swap" $swap
        exit 1
    fi
    part swap "$l_swap" $swap
    node="python3 scripts/bench/bench_node.py --python python3 --files ${FILES:-8000}
          --workers ${WORKERS:-4,8,16} --systems loose,fusefs,minimal_c --out $work/node
          --jsonl $OUT/figures.jsonl"
    part node_raw "$l_raw" $node --loaders raw --epochs "${EPOCHS:-2}"
    part node_decode "$l_decode" $node --loaders decode --epochs 1
    part hybrid "$l_hybrid" python3 scripts/bench/bench_hybrid.py --python python3 --models small,resnet18 \
        --epochs "${HYBRID_EPOCHS:-5}" --workers 4 --out $work/hybrid --jsonl "$OUT/figures.jsonl"
    for f in $work/swap/bench_swap.png $work/node/bench_node.png $work/hybrid/bench_hybrid.png; do
        [ -f "$f" ] && cp "$f" "$OUT/"
    done
    echo "device.sh check: done in $(( $(date +%s) - t0 )) s"
    ;;
build-pyfuse3)
    build_pyfuse3 "$2" "$3" ;;
*)
    echo "usage: bash scripts/device.sh prepare (here) | bash scripts/device.sh check (there, OUT set)"
    echo "       | source scripts/device.sh setup (there)"
    return 2 2>/dev/null || exit 2 ;;
esac
