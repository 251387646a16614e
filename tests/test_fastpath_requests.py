"""The fast path's C request handler without a mount: synthetic FUSE requests (lookup,
open, read at several offsets and sizes, release, forget, batch forget, ioctl, interrupt, and each with
a malformed length) go into the handler (pyfuse3.fast_path_configure / fast_path_answer:
the thread's own function, its replies written to a pipe), and each reply is checked byte
for byte against what Core answers, each event against what Core expects."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import subprocess
import sys
import time

import pytest

from fusefs import pyfuse3
from fusefs.control import FH_BASE
from fusefs.core import WRITE_FLAGS, Core
from fusefs.handles import (EVENT_BITS, FORGOTTEN, READ, READ_END, READ_LOST, RELEASED, SERIAL_WRAP,
                            SID_BITS)
from fusefs.entries import BLKSIZE, DATA_TIMEOUT
from fusefs.index import INDEX_NAME, Index
from fusefs.store import ChunkStore

LOOKUP, FORGET, OPEN, READ_OP, RELEASE, INTERRUPT, IOCTL, BATCH_FORGET = 1, 2, 14, 15, 18, 36, 39, 42
INT_REQ_BIT = 1 << 0  # (an interrupt's unique: the interrupted request's with this bit)
IN_HEADER = struct.Struct("<IIQQIIII")   # len, opcode, unique, nodeid, uid, gid, pid, padding
OUT_HEADER = struct.Struct("<IiQ")       # len, error, unique
ENTRY_OUT = struct.Struct("<QQQQII" + "QQQQQQIIIIIIIIII")  # fuse_entry_out with its fuse_attr
OPEN_IN, OPEN_OUT = struct.Struct("<II"), struct.Struct("<QII")
READ_IN = struct.Struct("<QQIIQII")      # fh, offset, size, read_flags, lock_owner, flags, padding
RELEASE_IN = struct.Struct("<QIIQ")      # fh, flags, release_flags, lock_owner
FOPEN_KEEP_CACHE = 1 << 1
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def request(opcode: int, nodeid: int, body: bytes = b"", unique: int = 7) -> bytes:
    return IN_HEADER.pack(IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 0, 0) + body


def reply(unique: int = 7, err: int = 0, body: bytes = b"") -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), -err, unique) + body


@contextlib.contextmanager
def configured(core: Core, delay_us: int = 0, batch: int = 1 << 30):
    """The fast path configured from core (its events' delay delay_us and batch), its
    replies written to a pipe: that pipe's (read end, write end)."""
    args = core.fast_path_args()
    r, w = os.pipe()
    os.set_blocking(r, False)
    fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)  # (a reply must fit: the handler writes before we read)
    pyfuse3.fast_path_kernel_flags(args["kernel_flags"])
    pyfuse3.fast_path_tree(args["tree"])
    pyfuse3.fast_path_configure(w, args["file_base"], args["n_files"], FH_BASE, args["sid_bits"],
                                args["serial"], args["serial_wrap"], args["write_flags"], args["events"],
                                delay_us=delay_us, batch=batch)
    try:
        yield r, w
    finally:
        pyfuse3.fast_path_events()  # (none left for another test)
        pyfuse3._fusefs_free()
        os.close(r)
        os.close(w)


@pytest.fixture
def fast(tricky):
    """A Core over the tricky set and the fast path configured from it, its replies written
    to a pipe: (core, answer(request) -> (answered, bytes written), events() -> list)."""
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    core = Core(ix, ChunkStore(dst, ix))
    with configured(core) as (r, w):

        def answer(req: bytes) -> tuple[bool, bytes]:
            done = pyfuse3.fast_path_answer(req)
            try:
                out = os.read(r, 1 << 21)
            except BlockingIOError:
                out = b""
            return done, out

        def events() -> list[int]:
            ev = pyfuse3.fast_path_events()
            return list(memoryview(ev).cast("Q")) if ev else []

        yield core, answer, events


