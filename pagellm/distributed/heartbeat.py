"""Liveness between the nodes of one engine, on a channel of its own beside the steps' gloo group.

Why: gloo notices a dead peer only when a step is sent (an idle engine looked healthy with a
node gone), and waits out its timeout for a peer that is hung or cut off (a step then hung).
Here every other node keeps one TCP connection to node 0 and both ends send a beat every
``HEARTBEAT_PERIOD_S`` from a thread of their own, so beats go on while a step blocks in gloo
and add nothing to a step: a peer whose process ended is noticed at once (its connection
closes), a silent one after ``HEARTBEAT_TIMEOUT_S``, and a node whose own rank died says so
before it leaves.

The connection carries lines: a node's first line is its node rank, then ``.`` is a beat, ``!``
a clean stop (the close that follows is no death), ``x WHO<TAB>DETAIL`` a rank of that node is
gone. Nothing is unpickled: the port is open to the network like the rendezvous's.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

HEARTBEAT_PERIOD_S = 1.0  # how often each end beats (and how often the engine checks its ranks)
HEARTBEAT_TIMEOUT_S = 10.0  # silence after which a peer counts as gone (hung, or cut off)
CONNECT_TIMEOUT_S = 60.0  # the other nodes connect right after the rendezvous they all passed
HELLO_TIMEOUT_S = 5.0  # a node names itself as it connects: a silent stray connection is dropped

BEAT, BYE, GONE = b".", b"!", b"x "
_MAX_LINE = 4096  # a peer sending more without a newline is not one of ours


@dataclass(frozen=True)
class Loss:
    """A peer (or a rank of one) found gone: ``who`` names it for clients, ``detail`` says how."""

    who: str
    detail: str


def _family(host: str) -> socket.AddressFamily:
    """IPv4 or IPv6, as ``host`` (the address every node reaches node 0 at) resolves."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]


def _read_line(sock: socket.socket) -> bytes:
    """One short line from a blocking socket (b"" if it closed or sent junk first)."""
    line = b""
    while not line.endswith(b"\n") and len(line) < 64:
        chunk = sock.recv(1)
        if not chunk:
            return b""
        line += chunk
    return line.strip() if line.endswith(b"\n") else b""


