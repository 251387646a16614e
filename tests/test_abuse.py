"""What another user of a shared node can do to a root daemon (issue 45): each attack is
made as that user would make it (what they own is owned by `nobody`), and each test
asserts that the attack fails and that the daemon serves on."""
import os
import pwd
import stat
import threading

import pytest

from fusefs import order as orderfmt

from conftest import (CONTROLLERS, TRY, as_attacker, as_root, attack, make_core, resident_bytes_of,
                      serves_on)

OTHER = pwd.getpwnam("nobody").pw_uid  # a user other than the daemon's


HUGE_ORDERS = """
import os, socket, sys
target = os.readlink(os.path.join(sys.argv[1], '.fusefs', 'control'))
answers, held = [], []
for _ in range(3):  # (each declares 256 MiB)
    s = socket.socket(socket.AF_UNIX)
    s.connect(target)
    s.sendall(b'order 0 %d\\n' % ((256 << 20) - 1))
    answers.append(s.recv(100).decode().strip())
    held.append(s)
print(*answers)
"""


def test_a_huge_order_costs_the_daemon_no_memory(tricky_mount):
    """(One write at offset 256 MiB - 1 of an order file cost the daemon 256 MB, before.)"""
    import subprocess
    import sys
    _, mnt, proc, _ = tricky_mount
    before = resident_bytes_of(proc.pid)
    r = subprocess.run([sys.executable, "-c", HUGE_ORDERS, mnt], capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.split() == ["too", "large"] * 3, r.stderr
    assert resident_bytes_of(proc.pid) - before < 16 << 20
    with open(os.path.join(mnt, "root file.txt"), "rb") as f:
        assert f.read() == b"at the root\n"  # serves on


# ---- logs ------------------------------------------------------------------------------
def test_a_background_log_is_neither_in_tmp_nor_reached_through_a_symlink(tmp_path, monkeypatch):
    from fusefs import runtime
    assert not runtime.default_log_path("/mnt/data").startswith("/tmp")
    assert runtime.default_log_path("/a/data") != runtime.default_log_path("/b/data")
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    link = tmp_path / "log"
    link.symlink_to(victim)
    with pytest.raises(runtime.RuntimeFolderError, match="symbolic link"):
        runtime.open_log(str(link))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(runtime.RuntimeFolderError, match="not a regular file"):
        runtime.open_log(str(tmp_path / "fifo"))
    assert victim.read_text() == "root's file\n"
    fd = runtime.open_log(str(tmp_path / "new.log"))
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "new.log").st_mode) == 0o600


# ---- the metrics server ----------------------------------------------------------------------
def test_idle_connections_get_no_more_threads_than_the_bound_and_scrapes_go_on(tricky, monkeypatch):
    """50 connections that send nothing: past MAX_CONNECTIONS each new one makes the oldest
    go, so at most MAX_CONNECTIONS threads serve them; a scrape is answered at once (it makes
    the oldest idle one go); the watchdog closes the rest REQUEST_S after their accept."""
    import socket
    import urllib.request
    from fusefs import metrics
    monkeypatch.setattr(metrics, "REQUEST_S", 1.0)
    stats = make_core(tricky[1]).statistics()
    calls = []
    server = metrics.serve_http(lambda: calls.append(1) or stats, 0, every=3600)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        urllib.request.urlopen(url, timeout=30).read()
        threads = threading.active_count()
        idle = []
        for _ in range(50):
            idle.append(socket.create_connection(("127.0.0.1", server.server_port)))
            idle[-1].settimeout(30)
            assert threading.active_count() - threads <= metrics.MAX_CONNECTIONS
        for s in idle[:-metrics.MAX_CONNECTIONS]:  # (made to go by those after them)
            assert s.recv(1) == b""
        assert b"fusefs_opens_total" in urllib.request.urlopen(url, timeout=30).read()
        for s in idle[-metrics.MAX_CONNECTIONS:]:  # (closed by the watchdog)
            assert s.recv(1) == b""
        for s in idle:
            s.close()
        assert len(calls) == 1  # (rendered once: every=3600)
    finally:
        server.shutdown()
        server.server_close()