def entry_reply(core: Core, parent: int, name: bytes) -> bytes:
    """What the fast path must answer to a lookup, from Core.lookup's attributes."""
    a = core.lookup(parent, name)
    sec, nsec = divmod(a.mtime_ns, 10**9)
    t = int(DATA_TIMEOUT)
    return reply(body=ENTRY_OUT.pack(a.ino, 0, t, t, 0, 0, a.ino, a.size, (a.size + 511) // 512,
                                     sec, sec, sec, nsec, nsec, nsec, a.mode, 1, core.uid, core.gid,
                                     0, BLKSIZE, 0))


def test_lookups_of_file_names_are_answered_as_core_answers_them(fast, tricky):
    core, answer, events = fast
    cat = core.lookup(1, b"cat").ino
    for parent, name in ((cat, b"img 000.jpg"), (cat, b"img 011.jpg"), (1, b"root file.txt"),
                         (core.lookup(1, "ünïcødé".encode()).ino, b"img 005.jpg")):
        assert answer(request(LOOKUP, parent, name + b"\0")) == (True, entry_reply(core, parent, name))
    # a folder, a missing name, a name cut without its NUL, a name in no folder: the loop's
    for parent, body in ((1, b"cat\0"), (cat, b"img 999.jpg\0"), (cat, b"img 000.jpg"),
                         (core.file_base, b"img 000.jpg\0"), (1, b".fusefs\0")):
        assert answer(request(LOOKUP, parent, body)) == (False, b"")
    assert events() == [] and pyfuse3.fast_path_counts()["lookup"] == 4


def test_opens_reads_and_releases_answer_byte_for_byte_and_become_events(fast, tricky):
    core, answer, events = fast
    files = tricky[2]
    d = core.lookup(1, b"dog").ino
    big = next(n for n in range(12) if len(files[f"dog/img {n:03d}.jpg"]) > 100_000)
    name = f"img {big:03d}.jpg"
    ino = core.lookup(d, name.encode()).ino
    sid, data = ino - core.file_base, files[f"dog/{name}"]
    done, out = answer(request(OPEN, ino, OPEN_IN.pack(os.O_RDONLY, 0)))
    fh = (((core.handles.serial + 1) % SERIAL_WRAP) << SID_BITS) | sid  # (the k-th open's handle)
    assert (done, out) == (True, reply(body=OPEN_OUT.pack(fh, FOPEN_KEEP_CACHE, 0)))
    assert core.open(ino, os.O_RDONLY).fh == fh  # (Core hands out the same handle)
    assert events() == [fh]
    read = lambda off, size: request(READ_OP, ino, READ_IN.pack(fh, off, size, 0, 0, 0, 0))  # noqa: E731
    assert answer(read(0, 4096)) == (False, b"")  # (not held: the loop fetches it)
    pyfuse3.fast_path_hold(sid, data)
    n = len(data)
    cases = [(0, 4096), (4096, 131072), (n - 100, 4096), (n, 4096), (n + 5000, 10), (0, 2 * n), (1, 0)]
    for off, size in cases:
        assert answer(read(off, size)) == (True, reply(body=data[off:off + size])), (off, size)
    core.kernel_view.held[sid] = True  # (the kernel was taken to hold its pages: a read means lost)
    assert answer(read(0, 10)) == (True, reply(body=data[:10]))
    ends = [off < n and off + size >= n for off, size in cases]
    assert events() == [READ | sid | (READ_END if end else 0) for end in ends] + [READ | sid | READ_LOST]
    assert answer(request(RELEASE, ino, RELEASE_IN.pack(fh, 0, 0, 0))) == (True, reply())
    assert events() == [fh | RELEASED]
    pyfuse3.fast_path_hold(sid, None)
    assert answer(read(0, 10)) == (False, b"")
    c = pyfuse3.fast_path_counts()
    assert (c["open"], c["release"], c["read"]) == (1, 1, len(cases) + 1)


