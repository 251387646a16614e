"""The control socket without a mount: a ControlSocket served by trio in this process, asked
by the client's own code (client._ask, in a thread) and by raw sockets that misbehave."""
from __future__ import annotations

import errno
import os
import socket
import stat

import pytest
import trio

from fusefs import client, control_socket
from fusefs.control_socket import MAX_CONNECTIONS, ControlSocket, ControlSocketError
from fusefs.entries import FsError

LIMIT = 1000


def serving(path, test, may=lambda uid, gids: True, limit=LIMIT, trusted=lambda uid: True, room=None):
    """Run test(server, ask) while a ControlSocket at path serves: ask(header, data) is the
    client's request in a thread; commits are recorded in server.committed."""
    committed = []

    async def commit(rank, data):
        if data.startswith(b"bad"):
            raise FsError(errno.EINVAL, "not an order\n(second line)")
        committed.append((rank, data))

    server = ControlSocket(str(path), commit, may, limit, trusted, room=room)
    server.committed = committed

    async def main():
        async with trio.open_nursery() as n:
            await n.start(server.serve)

            async def ask(header: bytes, data: bytes = b"") -> str:
                return await trio.to_thread.run_sync(client._ask, str(path), header, data)
            await test(server, ask)
            n.cancel_scope.cancel()
    try:
        trio.run(main)
    finally:
        server.close()
    return server


def test_orders_are_committed_refused_with_their_reason_or_denied(tmp_path):
    async def test(server, ask):
        assert await ask(b"order 3 5\n", b"12345") == "ok"
        assert server.committed == [(3, b"12345")]
        assert await ask(b"order 0 4\n", b"bad!") == "refused not an order (second line)"  # (one line)
        assert await ask(b"order 64 1\n", b"x") == "bad request"  # (ranks 0..63)
        assert await ask(b"order 0 5\n", b"123") == "bad request"  # (stopped short)
        assert await ask(b"hello\n") == "bad request"
        assert await ask(b"order 0 %d\n" % (LIMIT + 1), bytes(LIMIT + 1)) == "too large"
        assert await ask(b"order 0 %d\n" % LIMIT, bytes(LIMIT)) == "ok"
    server = serving(tmp_path / "s.sock", test)
    assert server.counts == {"accepted": 2, "denied": 0, "busy": 0, "refused": 1, "too_large": 1,
                             "bad": 3, "timed_out": 0}
    assert not os.path.exists(tmp_path / "s.sock")  # (closed: removed)


def test_who_may_is_decided_by_the_peers_credentials(tmp_path):
    seen = []

    def may(uid, gids):
        seen.append((uid, gids))
        return False

    async def test(server, ask):
        assert await ask(b"order 0 3\n", b"abc") == "denied"
    server = serving(tmp_path / "s.sock", test, may=may)
    assert seen == [(os.geteuid(), set(os.getgroups()) | {os.getegid()})]
    assert server.committed == [] and server.counts["denied"] == 1


def test_past_max_connections_a_client_is_told_busy_and_the_others_are_served(tmp_path):
    path = str(tmp_path / "s.sock")

    async def test(server, ask):
        idle = []
        for _ in range(MAX_CONNECTIONS):  # (each declares the largest order and sends none of it)
            s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await s.connect(path)
            await s.send(b"order 0 %d\n" % LIMIT)
            idle.append(s)
        while server.active < MAX_CONNECTIONS:
            await trio.sleep(0.001)
        assert await ask(b"order 1 3\n", b"abc") == "busy"
        for s in idle:
            s.close()
        while server.active:
            await trio.sleep(0.001)
        assert await ask(b"order 1 3\n", b"abc") == "ok"
    server = serving(tmp_path / "s.sock", test)
    assert server.counts["busy"] == 1 and server.committed == [(1, b"abc")]


def test_a_client_that_says_nothing_or_drips_its_request_is_dropped(tmp_path, monkeypatch):
    """The request must arrive whole within REQUEST_S of the accept: a client that says
    nothing, or sends a byte now and then (each within any idle bound), is dropped."""
    monkeypatch.setattr(control_socket, "REQUEST_S", 0.2)
    path = str(tmp_path / "s.sock")

    async def test(server, ask):
        silent = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await silent.connect(path)
        drip = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await drip.connect(path)
        with trio.fail_after(30):
            assert await silent.recv(100) == b""  # (closed by the daemon, no answer)
            sent = 0
            try:
                for byte in b"order 0 999\n" * 100:
                    await drip.send(bytes([byte]))
                    sent += 1
                    await trio.sleep(0.01)
            except OSError:  # (the daemon closed it: EPIPE or ECONNRESET)
                pass
            assert sent < 1200 and await drip.recv(100) == b""
        silent.close()
        drip.close()
    server = serving(path, test)
    assert server.counts["timed_out"] == 2