SET_ORDER = """
def set_order(ctl, data):
    import socket
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.readlink(os.path.join(ctl, 'control')))
    try:
        s.sendall(b'order 1 %d\\n' % len(data) + data)
    except OSError:
        pass
    return s.recv(100).decode().strip()
"""


@as_root
def test_another_user_reads_samples_and_stats_but_not_paths_orders_or_sets_orders(attacker, shared_mount):
    mnt, _, files = shared_mount
    ctl = os.path.join(mnt, ".fusefs")
    code = TRY + SET_ORDER + """
ctl = sys.argv[1]
read = lambda name: open(os.path.join(ctl, name), 'rb').read()
write = lambda name: open(os.path.join(ctl, name), 'wb').close()
sample = os.path.join(sys.argv[2], 'cat', 'img 004.jpg')
print(attempt(read, 'stats'), attempt(read, 'ids'), attempt(read, 'order'), attempt(write, 'order.1'),
      attempt(lambda: open(sample, 'rb').read()), attempt(lambda: open(sample, 'r+b')),
      set_order(ctl, bytes.fromhex(sys.argv[3])))
"""
    order = orderfmt.encode([2, 0, 1], epoch=7).hex()
    # (before: ids 0444)
    assert attack(attacker, code, ctl, mnt, order) == "ok EACCES EACCES EROFS ok EROFS denied"
    # a member of the control group may read the paths and set orders
    assert attack(attacker, code, ctl, mnt, order, controls=True) == "ok ok ok EROFS ok EROFS ok"
    from fusefs.client import mount_stats
    assert mount_stats(mnt)["plans"]["1"]["epoch"] == 7
    serves_on(mnt, files)


@as_root
def test_a_control_group_member_cannot_make_orders_cost_memory(attacker, shared_mount):
    mnt, proc, files = shared_mount
    before = resident_bytes_of(proc.pid)
    assert attack(attacker, HUGE_ORDERS, mnt, controls=True).split() == ["too", "large"] * 3
    assert resident_bytes_of(proc.pid) - before < 16 << 20  # (3 x 256 MiB before)
    serves_on(mnt, files)


CONCURRENT_ORDERS = """
import os, socket, struct, sys, threading
target = os.readlink(os.path.join(sys.argv[1], '.fusefs', 'control'))
n = int(sys.argv[2])
data = struct.pack('<8sIIQQ', b'FUSEFSOR', 1, 0, 0, n) + bytes(4 * n)  # (n entries of sample 0)
answers = []

def one():
    s = socket.socket(socket.AF_UNIX)
    s.connect(target)
    try:
        s.sendall(b'order 1 %d\\n' % len(data) + data)
    except OSError:
        pass
    answers.append(s.recv(200).decode().split(' ')[0].strip())
    s.close()
for _ in range(int(sys.argv[3])):
    threads = [threading.Thread(target=one) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print(' '.join(sorted(set(answers))))
"""


