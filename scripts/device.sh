#!/usr/bin/env bash
# fusefs on the GPU node, installed as here (pip), and the run that measures its figures
# there. The node has no package index and no libfuse3; it has Cython, setuptools and the
# Python packages fusefs needs but trio. So what pip needs that the node lacks is gathered
# here into .device/ (git ignores it) and carried.
#
# Here, once (needs .venv: scripts/setup.sh):
#     bash scripts/device.sh prepare
#   downloads Debian's libfuse3 (library, headers, fusermount3) and libxxhash, and the
#   wheels of trio and setuptools for the node's Python (3.12).
# There, in one call of the device tool (carry: [".device"]):
#     FUSEFS_COMMIT=<commit> bash scripts/device.sh check
#   sets up (below) and runs the GPU node's benchmarks, each under its own timeout, each
#   appending its figures to $OUT as JSON lines as it measures them (a run cut short keeps
#   what it measured). Or, for a command of your own:
#     source scripts/device.sh setup && python3 scripts/bench/bench_node.py --python python3
#   unpacks the Debian packages into /tmp/fx (never into /), then installs those wheels and
#   fusefs itself with pip, offline (`pip install --no-index --no-build-isolation -e .`,
#   libfuse3 and xxHash found in /tmp/fx), and checks that the binding has the fast path.
set -u

# the node's Python and the Debian packages it needs
NODE_PYTHON=3.12
DEBS="libfuse3-3 libfuse3-dev fuse3 libxxhash0 libxxhash-dev"
WHEELS="trio outcome sniffio setuptools"

# part NAME SECONDS COMMAND...: one part of the check under its own timeout, cut to what is
# left before $DEADLINE; its exit status and seconds as a JSON line in $OUT/figures.jsonl
part() {
    local name=$1 limit=$2 t0 rc left
    shift 2
    [[ " ${PARTS:-pages hotpath swap hybrid importance node_raw node_decode} " == *" $name "* ]] || return 0
    t0=$(date +%s)
    left=$(( ${DEADLINE:-$(( t0 + limit ))} - t0 - 5 ))
    (( left < limit )) && limit=$left
    if (( limit < 10 )); then
        echo "== $name: skipped, $left s left"
        echo "{\"part\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": true}" >> "$OUT/figures.jsonl"
        return 0
    fi
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
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.device/' "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")"; echo '/.device/' >> "$exclude"; }
    rm -rf .device && mkdir -p .device/debs .device/wheels
    (cd .device/debs && apt-get download $DEBS >/dev/null)
    # trio's own needs that the node lacks (attrs, idna and sortedcontainers are there), and
    # the setuptools pyproject.toml asks for (>= 77: an SPDX license), whatever the node has
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version $NODE_PYTHON \
        --implementation cp --platform manylinux2014_x86_64 -d .device/wheels \
        $(for w in $WHEELS; do .venv/bin/python -c "import importlib.metadata as m; print('$w==' + m.version('$w'))"; done)
    du -sh .device
    ;;
