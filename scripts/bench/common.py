"""Helpers the benchmarks share (each benchmark runs from this folder, so `import common`
finds it without any sys.path edit)."""
from __future__ import annotations

import json
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = os.path.join(REPO, "scripts", "workloads")


def git(*args: str) -> str:
    """git's output in the repository, stripped ('' when git fails)."""
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout.strip()


def commit() -> str:
    """The commit the figures come from: HEAD, short, with "+dirty" when fusefs/ or
    trainer/ differ from it."""
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "fusefs", "trainer") else "")


def run_trainer(script: str, args: list[str], show=None) -> list[dict]:
    """Run scripts/workloads/<script> under Debian's /usr/bin/python3 (torchvision) with the
    repository on PYTHONPATH; it prints one JSON row per epoch, each handed to show(row)
    as it comes. Returns the rows; stops the benchmark if the training fails."""
    cmd = ["/usr/bin/python3", os.path.join(WORKLOADS, script), *args]
    rows = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO)) as p:
        for line in p.stdout:
            rows.append(json.loads(line))
            if show is not None:
                show(rows[-1])
    if p.returncode:
        raise SystemExit(f"{script} {' '.join(args)} failed: exit {p.returncode}")
    return rows
