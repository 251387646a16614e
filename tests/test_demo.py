"""The README's first command runs scripts/demo.py: keep it working (small dataset)."""
import os
import subprocess
import sys

from conftest import REPO


def test_demo_runs_and_prints_its_figures(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--files", "120",
                        "--out", str(tmp_path / "demo")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "bytes identical to the source: yes" in r.stdout
    assert "daemon statistics: opens=" in r.stdout and "eio=0" in r.stdout
    assert not os.path.ismount(tmp_path / "demo" / "mnt")