setup)
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    [ -d "$here/.device/debs" ] || { echo "device.sh: no .device (prepare it here, carry it there)"; return 1; }
    fx=/tmp/fx
    if [ ! -f $fx/.ready ]; then
        for d in "$here"/.device/debs/*.deb; do dpkg -x "$d" $fx || return 1; done
        touch $fx/.ready
    fi
    lib=$(dirname "$(ls $fx/lib/x86_64-linux-gnu/libfuse3.so.3 $fx/usr/lib/x86_64-linux-gnu/libfuse3.so.3 2>/dev/null | head -1)")
    xx=$fx/usr/lib/x86_64-linux-gnu
    export FUSE3_CFLAGS="-I$fx/usr/include/fuse3" FUSE3_LIBS="-L$lib -l:libfuse3.so.3 -Wl,-rpath,$lib"
    python3 -m pip install -q --no-index --no-deps "$here"/.device/wheels/*.whl \
        || { echo "device.sh: the carried wheels did not install"; return 1; }
    CFLAGS="-I$fx/usr/include" LDFLAGS="-L$xx -Wl,-rpath,$xx" \
        python3 -m pip install -q --no-index --no-build-isolation --no-deps -e "$here" \
        || { echo "device.sh: fusefs did not install"; return 1; }
    # fusermount3 (the unmounts) from Debian's fuse3, found before any other
    export PATH=$fx/bin:$fx/usr/bin:$PATH
    python3 -c "import fusefs._fetchio, fusefs.pyfuse3 as p; assert callable(p.fast_path_start)" \
        || { echo "device.sh: fusefs's binding has no fast path, or _fetchio is missing"; return 1; }
    echo "device.sh: ready (fusefs with its binding and fast path, fusefs._fetchio; $(python3 --version))"
    ;;
check)
    # The GPU node's figures (issue 58), in the order of its items, so that a run cut short
    # keeps the most valuable rows, about 9 minutes on 16 cores:
    #   pages       page_cost.py: a fetched sample's read into fresh memory and into memory
    #               present, the floor under the fetched regimes (compare with the VM's table
    #               in HOTPATH.md; at most PAGES_LIMIT seconds, 30)
    #   hotpath     bench_hotpath --quick --no-peer: the daemon's CPU per sample in each regime
    #               and the scale epoch of 200,000 tiny samples, on 16 cores (HOTPATH_ROUNDS
    #               rounds, 1; at most HOTPATH_LIMIT seconds, 150)
    #   swap        bench_swap: ResNet-50 and a transformer stack, budgets 0.6 and 0.8, GPU
    #               memory capped just above the no-swap peak; no swap, checkpointing, the
    #               learned plan (it needs no mount, so it runs even if the setup fails)
    #   hybrid      bench_hybrid: the small CNN and ResNet-18, GPU only against hybrid, 3 seeds
    #   importance  bench_unbiased --local: ResNet-18 on the GPU through the mount, full /
    #               unbiased / rank, 3 seeds at once per mode
    #   node_raw, node_decode  bench_node: loose / fusefs (default threads and one) / minimal C daemon, 4 / 8 / 16
    #               workers, 3 counted epochs each
    # Back in $OUT: figures.jsonl (every benchmark's lines, and each part's exit status and
    # seconds), check.log and the PNGs. Sizes and timeouts from the environment, for a
    # rehearsal on a small machine: SWAP_MODELS, SWAP_BATCH, SWAP_ROUNDS, TRANSFORMER,
    # HYBRID_MODELS, HYBRID_EPOCHS, SEEDS, TRAIN, TEST, IMP_EPOCHS, IMP_MODEL, FILES,
    # DECODE_FILES, EPOCHS, WORKERS, SYSTEMS (bench_node's), LIMITS (seconds of each part, in the order above), TOTAL
    # (seconds for the whole check: a part is cut to what is left) and PARTS (which parts to
    # run). PY is the Python that runs the benchmarks and the trainers (python3) and
    # SKIP_SETUP=1 uses it as it is (a rehearsal, fusefs installed already). The tree there
    # has no .git: FUSEFS_COMMIT names the commit.
    here=$(cd "$(dirname "$0")/.." && pwd); cd "$here"
    OUT=${OUT:?"device.sh check: set OUT to the folder for the figures"}
    exec > >(tee -a "$OUT/check.log") 2>&1
    export PYTHONUNBUFFERED=1
    t0=$(date +%s)
    DEADLINE=$(( t0 + ${TOTAL:-560} ))
    PY=${PY:-python3}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "$(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, kernel $(uname -r)"
    $PY -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
    read -r l_swap l_hybrid l_imp l_raw l_decode <<< "${LIMITS:-110 110 140 85 75}"
    work=/tmp/fusefs-check
    mkdir -p $work
    swap="$PY scripts/bench/bench_swap.py --models ${SWAP_MODELS:-resnet50,transformer} --batch ${SWAP_BATCH:-128}
          --transformer ${TRANSFORMER:-8,512,256} --budgets 0.6,0.8 --rows no_swap,checkpoint,learned
          --fit 0.05 --rounds ${SWAP_ROUNDS:-24} --steps 2 --rounds-timed 3 --memory-limit 0
          --host-limit 0.25 --out $work/swap --jsonl $OUT/figures.jsonl"
    if [ "${SKIP_SETUP:-}" = 1 ] || source scripts/device.sh setup; then
        echo "{\"part\": \"setup\", \"rc\": 0, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/figures.jsonl"
    else
        echo "{\"part\": \"setup\", \"rc\": 1, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/figures.jsonl"
        PYTHONPATH=$here part swap "$l_swap" $swap  # (trainer from the tree: fusefs did not install)
        exit 1
    fi
    seeds=${SEEDS:-3}
    part pages "${PAGES_LIMIT:-30}" $PY scripts/bench/page_cost.py --results "$OUT/figures.jsonl"
    part hotpath "${HOTPATH_LIMIT:-150}" $PY scripts/bench/bench_hotpath.py --quick --no-peer \
        --rounds "${HOTPATH_ROUNDS:-1}" --out $work/hotpath --results "$OUT/figures.jsonl"
    part swap "$l_swap" $swap
    part hybrid "$l_hybrid" $PY scripts/bench/bench_hybrid.py --python $PY --models ${HYBRID_MODELS:-small,resnet18} \
        --modes accel,hybrid --seeds $seeds --epochs "${HYBRID_EPOCHS:-10}" --workers 4 --out $work/hybrid \
        --jsonl "$OUT/figures.jsonl"
    part importance "$l_imp" $PY scripts/bench/bench_unbiased.py --local --python $PY --model ${IMP_MODEL:-resnet18} \
        --device auto --train ${TRAIN:-10000} --test ${TEST:-2000} --epochs ${IMP_EPOCHS:-12} --warmup 2 \
        --seeds $seeds --parallel-seeds --workers 4 --batch 128 --out $work/unbiased --results "$OUT/figures.jsonl"
    node="$PY scripts/bench/bench_node.py --python $PY --workers ${WORKERS:-4,8,16}
          --systems ${SYSTEMS:-loose,fusefs,fusefs_n1,minimal_c} --epochs ${EPOCHS:-3} --jsonl $OUT/figures.jsonl"
    part node_raw "$l_raw" $node --files ${FILES:-8000} --loaders raw --out $work/node
    part node_decode "$l_decode" $node --files ${DECODE_FILES:-1500} --loaders decode --out $work/node_decode
    for f in swap/bench_swap.png hybrid/bench_hybrid.png unbiased/bench_unbiased.png node/bench_node.png \
             node_decode/bench_node.png; do
        [ -f "$work/$f" ] && cp "$work/$f" "$OUT/${f%%/*}.png"
    done
    echo "device.sh check: done in $(( $(date +%s) - t0 )) s"
    ;;
*)
    echo "usage: bash scripts/device.sh prepare (here) | bash scripts/device.sh check (there, OUT set)"
    echo "       | source scripts/device.sh setup (there)"
    return 2 2>/dev/null || exit 2 ;;
esac
