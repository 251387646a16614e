import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusefs import chunk


samples_st = st.lists(st.tuples(st.binary(max_size=2000), st.integers(-1, 2**31 - 1)), max_size=40)


@given(samples_st)
@settings(max_examples=200, deadline=None)
def test_write_then_read_round_trips(samples):
    buf = io.BytesIO()
    written = chunk.write_chunk(buf, samples)
    raw = buf.getvalue()
    head = chunk.read_header(io.BytesIO(raw), len(raw))
    assert head.n == len(samples) == written.n
    assert len(raw) == head.file_size
    for k, (data, label) in enumerate(samples):
        off, size = int(head.offsets[k]), int(head.sizes[k])
        assert raw[off:off + size] == data
        assert int(head.labels[k]) == label
        assert int(head.checksums[k]) == chunk.checksum(data)


def test_layout_is_the_documented_one():
    buf = io.BytesIO()
    chunk.write_chunk(buf, [(b"abc", 3), (b"", 0), (b"zz", -1)])
    raw = buf.getvalue()
    assert raw[:8] == b"FUSEFSCK"
    assert int.from_bytes(raw[8:12], "little") == chunk.VERSION
    assert int.from_bytes(raw[16:24], "little") == 3
    offsets = np.frombuffer(raw[32:56], "<u8")
    assert list(offsets) == [chunk.data_start(3), chunk.data_start(3) + 3, chunk.data_start(3) + 3]
    assert raw[chunk.data_start(3):] == b"abczz"


def _valid():
    buf = io.BytesIO()
    chunk.write_chunk(buf, [(b"hello", 1), (b"world!", 2)])
    return buf.getvalue()


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b"XXXXXXXX" + b[8:], "bad magic"),
    (lambda b: b[:8] + (9).to_bytes(4, "little") + b[12:], "version 9"),
    (lambda b: b[:16] + (10**15).to_bytes(8, "little") + b[24:], "does not fit"),
    (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], "checksum"),
    (lambda b: b[:20], "truncated"),
    (lambda b: b[:12] + (1).to_bytes(4, "little") + b[16:], "unknown flags"),
    (lambda b: _rechecksummed(b, lambda t: t.__setitem__(0, t[0] + 1)), "not contiguous"),
])
def test_bad_headers_are_refused_with_a_reason(mutate, message):
    bad = mutate(_valid())
    with pytest.raises(chunk.ChunkError, match=message):
        chunk.parse_header(bad)


def test_a_header_read_short_of_its_tables_is_refused():
    """Fewer bytes than the header or its tables take, from a file whose size would hold
    them (a short read)."""
    raw = _valid()
    with pytest.raises(chunk.ChunkError, match="truncated tables"):
        chunk.parse_header(raw[:chunk.HEAD_SIZE + 8], file_size=len(raw))
    with pytest.raises(chunk.ChunkError, match="truncated header"):
        chunk.read_header(io.BytesIO(raw[:20]), len(raw))


def _rechecksummed(raw: bytes, edit) -> bytes:
    """raw with its tables (offsets first) edited and their checksum made valid again."""
    import xxhash
    n = int.from_bytes(raw[16:24], "little")
    end = chunk.data_start(n)
    tables = np.frombuffer(raw[chunk.HEAD_SIZE:end], "<u8").copy()
    edit(tables)
    return (raw[:24] + xxhash.xxh3_64_intdigest(tables.tobytes()).to_bytes(8, "little") + tables.tobytes()
            + raw[end:])


def test_file_size_must_match_the_header():
    raw = _valid()
    with pytest.raises(chunk.ChunkError, match="header describes"):
        chunk.parse_header(raw, file_size=len(raw) - 1)


@given(st.binary(max_size=400))
@settings(max_examples=300, deadline=None)
def test_random_bytes_never_crash_the_parser(data):
    try:
        chunk.parse_header(data, file_size=len(data))
    except chunk.ChunkError:
        pass


@pytest.mark.parametrize("size", [0, 1, 240, 87_499, 87_500, 110_000, 1 << 20])
def test_checksum_is_xxh3_64_at_every_size(size):
    """The format's checksum (docs/FORMAT.md) is xxh3-64 with seed 0, the same as xxhash's
    streaming hasher gives, at sizes on both sides of where xxhash starts to release the GIL
    (87,500 bytes in xxhash 4.1.0)."""
    import xxhash
    data = np.random.default_rng(size).bytes(size)
    assert chunk.checksum(data) == xxhash.xxh3_64(data).intdigest()
    assert chunk.checksum(memoryview(data)) == xxhash.xxh3_64_intdigest(data)
    assert chunk.checksum(b"") == 0x2D06800538D394C2  # XXH3-64 of the empty input, seed 0
