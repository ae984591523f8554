"""Every key the parameter server's processes and its launcher read and write in the job's
store, in one place: each conversation spells its keys once, here, and both sides import them.

The job (launch/ps.py) ends every server with ``FINISH`` or ``PREEMPT`` and records each
process's end and each node's liveness; a server publishes its incarnation (its process
attempt) and, under that, where it listens; a worker's link to a server is a scope of its
own; backups, promotions and cuts have keys of their own below.
"""

from __future__ import annotations

FINISH = "ps/finish"  # set by the launcher: the job is over, every server stops
PREEMPT = "ps/preempt"  # set by the launcher: the job was preempted, servers cut and stop


def incarnation(k: int) -> str:
    """Server ``k``'s current process attempt (set as it starts serving)."""
    return f"ps/server{k}/incarnation"


def server_scope(k: int, attempt: int) -> str:
    """The scope under which server ``k``'s ``attempt`` accepts workers."""
    return f"ps/server{k}.{attempt}"


def server_host(k: int, attempt: int) -> str:
    """The address of the process serving slice ``k`` in that incarnation (a backup's, when
    it took the slice over)."""
    return f"{server_scope(k, attempt)}/host"


def worker_link(k: int, attempt: int, worker: int, worker_attempt: int) -> str:
    """The link between server ``k``'s ``attempt`` and worker ``worker``'s process attempt."""
    return f"ps/link/s{k}.{attempt}/w{worker}.{worker_attempt}"


def end(rank: int) -> str:
    """How process ``rank`` ended, as its node's launcher saw it (finished, died, ...)."""
    return f"ps/end/{rank}"


def alive(node: int) -> str:
    """A counter node ``node``'s launcher increments while it lives."""
    return f"ps/alive/{node}"


def death(rank: int, attempt: int) -> str:
    """Set by the launcher (to the cause) when process ``rank``'s ``attempt`` dies."""
    return f"ps/dead/{rank}.{attempt}"


def primary(k: int) -> str:
    """Where the primary of slice ``k`` publishes its process attempt."""
    return f"ps/replica/{k}/primary"


def backup(k: int) -> str:
    """Where the backup of slice ``k`` publishes its process attempt and link generation."""
    return f"ps/replica/{k}/backup"


def promote(k: int) -> str:
    """Set by the launcher when slice ``k``'s primary is gone for good: its backup serves it."""
    return f"ps/promote/{k}"


def stale(k: int) -> str:
    """Set by slice ``k``'s backup when it is asked to serve the slice and holds no copy."""
    return f"ps/promote/{k}/stale"


def replica_link(k: int, primary_attempt: int, backup: str) -> str:
    """The link of slice ``k``'s primary to its backup; ``backup``: the backup's process
    attempt and link generation, "ATTEMPT.GEN"."""
    return f"ps/replica/{k}/link/p{primary_attempt}.b{backup}"


CUT_COUNT = "ps/cut/count"  # store.add: the next cut's n
CUT_LATEST = "ps/cut/latest"  # the n of the last cut begun
CUT_PREEMPT = "ps/cut/preempt"  # the n of the preemption's cut


def cut_applied(n: int, server: int) -> str:
    """The pushes a server had applied when it froze for cut ``n``."""
    return f"ps/cut/{n}/applied/{server}"


def cut_pushes(n: int) -> str:
    """The pushes cut ``n`` holds (empty: abandoned)."""
    return f"ps/cut/{n}/pushes"


def cut_copied(n: int, server: int) -> str:
    """Set by a server once it holds its copy of cut ``n``."""
    return f"ps/cut/{n}/copied/{server}"
