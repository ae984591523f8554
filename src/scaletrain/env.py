"""Every environment variable scaletrain reads or sets, by name, in one place.

The launcher talks to the processes it starts through their environment (torch's elastic
agent does the same with RANK, WORLD_SIZE, ...). The names of our own are here, so that a
reader can see them all at once and no two modules spell one differently.
"""

from __future__ import annotations

import os

# Set by the launcher for its workers.
ATTEMPT = "SCALETRAIN_ATTEMPT"  # the rendezvous round of this world (rendezvous.py)
BIND = "SCALETRAIN_BIND"  # where rank 0's worker store listens (--bind)
MODE = "SCALETRAIN_MODE"  # restart, inplace or ps (launch/modes.py)
PS_ROLE = "SCALETRAIN_PS_ROLE"  # ps: "worker" or "server"
PS_STORE = "SCALETRAIN_PS_STORE"  # ps: HOST:PORT of the job's store
LIGHTHOUSE = "SCALETRAIN_LIGHTHOUSE"  # inplace: URL of torchft's lighthouse
ADDR = "SCALETRAIN_ADDR"  # inplace: this node's address, where a replica listens
GROUP_PORT = "SCALETRAIN_GROUP_PORT"  # inplace HSDP: the port of the replica group's store
JOB_RUN = "SCALETRAIN_JOB_RUN"  # which run of the job this is (launch/jobs.py)
ATTEMPT_BASE = "SCALETRAIN_ATTEMPT_BASE"  # the first attempt number of this job run
AGENT_PID = "SCALETRAIN_AGENT_PID"  # the process that supervises this one (forkserver.py)
# Given by the user (or the launcher, from --join-token-file).
JOIN_TOKEN = "SCALETRAIN_JOIN_TOKEN"  # the secret a process proves to join the ps
CACHE = "SCALETRAIN_CACHE"  # where built-in datasets are cached
# The test suite's stress knobs (scripts/stress.py).
STRESS_SEED = "SCALETRAIN_STRESS_SEED"  # a stress round's seed: new random draws
RESUME_DRAWS = "SCALETRAIN_RESUME_DRAWS"  # draws of the bitwise-resume property test

# torch's own, as its elastic agent sets them (our fleets set them alike).
RANK = "RANK"  # this process's global rank
WORLD_SIZE = "WORLD_SIZE"  # processes in the job
LOCAL_RANK = "LOCAL_RANK"  # its rank on this node
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # processes on this node
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # the attempt: restarts so far


def get_int(name: str, default: int = 0) -> int:
    return int(os.environ.get(name, str(default)))
