"""End to end on a real FUSE mount, read with plain open/read from several processes."""
import errno
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from fusefs.index import INDEX_NAME, Index
from fusefs.kernel_view import DROP_SHARE, DROP_WINDOW

from testkit.mounts import is_mounted, resolve, running_mount, stop_mount
from trainer.hints import mount_stats

from conftest import REPO, as_root, attack, flip_byte, fusefs_cmd, read_tree, refused_mount, rss_within


def test_every_file_is_byte_identical_with_same_metadata(tricky_mount):
    src, mnt, _, _ = tricky_mount
    assert read_tree(mnt) == read_tree(src)
    for dirpath, dirnames, filenames in os.walk(src):
        for name in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), src)
            a, b = os.stat(os.path.join(src, rel)), os.stat(os.path.join(mnt, rel))
            assert stat.S_IFMT(a.st_mode) == stat.S_IFMT(b.st_mode), rel
            assert stat.S_IMODE(a.st_mode) == stat.S_IMODE(b.st_mode), rel
            assert a.st_mtime_ns == b.st_mtime_ns, rel
            if stat.S_ISREG(a.st_mode):
                assert a.st_size == b.st_size, rel


def _stat_fields(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_size, st.st_blocks,
            st.st_blksize, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)


def test_names_looked_up_in_c_have_the_attributes_the_loop_gives(tricky, tmp_path):
    """The fast path's thread answers the lookup of every dataset file's name from the
    index's arrays (fusefs/_fastpath.h: a binary search of the folder's run of files): the
    same inode and attributes as the loop's lookup gives (--no-fast-path); folders, the
    control folder, its files and names that are not there go to the loop."""
    _, dst, files = tricky
    rels = sorted(k for k in files if not k.endswith("/"))
    folders = sorted({os.path.dirname(r) for r in rels} | {k.rstrip("/") for k in files if k.endswith("/")})
    folders = sorted({"/".join(f.split("/")[:i + 1]) for f in folders if f for i in range(f.count("/") + 1)})
    absent = ["cat/img 00", "cat/img 000.jpgx", "cat/img", "cat/\xff", "aaa", "zzz/x", "root file.tx"]
    seen, looped = {}, {}
    for flags in ([], ["--no-fast-path"]):
        mnt = str(tmp_path / ("mnt" + "".join(flags)))
        with running_mount(dst, mnt, *flags):  # (no listing: each stat below is a lookup)
            before = mount_stats(mnt)
            seen[bool(flags)] = {r: _stat_fields(os.stat(os.path.join(mnt, r))) for r in rels + folders}
            for name in absent:
                with pytest.raises(FileNotFoundError):
                    os.stat(os.path.join(mnt, name))
            after = mount_stats(mnt)
            looped[bool(flags)] = after["requests"]["lookup"] - before["requests"]["lookup"]
            fast = after["fast_path_requests"]
            if flags:
                assert fast is None
            else:
                in_c = fast["lookup"] - before["fast_path_requests"]["lookup"]
                assert in_c == len(rels), in_c  # every file's, nothing else
    # (the requests counts include the thread's): as many lookups either way
    assert looped[False] == looped[True] >= len(rels) + len(folders) + len(absent)
    assert {r: seen[False][r][5] for r in rels} == {r: len(files[r]) for r in rels}
    assert seen[False] == seen[True]


@pytest.mark.parametrize("fast", [True, False])
def test_uid_gid_umask_and_modes_are_what_stat_shows(tricky, tmp_path, fast):
    """--uid/--gid/--umask (as -o options, as fstab gives them) and --file-mode/--dir-mode:
    every file and folder shows them, whether the fast path's C or the loop answers its
    lookup, and listing (readdirplus) agrees; nothing else changes."""
    src, dst, files = tricky
    rels = sorted(k for k in files if not k.endswith("/"))
    folders = sorted({os.path.dirname(r) for r in rels if "/" in r})
    extra = [] if fast else ["--no-fast-path"]
    cases = [(["-o", "uid=4321,gid=5432,umask=027"], lambda m: m & ~0o027, lambda m: m & ~0o027),
             (["--file-mode", "0444", "--dir-mode", "0751", "--umask", "0001"], lambda m: 0o444,
              lambda m: 0o750)]
    for k, (args, file_bits, dir_bits) in enumerate(cases):
        mnt = str(tmp_path / f"mnt{k}")
        with running_mount(dst, mnt, *args, *extra):
            for r in rels:
                got, want = os.stat(os.path.join(mnt, r)), os.stat(os.path.join(src, r))
                assert stat.S_IMODE(got.st_mode) == file_bits(stat.S_IMODE(want.st_mode)), r
                assert got.st_size == want.st_size and got.st_mtime_ns == want.st_mtime_ns
                assert (got.st_uid, got.st_gid) == ((4321, 5432) if k == 0 else (os.getuid(), os.getgid()))
            for d in folders:
                got, want = os.stat(os.path.join(mnt, d)), os.stat(os.path.join(src, d))
                assert stat.S_IMODE(got.st_mode) == dir_bits(stat.S_IMODE(want.st_mode)), d
            listed = {e.name: stat.S_IMODE(e.stat().st_mode) for e in os.scandir(os.path.join(mnt, "cat"))}
            assert listed and all(m == file_bits(stat.S_IMODE(os.stat(os.path.join(src, "cat", n)).st_mode))
                                  for n, m in listed.items() if os.path.isfile(os.path.join(src, "cat", n)))
            assert read_tree(mnt) == read_tree(src)


