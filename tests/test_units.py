"""The pure parts on their own, without a mount: the pyfuse3 adapter against a fake core
(errors to errnos, the read-only table, request counting), GlusterFS pathinfo parsing, the
mount table's escapes, the mount settings' checks and the CLI's one error path."""
import errno
import os
import stat
import subprocess
import sys

from fusefs import pyfuse3
import pytest
import trio

from fusefs import mounts
from fusefs.cli import main
from fusefs.config import DEFAULTS, ConfigError, MountConfig
from fusefs.entries import Attr, FsError, OpenResult
from fusefs.errors import UserError
from fusefs.fs import Operations
from fusefs.nodes import parse_pathinfo


class Stats:
    def __init__(self):
        self.requests = {}


class FakeCore:
    """Answers lookups of b"ok", refuses b"missing" with ENOENT and fails b"boom" with a bug."""
    uid, gid = 1000, 1000

    def __init__(self):
        self.stats = Stats()
        self.forgotten = []

    def lookup(self, parent, name):
        if name == b"ok":
            return Attr(ino=7, mode=stat.S_IFREG | 0o444, size=3, mtime_ns=5)
        if name == b"missing":
            raise FsError(errno.ENOENT)
        raise ValueError("a bug in the core")

    def open(self, ino, flags, uid):
        return OpenResult(fh=(1 << 32) | ino)

    def forget(self, inos):
        self.forgotten += list(inos)
        raise RuntimeError("forget must not raise")


def call(coro_fn, *args):
    async def run():
        return await coro_fn(*args)
    return trio.run(run)


def fuse_errno(coro_fn, *args) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        call(coro_fn, *args)
    return e.value.errno


def test_the_adapter_translates_and_counts():
    core = FakeCore()
    ops = Operations(core)
    entry = call(ops.lookup, 1, b"ok")
    assert (entry.st_ino, entry.st_size, entry.st_uid, entry.st_mtime_ns) == (7, 3, 1000, 5)
    assert fuse_errno(ops.lookup, 1, b"missing") == errno.ENOENT
    assert fuse_errno(ops.lookup, 1, b"boom") == errno.EIO  # a bug is EIO, never an escape
    info = call(ops.open, 7, 0, type("Ctx", (), {"uid": 0})())
    assert info.fh == (1 << 32) | 7
    for name in ("mkdir", "unlink", "rename", "setxattr", "create", "symlink"):
        assert fuse_errno(getattr(ops, name), 1, b"x") == errno.EROFS, name
    call(ops.forget, [(7, 1), (8, 2)])  # logs, does not raise
    assert core.forgotten == [7, 8]
    assert ops.requests == {"lookup": 3, "open": 1, "mkdir": 1, "unlink": 1, "rename": 1,
                            "setxattr": 1, "create": 1, "symlink": 1, "forget": 1}
    assert ops.counters()["requests"]["lookup"] == 3


def test_pathinfo_names_the_brick_and_joins_replicas():
    one = "(<DISTRIBUTE:vol-dht> <POSIX(/srv/b1):host1:/srv/b1/chunks/chunk-000001.fck>)"
    assert parse_pathinfo(one) == "host1:/srv/b1"
    replicated = ("(<DISTRIBUTE:vol-dht> (<REPLICATE:vol-replicate-0> "
                  "<POSIX(/srv/b2):host2:/srv/b2/c> <POSIX(/srv/b1):host1:/srv/b1/c>))")
    assert parse_pathinfo(replicated) == "host1:/srv/b1,host2:/srv/b2"  # one node, sorted
    assert parse_pathinfo("(<DISTRIBUTE:vol-dht>)") is None


def test_bricks_left_out_by_a_pack_are_named_once_chance_is_ruled_out(monkeypatch):
    """A chunk folder's pathinfo lists every brick of its layout (as GlusterFS 10 gives it for
    a directory); the bricks that got none of the chunks are named, once there are enough
    chunks (8 per brick) for that not to be chance; replica sets count for each brick."""
    from fusefs import nodes
    folder = ("((<DISTRIBUTE:vol-dht> <POSIX(/srv/b2):h:/srv/b2/p/chunks> "
              "<POSIX(/srv/b1):h:/srv/b1/p/chunks> <POSIX(/srv/b3):h:/srv/b3/p/chunks>) "
              "(vol-dht-layout (vol-client-1 0 1431655764) (vol-client-2 1431655765 2863311529) "
              "(vol-client-0 2863311530 4294967295)))")
    monkeypatch.setattr(nodes.os, "getxattr", lambda path, name: folder.encode())
    assert nodes.bricks_left_out("f", ["h:/srv/b1"], 24) == ["h:/srv/b2", "h:/srv/b3"]
    assert nodes.bricks_left_out("f", ["h:/srv/b1"], 23) == []  # too few chunks to tell
    assert nodes.bricks_left_out("f", ["h:/srv/b1", "h:/srv/b3"], 30) == ["h:/srv/b2"]
    assert nodes.bricks_left_out("f", ["h:/srv/b1,h:/srv/b2", "h:/srv/b3"], 30) == []

    def no_xattr(path, name):
        raise OSError(61, "No data available")
    monkeypatch.setattr(nodes.os, "getxattr", no_xattr)  # not GlusterFS
    assert nodes.bricks_left_out("f", ["local"], 100) == []