def test_the_last_slot_is_kept_for_root_and_the_daemons_user(tmp_path):
    """Clients of the control group holding every slot they may take leave one for the
    owner, who is served at once; a third such client is told busy."""
    path = str(tmp_path / "s.sock")
    owner = {"is": False}

    async def test(server, ask):
        held = []
        for _ in range(MAX_CONNECTIONS - 1):
            s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await s.connect(path)
            await s.send(b"order 0 %d\n" % LIMIT)
            held.append(s)
        while server.active < MAX_CONNECTIONS - 1:
            await trio.sleep(0.001)
        assert await ask(b"order 1 3\n", b"abc") == "busy"
        owner["is"] = True
        assert await ask(b"order 1 3\n", b"abc") == "ok"
        for s in held:
            s.close()
    server = serving(path, test, trusted=lambda uid: owner["is"])
    assert server.counts["busy"] == 1 and server.committed == [(1, b"abc")]


def test_requests_being_read_hold_no_more_than_the_room_the_order_budget_leaves(tmp_path):
    """What the requests being read and committed hold together stays within room(rank):
    a control-group client past it is told busy before a byte is read (it asks again);
    root and the daemon's user are not held back; the room comes back as a request ends."""
    path = str(tmp_path / "s.sock")
    owner = {"is": False}
    rooms = []

    def room(rank):
        rooms.append(rank)
        return 10

    async def test(server, ask):
        holder = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await holder.connect(path)
        await holder.send(b"order 2 8\nabc")  # (8 bytes declared, 3 sent: it holds 8)
        while server.receiving < 8:
            await trio.sleep(0.001)
        assert await ask(b"order 1 3\n", b"abc") == "busy"
        owner["is"] = True
        assert await ask(b"order 1 3\n", b"xyz") == "ok"
        owner["is"] = False
        await holder.send(b"defgh")
        assert await holder.recv(100) == b"ok\n"
        holder.close()
        while server.receiving:
            await trio.sleep(0.001)
        assert await ask(b"order 1 3\n", b"abc") == "ok"
    server = serving(path, test, trusted=lambda uid: owner["is"], room=room)
    assert server.counts["busy"] == 1 and server.receiving == 0
    assert server.committed == [(1, b"xyz"), (2, b"abcdefgh"), (1, b"abc")]
    assert set(rooms) == {1, 2}


def test_a_stale_socket_of_ours_is_replaced_and_anything_else_refused(tmp_path):
    path = tmp_path / "s.sock"
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(str(path))
    old.close()  # (left behind, as by a daemon killed with -9)
    server = ControlSocket(str(path), None, None, LIMIT)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666  # (who may: the credentials decide)
    server.close()
    path.write_text("someone's file")
    with pytest.raises(ControlSocketError, match="something else is there"):
        ControlSocket(str(path), None, None, LIMIT)
    assert path.read_text() == "someone's file"


def test_the_client_maps_each_answer_to_its_error(tmp_path, monkeypatch):
    mnt = tmp_path / "mnt"
    (mnt / ".fusefs").mkdir(parents=True)
    os.symlink("/nonexistent.sock", mnt / ".fusefs" / "control")
    for answer, error, code in (("refused bad ids", client.OrderRefused, errno.EINVAL),
                                ("denied", PermissionError, errno.EACCES),
                                ("too large", OSError, errno.EFBIG),
                                ("no answer", OSError, errno.EIO)):
        monkeypatch.setattr(client, "_ask", lambda path, header, data, a=answer: a)
        with pytest.raises(error) as e:
            client.send_order(str(mnt), b"x", rank=2)
        assert e.value.errno == code and "rank 2" in str(e.value)
    asked = []
    monkeypatch.setattr(client, "_ask", lambda path, header, data: asked.append(header) or
                        ("busy" if len(asked) < 3 else "ok"))
    client.send_order(str(mnt), b"xyz", rank=2)  # (busy: asked again)
    assert asked == [b"order 2 3\n"] * 3


def test_an_order_for_a_folder_without_a_control_socket_says_so(tmp_path):
    """A folder that is no fusefs mount (or a daemon from before the control socket) gets
    no order, and the error says what is missing; bench_hotpath, which measures such a
    daemon with --against, writes that daemon's order file itself."""
    import sys
    (tmp_path / ".fusefs").mkdir()
    (tmp_path / ".fusefs" / "order.0").write_bytes(b"an older order")
    with pytest.raises(FileNotFoundError, match="no fusefs control socket"):
        client.send_order(str(tmp_path), b"the order")
    assert (tmp_path / ".fusefs" / "order.0").read_bytes() == b"an older order"
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "bench"))
    try:
        from bench_hotpath import write_order
    finally:
        sys.path.pop(0)
    write_order(str(tmp_path), [2, 0, 1], epoch=4)
    from fusefs import order as orderfmt
    written = orderfmt.parse((tmp_path / ".fusefs" / "order.0").read_bytes(), 3)
    assert written.ids.tolist() == [2, 0, 1] and written.epoch == 4
