"""The control channel's security and message checks, and the transport's naming rules (no processes)."""
import json
import socket
import threading
import time

import pytest
import torch
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge

from comfyui_hybrid_parallel.workers.protocol import (PROTOCOL_VERSION, ProtocolError, authenticate_server, decode,
                                                      encode, new_authkey)
from comfyui_hybrid_parallel.workers.transport import new_prefix, read_tensor, unlink, write_tensor


def _serve_one(sock, key, timeout=5.0):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("conn", authenticate_server(sock, key, timeout)))
    t.start()
    return t, out


def test_right_key_accepted():
    a, b = socket.socketpair()
    key = new_authkey()
    t, out = _serve_one(a, key)
    client = Connection(b.detach())
    answer_challenge(client, key)
    deliver_challenge(client, key)
    t.join(5)
    assert out["conn"] is not None
    out["conn"].send_bytes(encode("init", x=1))
    assert decode(client.recv_bytes())["x"] == 1


def test_wrong_key_refused():
    a, b = socket.socketpair()
    t, out = _serve_one(a, new_authkey())
    client = Connection(b.detach())
    with pytest.raises(AuthenticationError):
        answer_challenge(client, new_authkey())
    t.join(5)
    assert out["conn"] is None


@pytest.mark.parametrize("payload", [b"GET / HTTP/1.0\r\n\r\n", b"\x00\x00\x00\x10" + b"\x80\x04" * 8, b""])
def test_garbage_and_silence_refused_quickly(payload):
    a, b = socket.socketpair()
    t0 = time.monotonic()
    t, out = _serve_one(a, new_authkey(), timeout=0.5)
    b.sendall(payload)
    t.join(5)
    assert out["conn"] is None and time.monotonic() - t0 < 3.0
    b.close()


def test_messages_are_typed_and_versioned():
    msg = decode(encode("job", job=3, kind="steps"))
    assert msg == {"v": PROTOCOL_VERSION, "t": "job", "job": 3, "kind": "steps"}
    with pytest.raises(ProtocolError, match="version mismatch"):
        decode(json.dumps({"v": PROTOCOL_VERSION + 1, "t": "job"}).encode())
    with pytest.raises(ProtocolError, match="not JSON"):
        decode(b"\x80\x04\x95garbage")
    with pytest.raises(ProtocolError, match="unexpected message type"):
        decode(encode("stop"), expect={"result"})
    with pytest.raises(ProtocolError, match="unknown message type"):
        encode("exec")


def test_transport_refuses_foreign_names_and_dtypes():
    prefix = new_prefix()
    d = write_tensor(torch.arange(5), prefix)
    try:
        with pytest.raises(ValueError, match="does not belong"):
            read_tensor({**d, "name": "../etc/passwd"}, prefix)
        with pytest.raises(ValueError, match="does not belong"):
            read_tensor(d, new_prefix())
        with pytest.raises(ValueError, match="cannot travel"):
            read_tensor({**d, "dtype": "object"}, prefix)
        assert torch.equal(read_tensor(d, prefix), torch.arange(5))
    finally:
        unlink(d, prefix)
    with pytest.raises(ValueError, match="cannot travel"):
        write_tensor(torch.zeros(2, dtype=torch.complex128), prefix)


