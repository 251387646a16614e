"""The test harness's own promise: a test that hangs on a mount fails within its time limit
and leaves no mount or daemon behind (testkit.guard, testkit.mounts.abort_all)."""
import os
import subprocess
import sys

from conftest import REPO
from testkit.mounts import is_mounted

LIMIT = 20  # seconds: the inner test's pytest-timeout limit

INNER = f'''
import os
import signal

import pytest

from testkit.mounts import running_mount


@pytest.mark.timeout({LIMIT})
def test_a_read_from_a_stopped_daemon():
    mnt = os.environ["GUARD_MNT"]
    with running_mount(os.environ["GUARD_PACKED"], mnt) as (proc, _):
        with open(os.environ["GUARD_PID"], "w") as f:
            f.write(str(proc.pid))
        os.kill(proc.pid, signal.SIGSTOP)
        with open(os.path.join(mnt, "cat", "img 005.jpg"), "rb") as f:  # blocks: nobody answers
            f.read()
'''


def test_a_daemon_stopped_mid_read_fails_the_test_within_its_limit_and_leaves_no_mount(tricky, tmp_path):
    """A daemon stopped with SIGSTOP while a test reads through it: the read blocks in the
    kernel (a stopped daemon answers neither the request nor its interrupt), and without
    the guard pytest-timeout would end the whole process at the limit, leaving the mount
    and the stopped daemon behind. With it the test fails within its limit, its read
    broken by the guard, and nothing is left."""
    _, dst, _ = tricky
    test = tmp_path / "test_inner.py"
    test.write_text(INNER)
    mnt, pid_file = tmp_path / "mnt", tmp_path / "daemon.pid"
    env = dict(os.environ, GUARD_MNT=str(mnt), GUARD_PACKED=dst, GUARD_PID=str(pid_file),
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "scripts"), REPO]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "testkit.guard", "-p", "no:cacheprovider",
                        "-c", os.devnull, "--rootdir", str(tmp_path), "-o", "timeout_method=thread",
                        str(test)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=3 * LIMIT)
    out = r.stdout + r.stderr
    daemon = int(pid_file.read_text())
    try:
        assert r.returncode == 1 and "1 failed" in out, out[-3000:]
        # the guard ended it within the limit, not pytest-timeout at the limit (which would
        # have ended the process without its clean-up)
        assert "testkit.guard" in out and "Timeout" not in out, out[-3000:]
        assert not is_mounted(str(mnt))
        assert not os.path.exists(f"/proc/{daemon}") or open(f"/proc/{daemon}/stat").read().split()[2] == "Z"
    finally:  # whatever failed above, nothing stays
        if os.path.exists(f"/proc/{daemon}"):
            os.kill(daemon, 9)
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=30)
