"""`IOThreads`: the pieces of one storage call on the caller's thread and a few helpers."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from hicache.actors._io_threads import IOThreads

pytestmark = pytest.mark.timeout(30)


def test_results_come_in_item_order_from_every_thread() -> None:
    threads = IOThreads(3, "test-io")
    try:
        ran_on: dict[int, str] = {}

        def square(x: int) -> int:
            ran_on[x] = threading.current_thread().name
            return x * x

        assert threads.map(square, list(range(10))) == [x * x for x in range(10)]
        # Item k on thread k % 3: the caller's, then the two helpers.
        me = threading.current_thread().name
        assert {ran_on[k] for k in (0, 3, 6, 9)} == {me}
        assert {ran_on[k] for k in (1, 4, 7)} == {"test-io-1"}
        assert {ran_on[k] for k in (2, 5, 8)} == {"test-io-2"}
    finally:
        threads.close()


def test_one_thread_or_one_item_runs_on_the_caller_and_starts_no_helper() -> None:
    before = threading.active_count()
    for threads, items in ((IOThreads(1, "test-io"), [1, 2, 3]), (IOThreads(4, "test-io"), [5])):
        names = threads.map(lambda _: threading.current_thread().name, items)
        assert set(names) == {threading.current_thread().name}
        assert threading.active_count() == before
    assert IOThreads(2, "test-io").map(abs, []) == []


def test_a_failed_piece_is_raised_only_after_every_other_piece_finished() -> None:
    """A read's pieces write into host slots: none may still run once the call has raised."""
    threads = IOThreads(2, "test-io")
    try:
        finished: list[int] = []

        def piece(x: int) -> int:
            if x == 0:
                raise OSError(5, "caller's piece failed")
            time.sleep(0.05)  # the helper's piece is still running when the caller's fails
            finished.append(x)
            return x

        with pytest.raises(OSError, match="caller's piece failed"):
            threads.map(piece, [0, 1])
        assert finished == [1]

        def helper_fails(x: int) -> int:
            if x == 1:
                raise ValueError("helper's piece failed")
            return x

        with pytest.raises(ValueError, match="helper's piece failed"):
            threads.map(helper_fails, [0, 1, 2, 3])
        assert threads.map(abs, [-1, -2, -3]) == [1, 2, 3], "a failure leaves the helpers usable"
    finally:
        threads.close()


def test_helpers_are_daemon_threads_that_have_ended_when_close_returns() -> None:
    """A process that exits right after a close must find no helper halfway through its work:
    close waits for each to finish what it was given."""
    threads = IOThreads(3, "test-io-close")
    threads.map(abs, [1, 2, 3])
    helpers = [t for t in threading.enumerate() if t.name.startswith("test-io-close-")]
    assert len(helpers) == 2 and all(t.daemon for t in helpers)
    busy = threads.start(time.sleep, 0.3)  # the first helper is still sleeping when close is called
    threads.close()
    assert busy.done() and busy.result() == [None]
    assert not any(t.is_alive() for t in helpers)


def test_a_forked_child_starts_helpers_of_its_own() -> None:
    """A fork keeps the parent's queues but not its threads: the child must not wait on them."""
    threads = IOThreads(2, "test-io-fork")
    try:
        assert threads.map(abs, [-1, -2]) == [1, 2]  # the parent's helper is running
        pid = os.fork()
        if pid == 0:  # the child: a second map within 10 s, or a failing exit status
            signal.alarm(10)
            ok = threads.map(abs, [-3, -4, -5]) == [3, 4, 5]
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert threads.map(abs, [-6, -7]) == [6, 7]  # the parent's helpers still serve
    finally:
        threads.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_fewer_than_one_thread_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="at least 1 thread"):
        IOThreads(bad, "test-io")  # type: ignore[arg-type]


def test_start_runs_one_piece_on_the_first_helper_while_the_caller_goes_on() -> None:
    threads = IOThreads(2, "test-io-start")
    try:
        gate = threading.Event()

        def piece(x: int) -> tuple[int, str]:
            assert gate.wait(5), "the caller never went on"
            return x * 10, threading.current_thread().name

        done = threads.start(piece, 4)
        assert not done.done()  # it waits for the caller, which is not waiting for it
        gate.set()
        assert done.result(timeout=5) == [(40, "test-io-start-1")]

        def fails(x: int) -> int:
            raise OSError(28, "No space left on device")

        failed = threads.start(fails, 1)
        with pytest.raises(OSError, match="No space left"):
            failed.result(timeout=5)
        assert threads.start(abs, -3).result(timeout=5) == [3], "a failure leaves the helper usable"
        assert threads.map(abs, [-1, -2]) == [1, 2]
    finally:
        threads.close()


def test_start_without_a_helper_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="needs a helper thread"):
        IOThreads(1, "test-io").start(abs, -1)
