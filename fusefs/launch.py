"""`fusefs run -- COMMAND ...`: run a training command so that every torch DataLoader over a
fusefs mount hands the mount each epoch's order, with no change to the training code.

The command runs in this process's place (exec) with two variables added to its
environment and nothing written anywhere: PYTHONPATH led by fusefs/boot/ (whose
sitecustomize.py every Python process the command starts loads: ranks, loader workers,
another interpreter), and FUSEFS_RUN_HOME, the folder that holds this fusefs package (where
an interpreter without fusefs finds it: that name only). The hinting itself: autohint.py.
An interpreter started with -E or -I ignores PYTHONPATH and runs unhinted.
"""
from __future__ import annotations

import os
import shutil

from .autohint import QUIET_ENV
from .errors import UserError

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
HOME_ENV = "FUSEFS_RUN_HOME"  # (read by boot/sitecustomize.py, which has no imports of ours)


def environment(base: dict, quiet: bool = False) -> dict:
    """base (an environment) with what makes the Python processes started in it hint."""
    env = dict(base)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT]
    env["PYTHONPATH"] = os.pathsep.join([BOOT, *rest])
    env[HOME_ENV] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if quiet:
        env[QUIET_ENV] = "1"
    return env


def run(command: list[str], quiet: bool = False) -> None:
    """Replace this process by command, in environment(); never returns."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError("fusefs run: no command given (fusefs run -- python train.py ...)")
    exe = shutil.which(command[0]) if os.sep not in command[0] else command[0]
    if exe is None or not os.access(exe, os.X_OK) or os.path.isdir(exe):
        raise UserError(f"fusefs run: {command[0]}: no such command")
    os.execve(exe, command, environment(os.environ, quiet))
