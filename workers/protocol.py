"""Typed, versioned messages between the driver and its workers.

Every message is one JSON object sent with `Connection.send_bytes` after the
HMAC challenge of `multiprocessing.connection` has succeeded, so nothing a peer
sends is ever unpickled: a bug or a hostile peer can at worst produce a
`ProtocolError`, never run code. Tensors never travel in a message; a message
only *describes* them (see transport.py). This module does not import torch so
that the fake worker starts in a fraction of a second.

Message types (field `t`):
  worker -> driver: hello {rank, pid}, ready {rank, device}, progress {job, step, total, preview?},
                    result {job, rank, ok, values, tensors, error?}
  driver -> worker: init {config, backend, init_method, device, threads, timeout_s, shm_prefix, max_models},
                    job {job, kind, values, tensors, timeout_s}, cancel {job}, stop {}
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

PROTOCOL_VERSION = 1
HANDSHAKE_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a message only carries JSON and tensor descriptors

VAE_FAMILIES = ("vae_comfy",)  # ComfyUI's own VAE modules: what a worker builds for Patch VAE Decode (load_job.py)


def model_families() -> tuple:
    """The model family names a load_model job may carry (the wire's vocabulary): every adapter's
    (parallel/models/<family>.py, read from there so a new family is its adapter alone), "any", and the VAEs.
    Imported when called: this module itself stays free of torch."""
    from ..parallel.models import ADAPTERS, ANY  # lazy: torch (see the docstring)
    return (*ADAPTERS, ANY.family, *VAE_FAMILIES)

DRIVER_TYPES = {"init", "job", "cancel", "stop"}
WORKER_TYPES = {"hello", "ready", "progress", "result", "heartbeat"}


class ProtocolError(RuntimeError):
    """A message that is not ours: bad JSON, unknown type, or another protocol version."""


def encode(t: str, **fields) -> bytes:
    if t not in DRIVER_TYPES | WORKER_TYPES:
        raise ProtocolError(f"unknown message type {t!r}")
    return json.dumps({"v": PROTOCOL_VERSION, "t": t, **fields}, separators=(",", ":")).encode()


def decode(data: bytes, expect: set | None = None) -> dict:
    """Parse one message; refuse other versions and types not in `expect`."""
    try:
        msg = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"message is not JSON: {e}") from None
    if not isinstance(msg, dict) or "t" not in msg:
        raise ProtocolError("message is not a typed JSON object")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: peer speaks {msg.get('v')!r}, this side {PROTOCOL_VERSION}; "
            f"the driver and the workers come from different versions of the pack - restart ComfyUI")
    if expect is not None and msg["t"] not in expect:
        raise ProtocolError(f"unexpected message type {msg['t']!r} (expected one of {sorted(expect)})")
    return msg


class Channel:
    """A Connection with a send lock (the worker's reader thread and main thread both send)."""

    def __init__(self, conn):
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, t: str, **fields) -> None:
        self.send_encoded(encode(t, **fields))

    def send_encoded(self, data: bytes) -> None:
        """A message made by encode() once for several channels (a job goes to every rank alike)."""
        with self._send_lock:
            self.conn.send_bytes(data)

    def recv(self, expect: set | None = None, timeout: float | None = None) -> dict:
        """One message; `timeout` seconds at most (TimeoutError), EOFError if the peer is gone."""
        if timeout is not None and not self.conn.poll(timeout):
            raise TimeoutError(f"no message within {timeout:.1f} s")
        return decode(self.conn.recv_bytes(MAX_MESSAGE_BYTES), expect)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def _with_deadline(sock: socket.socket, fn, timeout: float):
    """Run a blocking handshake on `sock`; shut the socket down if it takes longer than `timeout`.

    `Connection` reads with os.read, which ignores socket timeouts, so a silent peer
    would block the handshake forever; shutting the socket down wakes the read with EOF.
    """
    timer = threading.Timer(timeout, lambda: _shutdown(sock))
    timer.daemon = True
    timer.start()
    try:
        return fn()
    finally:
        timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def authenticate_server(sock: socket.socket, authkey: bytes, timeout: float = HANDSHAKE_TIMEOUT_S):
    """Driver side of the stdlib HMAC handshake on an accepted socket; a Connection, or None if refused.

    The same two calls `Listener.accept()` makes, with a deadline so that a peer that
    connects and says nothing cannot stall the driver.
    """
    from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge

    conn = Connection(os.dup(sock.fileno()))
    try:
        def shake():
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        _with_deadline(sock, shake, timeout)
        return conn
    except (AuthenticationError, EOFError, OSError, ValueError):
        conn.close()
        return None
    finally:
        sock.close()


def _connect_retrying(address: str, timeout: float) -> socket.socket:
    """Connect, retrying while the driver's backlog is full (other peers may be queued in it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ":" in address and not address.startswith("/"):
                host, port = address.rsplit(":", 1)
                sock = socket.create_connection((host, int(port)), timeout=HANDSHAKE_TIMEOUT_S)
            else:
                sock = socket.socket(socket.AF_UNIX)
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                try:
                    sock.connect(address)
                except BaseException:
                    sock.close()
                    raise
            sock.settimeout(None)
            return sock
        except (BlockingIOError, ConnectionRefusedError, InterruptedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def connect(address: str, authkey: bytes, timeout: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """Worker side: connect to the driver (unix socket path or host:port) and authenticate."""
    from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

    sock = _connect_retrying(address, timeout=30.0)
    conn = Connection(os.dup(sock.fileno()))

    def shake():
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    try:
        _with_deadline(sock, shake, timeout)
    finally:
        sock.close()
    return Channel(conn)


def new_authkey() -> bytes:
    return os.urandom(32)
