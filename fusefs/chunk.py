"""The chunk file format: many samples' bytes in one large file.

A chunk file is, in this order (all integers little-endian, 64-bit):

    offset  size    field
    0       8       magic  b"FUSEFSCK"
    8       4       format version (u32, currently 1)
    12      4       flags (u32, 0)
    16      8       n, the number of samples (u64)
    24      8       xxh3-64 of the four tables below (u64)
    32      8n      offsets: absolute file offset of each sample's bytes (u64)
    32+8n   8n      sizes in bytes (u64)
    32+16n  8n      labels: class index, -1 for a file outside any class (i64)
    32+24n  8n      checksums: xxh3-64 of each sample's bytes (u64)
    32+32n  ...     the samples' bytes, back to back, unchanged

The first sample starts right after the tables; each next one right after the previous.
Nothing in this module knows about files on disk beyond a readable/writable object, so
it can be tested (and fuzzed) on bytes alone.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"FUSEFSCK"
VERSION = 1
_HEAD = struct.Struct("<8sIIQQ")
HEAD_SIZE = _HEAD.size  # 32
ENTRY_SIZE = 32  # offset + size + label + checksum per sample


class ChunkError(ValueError):
    """A chunk file (or a header read from one) is not a valid chunk."""


def checksum(data) -> int:
    """The checksum stored for every sample: xxh3-64 of its bytes."""
    return xxhash.xxh3_64_intdigest(data)


def data_start(n: int) -> int:
    """Offset of the first sample's bytes in a chunk of n samples."""
    return HEAD_SIZE + ENTRY_SIZE * n


@dataclass(frozen=True)
class ChunkHeader:
    offsets: np.ndarray  # u64
    sizes: np.ndarray  # u64
    labels: np.ndarray  # i64
    checksums: np.ndarray  # u64

    @property
    def n(self) -> int:
        return len(self.sizes)

    @property
    def file_size(self) -> int:
        return data_start(self.n) + int(self.sizes.sum())


def encode_header(sizes, labels, checksums) -> bytes:
    """The header and tables of a chunk whose samples have these sizes, labels, checksums."""
    sizes = np.asarray(sizes, dtype="<u8")
    n = len(sizes)
    labels = np.asarray(labels, dtype="<i8")
    checksums = np.asarray(checksums, dtype="<u8")
    if not (len(labels) == len(checksums) == n):
        raise ValueError("sizes, labels and checksums differ in length")
    offsets = np.empty(n, dtype="<u8")
    if n:
        offsets[0] = data_start(n)
        np.cumsum(sizes[:-1], out=offsets[1:])
        offsets[1:] += data_start(n)
    tables = offsets.tobytes() + sizes.tobytes() + labels.tobytes() + checksums.tobytes()
    return _HEAD.pack(MAGIC, VERSION, 0, n, xxhash.xxh3_64_intdigest(tables)) + tables


def write_chunk(f, samples) -> ChunkHeader:
    """Write samples, a sequence of (bytes, label), as one chunk to the binary file f."""
    sizes = [len(data) for data, _ in samples]
    labels = [label for _, label in samples]
    sums = [checksum(data) for data, _ in samples]
    head = encode_header(sizes, labels, sums)
    f.write(head)
    for data, _ in samples:
        f.write(data)
    return parse_header(head, file_size=len(head) + sum(sizes))


def parse_header(buf: bytes, file_size: int | None = None) -> ChunkHeader:
    """Parse a chunk's header and tables from buf (at least data_start(n) bytes).

    Raises ChunkError with the reason for anything that is not a valid version-1 chunk,
    without allocating more than buf's own size. With file_size, also checks that the
    samples' bytes fit the file exactly.
    """
    if len(buf) < HEAD_SIZE:
        raise ChunkError(f"truncated header ({len(buf)} of {HEAD_SIZE} bytes)")
    magic, version, flags, n, table_sum = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ChunkError("not a fusefs chunk (bad magic number)")
    if version != VERSION:
        raise ChunkError(f"unsupported chunk format version {version} (this fusefs reads {VERSION})")
    if flags != 0:
        raise ChunkError(f"unknown flags {flags:#x}")
    limit = file_size if file_size is not None else len(buf)
    if n > (limit - HEAD_SIZE) // ENTRY_SIZE:
        raise ChunkError(f"sample count {n} does not fit in {limit} bytes")
    end = data_start(n)
    if len(buf) < end:
        raise ChunkError(f"truncated tables ({len(buf)} of {end} bytes)")
    tables = memoryview(buf)[HEAD_SIZE:end]
    if xxhash.xxh3_64_intdigest(tables) != table_sum:
        raise ChunkError("header tables fail their checksum")
    arr = np.frombuffer(tables, dtype="<u8").reshape(4, n) if n else np.zeros((4, 0), "<u8")
    offsets, sizes = arr[0].copy(), arr[1].copy()
    labels = arr[2].view("<i8").copy()
    checksums = arr[3].copy()
    expect = np.empty(n, dtype="<u8")
    if n:
        expect[0] = end
        np.cumsum(sizes[:-1], out=expect[1:])
        expect[1:] += end
        if not np.array_equal(offsets, expect):
            raise ChunkError("sample offsets are not contiguous")
    header = ChunkHeader(offsets, sizes, labels, checksums)
    if file_size is not None and header.file_size != file_size:
        raise ChunkError(f"file is {file_size} bytes, its header describes {header.file_size}")
    return header


def read_header(f, file_size: int) -> ChunkHeader:
    """Read and parse the header of the chunk in binary file f of file_size bytes."""
    f.seek(0)
    head = f.read(HEAD_SIZE)
    if len(head) < HEAD_SIZE:
        raise ChunkError(f"truncated header ({len(head)} of {HEAD_SIZE} bytes)")
    n = _HEAD.unpack_from(head, 0)[3]
    if n > max(0, file_size - HEAD_SIZE) // ENTRY_SIZE:
        # Let parse_header name the precise problem without reading a huge table.
        return parse_header(head, file_size=file_size)
    return parse_header(head + f.read(ENTRY_SIZE * n), file_size=file_size)
