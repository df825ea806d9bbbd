"""Run one check with a wall-clock deadline, on a main thread or in any other thread.

On a process's main thread the deadline is a SIGALRM timer (no extra process, microseconds of overhead). Signals
reach only the main thread, so anywhere else the check runs in a forked child that is killed at the deadline.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class CheckTimeout(BaseException):
    """The check ran past its deadline.

    A BaseException on purpose: verifiers and libraries (math-verify, sympy) catch `Exception` broadly and would
    otherwise swallow the timeout and carry on into the next slow step.
    """


def call_with_deadline(fn: Callable[..., T], timeout_s: float | None, /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, or CheckTimeout after `timeout_s` seconds (None or <= 0: no deadline)."""
    if not timeout_s or timeout_s <= 0:
        return fn(*args, **kwargs)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _call_with_alarm(fn, timeout_s, args, kwargs)
    return _call_in_child(fn, timeout_s, args, kwargs)


def _call_with_alarm(fn: Callable[..., T], timeout_s: float, args: tuple, kwargs: dict) -> T:
    fired = []

    def on_alarm(signum, frame):
        fired.append(True)
        if clamped and callable(outer_handler):
            outer_handler(signum, frame)  # it is the outer deadline that expired: the outer handler reports it
        raise CheckTimeout(f"no result within {timeout_s:g} s")

    # Nesting: an outer deadline (another call_with_deadline, pytest-timeout) keeps its timer. Ours fires no later
    # than it, and the outer one is re-armed with what remains of it afterwards. When the outer deadline is the
    # earlier one, the alarm is the outer deadline: its own handler runs, from inside this call, and the timer is
    # not re-armed to fire a second time once this call has returned.
    outer_handler = signal.signal(signal.SIGALRM, on_alarm)
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    clamped = 0 < outer_left <= timeout_s
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, outer_left if clamped else timeout_s)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left > 0 and not (clamped and fired):
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 1e-6))


def _child_main(conn, fn: Callable, args: tuple, kwargs: dict) -> None:
    try:
        result = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", e)
    try:
        conn.send(result)
    except Exception as e:  # noqa: BLE001 - an unpicklable result or exception
        conn.send(("error", RuntimeError(f"check result could not be sent back: {type(e).__name__}: {e}")))


def _call_in_child(fn: Callable[..., T], timeout_s: float, args: tuple, kwargs: dict) -> T:
    # fork: the child inherits fn and its module state (a verifier loaded from a file need not be importable)
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(send, fn, args, kwargs), daemon=True)
    child.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            raise CheckTimeout(f"no result within {timeout_s:g} s")
        try:
            status, value = recv.recv()
        except EOFError:
            child.join()
            raise RuntimeError(f"check process died (exit code {child.exitcode})") from None
    finally:
        recv.close()
        if child.is_alive():
            child.kill()
        child.join()
    if status == "error":
        raise value
    return value
