"""The client side of a mount's control namespace `MNT/.fusefs/`: the calls a training
process makes through it (its names and the control socket's words: protocol.py).
Standard library and numpy only (no FUSE, no torch), so any framework can write an order.

    from fusefs import client
    ids = client.paths_to_ids(paths)             # the mount's sample ids of files under it
    client.write_order(mnt, ids, epoch=3)        # the epoch's read order (the control socket)
    client.mount_stats(mnt)["hits"]
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time

import numpy as np

from . import order as orderfmt
from .mounts import mount_of
from .protocol import (BUSY, CHUNKS, CONTROL, CONTROL_SOCKET, DENIED, FSTYPE, IDS, OK, REFUSED, STATS,
                       TOO_LARGE, order_name, order_request)


def control_path(mount: str, name: str) -> str:
    return os.path.join(mount, CONTROL, name)



def find_mount(path: str) -> str:
    """The mount point of the fusefs mount that holds path, as the system's mount table
    says (a folder of a dataset that happens to be called `.fusefs` proves nothing)."""
    point, kind = mount_of(path)
    if kind != FSTYPE:
        raise FileNotFoundError(f"{path} is not inside a fusefs mount")
    return point


def mount_ids(mount: str) -> dict[bytes, int]:
    """relative path (bytes) -> sample id, from `MNT/.fusefs/ids`. Kept while the same
    daemon serves that path: the table is cached under the ids file's mtime, its daemon's
    start (another data set mounted there later has its own table)."""
    mount = os.path.abspath(mount)
    key = (mount, os.stat(control_path(mount, IDS)).st_mtime_ns)
    table = _ID_TABLE.get(key)
    if table is None:
        with open(control_path(mount, IDS), "rb") as f:
            names = f.read().split(b"\0")[:-1]
        table = {name: i for i, name in enumerate(names)}
        for stale in [k for k in _ID_TABLE if k[0] == mount]:  # (an earlier mount there)
            del _ID_TABLE[stale]
        _ID_TABLE[key] = table
    return table


_ID_TABLE: dict[tuple[str, int], dict[bytes, int]] = {}


def mount_chunks(mount: str) -> np.ndarray:
    """sample id -> the chunk that holds it, from `MNT/.fusefs/chunks` (u32 per id)."""
    with open(control_path(os.path.abspath(mount), CHUNKS), "rb") as f:
        return np.frombuffer(f.read(), dtype="<u4").astype(np.int64)


def mount_stats(mount: str) -> dict:
    """The daemon's counters, `MNT/.fusefs/stats` (JSON)."""
    with open(control_path(mount, STATS)) as f:
        return json.load(f)


def paths_to_ids(paths, mount: str | None = None) -> np.ndarray:
    """Mount ids of paths under a fusefs mount (KeyError names a stranger): absolute, or
    relative to the mount when it is given (else to the working directory). A plain path
    under the mount (no `.`, `..` or `//` in it) costs a slice and a lookup; any other is
    normalised first."""
    paths = paths if isinstance(paths, (list, tuple)) else list(paths)
    if mount is None:
        if not paths:
            return np.empty(0, dtype=np.int64)
        base = os.getcwd()
        mount = os.path.abspath(find_mount(os.path.abspath(_text(paths[0]))))
    else:
        base = mount = os.path.abspath(mount)
    prefix = mount.rstrip("/") + "/"
    skip = len(prefix)
    get = mount_ids(mount).get
    out = np.empty(len(paths), dtype=np.int64)
    for k, p in enumerate(paths):
        p = _text(p)
        if p.startswith(prefix) and "/." not in p and "//" not in p:
            rel = p[skip:]
        else:
            p = os.path.abspath(os.path.join(base, p))  # (an absolute path stays)
            rel = os.path.relpath(p, mount)
        sid = get(os.fsencode(rel))
        if sid is None:
            raise KeyError(f"{p} is not a file of the fusefs mount at {mount}")
        out[k] = sid
    return out


def _text(path) -> str:
    path = os.fspath(path)
    return os.fsdecode(path) if isinstance(path, bytes) else path


def dataset_paths(dataset, paths=None) -> list[str]:
    """The file path of each index of a map-style dataset: `paths` if given (a list, or a
    function of the index); else torchvision's ImageFolder/DatasetFolder `.samples` (or
    `.imgs`), a `Subset` of such a dataset (its indices mapped through), a `ConcatDataset`
    of them, or a plain list of paths. TypeError, naming the dataset's class, where it
    names no file paths. (Duck-typed: no torch needed.)"""
    if paths is not None:
        if callable(paths):
            return [os.fspath(paths(i)) for i in range(len(dataset))]
        paths = [os.fspath(p) for p in paths]
        if len(paths) != len(dataset):
            raise ValueError(f"paths has {len(paths)} entries, the dataset {len(dataset)}")
        return paths
    inner = getattr(dataset, "dataset", None)
    indices = getattr(dataset, "indices", None)
    if inner is not None and indices is not None:  # (torch.utils.data.Subset, nested too)
        whole = dataset_paths(inner)
        return [whole[int(i)] for i in indices]
    parts = getattr(dataset, "datasets", None)
    if parts is not None and hasattr(dataset, "cumulative_sizes"):  # (ConcatDataset)
        return [p for part in parts for p in dataset_paths(part)]
    for attr in ("samples", "imgs"):
        items = getattr(dataset, attr, None)
        if items is not None:
            return [os.fspath(s[0] if isinstance(s, (tuple, list)) else s) for s in items]
    if isinstance(dataset, (list, tuple)) and all(isinstance(p, (str, bytes, os.PathLike)) for p in dataset):
        return [os.fspath(p) for p in dataset]
    raise TypeError(f"cannot tell the file of each sample of a {type(dataset).__name__}: it is not "
                    "an ImageFolder/DatasetFolder (.samples), a Subset or ConcatDataset of one, "
                    "or a list of paths")