def test_what_the_thread_does_not_answer_goes_to_the_loop(fast, tricky):
    core, answer, events = fast
    ino = core.lookup(core.lookup(1, b"cat").ino, b"img 001.jpg").ino
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_RDONLY | os.O_APPEND):
        assert flags & WRITE_FLAGS
        assert answer(request(OPEN, ino, OPEN_IN.pack(flags, 0))) == (False, b"")
    for other in (1, core.file_base - 1, core.file_base + core.index.n_files):  # not a dataset file
        assert answer(request(OPEN, other, OPEN_IN.pack(os.O_RDONLY, 0))) == (False, b"")
    assert answer(request(RELEASE, ino, RELEASE_IN.pack(FH_BASE + 3, 0, 0, 0))) == (False, b"")  # a control file's
    assert answer(request(READ_OP, ino, READ_IN.pack(FH_BASE, 0, 10, 0, 0, 0, 0))) == (False, b"")
    assert answer(request(4, ino)) == (False, b"")  # (getattr: always the loop's)
    assert events() == []


def test_forgets_and_batch_forgets_answer_nothing_and_become_events(fast, tricky):
    core, answer, events = fast
    cat = core.lookup(1, b"cat").ino
    a, b = (core.lookup(cat, f"img 00{i}.jpg".encode()).ino for i in (2, 3))
    assert answer(request(FORGET, a, struct.pack("<Q", 1))) == (True, b"")
    assert answer(request(FORGET, cat, struct.pack("<Q", 1))) == (True, b"")  # (a folder: dropped)
    ones = b"".join(struct.pack("<QQ", n, 1) for n in (b, cat, a))
    assert answer(request(BATCH_FORGET, 0, struct.pack("<II", 3, 0) + ones)) == (True, b"")
    sid = lambda ino: ino - core.file_base  # noqa: E731
    assert events() == [FORGOTTEN | sid(a), FORGOTTEN | sid(b), FORGOTTEN | sid(a)]
    assert pyfuse3.fast_path_counts()["forget"] == 3


def test_ioctl_is_enotty_and_malformed_lengths_go_to_the_loop(fast, tricky):
    core, answer, events = fast
    ino = core.lookup(core.lookup(1, b"cat").ino, b"img 001.jpg").ino
    assert answer(request(IOCTL, ino, bytes(32), unique=99)) == (True, reply(99, errno.ENOTTY))
    cut = [request(OPEN, ino, OPEN_IN.pack(os.O_RDONLY, 0))[:-1],
           request(READ_OP, ino, READ_IN.pack(1 << SID_BITS, 0, 10, 0, 0, 0, 0))[:-1],
           request(RELEASE, ino, RELEASE_IN.pack(1 << SID_BITS, 0, 0, 0))[:-1],
           request(FORGET, ino, struct.pack("<Q", 1))[:-1],
           request(BATCH_FORGET, 0, struct.pack("<II", 2, 0) + struct.pack("<QQ", ino, 1)),  # one of two
           request(BATCH_FORGET, 0, struct.pack("<I", 1)),
           request(LOOKUP, 1, b"cat\0")[:IN_HEADER.size - 1]]  # (shorter than a header)
    for req in cut:
        assert answer(req) == (False, b""), IN_HEADER.unpack_from(req + bytes(40))[1]
    assert events() == []
    # the event bits are the core's, handed over in the order the handler reads them
    assert EVENT_BITS == (RELEASED, READ, READ_END, READ_LOST)


