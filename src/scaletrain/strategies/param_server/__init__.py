"""--strategy ps: a sharded parameter server with bsp, asp and ssp consistency.

``--nproc-per-node N --num-servers K`` starts K server processes and N - K workers (ranks
0..W-1 are the workers, W..N-1 the servers), all from one launcher (supervisor.py); across
``--nnodes M`` the M x N ranks are laid out the same way, node i running its N of them. The
flattened parameters are cut into K slices balanced by bytes (consistency.shard_ranges: a
large tensor may be split); each server keeps its slice and the optimizer state for it and
applies the workers' gradients (server.py). Workers pull parameters, compute gradients on
batches leased from server 0 (coordinator.py), and push them (client.py), over gloo
point-to-point links (transport.py, which says why not RPC).

The modules:
- consistency.py  pure rules: partition, the ssp bound, staleness
- coordinator.py  pure data plan: leases dealt, committed, requeued; exactly once per epoch
- transport.py    one two-rank gloo group per worker-server link; the message layout
- server.py       one server process
- client.py       one worker process
- supervisor.py   the launcher side: processes, restarts, summary.json
"""

from __future__ import annotations

import os
from typing import ClassVar

from torch import nn

from scaletrain.config import RunConfig, parse_nnodes
from scaletrain.strategies.base import StrategyChecks, model_bytes
from scaletrain.strategies.param_server.admission import TOKEN_ENV


class ParameterServer(StrategyChecks):
    launcher: ClassVar[str] = "scaletrain.strategies.param_server.supervisor:run_ps"

    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, model: nn.Module | None) -> None:
        k = cfg.ps.num_servers
        lo, hi = parse_nnodes(cfg.launch.nnodes)
        if lo != hi:
            raise ValueError(
                f"nnodes: a parameter server job has a fixed set of processes; pass --nnodes N, "
                f"not {cfg.launch.nnodes!r}"
            )
        if hi > 1 and not (cfg.launch.join_token_file or os.environ.get(TOKEN_ENV)):
            raise ValueError(
                "join token: a parameter server across nodes needs the same secret on every "
                f"node: --join-token-file PATH or ${TOKEN_ENV} (otherwise each node draws its "
                "own and their processes cannot join each other)"
            )
        if k >= world_size:
            raise ValueError(
                f"num_servers: {k} servers leave no worker in a world of {world_size} processes; "
                f"--nproc-per-node must be more than --num-servers (e.g. --nproc-per-node "
                f"{k + 2} --num-servers {k} gives 2 workers)"
            )

    @classmethod
    def estimate_state_bytes(
        cls, model: nn.Module, optimizer_copies: int, cfg: RunConfig, world_size: int
    ) -> int | None:
        """The larger of a worker (a replica and its gradients) and a server (its slice, the
        optimizer state for it and a gradient buffer)."""
        total = model_bytes(model)
        server = -(-total // cfg.ps.num_servers) * (2 + optimizer_copies)
        return max(2 * total, server)
