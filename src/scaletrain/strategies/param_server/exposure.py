"""What a restarted server lost that its workers had seen acknowledged: counted, never silent.

A server restored from its backup holds every update its workers heard of (the backup
acknowledged each before the reply: replica.py). One restored from its checkpoint does not:
without --ps-replicas, or when its backup held no copy (the backup had died and was still
copying the slice again, or died with it), the updates after that checkpoint are gone,
although workers had their replies. Every reply carries the server's version, and a worker
says the last one it saw when it joins the restarted server; the difference to the version
the server restored is the count of acknowledged updates it lost. It is logged as a warning,
written as an ``acknowledged_lost`` event (summary.json's recoveries and
``ps.lost_acknowledged_updates`` report it), and a run with backups that lost none says 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("scaletrain.ps.exposure")


class AcknowledgedLoss:
    """One server incarnation's count. ``restored``: its version after its restore."""

    def __init__(self, *, server: int, attempt: int, restored: int, backed_up: bool,
                 record: Callable[[dict[str, Any]], None]) -> None:  # fmt: skip
        self.server, self.attempt, self.restored = server, attempt, restored
        self.backed_up, self.record = backed_up, record
        self.answered: set[int] = set()  # workers this incarnation has replied to
        self.lost = 0

    def replied(self, worker: int) -> None:
        self.answered.add(worker)

    def joined(self, worker: int, seen: int) -> None:
        """``worker`` joins, having seen ``seen`` as this slice's version (of the earlier
        incarnation, unless this one has replied to it already)."""
        if worker in self.answered or seen - self.restored <= self.lost:
            return
        self.lost = seen - self.restored
        why = ("its backup held no copy (it was copying the slice again, or died too)"
               if self.backed_up else "without --ps-replicas a restarted server continues "
               "from its checkpoint")  # fmt: skip
        log.warning("server %d restored version %d, and worker %d had seen version %d: %d "
                    "acknowledged updates lost, since %s", self.server, self.restored, worker,
                    seen, self.lost, why)  # fmt: skip
        self.record({"event": "acknowledged_lost", "server": self.server,
                     "attempt": self.attempt, "updates": self.lost, "worker": worker,
                     "restored_version": self.restored, "seen_version": seen})  # fmt: skip