def test_an_interrupt_of_a_request_answered_here_is_taken_any_other_goes_to_the_loop(fast, tricky):
    """The interrupt of a request the thread answered never reaches libfuse, which would keep
    it on its list (a reader signalling itself could grow it without bound); that of a request
    the thread did not answer (one waiting in the loop) goes to the loop, where the binding
    answers an interrupted read EINTR. Neither is answered."""
    core, answer, events = fast
    for unique in (8, 10, 12):  # (answered here: opens of dataset files)
        assert answer(request(OPEN, core.file_base, OPEN_IN.pack(os.O_RDONLY, 0), unique=unique))[0]
    events()
    before = pyfuse3.fast_path_interrupts_forwarded()
    for unique in (8, 10, 12):
        assert answer(request(INTERRUPT, 0, struct.pack("<Q", unique), unique=unique | INT_REQ_BIT)) == (True, b"")
    assert pyfuse3.fast_path_counts()["interrupt"] == 3 and events() == []
    for unique in (14, 16):  # (a read waiting in the loop: never answered here)
        assert answer(request(INTERRUPT, 0, struct.pack("<Q", unique), unique=unique | INT_REQ_BIT)) == (False, b"")
    assert answer(request(INTERRUPT, 0, b"\0" * 4, unique=18 | INT_REQ_BIT)) == (False, b"")  # (cut short)
    assert pyfuse3.fast_path_counts()["interrupt"] == 3
    assert pyfuse3.fast_path_interrupts_forwarded() - before == 3

def test_a_held_samples_opens_and_releases_wait_longer_while_nothing_is_fetched(tricky):
    """The events of opens and releases of samples the kernel holds are lazy (they may wait
    several times the delay, fusefs/_fastpath.h) while no sample came into the cache within
    that time: a reader's uses then move nothing the read-ahead has to do. While the
    read-ahead is idle too (it covered its orders), they wait longer still, in larger
    batches, and so do those of samples the kernel does not hold and their reads. Any event
    while samples come into the cache (the read-ahead needs the readers' progress then), a
    read of a sample the kernel was taken to hold (its pages were dropped) and a forget
    wait for the delay."""
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    core = Core(ix, ChunkStore(dst, ix))
    lazy, idle, idle_batch = pyfuse3.FAST_PATH_LAZY, pyfuse3.FAST_PATH_IDLE, pyfuse3.FAST_PATH_IDLE_BATCH
    assert 1 < lazy < idle and idle_batch > 1
    held, other = 3, 4

    def use(r, sid, read=False):
        done = pyfuse3.fast_path_answer(request(OPEN, core.file_base + sid, OPEN_IN.pack(os.O_RDONLY, 0)))
        fh = OPEN_OUT.unpack(os.read(r, 4096)[OUT_HEADER.size:])[0]
        if read:
            assert pyfuse3.fast_path_answer(request(READ_OP, core.file_base + sid,
                                                    READ_IN.pack(fh, 0, 1 << 20, 0, 0, 0, 0)))
            os.read(r, 1 << 20)
        assert done and pyfuse3.fast_path_answer(request(RELEASE, core.file_base + sid,
                                                         RELEASE_IN.pack(fh, 0, 0, 0)))
        os.read(r, 4096)

    # reads first (the second configuration leaves the counts at 0, as the binding's test
    # expects of a fresh process): the samples held for the thread; a delay of 1 us, so
    # that their hold (a fetch) is long past when the reads come
    core.kernel_view.held[held] = True  # (the flags the thread reads)
    with configured(core, delay_us=1, batch=1 << 20) as (r, w):
        for sid in (held, other):
            pyfuse3.fast_path_hold(sid, files[os.fsdecode(ix.file_path(sid))])
        time.sleep(0.01)  # (at least 10 ms: far more than the events' longest wait, 50 us)
        pyfuse3.fast_path_idle(True)
        use(r, other, read=True)
        assert pyfuse3.fast_path_pending() == (3, idle, False)  # the thread answered the read
        pyfuse3.fast_path_events()
        use(r, held, read=True)                                 # the kernel dropped its pages
        assert pyfuse3.fast_path_pending() == (3, 1, False)
        pyfuse3.fast_path_events()
        pyfuse3.fast_path_idle(False)
        use(r, other, read=True)
        assert pyfuse3.fast_path_pending() == (3, 1, False)
    # (a delay of 1,000 s: a sample that came into the cache counts as just now throughout;
    # a batch of 2 events: one sample's open and release)
    with configured(core, delay_us=10**9, batch=2) as (r, w):
        assert pyfuse3.fast_path_pending() == (0, 0, False)
        use(r, held)
        assert pyfuse3.fast_path_pending() == (2, lazy, True)  # lazy: the kernel holds it, nothing fetched
        use(r, other)
        assert pyfuse3.fast_path_pending() == (4, 1, True)     # the kernel does not hold it
        assert len(pyfuse3.fast_path_events()) == 4 * 8 and pyfuse3.fast_path_pending() == (0, 0, False)
        pyfuse3.fast_path_idle(True)  # the read-ahead covered its orders
        for k in range(1, idle_batch):
            use(r, held if k % 2 else other)
            assert pyfuse3.fast_path_pending() == (2 * k, idle, False)  # longer, in a larger batch
        use(r, held)
        assert pyfuse3.fast_path_pending() == (2 * idle_batch, idle, True)  # that batch is full
        pyfuse3.fast_path_events()
        use(r, held)
        assert pyfuse3.fast_path_pending() == (2, idle, False)
        assert pyfuse3.fast_path_answer(request(FORGET, core.file_base + other, struct.pack("<Q", 1)))
        assert pyfuse3.fast_path_pending() == (3, 1, True)     # a forget: within the delay
        pyfuse3.fast_path_events()
        use(r, other)
        assert pyfuse3.fast_path_pending() == (2, idle, False)  # not held, and yet it may wait
        pyfuse3.fast_path_idle(False)  # a new order: the read-ahead has work again
        assert pyfuse3.fast_path_pending() == (2, 1, False)    # (the thread signals at its next wait)
        pyfuse3.fast_path_events()
        use(r, held)
        assert pyfuse3.fast_path_pending() == (2, lazy, True)
        pyfuse3.fast_path_events()
        pyfuse3.fast_path_hold(other, files[os.fsdecode(ix.file_path(other))])  # a fetch arrived
        pyfuse3.fast_path_idle(True)
        use(r, held)
        assert pyfuse3.fast_path_pending() == (2, 1, True)     # fetching: the read-ahead needs them soon


