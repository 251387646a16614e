"""The epoch order a training process hands the mount (client.write_order, over the control
socket; `MNT/.fusefs/order.<rank>` shows the one in force).

Binary, little-endian:

    offset  size  field
    0       8     magic b"FUSEFSOR"
    8       4     format version (u32) = 1
    12      4     flags (u32): bit 0 set = an importance table follows the ids;
                         bit 1 set = the next epoch's record follows this one
    16      8     epoch (u64)
    24      8     n, the number of entries (u64)
    32      4n    sample ids (u32), the mount's own ids, in the order they will be read
    32+4n   4n    importance per entry (f32, finite, not negative), only with flag bit 0

A sample id is its line number (from 0) in `MNT/.fusefs/ids`, which lists every sample's
relative path, NUL-terminated. An id may occur more than once (its bytes are then kept
until its last occurrence).

A second record of the same layout may follow the first: the order of the next epoch
(HintedSampler knows it: an order is a function of seed and epoch); the first record's
flag bit 1 says that it follows (files written without the flag are read the same way),
so that a file cut after its first record is refused. The cache then keeps
what the next epoch needs first across the epoch boundary, and the read-ahead goes on into
it before the next epoch's order file is written. This module imports only numpy, so training code running in
another Python can write orders without fusefs's FUSE dependencies.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"FUSEFSOR"
VERSION = 1
FLAG_IMPORTANCE = 1
FLAG_NEXT = 2  # the next epoch's record follows
_HEAD = struct.Struct("<8sIIQQ")
HEAD_SIZE = _HEAD.size


class OrderError(ValueError):
    """An order file that cannot be used; the message says why."""


@dataclass(frozen=True)
class Order:
    ids: np.ndarray  # u32
    epoch: int = 0
    importance: np.ndarray | None = None  # f32, same length as ids
    next: "Order | None" = None  # the next epoch's order, if the file carries it

    def __len__(self) -> int:
        return len(self.ids)


def encode(ids, epoch: int = 0, importance=None, next_follows: bool = False) -> bytes:
    ids = integer_ids(ids)
    if len(ids) and (ids.min() < 0 or ids.max() >= 2**32):
        raise OrderError("ids must lie in 0 .. 2**32-1")
    flags = FLAG_NEXT if next_follows else 0
    body = ids.astype("<u4").tobytes()
    if importance is not None:
        imp = np.asarray(importance, dtype="<f4")
        if imp.shape != ids.shape:
            raise OrderError(f"{len(imp)} importance values for {len(ids)} ids")
        if not np.all(np.isfinite(imp)):
            raise OrderError("importance values must be finite")
        if len(imp) and float(imp.min()) < 0:
            raise OrderError(f"importance values must not be negative (entry "
                             f"{int(np.argmax(imp < 0))} is {float(imp.min()):g})")
        flags |= FLAG_IMPORTANCE
        body += imp.tobytes()
    return _HEAD.pack(MAGIC, VERSION, flags, int(epoch), len(ids)) + body


def integer_ids(ids) -> np.ndarray:
    """ids as a one-dimensional int64 array, or OrderError: a value that is not a whole
    number (1.5, NaN, a string) is refused, never truncated to another sample's id."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise OrderError("ids must be one-dimensional")
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":  # (an empty list is one)
        whole = np.isfinite(arr) & (arr == np.round(arr))
        if whole.all():
            return arr.astype(np.int64)
        k = int(np.argmin(whole))
        raise OrderError(f"sample ids must be whole numbers: entry {k} is {float(arr[k])!r}")
    raise OrderError(f"sample ids must be integers, not {arr.dtype} values")


def entry_limit(n_samples: int) -> int:
    """The most entries one record may have for a dataset of n_samples: every sample up to
    16 times (data echoing repeats samples), and at least 2**20."""
    return max(16 * n_samples, 1 << 20)


def size_limit(n_samples: int) -> int:
    """The largest valid order for a dataset of n_samples (two records of the most entries,
    with importance): the control socket refuses a larger one before reading it."""
    return 2 * _size(FLAG_IMPORTANCE, entry_limit(n_samples))