def _peak_and_resident(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        got = {line.split(":")[0]: int(line.split()[1]) << 10 for line in f if line.startswith(("VmHWM", "VmRSS"))}
    return got["VmHWM"], got["VmRSS"]


@as_root
@pytest.mark.parametrize("sender", ["control group member", "root"])
def test_orders_refused_past_the_order_memory_cost_no_more_than_it(attacker, tricky, shared_folder, sender):
    """The issue's attack: rounds of four concurrent 1M-entry orders from a control-group
    member, each refused past --order-memory (its plan would hold 24 MiB of an 8 MiB
    budget). What they cost before they are refused counts against the order memory: the
    daemon's peak stays within fresh + cache budget + order memory + 5%, and what stays
    resident after them within 5% of that (before, 48 -> 422 MiB, 331 MiB staying). From
    root too (issue 87 item 9: root's requests skipped the room's check, 5.4 MB over)."""
    import subprocess
    from testkit.mounts import running_mount
    mnt = os.path.join(shared_folder, "mnt")
    cache, order_memory = 4 << 20, 8 << 20
    with running_mount(tricky[1], mnt, "--cache-size", "4MiB", "--order-memory", "8MiB", "-o", "allow_other",
                       "--control-group", CONTROLLERS) as (proc, _):
        serves_on(mnt, tricky[2])
        _, fresh = _peak_and_resident(proc.pid)
        if sender == "root":
            answers = subprocess.run(["/usr/bin/python3", "-c", CONCURRENT_ORDERS, mnt, str(1 << 20), "3"],
                                     capture_output=True, text=True, timeout=300, check=True).stdout.split()
        else:
            answers = attack(attacker, CONCURRENT_ORDERS, mnt, 1 << 20, 3, controls=True).split()
        peak, resident = _peak_and_resident(proc.pid)
        assert "refused" in answers and not set(answers) - {"refused", "busy"}, answers
        bound = fresh + cache + order_memory
        assert peak <= 1.05 * bound, (fresh, peak)
        assert resident - fresh <= 0.05 * bound, (fresh, resident)
        serves_on(mnt, tricky[2])

def _released(mnt, count: str) -> None:
    """Wait until the stats' count of open handles is 0: the kernel sends the releases after
    the closes, in the background."""
    from fusefs.client import mount_stats
    for _ in range(600):
        if mount_stats(mnt)[count] == 0:
            return
        threading.Event().wait(0.05)
    assert mount_stats(mnt)[count] == 0


HOLD = """
import os, sys
mnt = sys.argv[1]
paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(mnt) for f in fs if os.path.getsize(os.path.join(d, f)) >= 70000)
fds = [os.open(paths[k % len(paths)], os.O_RDONLY | os.O_DIRECT) for k in range(800)]
for off in (0, 1):
    for fd in fds:
        os.pread(fd, 1, off)
print('held', flush=True)
sys.stdin.readline()
"""


@as_root
def test_handles_another_user_holds_open_keep_the_daemon_within_its_cap(attacker, shared_mount):
    """800 handles held open by another user, each read a byte at a time (O_DIRECT: each read
    reaches the daemon): 240 MB of samples, before, kept for them beside a 1 MiB budget."""
    import subprocess
    from fusefs.client import mount_stats
    from fusefs.handles import HELD_MIN
    mnt, proc, files = shared_mount
    before = resident_bytes_of(proc.pid)
    p = as_attacker(attacker, HOLD, mnt, stdin=subprocess.PIPE)
    try:
        assert p.stdout.readline() == "held\n", p.stderr.read() if p.poll() is not None else ""
        stats = mount_stats(mnt)
        assert stats["open_handles"] >= 800 and 0 < stats["held_bytes"] <= HELD_MIN
        assert resident_bytes_of(proc.pid) - before < HELD_MIN + (24 << 20)
    finally:
        p.communicate("\n", timeout=60)
    _released(mnt, "open_handles")
    assert mount_stats(mnt)["held_bytes"] == 0
    serves_on(mnt, files)


HAMMER = """
import os, sys, time
path = os.path.join(sys.argv[1], '.fusefs', 'stats')
texts = set()
t = time.monotonic()
for _ in range(3000):
    with open(path, 'rb') as f:
        texts.add(f.read())
print(len(texts), time.monotonic() - t)
"""


@as_root
def test_another_user_opening_the_stats_in_a_loop_gets_them_rendered_at_most_every_quarter_second(
        attacker, shared_mount):
    from fusefs.control import RENDER_EVERY
    mnt, _, files = shared_mount
    texts, seconds = attack(attacker, HAMMER, mnt).split()
    assert int(texts) <= float(seconds) / RENDER_EVERY + 2  # (3,000 renders on the loop before)
    serves_on(mnt, files)


HOLD_CONTROL = """
import errno, os, resource, sys
mnt, want = sys.argv[1], int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
each = max(64, min(hard, 1 << 20) - 64)  # (opens one process may hold: several hold them)
path = os.path.join(mnt, '.fusefs', 'chunks')
said_r, said_w = os.pipe()
go_r, go_w = os.pipe()  # (its end: this process's exit)
for k in range(-(-want // each)):
    if os.fork() == 0:
        os.close(go_w)
        fds, refused = [], 0
        for _ in range(min(each, want - k * each)):
            try:
                fds.append(os.open(path, os.O_RDONLY))
            except OSError as e:
                if e.errno != errno.ENFILE:
                    raise
                refused += 1
        os.write(said_w, b'%d %d,' % (len(fds), refused))
        os.read(go_r, 1)
        os._exit(0)
said = b''
while said.count(b',') < -(-want // each):
    said += os.read(said_r, 100)
got = [x.split() for x in said.decode().split(',') if x]
print(sum(int(g[0]) for g in got), sum(int(g[1]) for g in got), flush=True)
sys.stdin.readline()
"""


@as_root
def test_another_user_holding_control_files_open_grows_the_daemon_by_a_bounded_amount(attacker, shared_mount):
    """Issue 87 item 2: another user holds 20,000 opens of `.fusefs/chunks` (before, each
    kept its own copy of the chunk table, and a 2,000-file daemon went from 44 to 203 MB).
    They get UNTRUSTED_HANDLES opens, the rest ENFILE; the daemon stays within fresh +
    cache budget + order memory + 5% while they are held and after, and serves on."""
    import subprocess
    from fusefs.client import mount_stats
    from fusefs.control import UNTRUSTED_HANDLES
    mnt, proc, files = shared_mount
    stats = mount_stats(mnt)
    fresh = resident_bytes_of(proc.pid)
    bound = fresh + stats["cache_budget"] + stats["order_budget"]
    p = as_attacker(attacker, HOLD_CONTROL, mnt, 20_000, stdin=subprocess.PIPE)
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.poll() is not None else ""
        held, refused = map(int, line.split())
        assert (held, refused) == (UNTRUSTED_HANDLES, 20_000 - UNTRUSTED_HANDLES)
        assert mount_stats(mnt)["control_untrusted_handles"] == UNTRUSTED_HANDLES
        assert resident_bytes_of(proc.pid) <= 1.05 * bound, (fresh, resident_bytes_of(proc.pid))
        serves_on(mnt, files)
    finally:
        p.communicate("\n", timeout=120)
    _released(mnt, "control_untrusted_handles")
    assert resident_bytes_of(proc.pid) <= 1.05 * bound
    assert attack(attacker, "import os, sys; print(len(open(os.path.join(sys.argv[1], '.fusefs', 'chunks'), "
                  "'rb').read()))", mnt) == str(4 * len([v for v in files.values() if v is not None]))


SIGNALLED_READS = """
import os, signal, sys
signal.signal(signal.SIGALRM, lambda *a: None)
signal.setitimer(signal.ITIMER_REAL, 0.00005, 0.00005)
paths = [os.path.join(d, f) for d, _, fs in os.walk(sys.argv[1]) for f in fs]
bad = 0
for path in paths * int(sys.argv[2]):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        want = os.path.getsize(path)
        got = bytearray()
        while len(got) < want:
            part = os.pread(fd, 1 << 16, len(got))
            if not part:
                break
            got += part
        bad += len(got) != want
    finally:
        os.close(fd)
signal.setitimer(signal.ITIMER_REAL, 0)
print(bad)
"""


@as_root
def test_a_reader_that_signals_itself_gets_right_bytes_and_its_interrupts_go_where_they_belong(
        attacker, shared_mount):
    """A reader that signals itself every 50 us: interrupts of requests the fast path
    answered are taken there (libfuse would keep them on a list until the loop's next
    request: issue 45, item 10), the others go to the loop, which answers an interrupted
    read EINTR (the reader's read is made again); every read comes out right and the daemon
    serves on."""
    from fusefs.client import mount_stats

    def interrupts():
        stats = mount_stats(mnt)
        return stats["fast_path_requests"]["interrupt"] + stats["interrupts_to_loop"]
    mnt, proc, files = shared_mount
    for _ in range(100):  # (an interrupt needs a signal while a request waits: a race)
        assert attack(attacker, SIGNALLED_READS, mnt, 10) == "0"
        if interrupts():
            break
    assert interrupts() > 0
    serves_on(mnt, files)


# -- the local tier, where the other user may have made the folder (/dev/shm, /tmp)
@as_root
def test_a_local_cache_folder_another_user_made_is_refused_with_one_line(attacker, tricky, shared_folder):
    from conftest import refused_mount
    shared = os.path.join(shared_folder, "shm")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)  # (as /dev/shm)
    victim = os.path.join(shared_folder, "victim")
    with open(victim, "w") as f:
        f.write("root's file\n")
    os.chmod(victim, 0o600)
    theirs = os.path.join(shared, "cache")
    code = "import os, sys\nos.mkdir(sys.argv[1])\nos.symlink(sys.argv[2], os.path.join(sys.argv[1], 'lock'))\nprint('made')"
    assert attack(attacker, code, theirs, victim) == "made"
    mnt = os.path.join(shared_folder, "mnt")
    os.mkdir(mnt)
    r = refused_mount(tricky[1], mnt, "--local-cache", theirs, "-o", "allow_other", mnt=mnt)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert theirs in r.stderr and "owned by uid" in r.stderr, r.stderr
    assert open(victim).read() == "root's file\n"  # (truncated to the daemon's pid before)