def test_bad_ownership_and_mode_options_are_refused_in_one_line(tricky, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for args, words in ((["--umask", "0899"], "not an octal mode"), (["-o", "file_mode=4755"], "file_mode"),
                        (["--uid", "no-such-user-here"], "no such user")):
        r = subprocess.run(fusefs_cmd("mount", tricky[1], str(mnt), *args), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not is_mounted(str(mnt))


def _random_preads(args):
    src, mnt, rels, seed = args
    rng = random.Random(seed)
    checked = 0
    for _ in range(300):
        rel = rng.choice(rels)
        size_total = os.path.getsize(os.path.join(src, rel))
        off = rng.randrange(0, size_total + 10)
        size = rng.choice([1, 3, 511, 4096, 65537, 200_000])
        with open(os.path.join(src, rel), "rb") as f:
            want = os.pread(f.fileno(), size, off)
        with open(os.path.join(mnt, rel), "rb") as f:
            got = os.pread(f.fileno(), size, off)
        assert got == want, (rel, off, size)
        checked += 1
    return checked


def test_partial_unaligned_concurrent_reads_from_several_processes(tricky_mount):
    src, mnt, _, _ = tricky_mount
    rels = [k for k, v in read_tree(src).items() if v is not None]
    with ProcessPoolExecutor(4) as pool:
        done = list(pool.map(_random_preads, [(src, mnt, rels, s) for s in range(4)]))
    assert done == [300] * 4


def test_writes_are_refused_and_missing_paths_are_enoent(tricky_mount):
    src, mnt, _, _ = tricky_mount
    target = os.path.join(mnt, "cat", "img 001.jpg")
    def write(path, how):
        with open(path, how) as f:
            f.write(b"x")

    attempts = [
        lambda: open(os.path.join(mnt, "new.txt"), "wb"),
        lambda: write(target, "r+b"),
        lambda: write(target, "ab"),
        lambda: os.rename(target, target + ".x"),
        lambda: os.chmod(target, 0o777),
        lambda: os.unlink(target),
        lambda: os.mkdir(os.path.join(mnt, "newdir")),
        lambda: os.rmdir(os.path.join(mnt, "empty class")),
        lambda: os.setxattr(target, "user.x", b"1"),
        lambda: os.symlink("x", os.path.join(mnt, "link")),
        lambda: os.truncate(target, 0),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS
    for missing in ["nope", "cat/nope.jpg", "nope/deeper"]:
        with pytest.raises(FileNotFoundError):
            os.stat(os.path.join(mnt, missing))
    assert open(target, "rb").read() == open(os.path.join(src, "cat", "img 001.jpg"), "rb").read()


def test_control_namespace_hidden_and_stats(tricky_mount):
    src, mnt, _, _ = tricky_mount
    assert ".fusefs" not in os.listdir(mnt)
    assert os.path.isdir(os.path.join(mnt, ".fusefs"))
    open(os.path.join(mnt, "cat", "img 002.jpg"), "rb").read()
    stats = mount_stats(mnt)
    assert stats["opens"] >= 1 and stats["bytes_served"] > 0  # (read by the miss engine or the loop)
    assert stats["backend_reads"] + stats.get("engine_reads", 0) >= 1
    assert stats["loop_tasks"] >= 1  # (tasks of pyfuse3's request loop started)
    out = subprocess.run(fusefs_cmd("stats", mnt, "--json"), capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0 and json.loads(out.stdout)["opens"] >= stats["opens"]


def test_corrupt_chunk_gives_eio_and_a_log_line_and_the_rest_is_served(tricky, tmp_path):
    src, dst, files = tricky
    copy = tmp_path / "dst"
    shutil.copytree(dst, copy)
    ix = Index.load(str(copy / INDEX_NAME))
    victim = resolve(ix, "zz/img 003.jpg")[1]
    assert int(ix.size[victim]) > 10
    chunk_path = copy / ix.chunks[int(ix.chunk[victim])].path
    flip_byte(chunk_path, int(ix.offset[victim]) + 5)
    mnt = tmp_path / "mnt"
    with running_mount(str(copy), mnt) as (proc, log):
        for _ in range(2):
            with pytest.raises(OSError) as e:
                open(mnt / "zz" / "img 003.jpg", "rb").read()
            assert e.value.errno == errno.EIO
        assert read_tree(mnt / "cat") == read_tree(os.path.join(src, "cat"))
        assert proc.poll() is None
        text = open(log).read()
        assert str(chunk_path) in text and "zz/img 003.jpg" in text and "checksum" in text


def test_misses_wait_in_the_fast_path_and_a_corrupt_ones_read_goes_to_the_loop(tricky, tmp_path):
    """Without an order every first read of a sample is a miss. A read of a whole sample
    waits in the fast path's C thread, the loop hears of it as an event, and the fetch's
    worker thread answers it with the sample's exact bytes (misses_parked), no request
    reaching the loop. A corrupt sample's read waits there too, then goes to the loop, which
    answers EIO (parked_to_loop)."""
    src, dst, files = tricky
    copy = tmp_path / "dst"
    shutil.copytree(dst, copy)
    ix = Index.load(str(copy / INDEX_NAME))
    name = next(rel for rel, blob in sorted(files.items())  # (a whole read of it: one request)
                if rel.startswith("cat/") and blob is not None and 4096 <= len(blob) <= 70_000)
    victim = resolve(ix, name)[1]
    flip_byte(copy / ix.chunks[int(ix.chunk[victim])].path, int(ix.offset[victim]) + 5)
    mnt = tmp_path / "mnt"
    with running_mount(str(copy), mnt) as (proc, log):
        before = mount_stats(str(mnt))
        with pytest.raises(OSError) as e:
            open(mnt / name, "rb").read()
        assert e.value.errno == errno.EIO
        assert mount_stats(str(mnt))["parked_to_loop"] - before["parked_to_loop"] == 1
        assert read_tree(mnt / "dog") == read_tree(os.path.join(src, "dog"))
        s = mount_stats(str(mnt))
        # (not every one: a read that looks like a scan fetches the next samples along)
        assert s["misses_parked"] - before["misses_parked"] >= 2, s
        assert s["reads_parked"] - before["reads_parked"] >= s["misses_parked"] - before["misses_parked"]
        assert s["parked_to_loop"] - before["parked_to_loop"] == 1 and proc.poll() is None


def test_a_sample_up_to_a_mib_is_one_read_request_answered_in_the_fast_path(tricky, tmp_path):
    """Once the kernel has its INIT's answer, the daemon widens the kernel's read-ahead of
    the mount's files to what one FUSE read request carries and lets it keep more of them
    in flight (mount.widen_kernel_reads: 1 MiB and 64; the kernel's defaults are 128 KiB and
    12): a whole read of a sample of 300 KB is one request, which the fast path takes as a
    miss and answers, none reaching the loop, also with 16 readers at once. (At the defaults
    it took three, and the first, not a whole read, went to the loop.) With 16 readers, the
    reads look like a scan, so the loop fetches companions along with a miss and pushes them
    into the kernel: a reader of one whose push is under way finds some of its pages there and
    asks for the rest, a read that is not whole and goes to the loop (as many as were pushed,
    at most)."""
    from fusefs.mount import BACKGROUND, READAHEAD_KB
    from fusefs.mounts import device_of
    _, dst, files = tricky
    names = [rel for rel, blob in sorted(files.items()) if blob is not None and len(blob) >= 70_000]
    alone = [next(n for n in names if n.startswith(c) and len(files[n]) == 300_000) for c in ("cat/", "dog/")]
    together = [n for n in names if n not in alone]
    mnt = tmp_path / "mnt"
    with running_mount(dst, mnt) as (proc, log):
        mount_stats(str(mnt))  # (the INIT is answered: a request came after it)
        dev = device_of(str(mnt))
        for path, least in ((f"/sys/class/bdi/{dev}/read_ahead_kb", READAHEAD_KB),
                            (f"/sys/fs/fuse/connections/{dev.split(':')[1]}/max_background", BACKGROUND)):
            with open(path) as f:
                assert int(f.read()) >= least, path
        for group in ([[n] for n in alone], [together[i::16] for i in range(16)]):
            before = mount_stats(str(mnt))
            with ProcessPoolExecutor(len(group)) as pool:
                got = dict(kv for part in pool.map(_read_whole, [[str(mnt / n) for n in g] for g in group])
                           for kv in part)
            assert got == {str(mnt / n): files[n] for g in group for n in g}
            s = mount_stats(str(mnt))  # (its own reads, of a control file, are the loop's)
            fetched, pushed = sum(map(len, group)), s["pushed"] - before["pushed"]
            whole = s["fast_path_requests"]["read"] - before["fast_path_requests"].get("read", 0)
            assert fetched - (pushed if len(group) > 1 else 0) <= whole <= fetched, (whole, fetched, pushed)
            assert s["misses_parked"] + s["reads_parked"] > before["misses_parked"] + before["reads_parked"]
            assert s["parked_to_loop"] == before["parked_to_loop"] and proc.poll() is None


def _read_whole(paths: list[str]) -> list[tuple[str, bytes]]:
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append((p, f.read()))
    return out


@pytest.mark.parametrize("damage", ["no index", "truncated index", "missing chunk", "truncated chunk"])
def test_mount_refuses_a_damaged_dataset_naming_the_file(tricky, tmp_path, damage):
    dst = tmp_path / "dst"
    shutil.copytree(tricky[1], dst)
    ix = Index.load(str(dst / INDEX_NAME))
    named = dst / (INDEX_NAME if "index" in damage else ix.chunks[1].path)
    if damage.startswith("no") or damage.startswith("missing"):
        named.unlink()
    else:
        named.write_bytes(named.read_bytes()[:-10])
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = refused_mount(dst, mnt, mnt=mnt)
    assert r.returncode == 2
    assert str(named) in r.stderr
    assert not is_mounted(mnt)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGHUP", "umount"])
def test_clean_unmount(tricky, tmp_path, how):
    mnt = tmp_path / "mnt"
    with running_mount(tricky[1], mnt) as (proc, _):
        assert os.listdir(mnt)
        if how == "umount":
            r = subprocess.run(fusefs_cmd("umount", mnt), capture_output=True, text=True, cwd=REPO, timeout=300)
            assert r.returncode == 0, r.stderr
        else:
            proc.send_signal(getattr(signal, how))
        assert proc.wait(timeout=20) == 0
        assert not is_mounted(mnt)


def test_background_mount_and_umount(tricky, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "bg.log"
    try:
        r = subprocess.run(fusefs_cmd("mount", "--background", "--log", log, tricky[1], mnt),
                           capture_output=True, text=True, cwd=REPO, timeout=60)
        assert r.returncode == 0, r.stderr
        assert is_mounted(mnt) and "cat" in os.listdir(mnt)
        r = subprocess.run(fusefs_cmd("umount", mnt), capture_output=True, text=True, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 20
        while "unmounted" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "unmounted" in log.read_text()
    finally:
        stop_mount(mnt)
    assert not is_mounted(mnt)


def test_mount_t_fuse_fusefs_with_fstab_options_and_umount(tricky, tmp_path):
    """As an fstab line `DST MNT fuse.fusefs cache_size=1MiB,per_node=2,allow_other,_netdev,
    nofail,x-systemd.automount 0 0` mounts: mount(8) runs `fusefs DST MNT -o ...` through
    mount.fuse3 with the system's PATH (setup.sh links /usr/local/bin/fusefs) and waits for it."""
    src, dst, files = tricky
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = f"/tmp/fusefs-{os.getuid()}-mnt.log"
    try:
        r = subprocess.run(["mount", "-t", "fuse.fusefs", dst, str(mnt), "-o",
                            "cache_size=1MiB,per_node=2,no_kernel_cache,allow_other,_netdev,nofail,"
                            "x-systemd.automount"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr + (open(log).read()[-2000:] if os.path.exists(log) else "")
        assert read_tree(mnt) == read_tree(src)
        stats = mount_stats(str(mnt))
        assert stats["cache_budget"] == 1 << 20 and stats["pushed"] == 0  # the -o options took
        line = next(line for line in open("/proc/mounts") if f" {mnt} " in line)
        assert " fuse.fusefs " in line and "allow_other" in line
        r = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 20
        while is_mounted(mnt) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_mounted(mnt)
    finally:
        stop_mount(mnt)


def test_the_mount_helper_mounts_as_mount8_calls_it(tricky, tmp_path):
    """`mount.fuse.fusefs` (the entry point pip installs; an admin links it into /sbin,
    where mount(8) looks for `mount.fuse.fusefs` first) called as mount(8) calls a helper:
    DST MNT -o OPTS with the fstab line's options (nosuid,nodev among them), -n, -t. It
    mounts in the background; the mount is nosuid,nodev and takes fusefs's options. -f
    (fake) mounts nothing."""
    src, dst, _ = tricky
    helper = os.path.join(os.path.dirname(sys.executable), "mount.fuse.fusefs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    opts = "rw,nosuid,nodev,cache_size=1MiB,_netdev,x-systemd.automount"
    r = subprocess.run([helper, dst, str(mnt), "-f", "-o", opts], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not is_mounted(mnt), r.stderr
    try:
        r = subprocess.run([helper, dst, str(mnt), "-n", "-o", opts, "-t", "fuse.fusefs"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        line = next(line for line in open("/proc/mounts") if f" {mnt} " in line)
        assert " fuse.fusefs " in line and {"ro", "nosuid", "nodev"} <= set(line.split()[3].split(","))
        assert mount_stats(str(mnt))["cache_budget"] == 1 << 20
        assert read_tree(mnt) == read_tree(src)
    finally:
        stop_mount(mnt)
    r = subprocess.run([helper, dst, str(mnt), "-N", "/proc/1/ns/mnt"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not supported" in r.stderr and not is_mounted(mnt)


def test_dash_o_takes_every_mount_option_by_name():
    from fusefs.cli import apply_mount_options, build_parser
    a = build_parser().parse_args(["mount", "D", "M", "-o", "cache_size=10%,per-node=8,no_kernel_cache",
                                   "-o", "willneed=off,allow_other,metrics_port=9100,_netdev,x-systemd.automount,"
                                         "background"])
    apply_mount_options(a)
    assert (a.cache_size, a.per_node, a.kernel_cache, a.willneed, a.metrics_port, a.background) == \
        ("10%", 8, False, False, 9100, True)
    assert a.o == ["allow_other"]  # FUSE's own; mount(8)'s and systemd's dropped
    from fusefs.config import ConfigError
    for bad in ("per_node", "per_node=many"):
        a = build_parser().parse_args(["mount", "D", "M", "-o", bad])
        with pytest.raises(ConfigError, match="per_node"):
            apply_mount_options(a)


def test_version_and_help_name_every_default():
    r = subprocess.run(fusefs_cmd("--version"), capture_output=True, text=True, timeout=300)
    from fusefs import __version__
    assert r.returncode == 0 and r.stdout.startswith(f"fusefs {__version__} (Python ")
    r = subprocess.run(fusefs_cmd("mount", "--help"), capture_output=True, text=True, timeout=300)
    text = " ".join(r.stdout.split())
    for default in ("(default 256MiB)", "(default 4;", "(default 16;", "(default 300,", "(default on)",
                    "(default 127.0.0.1)"):
        assert default in text, default


@pytest.mark.parametrize("storm", ["SIGTERM", "SIGINT SIGHUP", "SIGHUP SIGTERM SIGINT"])
def test_signals_during_the_unmount_do_not_leave_a_dead_mount(tricky, tmp_path, storm):
    """A timeout that signals the owner's process group, then the parent-death signal:
    the daemon gets SIGTERM more than once, and one that came after the first (during the
    unmount) killed it half way and left a dead mount, or (a storm of them) ended in a
    RecursionError or a deadlock in trio's close. Here the signals come without pause, in
    turn, from the moment the mount is up until the daemon has ended: it unmounts and
    exits 0."""
    mnt = tmp_path / "mnt"
    kinds = [getattr(signal, name) for name in storm.split()]
    with running_mount(tricky[1], mnt) as (proc, log):
        sent = 0
        while proc.poll() is None:
            try:
                os.kill(proc.pid, kinds[sent % len(kinds)])
                sent += 1
            except ProcessLookupError:
                break
        assert proc.wait(timeout=30) == 0, open(log).read()[-2000:]
        assert not is_mounted(mnt)
        text = open(log).read()
        assert f"unmounted {mnt}" in text and sent > 1


def test_a_killed_owner_leaves_no_mount(tricky, tmp_path):
    """A benchmark or test killed with SIGKILL never runs its cleanup: the daemon it
    started must unmount by itself."""
    mnt = tmp_path / "mnt"
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]);"
              "from testkit.mounts import running_mount;"
              "cm = running_mount(sys.argv[2], sys.argv[3]); proc, _ = cm.__enter__();"
              "print(proc.pid, flush=True); time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", script, os.path.join(REPO, "scripts"), str(tricky[1]), str(mnt)],
                             stdout=subprocess.PIPE, text=True)
    try:
        daemon = int(owner.stdout.readline())
        assert is_mounted(mnt)
        owner.kill()
        owner.wait(timeout=60)
        deadline = time.monotonic() + 20
        while is_mounted(mnt) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_mounted(mnt)
        while os.path.exists(f"/proc/{daemon}") and time.monotonic() < deadline:
            try:  # (a zombie until reaped by init: its state is Z)
                if open(f"/proc/{daemon}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{daemon}") or \
            open(f"/proc/{daemon}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        owner.kill()
        stop_mount(mnt)


def run_bench(tmp_path, script: str, *args: str) -> tuple:
    """scripts/bench/SCRIPT end to end with args, its --out and --results under tmp_path:
    (the out folder, the JSON lines it appended)."""
    out, results = tmp_path / "out", tmp_path / "results.jsonl"
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench", script), *args,
                        "--out", str(out), "--results", str(results)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, [json.loads(line) for line in open(results)]


def test_bench_commit_times_every_ranks_commit_and_the_getattrs_meanwhile(tmp_path):
    """scripts/bench/bench_commit.py end to end at a tiny scale (testkit.synth.make_packed's
    set): one row with a commit time per rank, getattrs timed while they ran, and the orders
    held within the order budget; no mount left behind."""
    out, rows = run_bench(tmp_path, "bench_commit.py", "--samples", "20000", "--ranks", "3", "--rounds", "1")
    assert len(rows) == 1 and rows[0]["bench"] == "bench_commit" and len(rows[0]["commit_s"]) == 3
    assert rows[0]["order_entries"] == 2 * 20000  # (every sample in this epoch and the next)
    assert 0 < rows[0]["order_bytes"] <= rows[0]["order_budget"]
    assert not is_mounted(out / "mnt-20000")


def test_bench_ranks_reads_every_ranks_share_through_one_mount(tmp_path):
    """scripts/bench/bench_ranks.py end to end at a tiny scale: one row per cache size, every
    sample fetched at least once and every file read (two ranks, two readers each), its
    daemon's CPU and reads counted; no mount left behind."""
    out, rows = run_bench(tmp_path, "bench_ranks.py", "--files", "200", "--rounds", "1",
                          "--cache-size", "10%")
    assert [(r["bench"], r["ranks"], r["cache_size"]) for r in rows] == [("bench_ranks", 2, "10%")]
    r = rows[0]
    assert r["backend_samples"] >= 200 and r["requests"]["open"] >= 1.0  # (requests: a sample's)
    assert r["daemon_cpu_us_per_sample"] > 0 and 0 <= r["misses"] <= r["backend_samples"]
    assert not is_mounted(out / "mnt-200")


def test_bench_scale_drop_pages_finds_the_kernel_dropped_everything_in_a_hundred_misses(tmp_path):
    """scripts/bench/bench_scale.py --drop-pages end to end at a small scale (10,000 samples, a
    cache of a fifth of them): an epoch read first, then the measured one, whose page cache
    is dropped halfway; the daemon distrusts its pushes (kernel_drops) after about a tenth
    of kernel_view.DROP_WINDOW misses, not a tenth of the 5,000 samples opened before the
    drop, and every byte read is right (the benchmark checks each quarter's)."""
    out, rows = run_bench(tmp_path, "bench_scale.py", "--drop-pages", "--samples", "10000", "--cache-size", "6MiB")
    assert len(rows) == 1 and rows[0]["bench"] == "bench_scale_drop", rows
    row = rows[0]
    assert row["kernel_drops"] and 0 < row["quarters"][2]["misses"] <= 2 * DROP_SHARE * DROP_WINDOW, row
    assert not is_mounted(out / "mnt-10000")


def test_bench_scale_epochs_reads_epochs_in_a_row_on_one_mount(tmp_path):
    """scripts/bench/bench_scale.py --epochs end to end at a small scale (10,000 samples, a
    cache of a fifth of them): three epochs on one mount, every byte right (the benchmark
    checks each quarter's); the first fetches every sample once, the next ones almost none
    (the kernel holds what was pushed), and each epoch reports the daemon's memory."""
    out, rows = run_bench(tmp_path, "bench_scale.py", "--epochs", "3", "--samples", "10000", "--cache-size", "6MiB")
    assert len(rows) == 1 and rows[0]["bench"] == "bench_scale_epochs", rows
    epochs = rows[0]["epochs"]
    assert len(epochs) == 3 and epochs[0]["backend_samples"] == 10000, epochs
    assert all(e["backend_samples"] < 1000 for e in epochs[1:]), epochs
    assert all(0 < e["rss_mb"] <= e["rss_peak_mb"] <= rows[0]["rss_peak_mb"] for e in epochs), epochs
    assert rows[0]["backend_samples"] == sum(e["backend_samples"] for e in epochs)
    assert not is_mounted(out / "mnt-10000")


def test_bench_hotpath_runs_every_regime_and_paces_the_paced_one(tmp_path):
    """scripts/bench/bench_hotpath.py (the regression guard for fusefs/) end to end at a tiny
    scale: a row per regime with the daemon's CPU and requests per sample; a sample the
    kernel holds costs open, ioctl and release; the minimal daemons in pyfuse3 and in C
    answer the same requests; the paced readers keep to --pace; no mount left behind."""
    out, lines = run_bench(tmp_path, "bench_hotpath.py", "--files", "300", "--scale", "5000", "--rounds", "1",
                           "--pace", "600")
    rows = {row["regime"]: row for row in json.load(open(out / "bench_hotpath.json"))["rows"]}
    # --results: a line per row the table shows (the scale row's too), each under this benchmark
    # (pack's figures go to bench_pack.py's own results)
    assert sorted(x["regime"] for x in lines) == sorted(set(rows) - {"loose_cold", "loose_warm", "pack"})
    assert all(x["bench"] == "bench_hotpath" and x["commit"] and x["machine"] for x in lines)
    assert set(rows) == {"loose_cold", "loose_warm", "chunks_cold", "chunks", "kernel", "kernel_os",
                         "kernel_paced", "daemon", "handlers", "fetch_loop", "fetch_loop_missed",
                         "small_fill", "small_kernel",
                         "small_dropped", "small_dropped_16", "small_forgot", "small_missed", "minimal_read", "minimal_kernel", "minimal_paced",
                         "minimal_c_read", "minimal_c_kernel", "minimal_c_paced", "scale", "pack"}
    # the node's shape: 16 readers, every sample fetched again through a tenth cached
    assert rows["small_dropped_16"]["readers"] == 16 and rows["small_dropped_16"]["backend_samples"] > 0
    # the kernel's inodes dropped too (forgotten: every open looks its name up again)
    assert rows["small_forgot"]["backend_samples"] > 0 and rows["small_forgot"]["requests"]["lookup"] >= 0.99
    assert rows["small_dropped"]["requests"].get("lookup", 0) < 0.5
    # no order ever: every read a miss, fetched by the loop into the cache until it is full,
    # then by the miss engine (the loop also takes a miss whose sample follows one of the
    # last 64 missed: a fifth of a random order over 300 samples)
    unhinted = rows["small_missed"]
    assert unhinted["engine_misses"] > 0 and unhinted["backend_samples"] > 0, unhinted
    # `fusefs pack` of as many tiny files as the scale epoch reads
    pack = rows.pop("pack")
    assert pack["files"] == 5000 and pack["seconds"] > 0 and pack["peak_rss_mb"] > pack["index_mb"] > 0
    # the epoch at scale (here 5,000 tiny samples): every sample fetched once, the peak RSS known
    scale = rows.pop("scale")
    assert scale["samples"] == 5000 and scale["backend_samples"] == 5000 and scale["daemon_cpu_us_per_sample"] > 0
    assert scale["rss_peak_mb"] >= scale["rss_fresh_mb"] > 0
    # fusefs's own open and release handlers, in-process: a part of what `kernel` costs
    handlers = rows.pop("handlers")
    assert handlers["samples"] == 300 and len(handlers["passes_us_per_sample"]) == 3
    assert 0 < handlers["daemon_cpu_us_per_sample"] < rows["kernel"]["daemon_cpu_us_per_sample"]
    # the loop's own CPU per fetched sample, in-process (fetch_cost.py): every sample read
    loop = rows.pop("fetch_loop")
    assert loop["samples"] == 300 and len(loop["passes_us_per_sample"]) == 3, loop
    assert loop["daemon_cpu_us_per_sample"] > 0, loop
    assert all(loop["task_shares"][k] > 0 for k in ("deliveries", "read-ahead")), loop
    assert loop["task_shares"]["fetches"] == 0, loop  # (no task a batch; no retries here)
    # ... and without an order: every read a miss, each waiting in the fast path, not the loop
    missed = rows.pop("fetch_loop_missed")
    assert missed["samples"] == 300 and missed["daemon_cpu_us_per_sample"] > 0, missed
    # (a miss's read reaches the loop only where the sample it waits for is let go of meanwhile:
    # a sample served early that the cache does not keep; without the fast path's waits, all did)
    assert max(missed["loop_reads"] + loop["loop_reads"]) < 300 // 10, (loop, missed)
    for name, row in rows.items():
        assert row["samples"] == 300 and row["samples_per_s"] > 0, name
        if not name.startswith("loose"):
            assert row["daemon_cpu_us_per_sample"] > 0 and row["requests"]["open"] >= 0.99, name
    for name in ("chunks_cold", "chunks", "small_fill"):  # (the machine's CPU: readers' too)
        assert rows[name]["machine_cpu_us_per_sample"] > 0, name
    for name in ("kernel", "kernel_paced"):
        assert {"open", "ioctl", "release"} <= set(rows[name]["requests"])
        assert rows[name]["backend_samples"] == 0
    assert rows["kernel_os"]["requests"].get("ioctl", 0) < 0.05  # (the stats file's own)
    assert rows["chunks"]["backend_samples"] == 300
    # the C daemon answers the same requests as the pyfuse3 one (readdirplus: no lookups)
    for kind in ("read", "kernel", "paced"):
        assert set(rows[f"minimal_c_{kind}"]["requests"]) == set(rows[f"minimal_{kind}"]["requests"])
    for name in ("kernel_paced", "minimal_paced", "minimal_c_paced"):  # 300 files at 600 a second: 0.5 s at least
        assert rows[name]["samples_per_s"] <= 600 * 1.05, name
    assert not any(os.path.ismount(p) for p in out.iterdir())


@as_root
def test_a_refused_mount_says_what_to_do_for_a_user_who_is_not_root(attacker, shared_folder):
    """The reasons a user's mount is refused, asked as that user (fusefs.mounts needs only
    the standard library): a /dev/fuse they may not open names its mode and group and what
    an admin does; allow_other without user_allow_other in fuse.conf names the line; else
    the options."""
    dev = os.path.join(shared_folder, "fuse")
    conf = os.path.join(shared_folder, "fuse.conf")
    with open(dev, "w"):
        pass
    os.chmod(dev, 0o600)
    with open(conf, "w") as f:
        f.write("# user_allow_other\nmount_max = 1000\n")
    os.chmod(conf, 0o644)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from fusefs.mounts import why_fuse_refused as w; "
            "print(w(['allow_other'], dev=sys.argv[2], conf=sys.argv[3])); "
            "print(w(['allow_other'], dev='/dev/null', conf=sys.argv[3])); "
            "print(w(['bogus'], dev='/dev/null', conf=sys.argv[3]))")
    no_dev, no_allow, other = attack(attacker, code, REPO, dev, conf).splitlines()
    assert f"may not open {dev}" in no_dev and "mode 0600" in no_dev and "group root" in no_dev, no_dev
    # (at 0600 a group gives nothing, and group root is no fix anyway: 0666, or a fuse group)
    assert "adds you to group root" not in no_dev and "0666" in no_dev and 'GROUP="fuse"' in no_dev, no_dev
    assert "user_allow_other" in no_allow and conf in no_allow, no_allow
    assert "bogus" in other or "fusermount3" in other, other
    with open(conf, "w") as f:
        f.write("user_allow_other\n")
    assert "user_allow_other" not in attack(attacker, code, REPO, dev, conf).splitlines()[1]


def test_large_samples_keep_the_daemon_within_its_budgets(tmp_path):
    """Issue 87 item 9: 1 MiB samples and a 16 MiB budget. Reading through once left the
    daemon 12-15 MB over fresh + cache budget + order memory + 5% (freed heap pages that
    glibc keeps), and 120 part-read files held open another 8 MiB beyond the budget (the
    handles' minimum share). Now the bytes handles keep count against the cache budget
    (cache_outside), and the governor gives freed pages back past the bound."""
    import threading as th
    src = tmp_path / "src"
    for i in range(160):
        os.makedirs(src / f"c{i % 4}", exist_ok=True)
        (src / f"c{i % 4}" / f"f{i:03d}.bin").write_bytes(os.urandom(1 << 20))
    r = subprocess.run(fusefs_cmd("pack", "-q", src, tmp_path / "dst"), capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    mnt = tmp_path / "mnt"
    with running_mount(tmp_path / "dst", mnt, "--cache-size", "16MiB") as (proc, _):
        stats = mount_stats(str(mnt))
        bound = int(1.05 * stats["memory_bound"])
        assert stats["memory_bound"] >= stats["cache_budget"] + stats["order_budget"]
        paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(mnt) for f in fs)

        def read(ps):
            for p in ps:
                with open(p, "rb") as f:
                    while f.read(1 << 17):
                        pass
        readers = [th.Thread(target=read, args=(paths[k::4],)) for k in range(4)]
        [t.start() for t in readers]
        [t.join() for t in readers]
        assert rss_within(proc.pid, bound) <= bound
        fds = []
        try:
            for p in paths[:120]:
                fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
                os.pread(fds[-1], 4096, 0)  # (part-read: its handle keeps the sample)
            stats = mount_stats(str(mnt))
            assert 0 < stats["held_bytes"] == stats["cache_outside"]
            assert stats["cache_bytes"] + stats["cache_reserved"] + stats["cache_outside"] <= stats["cache_budget"]
            assert rss_within(proc.pid, bound) <= bound
        finally:
            for fd in fds:
                os.close(fd)
