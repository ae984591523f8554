"""How the launcher's process leaves when one of its helper threads cannot stop.

A helper thread inside a blocking store call on a cut link may never return (torch's
TCPStore client waits in recv() without a timeout when the store's host is cut off). Left to
interpreter finalization, such a daemon thread is forced out of its C++ frames when it next
takes the GIL, and the process aborts ("terminate called without an active exception",
exit -6) after the run has finished well. The thread's owner marks it here; the command
line then leaves with os._exit once everything it printed is flushed (files the run wrote
are renamed into place before; io.atomic_write_*). A caller of the Python API keeps its
process: the thread stays behind, parked in its call.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

_STUCK: list[threading.Thread] = []


def mark_stuck(thread: threading.Thread) -> None:
    """``thread`` did not stop when asked: it is inside a call that may never return."""
    _STUCK.append(thread)


def any_stuck() -> bool:
    return any(t.is_alive() for t in _STUCK)


def leave(code: int) -> int:
    """The command line's exit: ``code``, past interpreter finalization if a marked thread
    is still inside its call; otherwise returns ``code`` for sys.exit.

    The exit status is decided here, so from now on a preemption signal is ignored: it can
    change nothing (launch/signals.py), and Python's finalization puts the default action
    back for every signal that has a Python handler, so a SIGTERM in the last milliseconds of
    a finished job killed it (143) where the promise is 0 or 3. SIG_IGN is not a Python
    handler: finalization leaves it, and it holds for every thread."""
    from scaletrain.launch.signals import GUARD, PREEMPT_SIGNALS

    if GUARD.installed:  # `run` and `demo`: the commands that answer preemption
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    if any_stuck():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