_HOLD_DURING_A_REPLY = """
import os, select, struct, sys, threading
from fusefs import pyfuse3
from fusefs.control import FH_BASE
from fusefs.core import WRITE_FLAGS
from fusefs.handles import EVENT_BITS, SERIAL_WRAP, SID_BITS

FILE_BASE, SID, OTHER = 100, 1, 2
r, w = os.pipe()
os.set_blocking(r, False)
pyfuse3.fast_path_configure(w, FILE_BASE, 4, FH_BASE, SID_BITS, 0, SERIAL_WRAP, WRITE_FLAGS, EVENT_BITS)
data = os.urandom(200_000)  # (a reply many times the pipe's room: its write waits for the reader)
base = sys.getrefcount(data)
pyfuse3.fast_path_hold(SID, data)
body = struct.pack("<QQIIQII", SID, 0, 1 << 20, 0, 0, 0, 0)  # fuse_read_in: its handle, 1 MiB at 0
req = struct.pack("<IIQQIIII", 40 + len(body), 15, 7, FILE_BASE + SID, 0, 0, 0, 0) + body
answer = threading.Thread(target=pyfuse3.fast_path_answer, args=(req,))
answer.start()
select.select([r], [], [], 60)  # the reply's first bytes: its copy from data is under way
pyfuse3.fast_path_hold(SID, None)  # (a hold that waited for the copy would wait for ever here)
during = sys.getrefcount(data) - base
out, want = bytearray(), 16 + len(data)  # (the reply: its header, then data)
while len(out) < want:
    select.select([r], [], [], 60)
    try:
        out += os.read(r, want - len(out))
    except BlockingIOError:
        pass
answer.join()
pyfuse3.fast_path_hold(OTHER, None)  # (the next hold lets go of what no copy uses)
print(during, sys.getrefcount(data) - base, bytes(out[16:]) == data, len(out))
pyfuse3._fusefs_free()
"""


