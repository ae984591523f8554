"""An internal failure in a thread of a long-lived process: end the process at once.

A helper thread (a parameter server's replication, say) that hits a bug, rather than a dead
peer, must not die quietly and leave the rest of its process waiting for what it would have
done: a server whose backup thread failed on a shape mismatch held its primary's forward,
and with it every worker, until gloo's timeout. ``die_internal`` logs the traceback and
exits with INTERNAL_EXIT_CODE; the launchers never restart a process that exits so (the
same code would fail the same way) and fail the job at once as an internal failure, with
the last lines of that process's log.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger("scaletrain.internal")

INTERNAL_EXIT_CODE = 70  # EX_SOFTWARE


def die_internal(what: str, error: BaseException) -> None:
    """Log ``what`` failed with ``error`` (and its traceback), then exit the process now."""
    trace = "".join(traceback.format_exception(error)).rstrip()
    log.error("internal failure in %s (a bug in scaletrain, not in its input): %s: %s\n%s",
              what, type(error).__name__, error, trace)  # fmt: skip
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERNAL_EXIT_CODE)


def guarded(
    target: Callable[[], Any], what: str, *, stop: threading.Event,
    expected: tuple[type[BaseException], ...] = (),
) -> Callable[[], None]:  # fmt: skip
    """``target`` as a thread's body: an exception it lets out ends the process, unless
    the process is stopping (``stop`` is set) or it is one of ``expected`` (a lost
    connection to the job's store: logged, and the thread ends as it did)."""

    def body() -> None:
        try:
            target()
        except expected as e:
            log.warning("%s ended: %s: %s", what, type(e).__name__, str(e)[:200])
        except BaseException as e:  # every other escape is a bug
            if not stop.is_set():
                die_internal(what, e)

    return body