def test_the_mount_table_unescapes_and_finds_the_holder(monkeypatch, tmp_path):
    fake = tmp_path / "mounts"
    fake.write_text("proc /proc proc rw 0 0\n/dev/sda1 / ext4 rw 0 0\n"
                    "srv:/vol /mnt/my\\040data fuse.glusterfs rw 0 0\n")
    real_open = open
    monkeypatch.setattr("builtins.open",
                        lambda p, *a, **k: real_open(fake if p == "/proc/mounts" else p, *a, **k))
    assert ("/mnt/my data", "fuse.glusterfs") in mounts.table()
    assert mounts.fs_type("/mnt/my data/chunks/c1") == "fuse.glusterfs"
    assert mounts.fs_type("/home/x") == "ext4"
    assert mounts.is_mounted("/mnt/my data") and not mounts.is_mounted("/mnt/my")


def test_mount_settings_are_checked_in_one_place():
    assert DEFAULTS.fetch.per_node == 4 and DEFAULTS.fetch.batch == 16 and DEFAULTS.fetch.retries == 4
    assert DEFAULTS.cache_bytes == 256 << 20
    for bad, why in ((dict(per_node=0), "per-node"), (dict(batch=0), "batch"), (dict(retries=-1), "retries"),
                     (dict(static_bytes=2, cache_bytes=1), "static cache"), (dict(local_bytes=5), "local cache")):
        with pytest.raises(ConfigError, match=why):
            MountConfig.of(**bad)
    assert issubclass(ConfigError, UserError)


