"""A process-wide stop request: set by the SIGTERM / SIGINT handler of a training run, polled by long waits.

Blocking work that can outlast a preemption grace period (a remote reward call, a retry back-off) waits in short
slices with :func:`wait` and raises :class:`~stepflow.errors.StopRequested` once a stop was asked for, so the run can
write its checkpoint and exit within a bounded time.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from stepflow.errors import StopRequested

__all__ = ["STOP", "check", "wait", "request", "clear", "reason", "code", "agree", "signals_handled", "reclaim",
           "EXIT_CODES"]

#: set once a stop was requested (signal handler or test); cleared by :func:`clear`
STOP = threading.Event()
#: the signal (or reason) that asked for the stop
_reason: list[str] = []
#: the handler :func:`signals_handled` installed (empty outside it)
_active: list = []


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


#: exit status of a run stopped by a signal (128 + signal number, as a shell reports it)
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}
#: the reasons as numbers, for ranks to agree on one (:func:`code` / :func:`agree`); a later one wins
_CODES = ("stop requested", "SIGINT", "SIGTERM")


def code() -> int:
    """This process's stop request as a number: 0 none, else 1 + its place in ``_CODES`` (an unknown reason: 1)."""
    if not STOP.is_set():
        return 0
    r = reason()
    return 1 + (_CODES.index(r) if r in _CODES else 0)


def agree(shared: int) -> bool:
    """``shared``: the largest :func:`code` over the ranks. A rank that was not asked to stop itself takes the reason
    of one that was (the signal reaches one process, every rank reports it); returns whether the ranks stop."""
    if shared > 0 and not STOP.is_set():
        request(_CODES[min(int(shared), len(_CODES)) - 1])
    return shared > 0


@contextlib.contextmanager
def signals_handled(announce=None):
    """Inside the context, the first SIGINT / SIGTERM requests a stop (the run finishes or abandons its current
    phase, writes its checkpoint and exits non-zero); a second SIGINT interrupts at once (KeyboardInterrupt).
    ``announce(msg)`` is told once, when the first signal arrives. Handlers are restored on exit; outside the main
    thread (where Python cannot install handlers) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if STOP.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not STOP.is_set():
            request(name)
            if announce is not None:
                announce(f"{name} received: finishing the current phase, then writing the checkpoint"
                         + (" (Ctrl-C again to abort at once)" if signum == signal.SIGINT else ""))

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    clear()
    for s in old:
        signal.signal(s, handler)
    _active[:] = [handler]
    try:
        yield
    finally:
        _active.clear()
        for s, h in old.items():
            signal.signal(s, h)


def reclaim() -> None:
    """Make the handler of the enclosing :func:`signals_handled` the only SIGINT / SIGTERM handler again.

    Lightning's Trainer installs its own SIGTERM handler when fitting starts, chained before ours; under several
    processes that handler runs a ``broadcast`` inside the signal handler, on the signalled rank alone and at
    whatever point that rank was, which pairs with an unrelated collective of the other ranks and can hang the run
    (seen with FSDP2 on 2 gloo processes). Ours only sets :data:`STOP`; the ranks then agree at the next phase
    boundary with one collective that every rank calls at the same point. Called at the start of training; outside
    :func:`signals_handled` or the main thread this does nothing (Lightning restores its predecessor, ours, itself
    at teardown)."""
    if not _active or threading.current_thread() is not threading.main_thread():
        return
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _active[0])