def ids_from_text(text: bytes, mount: str) -> np.ndarray:
    """The sample ids of an order given as text (what a DALI or FFCV user, or a shell,
    writes): one sample per line, either all lines sample ids (decimal) or all paths,
    relative to the mount or absolute inside it. Blank lines are skipped; a trailing \r
    is dropped. ValueError names the first line that is neither (its number from 1)."""
    lines = [(k, line.rstrip(b"\r")) for k, line in enumerate(text.split(b"\n"), 1)]
    lines = [(k, line) for k, line in lines if line.strip()]
    if b"\0" in text:
        raise ValueError("neither a fusefs order nor a text list (a NUL byte)")
    if all(line.strip().isdigit() for _, line in lines):
        return np.array([int(line) for _, line in lines], dtype=np.int64)
    mount = os.path.abspath(mount)
    table = mount_ids(mount)
    root = os.fsencode(mount) + b"/"
    out = np.empty(len(lines), dtype=np.int64)
    for j, (k, line) in enumerate(lines):
        if line.startswith(root):
            rel = line[len(root):]
        else:
            rel = line[2:] if line.startswith(b"./") else line
        sid = table.get(rel)
        if sid is None:
            raise ValueError(f"line {k}: {os.fsdecode(line)!r} is not a file of the mount at {mount}")
        out[j] = sid
    return out


class OrderRefused(OSError):
    """The mount refused an order (errno EINVAL); the message says why."""


def write_order(mount: str, paths_or_ids, importance=None, epoch: int = 0, rank: int = 0,
                next_ids=None, next_importance=None) -> None:
    """Hand the mount an epoch's read order for `rank` (over its control socket,
    `MNT/.fusefs/control`; `MNT/.fusefs/order.<rank>` then shows it).

    paths_or_ids: paths under the mount (absolute, or relative to the mount), or the mount's
    sample ids (whole numbers: a float that is not one is refused). A bad order is
    refused (OrderRefused, saying why; the previous one stays in force); a user who may not
    set orders gets PermissionError. next_ids (and next_importance): the next epoch's order,
    written with it (the cache then keeps what that epoch needs first across the boundary)."""
    items = list(paths_or_ids)
    if items and isinstance(items[0], (str, bytes, os.PathLike)):
        ids = paths_to_ids(items, mount)
    else:
        ids = orderfmt.integer_ids(items)
    data = orderfmt.encode(ids, epoch=epoch, importance=importance,
                           next_follows=next_ids is not None)
    if next_ids is not None:
        data += orderfmt.encode(next_ids, epoch=epoch + 1, importance=next_importance)
    send_order(mount, data, rank)


def send_order(mount: str, data: bytes, rank: int = 0, patience: float = 30.0) -> None:
    """Hand the mount an encoded order (order.py's format) for rank over its control socket.
    A mount that serves as many clients as it will at once is asked again for `patience`
    seconds."""
    order_name(rank)  # (checks the rank)
    link = control_path(mount, CONTROL_SOCKET)
    try:
        target = os.readlink(link)
    except OSError as e:
        raise FileNotFoundError(errno.ENOENT, f"{mount} has no fusefs control socket ({link}: "
                                              f"{e.strerror}): is it a fusefs mount?") from None
    wait, deadline = 0.01, time.monotonic() + patience
    while True:
        answer = _ask(target, order_request(rank, len(data)), data)
        if answer != BUSY or time.monotonic() > deadline:
            break
        time.sleep(wait)
        wait = min(2 * wait, 0.5)
    if answer == OK:
        return
    what = f"the mount at {mount} refused the order for rank {rank}"
    if answer.startswith(REFUSED + " "):
        raise OrderRefused(errno.EINVAL, f"{what} (the previous one stays in force): "
                                         f"{answer[len(REFUSED) + 1:]}")
    if answer == DENIED:
        raise PermissionError(errno.EACCES, f"{what}: only root, the user who mounted and the "
                              "members of its --control-group may set orders")
    if answer == TOO_LARGE:
        raise OSError(errno.EFBIG, f"{what}: larger than any valid order for its dataset")
    raise OSError(errno.EIO, f"{what}: the daemon answered {answer!r}")


def _ask(path: str, header: bytes, data: bytes) -> str:
    """One request to the control socket at path: its answer line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        try:
            s.sendall(header)
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # (answered before it read everything: denied, too large, busy)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while not answer.endswith(b"\n"):
            try:
                got = s.recv(4096)
            except ConnectionResetError:
                break
            if not got:
                break
            answer += got
    return answer.decode(errors="replace").strip() or "no answer"