class NodeWatch:
    """Node 0's end: one connection per other node, beats to each, and the first node found
    gone (its connection closed or broke, silent past the timeout, or a rank of it reported)."""

    def __init__(self, master_addr: str, period_s: float = HEARTBEAT_PERIOD_S, timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self._period_s, self._timeout_s = period_s, timeout_s
        self._server = socket.create_server(("", 0), family=_family(master_addr))
        self.port: int = self._server.getsockname()[1]
        self._peers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._loss: Loss | None = None  # guarded by _lock
        self._lost = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def accept(self, nnodes: int, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Wait until nodes 1..nnodes-1 have connected (each naming itself), then start watching."""
        deadline = time.monotonic() + timeout_s
        while len(self._peers) < nnodes - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, nnodes)) - set(self._peers))
                raise TimeoutError(f"node(s) {missing} did not open their heartbeat within {timeout_s:.0f}s")
            self._server.settimeout(remaining)
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            sock.settimeout(min(max(deadline - time.monotonic(), 0.1), HELLO_TIMEOUT_S))
            try:
                hello = _read_line(sock)
            except OSError:
                hello = b""
            node = int(hello) if hello.isdigit() else -1
            if not 0 < node < nnodes or node in self._peers:
                logger.warning("refused a heartbeat connection that named itself %r", hello[:16])
                sock.close()
                continue
            sock.setblocking(False)
            self._peers[node] = sock
        self._server.close()
        self._thread = threading.Thread(target=self._run, name="pagellm-node-watch", daemon=True)
        self._thread.start()

    def loss(self, wait_s: float = 0.0) -> Loss | None:
        """The first node found gone (waiting up to ``wait_s`` for one), else None."""
        if wait_s > 0:
            self._lost.wait(wait_s)
        with self._lock:
            return self._loss

    def close(self) -> None:
        """A clean stop: stop watching, then tell every node (its connection's close is then no death)."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(self._period_s + 5.0)
        for sock in self._peers.values():
            try:
                sock.setblocking(True)
                sock.settimeout(1.0)
                sock.sendall(BYE + b"\n")
            except OSError:
                pass
            sock.close()
        self._peers = {}
        self._server.close()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        heard = {node: time.monotonic() for node in self._peers}
        pending = {node: b"" for node in self._peers}
        for node, sock in self._peers.items():
            selector.register(sock, selectors.EVENT_READ, node)
        next_beat = time.monotonic()
        while not self._closing.is_set() and selector.get_map():
            if time.monotonic() >= next_beat:
                for key in list(selector.get_map().values()):
                    try:
                        key.fileobj.send(BEAT + b"\n")  # type: ignore[union-attr]
                    except BlockingIOError:
                        pass  # the node is not reading: its silence tells
                    except OSError:
                        self._drop(selector, key.data, "its heartbeat connection broke")
                next_beat = time.monotonic() + self._period_s
            for key, _ in selector.select(max(next_beat - time.monotonic(), 0.0)):
                self._read(selector, key.data, heard, pending)
            now = time.monotonic()
            for key in list(selector.get_map().values()):
                if now - heard[key.data] > self._timeout_s:
                    self._drop(selector, key.data, f"it sent no heartbeat for {self._timeout_s:g}s (hung, or cut off from node 0)")
        selector.close()

    def _read(self, selector: selectors.BaseSelector, node: int, heard: dict[int, float], pending: dict[int, bytes]) -> None:
        sock = self._peers[node]
        try:
            data = sock.recv(_MAX_LINE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(selector, node, "its process ended (its heartbeat connection closed)")
            return
        heard[node] = time.monotonic()
        *lines, pending[node] = (pending[node] + data).split(b"\n")
        if len(pending[node]) > _MAX_LINE:
            self._drop(selector, node, "its heartbeat connection sent junk")
            return
        for line in lines:
            if line.startswith(GONE):
                who, _, detail = line[len(GONE) :].decode(errors="replace").partition("\t")
                self._drop(selector, node, detail, who=f"{who} on node {node}")
                return

    def _drop(self, selector: selectors.BaseSelector, node: int, detail: str, who: str | None = None) -> None:
        """Stop watching ``node`` and record it gone (the first loss is the one reported)."""
        selector.unregister(self._peers[node])
        with self._lock:
            if self._loss is None and not self._closing.is_set():
                self._loss = Loss(who or f"node {node}", detail)
                logger.error("%s is gone: %s", self._loss.who, detail)
                self._lost.set()


class NodeBeat:
    """The end of a node other than 0: beats to node 0, checks this node's ranks with ``check``
    each period (a loss is reported to node 0), and calls ``on_lost`` once node 0 or a rank here
    is gone (that node then exits: its main thread may be blocked in gloo, waiting for a step)."""

    def __init__(
        self, master_addr: str, port: int, node_rank: int, check: Callable[[], Loss | None],
        on_lost: Callable[[Loss], None], period_s: float = HEARTBEAT_PERIOD_S, timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:  # fmt: skip
        self._check, self._on_lost = check, on_lost
        self._period_s, self._timeout_s = period_s, timeout_s
        self._closing = threading.Event()
        self._sock = socket.create_connection((master_addr, port), timeout=CONNECT_TIMEOUT_S)
        self._sock.sendall(f"{node_rank}\n".encode())
        self._thread = threading.Thread(target=self._run, name="pagellm-node-beat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """A clean stop (node 0 said stop): beats end, and nothing is a loss any more."""
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv
        except OSError:
            pass
        self._thread.join(self._period_s + 5.0)
        self._sock.close()

    def _run(self) -> None:
        heard = next_beat = time.monotonic()
        while not self._closing.is_set():
            if time.monotonic() >= next_beat:
                loss = self._check()
                if loss is not None:
                    self._send(GONE + f"{loss.who}\t{loss.detail}".encode())
                    return self._lose(loss)
                if not self._send(BEAT):
                    return self._lose(Loss("node 0", "its heartbeat connection broke"))
                next_beat = time.monotonic() + self._period_s
            self._sock.settimeout(max(next_beat - time.monotonic(), 0.01))
            try:
                data: bytes | None = self._sock.recv(_MAX_LINE)
            except TimeoutError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                return self._lose(Loss("node 0", "its process ended (its heartbeat connection closed)"))
            if data:
                heard = time.monotonic()
                if BYE in data:  # node 0 stops the engine: the step channel says stop next
                    self._closing.set()
                    return None
            if time.monotonic() - heard > self._timeout_s:
                return self._lose(Loss("node 0", f"it sent no heartbeat for {self._timeout_s:g}s (hung, or cut off)"))
        return None

    def _send(self, message: bytes) -> bool:
        try:
            self._sock.sendall(message + b"\n")
            return True
        except OSError:
            return False

    def _lose(self, loss: Loss) -> None:
        if not self._closing.is_set():
            self._on_lost(loss)