def test_arena_is_reused_grows_and_checks_bounds():
    from comfyui_hybrid_parallel.workers.transport import ARENA_MAX_BYTES, Arena, list_prefix
    prefix = new_prefix()
    arena, maps = Arena(prefix), {}
    try:
        g = torch.Generator().manual_seed(5)
        first = {"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int16),
                 "c": torch.rand(4, generator=g) > 0.5, "e": torch.zeros(0, 3)}
        d1 = arena.write(first)
        name = arena.name
        assert d1["a"]["name"] == d1["b"]["name"] == name and d1["b"]["offset"] % 64 == 0
        for k, t in first.items():
            assert torch.equal(read_tensor(d1[k], prefix, unlink=True, maps=maps), t), k
        unlink(d1["a"], prefix)  # arenas outlive a job: neither unlink nor read(unlink=True) removes them
        d2 = arena.write({"x": torch.randn(64, 64, generator=g)})
        assert arena.name == name and list_prefix(prefix) == [f"/dev/shm/{name}"]
        big = torch.randn(2 * arena.capacity // 4, generator=g)  # does not fit: a new, larger file
        d3 = arena.write({"big": big})
        assert arena.name != name and list_prefix(prefix) == [f"/dev/shm/{arena.name}"]
        assert torch.equal(read_tensor(d3["big"], prefix, maps=maps), big)
        with pytest.raises(ValueError, match="holds"):
            read_tensor({**d3["big"], "offset": arena.capacity}, prefix)
        with pytest.raises(ValueError, match="does not belong"):
            read_tensor({**d2["x"], "name": "../x"}, prefix)
        huge = arena.write({"h": torch.zeros(ARENA_MAX_BYTES // 4 + 1)})["h"]  # its own file, unlinked after use
        assert "offset" not in huge
        read_tensor(huge, prefix, unlink=True)
    finally:
        arena.close()
    assert list_prefix(prefix) == []


def test_arena_view_is_in_place_and_a_copy_is_not():
    """read_tensor(view=True) - how a worker takes a step's latent - is the arena's own bytes (valid until the writer
    reuses its arena); the default read is a private copy."""
    from comfyui_hybrid_parallel.workers.transport import Arena
    prefix = new_prefix()
    arena, maps = Arena(prefix), {}
    try:
        x = torch.randn(3, 17, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        d = arena.write({"x": x, "pad": torch.ones(5)})["x"]
        view, copy = read_tensor(d, prefix, maps=maps, view=True), read_tensor(d, prefix, maps=maps)
        assert view.dtype == x.dtype and view.shape == x.shape and torch.equal(view, x) and torch.equal(copy, x)
        arena.write({"x": -x})  # the writer's next job reuses the same bytes
        assert torch.equal(view, -x) and torch.equal(copy, x)
        empty = arena.write({"e": torch.zeros(0, 4)})["e"]
        assert read_tensor(empty, prefix, maps=maps, view=True).shape == (0, 4)
    finally:
        arena.close()


def test_worker_with_another_protocol_version_is_named_at_startup(tmp_path):
    """A worker running other code (pack updated on disk) is reported as such, not as a timeout."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.launch import StartupError, World

    class OtherVersionWorld(World):
        def _command(self, rank):
            cmd = super()._command(rank)
            boot = cmd[2].replace("runpy.run_module", "__import__('comfyui_hybrid_parallel.workers.protocol')"
                                  ".workers.protocol.__setattr__('PROTOCOL_VERSION', 99); runpy.run_module")
            return [cmd[0], "-c", boot, *cmd[3:]]

    w = OtherVersionWorld(ParallelConfig(), tmpdir=str(tmp_path), generation=1, shm_prefix=new_prefix(),
                          fake="serve", device_kind="cpu", max_models=1, collective_timeout_s=10)
    t0 = time.monotonic()
    with pytest.raises(StartupError, match="another protocol.*version mismatch: peer speaks 99"):
        w.start(timeout_s=30)
    assert time.monotonic() - t0 < 20 and not w.alive()
    assert all(p.poll() is not None for p in w.procs)  # torn down, nothing left running


def test_weights_are_mapped_where_their_source_starts_in_its_line():
    """A weight's file keeps where its tensor starts within a 64-byte line (ComfyUI's loader maps a checkpoint's
    tensors at the file's offsets, and a CPU matmul rounds by that start): mapped, copied or adopted, the bytes are
    the tensor's, starting as it did; a start that is no whole number of elements is written from the line's start."""
    from comfyui_hybrid_parallel.workers.transport import lead_of, write_weights
    prefix = new_prefix()
    line = torch.empty(4096, dtype=torch.uint8)
    base = (-line.data_ptr()) % 64  # the first line's start in this buffer
    g = torch.Generator().manual_seed(7)
    sources = {}
    for name, start, dtype in (("bias", 4, torch.float32), ("w", 48, torch.float32), ("h", 2, torch.bfloat16),
                               ("aligned", 0, torch.float32), ("odd", 5, torch.float16), ("q", 3, torch.uint8)):
        t = torch.frombuffer(line.numpy(), dtype=dtype, count=40, offset=base + 64 + start)
        t.copy_(torch.randn(40, generator=g).to(dtype) if dtype.is_floating_point else torch.arange(40, dtype=dtype))
        sources[name] = t.view(5, 8)
    assert [lead_of(t) for t in sources.values()] == [4, 48, 2, 0, 0, 3]  # "odd": 5 bytes is no whole fp16
    want = {k: v.clone() for k, v in sources.items()}
    adopted, written = {}, set()
    descs = write_weights(dict(sources), prefix, written, adopt=lambda k, t: adopted.__setitem__(k, t))
    try:
        for k, t in want.items():
            d = descs[f"sd.{k}"]
            mapped, copy = read_tensor(d, prefix, mapped=True), read_tensor(d, prefix)
            start = {"odd": 0}.get(k, sources[k].data_ptr() % 64)
            assert mapped.data_ptr() % 64 == start and adopted[k].data_ptr() % 64 == start, k
            assert mapped.dtype == copy.dtype == t.dtype and mapped.shape == copy.shape == t.shape
            assert torch.equal(mapped, t) and torch.equal(copy, t) and torch.equal(adopted[k], t), k
    finally:
        for d in descs.values():
            unlink(d, prefix)
