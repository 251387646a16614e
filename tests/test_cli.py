"""The command line as a user of other FUSE mount tools expects it (issue 46): a background
mount returns once the daemon serves or with that run's own error, a non-empty mount point
is refused, every user error is one line and an exit code, /proc/mounts names what is
mounted, and a refused order says why."""
import os
import subprocess

import pytest

from fusefs.mounts import is_mounted
from testkit.mounts import running_mount

from conftest import fusefs_cmd

EXIT_USER, EXIT_SYSTEM = 2, 1  # (documented in README: "Exit codes")


def _run(*args, timeout=120):
    return subprocess.run(fusefs_cmd(*args), capture_output=True, text=True, timeout=timeout)


def _one_error_line(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and all(w in lines[-1] for w in words), r.stderr


def _no_zombies():
    """No child of this process is left defunct."""
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = open(f"/proc/{pid}/stat").read().split()
            except OSError:
                continue
            assert not (stat[3] == me and stat[2] == "Z"), f"defunct child {pid}"


def test_a_background_mount_reports_success_only_once_it_serves(tricky, tmp_path):
    _, dst, files = tricky
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "bg.log"
    r = _run("mount", "--background", "--log", log, dst, mnt)
    try:
        assert r.returncode == 0 and "mounted at" in r.stdout, r.stderr
        assert (mnt / "root file.txt").read_bytes() == files["root file.txt"]
        # a second mount on the same point fails, with one line of its own
        r = _run("mount", "--background", "--log", log, dst, mnt)
        _one_error_line(r, EXIT_USER, "already mounted")
        with open("/proc/mounts") as f:  # what is mounted, and by whom
            line = next(line for line in f if line.split()[1] == str(mnt))
        assert line.split()[0] == os.path.abspath(dst) and line.split()[2] == "fuse.fusefs"
        assert line.split()[3].split(",")[0] == "ro"  # (orders come over the control socket)
        r = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", str(mnt)], capture_output=True, text=True, timeout=300)
        assert r.stdout.split()[:2] == [os.path.abspath(dst), "fuse.fusefs"] and r.stdout.split()[2].startswith("ro,")
    finally:
        _run("umount", mnt)
    assert not is_mounted(mnt)
    _no_zombies()


@pytest.mark.parametrize("case", ["a file", "missing", "bad option", "unknown fuse option", "not empty"])
def test_a_failed_background_mount_prints_its_own_error_and_fails(tricky, tmp_path, case):
    _, dst, _ = tricky
    mnt = tmp_path / "mnt"
    log = tmp_path / "bg.log"
    log.write_text("an older run's error: Traceback (most recent call last)\n")
    args, words = [], []
    if case == "a file":
        mnt.write_text("x")
        words = ["not a folder"]
    elif case == "missing":
        words = ["not a folder"]
    else:
        mnt.mkdir()
        if case == "bad option":
            args, words = ["-o", "cache_size=abc"], ["not a size"]
        elif case == "unknown fuse option":
            args, words = ["-o", "bogus_opt"], ["bogus_opt"]
        else:
            (mnt / "keep.txt").write_text("mine\n")
            words = ["not empty", "nonempty"]
    try:
        r = _run("mount", "--background", "--log", log, dst, mnt, *args)
    finally:  # (a regression that mounted leaves nothing behind)
        if is_mounted(mnt):
            _run("umount", mnt)
    _one_error_line(r, EXIT_USER, *words)
    assert "older run" not in r.stderr  # (this run's lines only)
    assert not is_mounted(mnt)
    _no_zombies()


def test_nonempty_mounts_over_files(tricky, tmp_path):
    _, dst, files = tricky
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (mnt / "keep.txt").write_text("mine\n")
    with running_mount(dst, mnt, "-o", "nonempty", "-f"):
        assert (mnt / "root file.txt").read_bytes() == files["root file.txt"]
    assert (mnt / "keep.txt").read_text() == "mine\n"


@pytest.mark.parametrize("args,code,words", [
    (["pack", "{src}", "/proc/x"], EXIT_SYSTEM, ["/proc/x"]),
    (["stats", "/tmp"], EXIT_USER, ["not inside a fusefs mount"]),
    (["stats", "/tmp", "--watch"], EXIT_USER, ["not inside a fusefs mount"]),
    (["umount", "{tmp}"], EXIT_USER, ["not mounted"]),
    (["pack", "{tmp}/none", "{tmp}/p"], EXIT_USER, ["not a folder"]),
    (["order", "{tmp}", "{tmp}/none"], EXIT_SYSTEM, ["none"]),
    (["info", "{tmp}/none"], EXIT_USER, ["no index"]),
    (["verify", "{tmp}/none"], EXIT_USER, ["no index"]),
    (["mount", "{tmp}/none", "{tmp}"], EXIT_USER, ["no index"]),
    (["mount", "{dst}", "{tmp}/m", "-o", "cache_size=abc"], EXIT_USER, ["not a size"]),
    (["mount", "{dst}", "{tmp}/m", "-o", "per_node"], EXIT_USER, ["needs a value"]),
])
def test_user_errors_are_one_line_and_an_exit_code(tricky, tmp_path, args, code, words):
    src, dst, _ = tricky
    (tmp_path / "m").mkdir()
    args = [a.format(src=src, dst=dst, tmp=tmp_path) for a in args]
    r = _run(*args)
    _one_error_line(r, code, *words)


def test_a_refused_order_says_why(tricky_mount):
    from fusefs.client import OrderRefused, write_order
    _, mnt, _, _ = tricky_mount
    with pytest.raises(OrderRefused, match="unknown sample id 99999"):
        write_order(mnt, [0, 99999])
    write_order(mnt, [0, 1])  # (a good one is taken)


def test_sizes_print_in_iec_units_and_parse_in_both(tricky, tmp_path):
    import re
    from fusefs.cli import parse_size
    src, _, _ = tricky
    r = _run("pack", src, tmp_path / "p", "--quiet")
    assert r.returncode == 0, r.stderr
    assert re.search(r"files, [0-9.]+ (B|KiB|MiB) into .*\([0-9.]+ (B|KiB|MiB|GiB)/s\)", r.stdout), r.stdout
    assert not re.search(r"\d ?[kMG]B\b", r.stdout), r.stdout
    assert parse_size("2MiB") == 2 << 20 and parse_size("2MB") == 2_000_000 and parse_size("1.5GiB") == 3 << 29


def test_fusefs_order_hands_a_mount_an_order_from_a_file_or_stdin(tricky, tmp_path):
    """What `cat order > MNT/.fusefs/order` did before the mount was read-only."""
    from fusefs import order as orderfmt
    from fusefs.client import mount_stats
    mnt = tmp_path / "mnt"
    good = tmp_path / "good.order"
    good.write_bytes(orderfmt.encode([2, 0, 1], epoch=5))
    with running_mount(tricky[1], mnt):
        r = _run("order", mnt, good, "--rank", "3")
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert mount_stats(str(mnt))["plans"]["3"]["epoch"] == 5
        r = subprocess.run(fusefs_cmd("order", mnt / "cat"), input=orderfmt.encode([1], epoch=6),
                           capture_output=True, timeout=60)  # (stdin; a path inside the mount)
        assert r.returncode == 0 and mount_stats(str(mnt))["plans"]["0"]["epoch"] == 6, r.stderr
        bad = tmp_path / "bad.order"
        bad.write_bytes(orderfmt.encode([0, 99999]))
        _one_error_line(_run("order", mnt, bad), EXIT_USER, "unknown sample id 99999", "previous one stays")
        _one_error_line(_run("order", mnt, good, "--rank", "64"), EXIT_USER, "rank")
        _one_error_line(_run("order", mnt, tmp_path / "missing"), EXIT_SYSTEM, "missing")
        _one_error_line(_run("order", tmp_path, good), EXIT_USER, "not inside a fusefs mount")
        assert mount_stats(str(mnt))["plans"]["3"]["epoch"] == 5  # (the refused ones changed nothing)


def test_fusefs_order_takes_a_text_list_of_paths_or_ids(tricky, tmp_path):
    """A text list (one sample per line: relative or absolute paths, or ids), as a DALI or
    FFCV user would write it; refused with the line named, the previous order in force."""
    from fusefs.client import mount_ids, mount_stats
    from fusefs import order as orderfmt
    mnt = tmp_path / "mnt"
    with running_mount(tricky[1], mnt):
        table = mount_ids(str(mnt))
        names = sorted(table)[:3]
        text = tmp_path / "paths.txt"
        text.write_bytes(b"\n".join([names[2], b"./" + names[0], os.fsencode(str(mnt)) + b"/" + names[1]])
                         + b"\r\n\n")
        r = _run("order", mnt, text, "--epoch", "4", "--rank", "2")
        assert r.returncode == 0 and r.stderr == "", r.stderr
        current = orderfmt.parse((mnt / ".fusefs" / "order.2").read_bytes(), len(table))
        assert current.epoch == 4 and current.ids.tolist() == [table[names[i]] for i in (2, 0, 1)]
        r = subprocess.run(fusefs_cmd("order", mnt), input=b"2\n0\n1\n", capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert orderfmt.parse((mnt / ".fusefs" / "order").read_bytes(), len(table)).ids.tolist() == [2, 0, 1]
        bad = tmp_path / "bad.txt"
        bad.write_bytes(names[0] + b"\nno/such/file.jpg\n")
        _one_error_line(_run("order", mnt, bad), EXIT_USER, "line 2", "no/such/file.jpg")
        bad.write_bytes(b"0\n99999\n")
        _one_error_line(_run("order", mnt, bad), EXIT_USER, "unknown sample id 99999")
        bad.write_bytes(b"0\x001\n")
        _one_error_line(_run("order", mnt, bad), EXIT_USER, "neither a fusefs order nor a text list")
        good = tmp_path / "good.order"
        good.write_bytes(orderfmt.encode([1], epoch=9))
        _one_error_line(_run("order", mnt, good, "--epoch", "3"), EXIT_USER, "--epoch is for a text list")
        plans = mount_stats(str(mnt))["plans"]
        assert plans["0"]["length"] == 3 and plans["2"]["epoch"] == 4  # (the refused changed nothing)


def test_fusefs_stats_prints_a_short_table_for_people(tricky, tmp_path):
    """Without --json: a line per subject (IEC sizes), one per storage node and one per
    rank's order, figures that agree with --json's."""
    import json
    import re
    from fusefs.client import mount_stats, write_order
    mnt = tmp_path / "mnt"
    with running_mount(tricky[1], mnt):
        write_order(str(mnt), [2, 0, 1], epoch=4, rank=3)
        for name in ("cat/img 000.jpg", "cat/img 001.jpg"):
            (mnt / name).read_bytes()
        r = _run("stats", mnt)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        lines = r.stdout.splitlines()
        heads = [line.split("  ")[0].strip() for line in lines]
        assert heads[:7] == ["mount", "dataset", "cache", "opens", "reads", "backend", "daemon"], heads
        stats = mount_stats(str(mnt))
        assert [h for h in heads if h.startswith("node ")] == [f"node {n}" for n in sorted(stats["nodes"])]
        assert "rank 3" in heads and re.search(r"rank 3 +epoch 4: [0-3] of 3 read", r.stdout), r.stdout
        assert f"{stats['samples']:,} samples" in r.stdout
        assert not re.search(r"\d{7,}", r.stdout), r.stdout  # (no raw byte counts: IEC units)
        assert re.search(r"\d\.\d (KiB|MiB|GiB)", r.stdout)
        assert json.loads(_run("stats", mnt, "--json").stdout)["samples"] == stats["samples"]


def test_global_options_are_taken_after_the_command_too(tricky, tmp_path):
    """-v and --log-level before or after the command's name; a mount at --log-level
    warning logs no info line, one at -v its debug lines."""
    _, dst, _ = tricky
    for args in (["-v", "info", dst], ["info", dst, "-v"], ["info", "--log-level", "error", dst]):
        r = _run(*args)
        assert r.returncode == 0, (args, r.stderr)
    r = _run("info", dst, "--log-level", "loud")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    quiet, loud = tmp_path / "quiet", tmp_path / "loud"
    with running_mount(dst, quiet, "--log-level", "warning") as (_, log):
        (quiet / "cat" / "img 000.jpg").read_bytes()
    assert " INFO " not in open(log).read()
    with running_mount(dst, loud, "-v") as (_, log):
        (loud / "cat" / "img 000.jpg").read_bytes()
    assert " INFO " in open(log).read()


@pytest.mark.parametrize("command", ["info", "verify", "mount"])
def test_a_crafted_index_that_passes_its_checksums_is_refused_by_every_command(tricky, tmp_path, command):
    """An index edited by hand with its checksums made valid again (two samples of a chunk
    overlapping): `fusefs info`, `verify` and `mount` each refuse it, exit 2, one line
    naming the reason, no traceback, nothing mounted."""
    import shutil
    from conftest import craft_index
    from fusefs.index import INDEX_NAME
    dst = tmp_path / "dst"
    shutil.copytree(tricky[1], dst)
    raw = (dst / INDEX_NAME).read_bytes()
    (dst / INDEX_NAME).write_bytes(craft_index(raw, lambda k, a: a.__setitem__(1, a[0]) if k == "offset" else None))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    args = [command, dst] + ([mnt] if command == "mount" else [])
    _one_error_line(_run(*args), EXIT_USER, "overlap")
    assert not is_mounted(mnt)


def test_a_log_file_is_rotated_at_its_size_and_the_daemon_goes_on(tricky, tmp_path):
    """A background mount with --log-max-size 4KiB, given refused orders (a log line each)
    until its log passed the size twice: the log was renamed to LOG.1 and begun anew (one
    older file kept), neither holds much more than the size, the last refusal is in the
    current one, and the mount serves on."""
    from fusefs.client import OrderRefused, write_order
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "bg.log"
    r = _run("mount", "--background", "--log-file", log, "--log-max-size", "4KiB", tricky[1], mnt)
    assert r.returncode == 0, r.stderr
    try:
        for k in range(80):
            with pytest.raises(OrderRefused):
                write_order(str(mnt), [0, 10 ** 6 + k])
        old = tmp_path / "bg.log.1"
        assert old.exists() and log.stat().st_size <= 4096 + 512 and old.stat().st_size <= 4096 + 512
        assert f"unknown sample id {10 ** 6 + 79}" in log.read_text()
        assert f"unknown sample id {10 ** 6 + 79}" not in old.read_text()
        assert (mnt / "root file.txt").read_bytes() == tricky[2]["root file.txt"]
    finally:
        _run("umount", mnt)
    assert not is_mounted(mnt)


def test_a_foreground_mount_logs_to_its_log_file(tricky, tmp_path):
    """--log-file in the foreground: the daemon's lines go to the file (stderr, journald's,
    is the default), rotated as a background mount's."""
    log = tmp_path / "fg.log"
    with running_mount(tricky[1], tmp_path / "mnt", "--log-file", log) as (_, stderr_log):
        (tmp_path / "mnt" / "root file.txt").read_bytes()
        assert "mounted" in log.read_text()
    assert "mounted" not in open(stderr_log).read()
