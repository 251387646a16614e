"""The `fusefs` command: pack, mount, umount, info, verify, stats, order, run."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys

from .config import (CACHE_SIZE, DEFAULTS, STOP_SIGNALS, ConfigError, FastPathConfig, FetchConfig, FilesConfig,
                     LocalConfig, MetricsConfig, MountConfig, default_fast_threads)
from .errors import UserError
from .runtime import LOG_FILE_ENV, RotatingLog

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


def parse_size(text: str, whole: int | None = None) -> int:
    """'64MiB' -> bytes; '10%' -> that share of whole (e.g. the dataset's size)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[a-zA-Z]*)\s*", text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 10%)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if whole is None:
            raise ConfigError(f"{text!r}: a percentage is not allowed here")
        return int(whole * value / 100)
    if unit not in _UNITS:
        raise ConfigError(f"unknown unit in {text!r} (use B, KiB, MiB, GiB, TiB, or kB, MB, GB, TB "
                          "for powers of 1000)")
    return int(value * _UNITS[unit])


def _human(n: float) -> str:
    """Bytes in IEC units (KiB, MiB, GiB: powers of 1024), as every size fusefs prints."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def cmd_pack(a) -> int:
    from .pack import pack
    mode = None
    if a.mode is not None:
        try:
            mode = int(a.mode, 8)
        except ValueError:
            raise UserError(f"--mode {a.mode}: not an octal mode (e.g. 0640)") from None
    if a.in_place:
        from .tarindex import index_in_place
        r = index_in_place(a.src, a.dst, nodes=a.nodes, strict=a.strict, force=a.force,
                           progress=False if a.quiet else None, mode=mode)
        for path, why in r.skipped:
            print(f"skipped: {path}: {why}", file=sys.stderr)
        print(f"indexed {r.files} files, {_human(r.bytes)} in {r.chunks} tars in place in "
              f"{r.seconds:.1f} s ({_human(r.bytes / max(r.seconds, 1e-9))}/s){f'; {len(r.skipped)} skipped' if r.skipped else ''}")
        return 0
    r = pack(a.src, a.dst, chunk_bytes=None if a.chunk_count else parse_size(a.chunk_size),
             chunk_count=a.chunk_count, nodes=a.nodes, workers=a.workers, strict=a.strict,
             force=a.force, progress=False if a.quiet else None, mix_classes=a.mix_classes,
             follow_symlinks=a.follow_symlinks, mode=mode)
    for path, why in r.skipped:
        print(f"skipped: {path}: {why}", file=sys.stderr)
    print(f"packed {r.files} files, {_human(r.bytes)} into {r.chunks} chunks in {r.seconds:.1f} s "
          f"({_human(r.bytes / max(r.seconds, 1e-9))}/s){f'; {len(r.skipped)} skipped' if r.skipped else ''}")
    return 0


def _load(dst):
    from .index import INDEX_NAME, Index
    return Index.load(os.path.join(dst, INDEX_NAME))


def cmd_info(a) -> int:
    ix = _load(a.dst)
    info = {"samples": ix.n_files, "classes": len(ix.classes), "directories": ix.n_dirs,
            "chunks": len(ix.chunks), "bytes": ix.total_bytes, "nodes": len(ix.nodes),
            "chunks_per_node": ix.chunks_per_node()}
    if ix.in_place:
        info["in_place"] = ix.source  # (the chunks are the tars beneath it)
    if a.chunks:
        info["chunk_nodes"] = {c.path: ix.nodes[c.node] for c in ix.chunks}
    if a.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"samples:  {ix.n_files}\nclasses:  {len(ix.classes)}\ndirs:     {ix.n_dirs}\n"
          f"chunks:   {len(ix.chunks)}\nbytes:    {ix.total_bytes} ({_human(ix.total_bytes)})\n"
          f"nodes:    {len(ix.nodes)}")
    for name, count in info["chunks_per_node"].items():
        print(f"  {name}: {count} chunks")
    if ix.in_place:
        print(f"in place: the chunks are tars beneath {ix.source}")
    if a.chunks:
        for c in ix.chunks:
            print(f"{c.path}\t{ix.nodes[c.node]}\t{c.count} samples\t{c.size} bytes")
    return 0


def cmd_verify(a) -> int:
    from .store import verify
    ix = _load(a.dst)
    problems = verify(ix.data_root(a.dst), ix, progress=False if a.quiet else None)
    for p in problems:
        print(f"BAD: {p}")
    print(f"verified {ix.n_files} samples in {len(ix.chunks)} chunks: "
          f"{'all good' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


def parse_mode(text: str) -> int:
    """An octal permission mode within 0777 (umask, file and folder modes)."""
    try:
        value = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r}") from None
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"{text}: a mode within 0777 (no setuid, setgid or sticky bits)")
    return value


def _by_name_or_number(text: str | None, lookup, what: str) -> int | None:
    """lookup(name)'s number for a name, the number itself for digits; None for None."""
    if text is None:
        return None
    try:
        return lookup(text)
    except KeyError:
        if text.isdigit():
            return int(text)
        raise ConfigError(f"no such {what}: {text}") from None


def parse_user(text: str | None) -> int | None:
    """A user name or number, or None."""
    import pwd
    return _by_name_or_number(text, lambda name: pwd.getpwnam(name).pw_uid, "user")


def parse_group(text: str | None) -> int | None:
    """A group name or number, or None."""
    import grp
    return _by_name_or_number(text, lambda name: grp.getgrnam(name).gr_gid, "group")


def log_to_file(path: str, max_bytes: int, std: bool) -> None:
    """Every log line to the file at path from now on, rotated past max_bytes (runtime.
    RotatingLog); std: stdout and stderr are that file (a background daemon's)."""
    handler = RotatingLog(path, max_bytes, std=std)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)


