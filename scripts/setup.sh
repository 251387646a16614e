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
# (passwd and util-linux: useradd and setpriv, with which tests/test_abuse.py attacks as a second user)
need_apt=($(missing fuse3 libfuse3-dev libxxhash-dev pkg-config gcc python3-dev python3-venv python3-torchvision \
                    python3-pil glusterfs-server glusterfs-client attr procps passwd util-linux))
# scikit-learn for trainer/ in the training runs by /usr/bin/python3, and fio, a reader of
# the mount that no one here wrote (both without their recommended packages)
need_slim=($(missing python3-sklearn fio))
if [ ${#need_apt[@]} -gt 0 ] || [ ${#need_slim[@]} -gt 0 ]; then
    echo "setup: apt-get install ${need_apt[*]} ${need_slim[*]}"
    apt-get update -qq
    [ ${#need_apt[@]} -eq 0 ] || apt-get install -y -qq "${need_apt[@]}" >/dev/null
    [ ${#need_slim[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${need_slim[@]}" >/dev/null
fi

# The kernel's FUSE control filesystem, which systemd mounts at boot and a bare machine may
# not have: a mount's daemon widens the kernel's reads of its files there
# (fusefs/mount.py, widen_kernel_reads; tests/test_mount.py holds it).
if [ -d /sys/fs/fuse/connections ] && ! mountpoint -q /sys/fs/fuse/connections; then
    mount -t fusectl fusectl /sys/fs/fuse/connections \
        || echo "setup: the FUSE control filesystem is not mounted: each mount keeps the kernel's default read-ahead" >&2
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PY --version)"
    $PY -m venv .venv
fi
# `pip install` is the install: it builds fusefs's compiled parts, its FUSE binding
# fusefs.pyfuse3 (pyfuse3 3.5.0 with fusefs's patches, fusefs/pyfuse3, and the fast path,
# fusefs/_fastpath.h), the loop's cores (fusefs/_cachecore.c, _plancore.c, _eventscore.c) and
# fusefs._fetchio, and fails, naming what is missing, where it cannot
# (setup.py). Again whenever a source of theirs changed.
stamp=.venv/.fusefs-installed
native=(pyproject.toml setup.py fusefs/_*.c fusefs/_*.h fusefs/pyfuse3/*.pyx fusefs/pyfuse3/*.pxi)
parts='import fusefs._fetchio, fusefs.pyfuse3, fusefs._cachecore, fusefs._plancore, fusefs._eventscore'
stale=$(for f in "${native[@]}"; do [ -f "$stamp" ] && [ "$f" -nt "$stamp" ] && echo "$f"; done; true)
if [ ! -f "$stamp" ] || [ -n "$stale" ] || ! .venv/bin/python -c "$parts" 2>/dev/null; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -e ".[trainer,bench,test]"
    .venv/bin/python -c "$parts" || { echo "setup: fusefs's compiled parts did not build"; exit 1; }
    touch "$stamp"
fi
# a copy of the sdist that fusefs/pyfuse3 is written from (scripts/pyfuse3_patched.py), which
# its test checks by hash: after set-up, no test needs the package index
.venv/bin/python scripts/pyfuse3_patched.py --fetch >/dev/null
# mount(8) runs `fusefs` for an fstab line of type fuse.fusefs (through mount.fuse3) with
# the system's PATH: put the command there too (saying so when another install's link was there)
if [ "$(id -u)" = 0 ]; then
    bash scripts/link_command.sh "$PWD/.venv/bin/fusefs" /usr/local/bin/fusefs
fi
echo "setup: ready (.venv/bin/fusefs)"
