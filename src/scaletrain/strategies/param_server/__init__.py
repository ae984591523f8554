"""--strategy ps: a sharded parameter server with bsp, asp and ssp consistency.

``--nproc-per-node N --num-servers K`` starts K server processes and N - K workers (ranks
0..W-1 are the workers, W..N-1 the servers), all from one launcher (launch/ps.py); across
``--nnodes M`` the M x N ranks are laid out the same way, node i running its N of them. The
flattened parameters are cut into K slices balanced by bytes (consistency.shard_ranges: a
large tensor may be split); each server keeps its slice and the optimizer state for it and
applies the workers' gradients (server.py). Workers pull parameters, compute gradients on
batches leased from server 0 (coordinator.py), and push them (worker.py: a strategy of the one
training loop, its plan the leases), over gloo point-to-point links (transport.py, which says
why not RPC).

The modules:
- consistency.py  pure rules: partition, the ssp bound, staleness
- coordinator.py  pure data plan: leases dealt, committed, requeued; exactly once per epoch
- transport.py    one two-rank gloo group per worker-server link; the message layout
- server.py       one server process
- worker.py       a worker: the strategy the training loop steps with, and its lease plan
(the launcher side, processes, restarts and summary.json, is launch/ps.py)
"""