def cmd_mount(a) -> int:
    from .mount import clear_dead_mount, missing_native, open_dataset, serve, start_background
    apply_mount_options(a)
    log_file = os.environ.pop(LOG_FILE_ENV, None)  # (set for the daemon of a background mount)
    if log_file or (a.log and not a.background):
        log_to_file(log_file or a.log, parse_size(a.log_max_size), std=bool(log_file))
    if a.background:  # (in the foreground, serve clears a dead mount itself)
        if clear_dead_mount(a.mnt):
            print(f"fusefs mount: {a.mnt} was a dead mount (its daemon had died): cleared it",
                  file=sys.stderr)
        argv = [x for x in a.argv if x not in ("--background", "-b")]
        return start_background(argv, a.mnt, a.log)
    for line in missing_native():
        logging.getLogger("fusefs").warning(line)
    fetch = fetch_config(a)
    index, store = open_dataset(a.dst, fetch, parse_group(a.gid))  # refuses a broken dataset before mounting
    serve(index, store, a.mnt, mount_config(a, index.total_bytes, fetch), options=a.o or [],
          nonempty=a.nonempty, source=a.dst)
    return 0


# What mount(8) and systemd put among the options for themselves: never for FUSE.
_MOUNT_ONLY = {"_netdev", "nofail", "noauto", "auto", "user", "users", "nouser", "owner", "group",
               "defaults", "rw"}
_FALSE = {"0", "no", "off", "false"}


def apply_mount_options(a) -> None:
    """`-o name=value,...`: every `fusefs mount` option by its long name (cache_size=10%,
    per_node=8, no_kernel_cache, kernel_cache=off, background), as mount(8) and fstab pass
    them; the rest are FUSE options (allow_other, ...), except what only mount(8) and systemd
    use (_netdev, nofail, noauto, x-systemd.*, ...), which is dropped."""
    actions = {opt[2:].replace("-", "_"): act for act in a.parser._actions
               for opt in act.option_strings if opt.startswith("--")}
    fuse = []
    for item in a.o or []:
        for opt in filter(None, item.split(",")):
            name, has_value, value = opt.partition("=")
            key = name.replace("-", "_")
            if key in _MOUNT_ONLY or key.startswith(("x-", "x_", "comment")):
                continue
            act = actions.get(key)
            if act is None or act.dest in ("o", "help"):
                fuse.append(opt)
            elif isinstance(act, argparse.BooleanOptionalAction) or act.nargs == 0:
                on = not key.startswith("no_") if not has_value else value.lower() not in _FALSE
                setattr(a, act.dest, on)
            elif not has_value:
                raise ConfigError(f"-o {name} needs a value ({name}=...)")
            else:
                try:
                    setattr(a, act.dest, act.type(value) if act.type else value)
                except (ValueError, argparse.ArgumentTypeError):
                    raise ConfigError(f"-o {opt}: not a valid value for {name}") from None
    a.o = [",".join(fuse)] if fuse else []


