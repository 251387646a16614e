"""`.fusefs/ids` and `.fusefs/chunks`, rendered per read from the index: no copy of either
table is held, whoever opens them and however often.

`.fusefs/ids` is every sample's relative path, NUL-terminated, in id order; a read at an
offset finds its first id from a mark every STRIDE ids (the table's offset there) and the
lengths of the paths after it, then renders only the paths the read covers. What it keeps:
the marks (8 bytes every STRIDE samples) and each folder's path length (8 bytes a folder),
made at the first read. `.fusefs/chunks` is the chunk of each sample, u32 little-endian,
sliced from the index's array for each read.
"""
from __future__ import annotations

import numpy as np

STRIDE = 64  # samples between two marks of the ids table


class PathsText:
    """The ids table (every sample's path, NUL-terminated) of index, read by ranges."""

    def __init__(self, index):
        self.index = index
        self._marks: np.ndarray | None = None  # table offset of every STRIDE-th id, and the end
        self._dir_len: np.ndarray | None = None  # each folder's path length
        self._last: tuple[int, bytes] = (0, b"")  # (folder, its path): ids run folder by folder

    @property
    def size(self) -> int:
        """The table's length in bytes."""
        self._prepare()
        return int(self._marks[-1])

    def _prepare(self) -> None:
        if self._marks is not None:
            return
        ix = self.index
        parents, names = ix.dir_parent.tolist(), ix.dir_name_len.tolist()
        length = [0] * ix.n_dirs
        for d in range(1, ix.n_dirs):  # (folders are numbered breadth-first: parents first)
            p = parents[d]
            length[d] = length[p] + (1 if p else 0) + names[d]
        self._dir_len = np.asarray(length, np.int64)
        ends = np.cumsum(self._lengths(0, ix.n_files))
        # marks[k]: where id k * STRIDE starts, for every k with k * STRIDE < n; then the end
        self._marks = np.concatenate([[0], ends[STRIDE - 1:-1:STRIDE], ends[-1:]]).astype(np.int64) \
            if ix.n_files else np.zeros(1, np.int64)

    def _lengths(self, lo: int, hi: int) -> np.ndarray:
        """The table bytes of ids lo..hi-1 (path and NUL)."""
        ix = self.index
        d = ix.file_dir[lo:hi].astype(np.int64)
        return self._dir_len[d] + (d > 0) + ix.file_name_len[lo:hi].astype(np.int64) + 1

    def _path(self, i: int) -> bytes:
        ix = self.index
        d = int(ix.file_dir[i])
        if d != self._last[0]:
            self._last = (d, ix.dir_path(d))
        folder = self._last[1]
        return folder + b"/" + ix.file_name(i) if folder else ix.file_name(i)

    def read(self, off: int, size: int) -> bytes:
        """size bytes of the table from off (fewer at its end)."""
        self._prepare()
        marks, n = self._marks, self.index.n_files
        if size <= 0 or off >= marks[-1]:
            return b""
        k = int(np.searchsorted(marks, off, side="right")) - 1
        lo = k * STRIDE
        ends = int(marks[k]) + np.cumsum(self._lengths(lo, min(n, lo + STRIDE)))
        i = lo + int(np.searchsorted(ends, off, side="right"))  # (the id whose bytes hold off)
        pos = int(ends[i - lo - 1]) if i > lo else int(marks[k])
        out = bytearray()
        end = off + size
        while i < n and pos < end:
            path = self._path(i) + b"\0"
            out += path[max(0, off - pos):end - pos]
            pos += len(path)
            i += 1
        return bytes(out)


def chunks_read(chunk: np.ndarray, off: int, size: int) -> bytes:
    """size bytes from off of the chunk table (each sample's chunk, u32 little-endian)."""
    if size <= 0 or off >= 4 * len(chunk):
        return b""
    lo, hi = off // 4, min(len(chunk), -(-(off + size) // 4))
    return chunk[lo:hi].astype("<u4").tobytes()[off - 4 * lo:off - 4 * lo + size]