@as_root
def test_another_user_cannot_read_the_local_cache(attacker, tricky, shared_folder):
    from testkit.mounts import running_mount
    mnt, cache = os.path.join(shared_folder, "mnt"), os.path.join(shared_folder, "cache")
    with running_mount(tricky[1], mnt, "--local-cache", cache, "-o", "allow_other"):
        serves_on(mnt, tricky[2])  # (fills the tier)
    files = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
    assert len(files) > 1
    code = TRY + "print(*sorted({attempt(lambda p=p: open(p, 'rb').read()) for p in sys.argv[1:]}))"
    assert attack(attacker, code, cache, *files) == "EACCES"  # (0644 in 0755 folders before)


@as_root
def test_a_symlink_another_user_plants_at_the_old_log_path_is_not_followed(attacker, tricky, shared_folder):
    """The background log was /tmp/fusefs-<uid>-<name>.log, opened following symlinks."""
    import subprocess
    from conftest import fusefs_cmd
    from testkit.mounts import stop_mount
    victim = os.path.join(shared_folder, "victim")
    with open(victim, "w") as f:
        f.write("root's file\n")
    os.chmod(victim, 0o600)
    mnt = os.path.join(shared_folder, os.path.basename(shared_folder))  # (a name no run had)
    os.mkdir(mnt)
    planted = f"/tmp/fusefs-0-{os.path.basename(mnt)}.log"
    code = "import os, sys\nos.symlink(sys.argv[2], sys.argv[1])\nprint('planted')"
    assert attack(attacker, code, planted, victim) == "planted"
    try:
        r = subprocess.run(fusefs_cmd("mount", "--background", tricky[1], mnt, "-o", "bogus_option"),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        r = subprocess.run(fusefs_cmd("mount", "--background", tricky[1], mnt), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        serves_on(mnt, tricky[2])
    finally:
        stop_mount(mnt)
        os.unlink(planted)
    assert open(victim).read() == "root's file\n"


# ---- the mount point ------------------------------------------------------------------------
LINK_MOUNT_POINT = """
import os, sys
os.symlink(sys.argv[2], os.path.join(sys.argv[1], 'mp'))
"""


def test_a_mount_point_another_user_swaps_for_a_link_is_refused_not_followed(attacker, tricky,
                                                                               shared_folder):
    """The issue's attack: root mounts at a path inside a folder a user can write to, and the
    user has made the mount point a link to root's own 0700 folder. The mount is refused,
    saying so, and nothing is mounted over root's folder."""
    from fusefs.mounts import is_mounted
    from conftest import refused_mount
    uid, gid, _ = attacker
    victim = os.path.join(shared_folder, "emptyroot")
    os.mkdir(victim, 0o700)
    upar = os.path.join(shared_folder, "upar")
    os.mkdir(upar)
    os.chown(upar, uid, gid)
    attack(attacker, LINK_MOUNT_POINT, upar, victim)
    mp = os.path.join(upar, "mp")
    r = refused_mount(tricky[1], mp, "-o", "allow_other", mnt=victim)
    assert r.returncode != 0 and "symbolic link" in r.stderr, r.stderr
    assert not is_mounted(victim) and not is_mounted(mp)
