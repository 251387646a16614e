"""scripts/pyfuse3_patched.py: each patch changes what it is meant to change in a stand-in
for the part of pyfuse3 3.5.0 it touches (built from the script's own patterns: whether
they match the real sources is checked by the build in scripts/setup.sh, which fails
loudly), and refuses text that changed (a new pyfuse3 must be looked at, not patched
blindly)."""
import importlib.util
import os

import pyfuse3
import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location(
    "pyfuse3_patched", os.path.join(REPO, "scripts", "pyfuse3_patched.py"))
patched = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patched)

# Stand-ins for the parts of internal.pxi and handlers.pxi that the patches touch.
LOOP = ("async def _session_loop(nursery, int min_tasks, int max_tasks):\n"
        "    cdef int res\n" + patched.LOOP_START + "    while not fuse_session_exited(session):\n"
        + patched.LOOP_WAIT + "        save_retval(None)\n" + patched.LOOP_END
        + "    worker_data.task_count -= 1\n")
HANDLER = "cdef void fuse_read (fuse_req_t req, fuse_ino_t ino, size_t size):\n" + patched.HANDLE_LINE


def test_the_loop_reads_first_and_waits_only_when_nothing_is_queued():
    out = patched.patch_session_loop("# before\n" + LOOP + "\nasync def _next():\n    pass\n")
    take = out.index("res = fuse_session_receive_buf(session, &buf)\n        if res == -errno.EAGAIN:")
    assert take < out.index("await _wait_fuse_readable()")
    assert "os.O_NONBLOCK" in out and "await trio.lowlevel.checkpoint()" in out
    assert out.startswith("# before\n") and out.endswith("\nasync def _next():\n    pass\n")
    assert patched.LOOP_WAIT not in out


def test_a_changed_loop_is_refused():
    with pytest.raises(SystemExit, match="_session_loop changed"):
        patched.patch_session_loop(LOOP.replace("await _wait_fuse_readable()", "await wait()"))


def test_handlers_get_the_inode_where_the_handle_is_zero():
    handlers = "".join(HANDLER.replace("fuse_read ", h) for h in patched.HANDLERS)
    out = patched.patch_handlers(handlers)
    assert out.count("c.fh = fi.fh if fi.fh != 0 else ino") == len(patched.HANDLERS)
    with pytest.raises(SystemExit, match="handlers changed"):
        patched.patch_handlers(handlers.replace("fuse_flush ", "fuse_flush2 "))


def test_the_venv_has_the_first_two_patches():
    """scripts/setup.sh builds them; the hot-path figures in docs are measured with them."""
    assert pyfuse3.INODE_WITHOUT_OPEN and pyfuse3.REQUESTS_WITHOUT_WAIT


def test_notify_store_many_is_added_after_notify_store():
    init = ("# before\ndef notify_store(inode, offset, data):\n    cdef int ret\n    with nogil:\n"
            + patched.STORE_ANCHOR + "\n\ndef get_sup_groups(pid):\n    pass\n")
    out = patched.patch_store_many(init)
    assert out.startswith(init) and "\ndef notify_store_many(items):\n" in out
    assert out.count("fuse_lowlevel_notify_store(session, inos[i], 0, &bufvec, 0)") == 1
    with pytest.raises(SystemExit, match="notify_store changed"):
        patched.patch_store_many(init.replace("&bufvec, 0)", "&bufvec, flags)"))


def test_the_venv_has_notify_store_many():
    assert pyfuse3.STORE_MANY and callable(pyfuse3.notify_store_many)
    assert pyfuse3.notify_store_many([]) == []


def test_ioctl_requests_are_answered_in_c_and_counted():
    init_ops = "cdef void init_fuse_ops():\n    fuse_ops.statfs = fuse_statfs\n" + patched.IOCTL_ANCHOR
    out = patched.patch_ioctl(init_ops + "\ncdef make_fuse_args(args):\n    pass\n")
    assert out.index(patched.IOCTL_ANCHOR) < out.index("    fusefs_set_ioctl(&fuse_ops)\n")
    assert "fuse_reply_err(req, ENOTTY)" in out and "\ndef ioctl_requests():\n" in out
    with pytest.raises(SystemExit, match="init_fuse_ops changed"):
        patched.patch_ioctl(init_ops.replace("fuse_poll", "fuse_poll2"))


def test_the_venv_counts_ioctl_requests():
    assert pyfuse3.IOCTL_COUNTED and pyfuse3.ioctl_requests() >= 0
