#!/usr/bin/env bash
# Installs everything fusefs needs on a fresh Debian 12 machine (run as root):
# Debian's FUSE 3 and build tools, Debian's torchvision (for the unmodified-loader
# runs by /usr/bin/python3), GlusterFS, and a venv in .venv with fusefs installed.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for p in fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv python3-torchvision \
         python3-pil glusterfs-server glusterfs-client attr procps; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup: apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PY --version)"
    $PY -m venv .venv
fi
stamp=.venv/.fusefs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -e ".[trainer,bench,test]"
    touch "$stamp"
fi
echo "setup: ready (.venv/bin/fusefs)"
