"""Which storage node holds a chunk file.

Per-node batching needs to know which server a chunk lives on. A layout made by hand
(`pack --nodes N`) says so itself. On a flat layout we ask the filesystem:

* GlusterFS: the virtual xattr `trusted.glusterfs.pathinfo` names the brick(s) of a file,
  e.g. `(<DISTRIBUTE:vol-dht> <POSIX(/srv/b1):host:/srv/b1/chunks/chunk-000000.fck>)`.
  The node is `host:/srv/b1` (replicas joined by commas: a replica set is one node).
* Lustre: `lfs getstripe -i FILE` prints the index of the OST holding the first stripe.
* Anything else: one node, "local".
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

from .mounts import fs_type

PATHINFO_XATTR = "trusted.glusterfs.pathinfo"
_POSIX = re.compile(r"<POSIX\(([^)]*)\):([^:>]+):")


def parse_pathinfo(value: str) -> str | None:
    """The node name in a GlusterFS pathinfo value, or None if it names no brick."""
    bricks = sorted({f"{host}:{brick}" for brick, host in _POSIX.findall(value)})
    return ",".join(bricks) if bricks else None


def gluster_node(path: str) -> str | None:
    try:
        value = os.getxattr(path, PATHINFO_XATTR)
    except OSError:
        return None
    return parse_pathinfo(value.decode("utf-8", "replace"))


def lustre_node(path: str) -> str | None:
    if shutil.which("lfs") is None:
        return None
    try:
        out = subprocess.run(["lfs", "getstripe", "-i", path], capture_output=True,
                             text=True, timeout=30, check=True).stdout.strip()
        return f"ost{int(out.split()[0])}"
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


# Chunks are placed on GlusterFS bricks by the hash of their names: with this many chunks
# per brick or more, a brick left without any is not chance (2/3 ** 24 for one of three).
MIN_CHUNKS_PER_BRICK = 8


def bricks_left_out(folder: str, node_names: list[str], n_chunks: int) -> list[str]:
    """GlusterFS: the bricks that the folder's layout spreads new files over and that got
    none of its n_chunks chunks (on node_names, replica sets joined by commas), when there
    are enough chunks for that not to be chance; [] elsewhere. DHT puts a file on another
    brick than its name's when that brick is below cluster.min-free-disk or unreachable."""
    try:
        value = os.getxattr(folder, PATHINFO_XATTR).decode("utf-8", "replace")
    except OSError:
        return []
    bricks = {f"{host}:{brick}" for brick, host in _POSIX.findall(value)}
    if n_chunks < MIN_CHUNKS_PER_BRICK * len(bricks):
        return []
    used = {b for name in node_names for b in name.split(",")}
    return sorted(bricks - used)


def discover(paths: list[str]) -> tuple[list[str], list[int]]:
    """Node names (sorted) and, for each path, the index of its node."""
    if not paths:
        return ["local"], []
    kind = fs_type(paths[0])
    if kind.startswith("fuse.glusterfs") or gluster_node(paths[0]) is not None:
        probe = gluster_node
    elif kind == "lustre":
        probe = lustre_node
    else:
        return ["local"], [0] * len(paths)
    found = [probe(p) or "unknown" for p in paths]
    names = sorted(set(found))
    where = {name: i for i, name in enumerate(names)}
    return names, [where[name] for name in found]
