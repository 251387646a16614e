#!/usr/bin/env bash
# Set up (Debian packages, .venv) and run the main job on the built-in default dataset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
