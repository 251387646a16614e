"""Build and install pyfuse3 with one change: without `open`, a handler gets the inode.

When a file system answers `open` with ENOSYS, the kernel stops sending `open` and
`release` for every file of the mount and serves each open itself (`no_open`, Linux 4.19+):
a file whose pages the kernel holds then costs the daemon no request at all. Its reads,
writes and fsyncs still reach the daemon, with handle 0 and the file's inode; pyfuse3
passes the handle only, so such a read cannot tell which file it is for. This script
patches pyfuse3's handlers to pass the inode where the handle is 0 (read, write, flush,
fsync), marks the module with `INODE_WITHOUT_OPEN = True`, and pip-installs it into the
running Python. fusefs uses that mode only when the mark is there (fusefs/fs.py).

    .venv/bin/python scripts/pyfuse3_inode.py        # (scripts/setup.sh runs it)
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import tarfile
import tempfile

VERSION = "3.5.0"
HANDLE_LINE = "    c.fh = fi.fh\n"
HANDLERS = ("fuse_read ", "fuse_write ", "fuse_write_buf", "fuse_flush ", "fuse_fsync ")
MARK = ("\n# fusefs: read, write, flush and fsync get the inode as their handle when the file\n"
        "# system answered open with ENOSYS (the kernel's no_open mode: handle 0)\n"
        "INODE_WITHOUT_OPEN = True\n")


def patch_handlers(text: str) -> str:
    """The handlers' text with `c.fh = fi.fh or ino` in the five that take a handle."""
    out, done = [], set()
    current = None
    for line in text.splitlines(keepends=True):
        if line.startswith("cdef void "):
            name = line[len("cdef void "):]
            current = next((h for h in HANDLERS if name.startswith(h)), None)
        if current and line == HANDLE_LINE:
            line = "    c.fh = fi.fh if fi.fh != 0 else ino\n"
            done.add(current)
            current = None
        out.append(line)
    missing = set(HANDLERS) - done
    if missing:
        raise SystemExit(f"pyfuse3 {VERSION}'s handlers changed: no handle line in {sorted(missing)}")
    return "".join(out)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", f"pyfuse3=={VERSION}", "-d", tmp], check=True)
        with tarfile.open(next(pathlib.Path(tmp).glob("pyfuse3-*.tar.gz"))) as tar:
            if hasattr(tarfile, "data_filter"):  # (Python 3.11.4 and later)
                tar.extractall(tmp, filter="data")
            else:
                tar.extractall(tmp)
        src = pathlib.Path(tmp, f"pyfuse3-{VERSION}", "src", "pyfuse3")
        handlers = src / "handlers.pxi"
        handlers.write_text(patch_handlers(handlers.read_text()))
        init = src / "__init__.pyx"
        init.write_text(init.read_text() + MARK)
        (src / "__init__.c").unlink(missing_ok=True)  # generated from the .pyx: regenerate
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--force-reinstall",
                        "--no-deps", str(src.parent.parent)], check=True)
    import importlib
    import pyfuse3
    importlib.reload(pyfuse3)
    if not getattr(pyfuse3, "INODE_WITHOUT_OPEN", False):
        raise SystemExit("pyfuse3 was installed without the inode patch")
    print(f"pyfuse3 {VERSION} installed with the inode patch")


if __name__ == "__main__":
    main()
