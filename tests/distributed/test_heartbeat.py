"""The nodes' heartbeat (``distributed.heartbeat``) over 127.0.0.1, with short periods: each way
a peer can be lost is noticed within its bound and named; a clean stop is no loss. And the typed
error that names a lost rank survives the trip between processes."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from pagellm.distributed.heartbeat import Loss, NodeBeat, NodeWatch
from pagellm.worker.errors import DeadRankError, RankError, dead_rank_in

PERIOD, TIMEOUT = 0.05, 0.5  # the real ones are 1 s and 10 s
BOUND = 10.0  # generous: each wait ends on its condition, long before this


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, f"not within {BOUND:.0f}s: {what}"
        time.sleep(0.01)


class Beat:
    """Node 1's end, recording what it lost."""

    def __init__(self, port: int, check: Callable[[], Loss | None] = lambda: None) -> None:
        self.lost: list[Loss] = []
        self.beat = NodeBeat("127.0.0.1", port, 1, check, self.lost.append, PERIOD, TIMEOUT)


@pytest.fixture
def watch() -> Iterator[NodeWatch]:
    watch = NodeWatch("127.0.0.1", PERIOD, TIMEOUT)
    yield watch
    watch.close()


def _accept(watch: NodeWatch, nnodes: int = 2) -> threading.Thread:
    thread = threading.Thread(target=watch.accept, args=(nnodes, BOUND), daemon=True)
    thread.start()
    return thread


def test_beats_keep_both_ends_quiet_and_a_clean_stop_is_no_loss(watch: NodeWatch) -> None:
    accepting = _accept(watch)
    node1 = Beat(watch.port)
    accepting.join(BOUND)
    time.sleep(4 * TIMEOUT)  # several timeouts of beats: neither end may call the other gone
    assert watch.loss() is None and node1.lost == []
    watch.close()  # node 0 stops the engine: its bye comes before the close
    node1.beat.close()
    assert node1.lost == [] and watch.loss() is None


def test_a_node_whose_process_ends_is_lost_at_once(watch: NodeWatch) -> None:
    accepting = _accept(watch)
    peer = socket.create_connection(("127.0.0.1", watch.port))
    peer.sendall(b"1\n")
    accepting.join(BOUND)
    started = time.monotonic()
    peer.close()  # what the kernel does for a killed process
    loss = watch.loss(wait_s=BOUND)
    assert loss == Loss("node 1", "its process ended (its heartbeat connection closed)")
    assert time.monotonic() - started < TIMEOUT  # the close, not the silence


def test_a_silent_node_is_lost_after_the_timeout(watch: NodeWatch) -> None:
    accepting = _accept(watch)
    peer = socket.create_connection(("127.0.0.1", watch.port))  # connected, then hung: never beats
    try:
        peer.sendall(b"1\n")
        accepting.join(BOUND)
        started = time.monotonic()
        loss = watch.loss(wait_s=BOUND)
        assert loss is not None and loss.who == "node 1" and "no heartbeat for 0.5s" in loss.detail
        assert TIMEOUT <= time.monotonic() - started + PERIOD
    finally:
        peer.close()


def test_a_node_reports_its_own_lost_rank(watch: NodeWatch) -> None:
    gone = threading.Event()
    accepting = _accept(watch)
    node1 = Beat(watch.port, lambda: Loss("rank 3", "its process ended (exit code -9)") if gone.is_set() else None)
    accepting.join(BOUND)
    gone.set()
    assert watch.loss(wait_s=BOUND) == Loss("rank 3 on node 1", "its process ended (exit code -9)")
    _wait(lambda: node1.lost == [Loss("rank 3", "its process ended (exit code -9)")], "node 1 gives up")
    node1.beat.close()


def test_a_stray_connection_is_refused_and_a_missing_node_times_out(watch: NodeWatch) -> None:
    accepting = _accept(watch)
    stray = socket.create_connection(("127.0.0.1", watch.port))
    stray.sendall(b"GET / HTTP/1.1\r\n")
    node1 = Beat(watch.port)
    assert stray.recv(16) == b""  # refused: closed
    stray.close()
    accepting.join(BOUND)
    assert not accepting.is_alive()
    node1.beat.close()
    lonely = NodeWatch("127.0.0.1")
    with pytest.raises(TimeoutError, match=r"node\(s\) \[1, 2\] did not open"):
        lonely.accept(3, timeout_s=0.2)
    lonely.close()


@pytest.mark.parametrize("how", ["closes", "goes silent"])
def test_node_0_lost_is_noticed_by_the_other_node(how: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        node1 = Beat(server.getsockname()[1])
        node0, _ = server.accept()
        assert node0.recv(2) == b"1\n"
        started = time.monotonic()
        if how == "closes":
            node0.close()
        _wait(lambda: len(node1.lost) == 1, "node 1 notices node 0 gone")
        assert node1.lost[0].who == "node 0"
        assert ("closed" if how == "closes" else "no heartbeat") in node1.lost[0].detail
        if how == "closes":
            assert time.monotonic() - started < TIMEOUT
        node0.close()
        node1.beat.close()


def test_the_dead_rank_error_names_its_rank_across_processes_and_chains() -> None:
    error = DeadRankError("node 1", "its process ended")
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, RankError) and (copy.who, copy.detail) == ("node 1", "its process ended")
    assert str(copy) == "node 1 is gone: its process ended"
    try:
        try:
            raise error
        except DeadRankError as exc:
            raise RuntimeError("the engine process died") from exc
    except RuntimeError as outer:
        assert dead_rank_in(outer) is error
    assert dead_rank_in(RuntimeError("boom")) is None and dead_rank_in(None) is None
