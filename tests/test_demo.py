"""The README's first command runs scripts/demo.py: keep it working (small dataset, on the
GlusterFS test bed as the demo itself uses it)."""
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.gluster  # (the demo brings the test bed up)


def test_demo_runs_and_prints_its_figures(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--files", "150",
                        "--out", str(tmp_path / "demo")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "bytes identical to the source: yes" in r.stdout
    assert "loose files on GlusterFS" in r.stdout and "fusefs run -- the script as it is" in r.stdout
    assert "the script changed to HintedSampler" in r.stdout
    assert "Where fusefs does not help" in r.stdout
    assert "daemon statistics: opens=" in r.stdout and "eio=0" in r.stdout
    assert not os.path.ismount(tmp_path / "demo" / "mnt")
    from testkit.gluster import GMNT
    assert not os.path.exists(os.path.join(GMNT, "demo-150"))  # the demo cleans up the volume
