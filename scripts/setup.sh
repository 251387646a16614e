#!/usr/bin/env bash
# Installs everything fusefs needs on a fresh Debian 12 machine (run as root):
# Debian's FUSE 3 and build tools, Debian's torchvision and scikit-learn (for the
# unmodified-loader and training runs by /usr/bin/python3), GlusterFS, and a venv in .venv
# with fusefs installed.
set -euo pipefail
cd "$(dirname "$0")/.."

missing() {
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
    done
}
export DEBIAN_FRONTEND=noninteractive
need_apt=($(missing fuse3 libfuse3-dev libxxhash-dev pkg-config gcc python3-dev python3-venv python3-torchvision \
                    python3-pil glusterfs-server glusterfs-client attr procps))
# scikit-learn for trainer/ in the training runs by /usr/bin/python3, and fio, a reader of
# the mount that no one here wrote (both without their recommended packages)
need_slim=($(missing python3-sklearn fio))
if [ ${#need_apt[@]} -gt 0 ] || [ ${#need_slim[@]} -gt 0 ]; then
    echo "setup: apt-get install ${need_apt[*]} ${need_slim[*]}"
    apt-get update -qq
    [ ${#need_apt[@]} -eq 0 ] || apt-get install -y -qq "${need_apt[@]}" >/dev/null
    [ ${#need_slim[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${need_slim[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PY --version)"
    $PY -m venv .venv
fi
stamp=.venv/.fusefs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
        || [ fusefs/_fetchio.c -nt "$stamp" ] || ! .venv/bin/python -c 'import fusefs._fetchio' 2>/dev/null; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -e ".[trainer,bench,test]"
    # the compiled fetch reads (setup.py; the build fails without them unless FUSEFS_NO_NATIVE=1)
    .venv/bin/python -c 'import fusefs._fetchio' || { echo "setup: fusefs/_fetchio.c did not build"; exit 1; }
    touch "$stamp"
fi
# pyfuse3 3.5.0 (its sdist checked by SHA-256) with fusefs's five patches
# (scripts/pyfuse3_patched.py): a request loop that takes queued requests without waiting for
# the fd, notify_store_many (many page cache pushes with one GIL hand-off), ioctl requests
# counted, the loop starting a task only when every other is inside a handler, and the fast
# path, a thread in C answering the dataset files' lookups, opens, releases, forgets and
# reads of cached samples (its mark hashes scripts/pyfuse3_fastpath.h and
# pyfuse3_patched.py: a change to either rebuilds; --check compares the marks)
if ! .venv/bin/python scripts/pyfuse3_patched.py --check; then
    echo "setup: building pyfuse3 with fusefs's patches"
    .venv/bin/python scripts/pyfuse3_patched.py
fi
# mount(8) runs `fusefs` for an fstab line of type fuse.fusefs (through mount.fuse3) with
# the system's PATH: put the command there too
if [ "$(id -u)" = 0 ]; then
    ln -sfn "$PWD/.venv/bin/fusefs" /usr/local/bin/fusefs
fi
echo "setup: ready (.venv/bin/fusefs)"
