"""What a mount and its clients say to each other, in one place: the names of the control
namespace `MNT/.fusefs/`, what the mount table calls a fusefs mount, and the control
socket's request and answers. The daemon (control.py, control_socket.py, index.py's
reserved name) and the client (client.py) both take them from here. Standard library only.

The control socket (control_socket.py) takes one request and gives one answer line:

    order RANK SIZE\\n + SIZE bytes (an order, order.py's format)
      -> ok | refused WHY | denied | too large | busy | bad request
"""
from __future__ import annotations

CONTROL = ".fusefs"            # the hidden folder at the mount's root
STATS = "stats"                # the daemon's counters, JSON
METRICS = "metrics"            # the same in the Prometheus text exposition format
IDS = "ids"                    # every sample's relative path, NUL-terminated; line k is id k
CHUNKS = "chunks"              # the chunk of each sample, u32 little-endian per id
ORDER = "order"                # order.<rank>; plain `order` is rank 0: the order in force
CONTROL_SOCKET = "control"     # a symbolic link to the daemon's control socket
MAX_RANKS = 64                 # order.0 .. order.63

FSTYPE = "fuse.fusefs"         # what the mount table says of a fusefs mount

# the control socket's request, and its answers (a refusal is REFUSED + " " + why)
ORDER_VERB = b"order"
OK, REFUSED, DENIED, TOO_LARGE, BUSY, BAD_REQUEST = "ok", "refused", "denied", "too large", "busy", "bad request"


def order_name(rank: int) -> str:
    if not 0 <= rank < MAX_RANKS:
        raise ValueError(f"rank must lie in [0, {MAX_RANKS}), got {rank}")
    return f"{ORDER}.{rank}"


def order_request(rank: int, size: int) -> bytes:
    """The request line that hands the daemon an order of size bytes for rank."""
    return b"%s %d %d\n" % (ORDER_VERB, rank, size)