def test_the_cli_reports_a_user_error_once_with_its_exit_code(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2  # no index there
    err = capsys.readouterr().err
    assert err.startswith("fusefs info: ") and err.count("\n") == 1
    out = subprocess.run([sys.executable, "-m", "fusefs", "umount", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.startswith("fusefs umount: ") and "not mounted" in out.stderr


def test_the_benchmarks_cpu_meter_splits_the_cpu_by_who_spent_it():
    """bench_order's CpuMeter: a child that spins and ends is counted as a waited-for child,
    a live process named in a group as that group, and the machine as busy meanwhile."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "bench"))
    try:
        from common import CpuMeter
    finally:
        sys.path.pop(0)
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    other = subprocess.Popen([sys.executable, "-c", "import sys, time\ninput()\n" + spin
                              + "print('done', flush=True)\ntime.sleep(60)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with CpuMeter(other=[other.pid]) as meter:
            other.stdin.write("go\n")
            other.stdin.flush()
            subprocess.run([sys.executable, "-c", spin], check=True, timeout=300)
            assert other.stdout.readline() == "done\n"
    finally:
        other.kill()
        other.wait(timeout=60)
    assert meter.seconds["children"] >= 0.25
    assert meter.seconds["other"] >= 0.25
    assert 0.1 < meter.busy <= 1.0


_HEAP_STEPS = """
import ctypes, sys
from fusefs.memory import tune_malloc
libc = ctypes.CDLL("libc.so.6")
libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = [ctypes.c_ssize_t]
if sys.argv[1] == "tuned":
    tune_malloc()
kept, steps, brk = [], 0, libc.sbrk(0)
for _ in range(1000):  # 110 MB of ~110 KB samples, kept as the growing cache keeps them
    kept.append(bytes(110_000))
    if libc.sbrk(0) != brk:
        steps, brk = steps + 1, libc.sbrk(0)
print(steps)
"""


def test_the_daemons_heap_grows_in_few_steps():
    """tune_malloc, which every mount runs: samples come from the heap, and the heap grows
    64 MiB a brk while the cache grows (glibc's default pad of 128 KiB took a brk every few
    samples, under the GIL)."""
    steps = {how: int(subprocess.check_output([sys.executable, "-c", _HEAP_STEPS, how], timeout=300))
             for how in ("tuned", "default")}
    assert steps["tuned"] <= 3 and steps["default"] >= 100, steps


_ARENAS = """
import ctypes, os, re, sys, threading
from fusefs.mount import MountError, serve

class Store:
    def close(self):
        pass

try:  # (a mount point that is no folder: serve stops after starting its signal thread)
    serve(None, Store(), os.path.join(sys.argv[1], "no-such-folder"))
except MountError:
    pass
t = threading.Thread(target=lambda: [bytes(200_000) for _ in range(10)])  # (a fetch thread)
t.start()
t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
path = os.path.join(sys.argv[1], "malloc_info")
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(fp))
libc.fclose(ctypes.c_void_p(fp))
print(len(re.findall("<heap nr=", open(path).read())), [t.name for t in threading.enumerate()])
"""


def test_the_daemon_allocates_from_one_malloc_arena(tmp_path):
    """serve() sets glibc's malloc up (tune_malloc: one arena) before it starts any thread: a
    thread that allocates before that gets an arena of its own, and the fetch threads made
    later share the two (samples then freed on the loop leave holes in both: 402 MB in the
    second arena at ImageNet's count). Here serve starts its signal thread and stops at a
    mount point that is no folder; a thread that allocates after it finds one arena."""
    out = subprocess.check_output([sys.executable, "-c", _ARENAS, str(tmp_path)], text=True, timeout=300)
    heaps, threads = out.split(" ", 1)
    assert "fusefs-signals" in threads and int(heaps) == 1, out


def test_every_subprocess_call_and_wait_in_the_tests_has_a_timeout():
    """Nothing the tests start can hang them: every subprocess.run / check_output and every
    process wait() in tests/ and scripts/testkit/ names a timeout (shorter than pytest's), or
    waits within a trio deadline (`with trio.fail_after(...)`)."""
    import ast
    import glob
    from conftest import REPO
    missing = []
    for path in glob.glob(f"{REPO}/tests/*.py") + glob.glob(f"{REPO}/scripts/testkit/*.py"):
        tree = ast.parse(open(path).read())
        bounded = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.With, ast.AsyncWith))
                   and any(ast.unparse(item.context_expr).startswith("trio.fail_after(") for item in node.items)
                   for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or {"timeout", None} & {k.arg for k in node.keywords} \
                    or id(node) in bounded:
                continue
            name = ast.unparse(node.func)
            waits = isinstance(node.func, ast.Attribute) and node.func.attr == "wait" and not node.args
            if name in ("subprocess.run", "subprocess.check_output", "subprocess.call") or (
                    # (key.data: a process that has exited, its status; pending: a fetch's
                    # trio wait, cancelled by run_epoch's deadline)
                    waits and name not in ("key.data.wait", "pending.wait")):
                missing.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {name}")
    assert not missing, "\n".join(missing)


def test_the_fast_paths_thread_limit_is_the_c_sides():
    """One number, two languages: MountConfig's limit on --fast-threads is _fastpath.h's
    FUSEFS_MAX_THREADS (the C side's arrays hold as many threads)."""
    import re
    from conftest import REPO
    from fusefs.config import MAX_FAST_THREADS
    header = open(os.path.join(REPO, "fusefs", "_fastpath.h")).read()
    assert int(re.search(r"#define FUSEFS_MAX_THREADS (\d+)", header).group(1)) == MAX_FAST_THREADS


def test_no_test_module_imports_another():
    """Helpers several test modules share live in conftest.py or scripts/testkit: a test
    module imported by another runs its module-level code twice and hides who owns what."""
    import ast
    import pathlib
    here = pathlib.Path(__file__).parent
    modules = {p.stem for p in here.glob("test_*.py")}
    found = []
    for path in here.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in modules]
    assert found == []


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="makes a user (CI runs as root)")
def test_accounts_a_killed_run_left_are_removed_by_the_next(monkeypatch, tmp_path):
    """The attacker fixture records each account, with its run's pid, before it makes it; a
    run killed before its teardown leaves the record, and a process of the account's still
    running (which would make userdel fail). The next run removes the account, that process
    first; what a run still alive recorded stays. (The list here is the test's own.)"""
    import os
    import pwd
    import conftest
    monkeypatch.setattr(conftest, "MADE_ACCOUNTS", str(tmp_path / "made" / "accounts"))
    name, other = "fusefs-leftover", "fusefs-other-run"
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=60)  # (the killed run: a pid no longer alive)
    alive = subprocess.Popen(["sleep", "600"])  # (another run, still going)
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True, timeout=60)
    left = None
    try:
        os.makedirs(os.path.dirname(conftest.MADE_ACCOUNTS), mode=0o700, exist_ok=True)
        with open(conftest.MADE_ACCOUNTS, "w") as f:
            f.write(f"userdel {name} {dead.pid}\nuserdel {other} {alive.pid}\n")
        left = subprocess.Popen(["setpriv", f"--reuid={pwd.getpwnam(name).pw_uid}", "--clear-groups",
                                 "sh", "-c", "echo running; exec sleep 600"], stdout=subprocess.PIPE)
        assert left.stdout.readline() == b"running\n"  # (as the account now: setpriv has switched)
        conftest._remove_made()  # (what the next run does when it starts)
        with pytest.raises(KeyError):
            pwd.getpwnam(name)
        assert left.wait(timeout=60) != 0  # (killed)
        with open(conftest.MADE_ACCOUNTS) as f:
            assert f.read() == f"userdel {other} {alive.pid}\n"
        alive.kill()
        alive.wait(timeout=60)
        conftest._remove_made()  # (the other run has ended: its line goes, and the list)
        assert not os.path.exists(conftest.MADE_ACCOUNTS)
    finally:
        for p in (alive, left):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=60)
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