def test_a_hold_never_waits_for_a_reply_and_keeps_its_bytes_until_the_copy_ends():
    """The loop changes the held table (fast_path_hold, with the GIL) while a thread copies a
    reply from a held object: the hold returns at once, and the object it took out of the
    table stays alive until the copy is done; the next hold lets go of it. Here the reply
    goes into a pipe that no one reads until the hold has returned (in a process of its own:
    a hold that waited for the copy would wait there for ever, and the timeout ends it)."""
    r = subprocess.run([sys.executable, "-c", _HOLD_DURING_A_REPLY], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    during, after, same, n = r.stdout.split()
    assert (int(during), int(after), same, int(n)) == (1, 0, "True", 16 + 200_000), r.stdout


def replies(out: bytes) -> list[bytes]:
    """The replies written in turn, each its bytes."""
    got = []
    while out:
        n = OUT_HEADER.unpack_from(out)[0]
        got.append(out[:n])
        out = out[n:]
    return got


def test_a_read_of_an_expected_sample_waits_until_its_hold_answers_it_or_hands_it_on(fast, tricky):
    """A read of a sample a fetch thread is to hold (fast_path_expect) waits in the fast path:
    nothing is written and nothing goes to the loop. The hold of the sample's bytes answers
    every read that waits, each as a read of a held sample (its event, its bytes); a hold of
    None hands them to the loop; an interrupt of a waiting read answers it EINTR, and the
    hold that comes later answers nothing. A sample no one expects goes to the loop."""
    core, answer, events = fast
    files = tricky[2]
    ino = core.lookup(core.lookup(1, b"cat").ino, b"img 001.jpg").ino
    sid, data = ino - core.file_base, files["cat/img 001.jpg"]
    assert len(data) > 4196
    assert answer(request(OPEN, ino, OPEN_IN.pack(os.O_RDONLY, 0)))[0]
    fh = (((core.handles.serial + 1) % SERIAL_WRAP) << SID_BITS) | sid
    events()

    def read(off: int, size: int, unique: int) -> bytes:
        return request(READ_OP, ino, READ_IN.pack(fh, off, size, 0, 0, 0, 0), unique=unique)
    assert answer(read(0, 4096, 20)) == (False, b"")  # (no one fetches it: the loop's)
    pyfuse3.fast_path_expect([sid, core.index.n_files, -1])  # (out of range ones: ignored)
    assert answer(read(0, 4096, 22)) == (True, b"")
    assert answer(read(4096, 100, 24)) == (True, b"")
    assert pyfuse3.fast_path_parked() == (2, 0, 0) and events() == []
    pyfuse3.fast_path_hold_many([(sid, data)])
    done, out = answer(request(IOCTL, ino, unique=26))  # (reads what the hold wrote, then this)
    assert sorted(replies(out)) == sorted([reply(22, body=data[:4096]), reply(24, body=data[4096:4196]),
                                           reply(26, errno.ENOTTY)])
    assert events() == [READ | sid, READ | sid]
    assert answer(read(0, 10, 28)) == (True, reply(28, body=data[:10]))  # (held now)
    events()
    pyfuse3.fast_path_hold(sid, None)
    pyfuse3.fast_path_expect([sid])
    assert answer(read(0, 10, 30)) == (True, b"")
    pyfuse3.fast_path_hold(sid, None)  # (its fetch failed: the loop answers it)
    assert pyfuse3.fast_path_parked() == (3, 1, 0)
    assert answer(read(0, 10, 32)) == (False, b"")  # (no longer expected)
    pyfuse3.fast_path_expect([sid])
    assert answer(read(0, 10, 34)) == (True, b"")
    assert answer(request(INTERRUPT, 0, struct.pack("<Q", 34), unique=34 | INT_REQ_BIT)) == \
        (True, reply(34, errno.EINTR))
    pyfuse3.fast_path_hold(sid, data)
    assert answer(request(IOCTL, ino, unique=36)) == (True, reply(36, errno.ENOTTY))  # (only this)
    assert pyfuse3.fast_path_parked() == (4, 1, 0) and events() == []


def two_opened(fast, tricky):
    """Two samples of over 100 bytes opened through the fast path (its events taken):
    (a, b, {sid: its bytes}, read(sid, unique) -> a request for the whole of sid through its
    handle)."""
    core, answer, events = fast
    files, ix = tricky[2], core.index
    a, b = [s for s in range(ix.n_files) if ix.size[s] > 100][:2]
    fh = {}
    for sid in (a, b):
        assert answer(request(OPEN, core.file_base + sid, OPEN_IN.pack(os.O_RDONLY, 0)))[0]
        fh[sid] = (((core.handles.serial + len(fh) + 1) % SERIAL_WRAP) << SID_BITS) | sid
    events()

    def read(sid: int, unique: int) -> bytes:
        return request(READ_OP, core.file_base + sid, READ_IN.pack(fh[sid], 0, 1 << 20, 0, 0, 0, 0), unique=unique)
    return a, b, {sid: files[os.fsdecode(ix.file_path(sid))] for sid in (a, b)}, read


def test_a_fetched_group_is_published_in_c_held_where_served_else_handed_to_its_reads(fast, tricky):
    """The compiled reads publish a group's samples to the fast path as they are read
    (ChunkStore.read_batch's publish: fusefs/_publishapi.h): the reads that wait for them are
    answered before read_batch returns, a sample of `served` is held from then on (a later
    read is answered), any other is not (a later read goes to the loop), and on_read is told
    that they were published."""
    import numpy as np
    core, answer, events = fast
    kept, handed, data, read = two_opened(fast, tricky)
    pyfuse3.fast_path_expect([kept, handed])
    assert answer(read(kept, 40)) == (True, b"") and answer(read(handed, 42)) == (True, b"")
    told = []
    got = core.store.read_batch([kept, handed], on_read=lambda got, n, b, **kw: told.append(kw),
                                publish=(pyfuse3.fast_path_publish_api(), np.array([kept], np.int64)))[0]
    assert got == data and told and all(kw == {"published": True} for kw in told)
    done, out = answer(request(IOCTL, core.file_base + kept, unique=44))  # (what was written, then this)
    assert sorted(replies(out)) == sorted([reply(40, body=data[kept]), reply(42, body=data[handed]),
                                           reply(44, errno.ENOTTY)])
    assert answer(read(kept, 46)) == (True, reply(46, body=data[kept]))  # (held)
    assert answer(read(handed, 48)) == (False, b"")  # (handed over, not held: the loop's)
    assert pyfuse3.fast_path_parked() == (2, 0, 0)
    held, handed_over = got.pop(kept), got.pop(handed)
    refs = sys.getrefcount(held), sys.getrefcount(handed_over)  # (the fast path holds one reference
    pyfuse3.fast_path_hold(kept, None)  # to the held bytes, none to the others)
    after = sys.getrefcount(held)
    assert refs == (3, 2) and after == 2


def test_a_cache_mirrored_in_c_holds_what_it_keeps_and_lets_go_of_what_leaves(fast, tricky):
    """A cache whose mirror is the fast path's capsule (fusefs/_publishapi.h: no Python call
    an entry) tells the fast path of each entry in C: a put answers the read that waited for
    its sample and the fast path answers the sample's reads from then on; an entry evicted or
    dropped is let go of, its reads going to the loop."""
    from fusefs.cache import SampleCache
    core, answer, events = fast
    a, b, data, read = two_opened(fast, tricky)
    cache = SampleCache(max(map(len, data.values())), entry_overhead=0,
                        mirror=pyfuse3.fast_path_publish_api(), samples=core.index.n_files)
    pyfuse3.fast_path_expect([a])
    assert answer(read(a, 50)) == (True, b"")
    assert cache.put(a, data[a], 5.0)
    assert answer(request(IOCTL, core.file_base + a, unique=52)) == \
        (True, reply(50, body=data[a]) + reply(52, errno.ENOTTY))  # (the put answered the read)
    assert answer(read(a, 54)) == (True, reply(54, body=data[a]))
    assert answer(read(b, 56)) == (False, b"")
    assert cache.put(b, data[b], 1.0) and a not in cache  # (b is needed sooner: a is evicted)
    assert answer(read(a, 58)) == (False, b"")
    assert answer(read(b, 60)) == (True, reply(60, body=data[b]))
    cache.drop(b)
    assert answer(read(b, 62)) == (False, b"")


def test_a_read_of_a_whole_sample_no_one_fetches_waits_and_is_told_at_once(tricky):
    """With misses told (fast_path_misses), a read of the whole of a sample that is neither
    held nor expected waits in the fast path and becomes an event at once (READ | MISSED |
    sample: the core fetches it); a second read of it meanwhile waits for the same fetch,
    untold. fast_path_hand_many answers both from bytes the fast path does not hold (the
    first read's event: READ | MISSED | READ_END, counted as that miss; the second's a plain
    read), so the next read is a miss again. A read of part of a sample goes to the loop. A
    bit that is not a single one above every sample is refused at the start."""
    from fusefs.handles import MISSED
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    core = Core(ix, ChunkStore(dst, ix))
    pyfuse3.fast_path_misses(READ)  # (another event's bit)
    with pytest.raises(OSError) as e, configured(core):
        pass
    assert e.value.errno == errno.EINVAL
    pyfuse3.fast_path_misses(MISSED)
    with configured(core, delay_us=10**9) as (r, w):
        def answer(req: bytes) -> tuple[bool, bytes]:
            done = pyfuse3.fast_path_answer(req)
            try:
                return done, os.read(r, 1 << 21)
            except BlockingIOError:
                return done, b""

        def events() -> list[int]:
            ev = pyfuse3.fast_path_events()
            return list(memoryview(ev).cast("Q")) if ev else []
        ino = core.lookup(core.lookup(1, b"cat").ino, b"img 002.jpg").ino
        sid, data = ino - core.file_base, files["cat/img 002.jpg"]
        whole = len(data) + 4096  # (a read as the kernel's: a whole number of pages, past the end)
        assert answer(request(OPEN, ino, OPEN_IN.pack(os.O_RDONLY, 0)))[0]
        fh = (((core.handles.serial + 1) % SERIAL_WRAP) << SID_BITS) | sid
        events()

        def read(off: int, size: int, unique: int) -> bytes:
            return request(READ_OP, ino, READ_IN.pack(fh, off, size, 0, 0, 0, 0), unique=unique)
        assert answer(read(0, len(data) - 1, 20)) == (False, b"")  # (part of it: the loop's)
        assert answer(read(1, whole, 22)) == (False, b"")
        assert pyfuse3.fast_path_pending()[2] is False
        assert answer(read(0, whole, 24)) == (True, b"")
        assert pyfuse3.fast_path_pending()[2] is True  # (told at once, whatever the delay)
        assert answer(read(0, whole, 26)) == (True, b"")
        assert events() == [READ | MISSED | sid]
        pyfuse3.fast_path_hand_many([(sid + 1, files["cat/img 003.jpg"]), (sid, data)])
        done, out = answer(request(IOCTL, ino, unique=28))
        assert sorted(replies(out)) == sorted([reply(24, body=data), reply(26, body=data),
                                               reply(28, errno.ENOTTY)])
        assert sorted(events()) == sorted([READ | MISSED | READ_END | sid, READ | READ_END | sid])
        assert answer(read(0, whole, 30)) == (True, b"")  # (not held: a miss again)
        assert events() == [READ | MISSED | sid] and pyfuse3.fast_path_parked() == (3, 0, 2)
        pyfuse3.fast_path_hold(sid, None)  # (the core lets it go: to the loop)
        assert pyfuse3.fast_path_parked() == (3, 1, 2)