def entries(data) -> tuple[int, int] | None:
    """(entries of the order, entries of the next epoch's) as the headers say, read without
    parsing the arrays (what an order will cost is known before it costs anything), or None
    where the headers do not add up to data's length (parse then says why)."""
    if len(data) < HEAD_SIZE or _HEAD.unpack_from(data, 0)[0] != MAGIC:
        return None
    first = _record_size(data, 0)
    if first > len(data):
        return None
    n = _HEAD.unpack_from(data, 0)[4]
    if first == len(data):
        return n, 0
    if len(data) - first < HEAD_SIZE or _HEAD.unpack_from(data, first)[0] != MAGIC \
            or _record_size(data, first) != len(data) - first:
        return None
    return n, _HEAD.unpack_from(data, first)[4]


def parse(data: bytes, n_samples: int, max_entries: int | None = None) -> Order:
    """Parse and validate an order (and the next epoch's, if a second record follows) for
    a dataset of n_samples; OrderError says why not."""
    first = _record_size(data, 0)
    if len(data) > first:
        try:
            nxt = _parse_one(memoryview(data)[first:], n_samples, max_entries, last=True)
        except OrderError as e:
            raise OrderError(f"trailing bytes after the order are not a next-epoch order: {e}") from None
        cur = _parse_one(memoryview(data)[:first], n_samples, max_entries)
        return Order(cur.ids, cur.epoch, cur.importance, nxt)
    cur = _parse_one(data, n_samples, max_entries)
    if _HEAD.unpack_from(data, 0)[2] & FLAG_NEXT:
        raise OrderError("truncated: the order says the next epoch's order follows, and none does")
    return cur


def _size(flags: int, n: int) -> int:
    """The size of a record of n entries with these flags, header included."""
    return HEAD_SIZE + (8 if flags & FLAG_IMPORTANCE else 4) * n


def _record_size(data, start: int) -> int:
    """The size of the record at start as its header says (or all of data if unreadable:
    _parse_one then names the problem)."""
    if len(data) - start < HEAD_SIZE:
        return len(data)
    magic, _, flags, _, n = _HEAD.unpack_from(data, start)
    if magic != MAGIC:
        return len(data)
    return _size(flags, n)


def _parse_one(data, n_samples: int, max_entries: int | None = None, last: bool = False) -> Order:
    if max_entries is None:
        max_entries = entry_limit(n_samples)
    if len(data) < HEAD_SIZE:
        raise OrderError(f"truncated: {len(data)} bytes, the header alone is {HEAD_SIZE}")
    magic, version, flags, epoch, n = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise OrderError("not an order file (bad magic number; see fusefs/order.py for the format)")
    if version != VERSION:
        raise OrderError(f"unsupported order format version {version} (this fusefs reads {VERSION})")
    if flags & ~(FLAG_IMPORTANCE | FLAG_NEXT) or (last and flags & FLAG_NEXT):
        raise OrderError(f"unknown flags {flags:#x}")
    if n > max_entries:
        raise OrderError(f"too large: {n} entries (at most {max_entries} for {n_samples} samples)")
    size = _size(flags, n)
    if len(data) != size:
        raise OrderError(f"{'truncated' if len(data) < size else 'trailing bytes'}: "
                         f"{len(data)} bytes for {n} entries (expected {size})")
    ids = np.frombuffer(data, dtype="<u4", count=n, offset=HEAD_SIZE)
    if n and int(ids.max()) >= n_samples:
        bad = int(ids[np.argmax(ids >= n_samples)])
        raise OrderError(f"unknown sample id {bad} (the dataset has ids 0..{n_samples - 1})")
    importance = None
    if flags & FLAG_IMPORTANCE:
        importance = np.frombuffer(data, dtype="<f4", count=n, offset=HEAD_SIZE + 4 * n)
        if not np.all(np.isfinite(importance)):
            raise OrderError("importance values must be finite")
        if n and float(importance.min()) < 0:
            raise OrderError(f"importance values must not be negative (entry "
                             f"{int(np.argmax(importance < 0))} is {float(importance.min()):g})")
    return Order(ids.astype(np.int64), int(epoch), importance)