def test_the_runtime_folder_is_the_environments_when_set(monkeypatch, tmp_path):
    """FUSEFS_RUNTIME_DIR moves a daemon's log and control socket (the tests set it for
    the whole run: nothing of theirs is left in /run/fusefs)."""
    import os
    from fusefs import runtime
    monkeypatch.setenv(runtime.RUNTIME_ENV, str(tmp_path))
    assert os.path.dirname(runtime.runtime_path("/data/x", ".sock")) == str(tmp_path)
    monkeypatch.setenv(runtime.RUNTIME_ENV, "relative/not/taken")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    want = "/run/fusefs" if os.geteuid() == 0 else os.path.expanduser("~/.cache/fusefs")
    assert os.path.dirname(runtime.default_log_path("/data/x")) == want


def _module_imports(folder, relative: bool) -> dict:
    """module -> the modules of the same folder it imports (at any depth, lazy ones too):
    relative imports (a package) or plain ones of a sibling's name (scripts that run with
    their folder on sys.path)."""
    import ast
    import pathlib
    names = {p.stem for p in pathlib.Path(folder).glob("*.py")}
    graph = {}
    for path in pathlib.Path(folder).glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level == 1) == relative and (relative or node.module):
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.Import) and not relative:
                deps |= {a.name.split(".")[0] for a in node.names}
        graph[path.stem] = deps & names
    return graph


def _assert_no_cycle(graph: dict) -> None:
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != "open", " -> ".join(stack + [m, d])
            if d not in state:
                visit(d, stack + [m])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_fusefs_modules_import_one_another_without_a_loop():
    """The modules of fusefs/ (imports at any depth, lazy ones too) form no cycle: each can
    be read knowing only the modules below it."""
    import pathlib
    _assert_no_cycle(_module_imports(pathlib.Path(__file__).parent.parent / "fusefs", relative=True))


def test_the_scripts_modules_import_one_another_without_a_loop():
    """Nor do the scripts of one folder (workloads, benchmarks, the test kit), which import
    their siblings by name: what two share lives in a module of its own."""
    import pathlib
    scripts = pathlib.Path(__file__).parent.parent / "scripts"
    for folder in ("workloads", "bench", "testkit"):
        graph = _module_imports(scripts / folder, relative=False)
        assert graph, folder
        _assert_no_cycle(graph)
    assert "nets" in _module_imports(scripts / "workloads", relative=False)["train_hybrid"]


def test_fusermount_that_does_not_end_is_killed_and_reported(monkeypatch, tmp_path):
    """fusefs's fusermount3 call has a timeout: one that hangs (a stuck unmount) is killed
    and comes back as a failure saying so, instead of hanging the daemon's exit or
    `fusefs umount`; a missing fusermount3 is a failure too, not an exception."""
    import os
    from fusefs.mounts import fusermount
    fake = tmp_path / "fusermount3"
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    r = fusermount(str(tmp_path / "mnt"), lazy=True, timeout=0.2)
    assert r.returncode != 0 and "did not end within 0.2 s" in r.stderr
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    r = fusermount(str(tmp_path / "mnt"))
    assert r.returncode != 0 and "fusermount3" in r.stderr


def test_paths_relative_to_the_mount_are_the_mounts_not_the_working_directorys(tmp_path, monkeypatch):
    """client.paths_to_ids (write_order's): a relative path names a file of the mount, from
    wherever the caller runs; an absolute one is taken as it is; a stranger is a KeyError."""
    from fusefs import client
    mnt = tmp_path / "mnt"
    (mnt / ".fusefs").mkdir(parents=True)
    (mnt / ".fusefs" / "ids").write_bytes(b"cat/a.jpg\0dog/b.jpg\0")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "cat").mkdir(parents=True)
    monkeypatch.chdir(elsewhere)  # (a cat/a.jpg here too: not the mount's)
    assert client.paths_to_ids(["dog/b.jpg", "cat/a.jpg", mnt / "dog" / "b.jpg"], str(mnt)).tolist() == [1, 0, 1]
    with pytest.raises(KeyError, match="not a file of the fusefs mount"):
        client.paths_to_ids(["cat/none.jpg"], str(mnt))
