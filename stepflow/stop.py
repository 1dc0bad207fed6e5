"""A process-wide stop request: set by the SIGTERM / SIGINT handler of a training run, polled by long waits.

Blocking work that can outlast a preemption grace period (a remote reward call, a retry back-off) waits in short
slices with :func:`wait` and raises :class:`StopRequested` once a stop was asked for, so the run can write its
checkpoint and exit within a bounded time.
"""

from __future__ import annotations

import threading

__all__ = ["STOP", "StopRequested", "check", "wait", "request", "clear", "reason"]

#: set once a stop was requested (signal handler or test); cleared by :func:`clear`
STOP = threading.Event()
#: the signal (or reason) that asked for the stop
_reason: list[str] = []


class StopRequested(RuntimeError):
    """Raised by :func:`check` / :func:`wait` when a stop was requested."""


def request(reason: str = "stop requested") -> None:
    """Ask every polling wait to stop (safe to call from a signal handler)."""
    _reason[:] = [reason]
    STOP.set()


def clear() -> None:
    _reason.clear()
    STOP.clear()


def reason() -> str:
    return _reason[0] if _reason else "stop requested"


def check() -> None:
    """Raise :class:`StopRequested` if a stop was requested."""
    if STOP.is_set():
        raise StopRequested(reason())


def wait(seconds: float) -> None:
    """Sleep ``seconds`` (a back-off), returning early with :class:`StopRequested` as soon as a stop is requested."""
    if STOP.wait(max(0.0, float(seconds))):
        raise StopRequested(reason())
