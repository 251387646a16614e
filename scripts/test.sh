#!/usr/bin/env bash
# Set up (Debian packages, .venv) and run every test (real FUSE mounts, GlusterFS, torchvision).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