def fetch_config(a) -> FetchConfig:
    """How `fusefs mount`'s arguments read the storage nodes (checked before the dataset is
    opened with it)."""
    return FetchConfig(per_node=a.per_node, batch=a.batch, retries=a.retries, io_timeout=a.io_timeout,
                       willneed=a.willneed)


def mount_config(a, dataset_bytes: int, fetch: FetchConfig) -> MountConfig:
    """The MountConfig of `fusefs mount`'s arguments (sizes may be shares of the dataset),
    with fetch (fetch_config) as its fetch section."""
    if a.local_cache_size is not None and not a.local_cache:
        raise ConfigError("--local-cache-size needs --local-cache DIR")
    cache = parse_size(a.cache_size, whole=dataset_bytes)
    local_bytes = 0
    if a.local_cache:
        local_bytes = default_local_size(a.local_cache, dataset_bytes) \
            if a.local_cache_size is None else parse_size(a.local_cache_size, whole=dataset_bytes)
    return MountConfig(
        cache_bytes=cache, static_bytes=parse_size(a.static_cache, whole=cache),
        readahead=None if a.readahead is None else parse_size(a.readahead, whole=cache),
        order_bytes=None if a.order_memory is None else parse_size(a.order_memory, whole=cache),
        kernel_cache=a.kernel_cache, control_gid=parse_group(a.control_group), fetch=fetch,
        files=FilesConfig(uid=parse_user(a.uid), gid=parse_group(a.gid), umask=a.umask,
                          file_mode=a.file_mode, dir_mode=a.dir_mode),
        fast_path=FastPathConfig(enabled=a.fast_path, threads=a.fast_threads, miss_engine=a.miss_engine),
        local=LocalConfig(dir=a.local_cache, bytes=local_bytes),
        metrics=MetricsConfig(port=a.metrics_port, address=a.metrics_address))


def default_local_size(folder: str, dataset_bytes: int) -> int:
    """Without --local-cache-size: the whole dataset, or 90% of the space free where the
    folder is (or would be created), whichever is smaller."""
    probe = os.path.abspath(folder)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return min(dataset_bytes, int(st.f_bavail * st.f_frsize * 0.9))


def cmd_umount(a) -> int:
    from .mount import unmount
    unmount(a.mnt)
    return 0


def _read_stats(mnt: str) -> dict:
    from .client import find_mount, mount_stats
    return mount_stats(find_mount(mnt))


def _watch(mnt: str, interval: float) -> int:
    """One line per interval: rates since the last line and the cache state."""
    import time
    prev, t_prev = _read_stats(mnt), time.monotonic()
    # kern%: opens of samples the kernel page cache held (their reads never reach the
    # daemon); hit%: the daemon's reads answered from its cache
    print(f"{'opens/s':>8} {'MB/s':>7} {'kern%':>6} {'hit%':>6} {'waits':>6} {'miss':>6} {'backend MB/s':>12} "
          f"{'cache MB':>9} {'ahead':>6} {'evict':>6} {'cpu us/smp':>10} {'req/smp':>7}")
    while True:
        time.sleep(interval)
        cur, now = _read_stats(mnt), time.monotonic()
        dt = now - t_prev
        d = {k: cur[k] - prev[k] for k in ("opens", "opens_pushed", "bytes_served", "hits", "read_waits",
                                          "misses", "backend_bytes", "evictions", "cpu_s")}
        reqs = sum(cur["requests"].values()) - sum(prev["requests"].values())
        served = d["hits"] + d["read_waits"] + d["misses"]
        ahead = sum(p["ahead_ready"] for p in cur["plans"].values())
        # (per sample: "-" while nothing is opened, not this command's own polling over zero)
        cpu = f"{1e6 * d['cpu_s'] / d['opens']:10.0f}" if d["opens"] else f"{'-':>10}"
        req = f"{reqs / d['opens']:7.2f}" if d["opens"] else f"{'-':>7}"
        kern = f"{100 * d['opens_pushed'] / d['opens']:6.1f}" if d["opens"] else f"{'-':>6}"
        hit = f"{100 * d['hits'] / served:6.1f}" if served else f"{'-':>6}"
        print(f"{d['opens'] / dt:8.0f} {d['bytes_served'] / dt / 1e6:7.1f} {kern} {hit} "
              f"{d['read_waits']:6d} {d['misses']:6d} {d['backend_bytes'] / dt / 1e6:12.1f} "
              f"{cur['cache_bytes'] / 1e6:9.1f} {ahead:6d} {d['evictions']:6d} {cpu} {req}", flush=True)
        prev, t_prev = cur, now


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def human_stats(s: dict) -> str:
    """`fusefs stats MNT`: what a person asks of a mount, a line each (sizes in IEC units),
    then a line per storage node and per rank's order. `--json` gives every counter."""
    g = s.get
    opens = g("opens", 0) or 0
    kernel_opens = g("opens_pushed", 0) or 0
    served = (g("hits", 0) or 0) + (g("read_waits", 0) or 0) + (g("misses", 0) or 0)
    up = int(g("uptime_s", 0) or 0)
    rows = [("mount", f"up {up // 3600}h {up // 60 % 60:02d}m {up % 60:02d}s, {g('open_handles', 0)} files open"),
            ("dataset", f"{g('samples', 0):,} samples, {_human(g('dataset_bytes', 0))}"),
            ("cache", f"{_human(g('cache_bytes', 0))} of {_human(g('cache_budget', 0))} "
                      f"({g('cache_samples', 0):,} samples; peak {_human(g('cache_peak', 0))}), "
                      f"{g('evictions', 0):,} evictions"),
            ("opens", f"{opens:,}, of samples the kernel held {kernel_opens:,} ({_share(kernel_opens, opens)})"),
            ("reads", f"{served:,} reached the daemon: {_share(g('hits', 0), served)} from its cache, "
                      f"{g('read_waits', 0):,} waited for a fetch, {g('misses', 0):,} missed; "
                      f"{_human(g('bytes_served', 0))} served"),
            ("backend", f"{_human(g('backend_bytes', 0))} in {g('backend_requests', 0):,} requests "
                        f"({g('backend_samples', 0):,} samples), {g('backend_errors', 0):,} errors, "
                        f"{g('backend_retries', 0):,} retries; EIO {g('eio', 0):,}"),
            ("daemon", f"CPU {g('cpu_s', 0):.1f} s" + (f", {g('cpu_us_per_sample')} us per opened sample"
                                                        if g("cpu_us_per_sample") is not None else ""))]
    for name, node in sorted((g("nodes") or {}).items()):
        rows.append((f"node {name}", f"{'DOWN' if node.get('down') else 'up'}, {node.get('requests', 0):,} "
                                     f"requests, {_human(node.get('bytes', 0))}, {node.get('errors', 0):,} errors, "
                                     f"{node.get('inflight', 0)} in flight"))
    for rank, plan in sorted((g("plans") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append((f"rank {rank}", f"epoch {plan['epoch']}: {plan['cursor']:,} of {plan['length']:,} read "
                                     f"({_share(plan['cursor'], plan['length'])}), {plan['ahead_ready']:,} of the "
                                     f"next {plan['ahead_planned']:,} ready"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_stats(a) -> int:
    from .client import find_mount
    try:
        find_mount(a.mnt)
    except FileNotFoundError as e:  # (not a mount: the user's to fix)
        raise UserError(str(e)) from None
    try:
        if a.watch:
            return _watch(a.mnt, a.interval)
        stats = _read_stats(a.mnt)
    except KeyboardInterrupt:
        return 0
    except OSError as e:
        print(f"fusefs stats: {a.mnt}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=1, sort_keys=True) if a.json else human_stats(stats))
    return 0


def cmd_order(a) -> int:
    """Hand the mount an order read from a file (or stdin): what `cat > MNT/.fusefs/order`
    did before the mount was read-only."""
    from . import order as orderfmt
    from .client import OrderRefused, find_mount, ids_from_text, send_order
    if a.file == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(a.file, "rb") as f:
            data = f.read()
    try:
        mount = find_mount(a.mnt)
        if not data.startswith(orderfmt.MAGIC):  # a text list of paths or ids
            data = orderfmt.encode(ids_from_text(data, mount), epoch=a.epoch or 0)
        elif a.epoch is not None:
            raise UserError("--epoch is for a text list (a binary order carries its epoch)")
        send_order(mount, data, a.rank)
    except OrderRefused as e:
        print(f"fusefs order: {e.strerror}", file=sys.stderr)
        return UserError.exit_code
    except (FileNotFoundError, ValueError) as e:  # (not a mount; a rank out of range)
        raise UserError(str(e)) from None
    return 0


def version_text() -> str:
    """`fusefs --version`: fusefs's, and what it was built with and runs on: the binding and
    its fast path, the native fetch reads, libfuse (asked of the library the binding loaded),
    the kernel and its FUSE over io_uring switch."""
    import ctypes
    import platform
    from . import __version__, store
    from . import pyfuse3
    lines = [f"fusefs {__version__} (Python {platform.python_version()})",
             f"binding: pyfuse3 {pyfuse3.__version__} with fusefs's patches; fast path: "
             f"{'built in' if getattr(pyfuse3, 'FAST_PATH', False) else 'not built'}",
             "native fetch (fusefs._fetchio): " + ("built in" if store.NATIVE else
                                                   "not built (fetches are read in Python)")]
    try:
        libfuse = ctypes.CDLL(pyfuse3.__file__).fuse_pkgversion
        libfuse.restype = ctypes.c_char_p
        lines.append(f"libfuse: {libfuse().decode()}")
    except (OSError, AttributeError):
        lines.append("libfuse: unknown")
    uring = "/sys/module/fuse/parameters/enable_uring"
    try:
        with open(uring) as f:
            state = "on" if f.read().strip() in ("Y", "1") else "off"
        uring_text = f"FUSE over io_uring in the kernel ({state}; fusefs does not use it)"
    except OSError:
        uring_text = "no FUSE over io_uring in the kernel"
    lines.append(f"kernel: {platform.system()} {platform.release()}; {uring_text}; the FUSE "
                 "protocol is agreed at each mount")
    return "\n".join(lines)


class VersionAction(argparse.Action):
    """--version, worked out only when asked (it loads the binding)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help=kw.get("help"))

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            print(version_text(), flush=True)
        except BrokenPipeError:  # (`fusefs --version | head -1`)
            pass
        parser.exit()


def cmd_run(a) -> int:
    from .launch import run
    run(a.command, quiet=a.quiet)  # (replaces this process: returns only by an error)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusefs", description=__doc__.splitlines()[0])
    p.add_argument("--version", action=VersionAction,
                   help="fusefs's version, and the binding, fast path, native fetch, libfuse and "
                        "kernel it has")
    # the options every command takes, before or after its name (`fusefs -v mount ...` and
    # `fusefs mount ... -v` alike)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log debug messages (as --log-level debug)")
    common.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                        help="the least level logged (default info)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages (as --log-level debug)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="the least level logged (default info)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("pack", parents=[common], help="pack a folder tree into chunk files plus an index")
    s.add_argument("src", help="the folder tree to pack (an ImageFolder, or any tree of files)")
    s.add_argument("dst", help="where the chunk files and the index go (on the parallel filesystem)")
    s.add_argument("--in-place", action="store_true",
                   help="SRC is a tar file or a folder of uncompressed tars (WebDataset shards, "
                        "ImageNet's archive): index them where they are, tars inside tars as "
                        "folders; DST gets only the index, nothing is copied")
    s.add_argument("--chunk-size", default="64MiB", help="target bytes per chunk (default 64MiB)")
    s.add_argument("--chunk-count", type=int, help="samples per chunk (instead of --chunk-size)")
    s.add_argument("--nodes", type=int, help="spread chunks over N node folders (chunk i on node i mod N)")
    s.add_argument("--mix-classes", action="store_true",
                   help="interleave the classes so that every chunk holds each in its share of the "
                        "tree (default: class by class, in the tree's order)")
    s.add_argument("--workers", type=int, default=16, help="parallel source reads (default 16)")
    s.add_argument("--strict", action="store_true", help="stop at the first unreadable source entry")
    s.add_argument("--follow-symlinks", action="store_true",
                   help="pack the files that symbolic links point at (default: links are reported "
                        "and skipped, and no link is followed on the way to a file)")
    s.add_argument("--mode", metavar="OCTAL",
                   help="the chunks' and the index's mode, e.g. 0644 (default: the most restrictive "
                        "their files had in the source, folders above them included)")
    s.add_argument("--force", action="store_true", help="replace a packed dataset already in DST")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_pack)

    s = sub.add_parser("mount", parents=[common], help="show a packed dataset as its original tree",
                       epilog="Every option can also be given as -o name=value (e.g. -o cache_size=10%,"
                              "per_node=8,allow_other), as mount(8) passes an fstab line's options.")
    s.add_argument("dst", help="the packed folder (what `fusefs pack` wrote)")
    s.add_argument("mnt", help="the mount point (an empty folder)")
    s.add_argument("-b", "--background", action="store_true",
                   help="detach once mounted (returns 0 once the daemon serves, else its error)")
    s.add_argument("-f", "--foreground", action="store_false", dest="background",
                   help="serve in the foreground until unmounted (the default)")
    s.add_argument("--nonempty", action="store_true",
                   help="mount over a folder that holds files (hiding them); refused by default")
    s.add_argument("-o", action="append", metavar="OPTS",
                   help="mount options, comma-separated: this command's own by name (cache_size=10%%) "
                        "and FUSE's (allow_other)")
    s.add_argument("--cache-size", default=CACHE_SIZE,
                   help=f"sample cache budget: bytes or %% of the dataset (default {CACHE_SIZE})")
    s.add_argument("--static-cache", default="0", metavar="SIZE",
                   help="part of the cache budget (bytes or %% of the budget, e.g. 30%%) that keeps "
                        "the samples of highest importance in the order across epochs (default 0)")
    s.add_argument("--local-cache", metavar="DIR",
                   help="a node-local folder (NVMe, /dev/shm) that keeps fetched samples across "
                        "epochs and remounts: reads look in memory, then DIR, then the backend")
    s.add_argument("--local-cache-size", metavar="SIZE",
                   help="budget of --local-cache: bytes or %% of the dataset (default: the dataset, "
                        "at most 90%% of the free space there)")
    s.add_argument("--per-node", type=int, default=DEFAULTS.fetch.per_node,
                   help=f"backend requests in flight per storage node (default {DEFAULTS.fetch.per_node}; a request's "
                        "reads are advised at once, see --willneed)")
    s.add_argument("--batch", type=int, default=DEFAULTS.fetch.batch,
                   help=f"samples per backend request (default {DEFAULTS.fetch.batch}; smaller samples "
                        "are batched up to 1 MiB a request; a read-ahead request holds up to 64 within 4 MiB)")
    s.add_argument("--readahead", metavar="SIZE",
                   help="how far ahead of the readers the order is read: bytes or %% of the cache "
                        "budget (default 1/16 of the budget, at least a full batch per request slot of "
                        "every node, two up to 1/4 of the budget); "
                        "the rest of the budget keeps what the orders need again")
    s.add_argument("--order-memory", metavar="SIZE",
                   help="what the orders of all ranks may hold together: bytes or %% of the cache "
                        "budget (default: a quarter of the budget, at least what orders covering the "
                        "dataset for 8 ranks take); an order past it is refused with the figures")
    s.add_argument("--control-group", metavar="GROUP",
                   help="a group whose members may write the control files (the order) too; "
                        "by default only the user who mounted (and root) may")
    s.add_argument("--uid", metavar="USER", help="the files' owner, a user name or number (default: "
                   "the user who mounts); with allow_other, as rclone's and mountpoint-s3's uid=")
    s.add_argument("--gid", metavar="GROUP", help="the files' group, a name or number (default: the "
                   "mounting user's group)")
    s.add_argument("--umask", type=parse_mode, metavar="OCTAL",
                   help="permission bits taken from every file's and folder's mode, e.g. 022")
    s.add_argument("--file-mode", type=parse_mode, metavar="OCTAL",
                   help="every file's mode instead of its packed one (then --umask), e.g. 0444")
    s.add_argument("--dir-mode", type=parse_mode, metavar="OCTAL",
                   help="every folder's mode instead of its packed one (then --umask), e.g. 0555")
    s.add_argument("--retries", type=int, default=DEFAULTS.fetch.retries,
                   help="retries of a failed backend read, with doubling backoff from 0.1 s "
                        f"(default {DEFAULTS.fetch.retries}; the index, read once at start, gets at least 16)")
    s.add_argument("--io-timeout", type=float, default=DEFAULTS.fetch.io_timeout, metavar="SECONDS",
                   help="how long a read waits for a storage node that does not answer before it "
                        f"gets EIO (default {DEFAULTS.fetch.io_timeout:g}, like an NFS hard mount within a bound; "
                        "0: give up after --retries, about 1.5 s, like NFS soft); reads from "
                        "the other nodes go on meanwhile")
    s.add_argument("--kernel-cache", action=argparse.BooleanOptionalAction, default=DEFAULTS.kernel_cache,
                   help="let the kernel page cache hold every fetched sample (read through "
                        "the fast path from the cache, or pushed as it arrives: notify_store), "
                        "so its later reads never reach the daemon (default on)")
    s.add_argument("--fast-path", action=argparse.BooleanOptionalAction, default=DEFAULTS.fast_path.enabled,
                   help="answer the dataset files' lookup, open, ioctl, release, forget and the "
                        "reads of cached samples on a thread in C, outside the Python loop "
                        "(default on; fusefs/_fastpath.h, docs/ARCHITECTURE.md)")
    s.add_argument("--fast-threads", type=int, metavar="N",
                   help="threads of the fast path, each reading its own clone of /dev/fuse (default: "
                        f"one per 16 cores, 1 to 8: {default_fast_threads()} here)")
    s.add_argument("--miss-engine", action=argparse.BooleanOptionalAction, default=DEFAULTS.fast_path.miss_engine,
                   help="while no order is in force, read each sample a reader misses in C, a "
                        "thread per storage node, and answer its read there, without the daemon's "
                        "Python (default on; needs the fast path and the native reads)")
    s.add_argument("--willneed", action=argparse.BooleanOptionalAction, default=DEFAULTS.fetch.willneed,
                   help="ask the backend's client for all of a request's reads at once "
                        "(posix_fadvise WILLNEED), so it fetches them concurrently while the "
                        "request reads them in order (default on)")
    s.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="also serve the Prometheus metrics (MNT/.fusefs/metrics) over HTTP on PORT "
                        "(default: no HTTP server)")
    s.add_argument("--metrics-address", default=DEFAULTS.metrics.address, metavar="ADDR",
                   help=f"address of the metrics server (default {DEFAULTS.metrics.address})")
    s.add_argument("--log", "--log-file", dest="log",
                   help="log to this file (default: stderr in the foreground, for journald; with "
                        "--background /run/fusefs/NAME-HASH.log for root, else $XDG_RUNTIME_DIR/fusefs "
                        "or ~/.cache/fusefs, one file per mount point)")
    s.add_argument("--log-max-size", default="16MiB", metavar="SIZE",
                   help="a log file is renamed to FILE.1 (replacing an older one) and begun anew past "
                        "this size (default 16MiB)")
    s.set_defaults(func=cmd_mount, parser=s)

    s = sub.add_parser("umount", parents=[common], help="unmount a fusefs mount")
    s.add_argument("mnt", help="the mount point")
    s.set_defaults(func=cmd_umount)

    s = sub.add_parser("info", parents=[common], help="print what a packed dataset holds")
    s.add_argument("dst", help="the packed folder")
    s.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    s.add_argument("--chunks", action="store_true", help="also list every chunk and its node")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("verify", parents=[common], help="check every checksum of a packed dataset")
    s.add_argument("dst", help="the packed folder")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("stats", parents=[common], help="print a mount's statistics")
    s.add_argument("mnt", help="the mount point (or any path inside it)")
    s.add_argument("--json", action="store_true", help="the whole statistics as JSON, for scripts")
    s.add_argument("-w", "--watch", action="store_true", help="print rates every interval until Ctrl-C")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between --watch lines (default 1)")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("order", parents=[common], help="hand a mount an epoch's read order (docs/FORMAT.md) from a file")
    s.add_argument("mnt", help="the mount point (or any path inside it)")
    s.add_argument("file", nargs="?", default="-",
                   help="the order (default: stdin): fusefs's binary format (docs/FORMAT.md), or text "
                        "with one sample per line, all sample ids or all paths (relative to the mount, "
                        "or absolute inside it)")
    s.add_argument("--rank", type=int, default=0, help="the rank whose order it is (0..63, default 0)")
    s.add_argument("--epoch", type=int, help="the epoch of a text list (default 0)")
    s.set_defaults(func=cmd_order)

    s = sub.add_parser("run", parents=[common],
                       help="run a training command so that its DataLoaders hand the mount each epoch's order",
                       description="Run COMMAND (python train.py, torchrun ..., python -m ...) so that in every "
                                   "Python process it starts, a torch DataLoader over files on a fusefs mount "
                                   "hands the mount each epoch's order, taken from the loader's own sampler: "
                                   "no change to the training code (fusefs/launch.py).")
    s.add_argument("-q", "--quiet", action="store_true",
                   help="no line saying which loaders are hinted (the lines saying why one is not stay)")
    s.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    s.set_defaults(func=cmd_run)
    return p


COMMANDS = ("pack", "mount", "umount", "info", "verify", "stats", "order", "run")
LOG_LEVELS = ("debug", "info", "warning", "error")
# (the pid: a background mount's log may hold another daemon's lines too: mount.own_lines)
LOG_FORMAT = "%(asctime)s [%(process)d] %(name)s %(levelname)s %(message)s"


def from_mount_helper(argv: list[str]) -> list[str]:
    """mount(8) runs `mount -t fuse.fusefs DST MNT -o OPTS` (an fstab line of type fuse.fusefs)
    as `fusefs DST MNT -o OPTS` through mount.fuse3, and waits for it: that is `fusefs mount
    --background DST MNT -o OPTS`."""
    if len(argv) >= 2 and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        return ["mount", "--background", *argv]
    return argv


def mount_helper(argv=None) -> int:
    """`mount.fuse.fusefs`, the helper mount(8) runs for an fstab line (or `mount -t
    fuse.fusefs`) of type fuse.fusefs: `mount.fuse.fusefs DST MNT [-sfnv] [-N NS] [-o OPTS]
    [-t TYPE]`, as mount(8) calls every helper. It mounts in the background (mount(8) waits
    for it) with OPTS, fusefs's and FUSE's, as `-o` gives them to `fusefs mount`. An admin
    links it where mount(8) looks: `ln -s VENV/bin/mount.fuse.fusefs /sbin/`."""
    p = argparse.ArgumentParser(prog="mount.fuse.fusefs", description=mount_helper.__doc__.splitlines()[0])
    p.add_argument("dst")
    p.add_argument("mnt")
    p.add_argument("-o", action="append", default=[])
    p.add_argument("-t", help="the type mount(8) names (fuse.fusefs)")
    p.add_argument("-N", help="a mount namespace (not supported)")
    for flag in ("-s", "-n", "-v"):  # sloppy, no mtab, verbose: nothing to do for fusefs
        p.add_argument(flag, action="store_true")
    p.add_argument("-f", action="store_true", help="fake: do everything but mount")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.N:
        print("mount.fuse.fusefs: -N (another mount namespace) is not supported", file=sys.stderr)
        return UserError.exit_code
    if a.f:
        return 0
    return main(["mount", "--background", a.dst, a.mnt, *(["-o", ",".join(a.o)] if a.o else []),
                 *(["-v"] if a.v else [])])


def main(argv=None) -> int:
    argv = from_mount_helper(list(sys.argv[1:] if argv is None else argv))
    if argv[:1] == ["mount"] and not {"--background", "-b"} & set(argv):
        # before any thread (numpy's import starts OpenBLAS's): every thread of the daemon
        # inherits the blocked stop signals, which one thread of its own takes (mount.Stops)
        import signal
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    a = build_parser().parse_args(argv)
    a.argv = argv
    level = "debug" if a.verbose else a.log_level
    logging.basicConfig(level=getattr(logging, level.upper()), format=LOG_FORMAT)
    try:
        return a.func(a)
    except UserError as e:  # every error a user can fix, with its exit code (2)
        print(f"fusefs {a.command}: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a file or folder the system refused (1)
        where = f"{e.filename}: " if e.filename else ""
        print(f"fusefs {a.command}: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
