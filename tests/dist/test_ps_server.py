"""A parameter server in this process, its workers as threads speaking the wire protocol
over real gloo links on loopback:
- bsp: a worker that stays silent (alive, not dead) is dropped from the step after
  --barrier-timeout-s, the step is applied without it, its batch is dealt again first, its
  late push is refused, and it can join again at the next step;
- ssp: a worker too far ahead of the slowest is held until the slowest catches up;
- admission: a joiner without the job's token (or replaying a record) gets no link;
- a cut (asp): a server copies exactly the pushes the cut holds.

Every test ends with its server finished, its workers gone and every thread it started joined
(``no_thread_outlives_its_test``): a daemon thread still inside a torch call at interpreter
exit is forced out by pthread_exit when the call returns, which aborted the whole pytest
process ("terminate called without an active exception") after a failed test here.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from scaletrain.config import from_dict
from scaletrain.strategies.param_server import transport as wire
from scaletrain.strategies.param_server.admission import JoinRefused, join_record
from scaletrain.strategies.param_server.server import ShardServer

BATCH = 2
TOKEN = "the-right-secret"


def client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))


class Worker:
    """The protocol as the worker strategy (worker.py) speaks it, one message at a time."""

    def __init__(
        self, port: int, worker: int, attempt: int = 0, token: str = TOKEN, *, server: int = 0,
        clock: int = 0, numel: int = 2,
    ) -> None:  # fmt: skip
        store = client(port)
        inc = int(store.get(f"ps/server{server}/incarnation"))
        base = f"ps/server{server}.{inc}/joins"
        n = store.add(f"{base}/count", 1)
        store.set(f"{base}/{n}", join_record(token, f"ps/server{server}.{inc}", worker, attempt))
        store.wait([f"{base}/{n}/answer"])
        answer = store.get(f"{base}/{n}/answer").decode()
        if answer != "ok":
            raise JoinRefused(answer)
        self.worker, self.attempt, self.server = worker, attempt, server
        self.clock, self.numel = clock, numel  # pushes so far (what a HELLO claims)
        self.link = wire.Link(client(port), f"ps/link/s{server}.{inc}/w{worker}.{attempt}",
                            server_side=False, timeout_s=30)  # fmt: skip
        _WORKERS.append(self)

    def close(self) -> None:
        """Leave as the worker strategy does at the end: DONE, so the server's handler returns."""
        with contextlib.suppress(RuntimeError):  # the server may be gone already
            done = wire.header(kind=wire.Kind.DONE, worker=self.worker, attempt=self.attempt)
            self.link.send(done)

    def _reply(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        head = torch.zeros(wire.HEADER, dtype=torch.int64)
        params, lease = torch.zeros(self.numel), torch.zeros(BATCH, dtype=torch.int64)
        self.link.recv(head, params, *([lease] if self.server == 0 else []))
        return head, params, lease[: int(head[wire.LEASE_LEN])].tolist()

    def hello(self):
        self.link.send(wire.header(kind=wire.Kind.HELLO, worker=self.worker, attempt=self.attempt,
                                 clock=self.clock))  # fmt: skip
        return self._reply()

    def push(self, step: int, grad: list[float], num_samples: int):
        self.clock += 1
        head = wire.header(kind=wire.Kind.PUSH, step=step, num_samples=num_samples,
                         worker=self.worker, attempt=self.attempt, clock=self.clock)  # fmt: skip
        self.link.send(head)
        self.link.send(torch.tensor(grad), first_tag=1)
        return self._reply()


_WORKERS: list[Worker] = []
_SERVERS: list[tuple[TCPStore, ShardServer]] = []


@pytest.fixture(autouse=True)
def no_thread_outlives_its_test():
    before = set(threading.enumerate())
    yield
    for store, server in _SERVERS:
        store.set("ps/finish", "1")
        server.stop.wait(5)
        with server.cond:  # waiters re-check the stop flag
            server.cond.notify_all()
    for worker in _WORKERS:
        worker.close()
    _SERVERS.clear()
    _WORKERS.clear()
    deadline = time.monotonic() + 40  # a recv in flight ends by its 30 s timeout at worst
    for thread in set(threading.enumerate()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in set(threading.enumerate()) - before]
    assert not alive, f"threads outlived the test: {alive}"


def in_thread(fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", fn(*args)), daemon=True)
    thread.start()
    return thread, out


def start_server(
    tmp_path, consistency: str = "bsp", staleness: int = -1, num_train: int = 8, *,
    index: int = 0, num_servers: int = 1, attempt: int = 0, barrier_timeout_s: float = 1.0,
    checkpoint_every: int = 0,
) -> tuple[TCPStore, ShardServer]:  # fmt: skip
    """Server ``index`` of ``num_servers``, of 2 workers over 2 parameters (both 1.0, SGD
    lr 1), in a thread."""
    (tmp_path / "logs").mkdir()
    cfg = from_dict({
        "train": {"strategy": "ps", "batch_size": BATCH, "epochs": 1},
        "ps": {"consistency": consistency, "barrier_timeout_s": barrier_timeout_s,
               "staleness": staleness,
               "num_servers": num_servers},
        "launch": {"timeout_s": 30.0},
        "fault": {"checkpoint_every": checkpoint_every},
    })  # fmt: skip
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if index:  # the server 0 a cut's follower watches (test_a_cut_...)
        store.set("ps/server0/incarnation", "0")
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    server = ShardServer(
        cfg, model=model, num_train=num_train, shard_sizes=None, index=index, num_workers=2,
        attempt=attempt,
        build_optimizer=lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.0),
        store=client(store.port), new_store=lambda: client(store.port), run_dir=tmp_path,
        token=TOKEN,
    )  # fmt: skip
    threading.Thread(target=server.serve, daemon=True, name="serve").start()
    store.wait([f"ps/server{index}/incarnation"])
    _SERVERS.append((store, server))
    return store, server


def wait_for(server: ShardServer, predicate) -> None:
    """Block until the server's state satisfies ``predicate``, looked at under its lock (not
    every change notifies its condition); fail after 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with server.cond:
            if predicate(server):
                return
        time.sleep(0.01)
    raise AssertionError("the server never reached the awaited state")


def events(tmp_path):
    lines = (tmp_path / "logs" / "ps_events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_joiner_without_the_token_is_refused_and_gets_no_link(tmp_path):
    store, _ = start_server(tmp_path, "asp")
    with pytest.raises(JoinRefused, match="refused: wrong join token"):
        Worker(store.port, 1, token="a-guess")
    [refused] = [e for e in events(tmp_path) if e["event"] == "join_refused"]
    assert refused["worker"] == 1 and refused["why"] == "wrong join token"
    # A record read from the store and replayed is refused too.
    record = store.get("ps/server0.0/joins/1").decode()
    n = store.add("ps/server0.0/joins/count", 1)
    good = join_record(TOKEN, "ps/server0.0", 0, 0)
    store.set(f"ps/server0.0/joins/{n}", good)
    store.wait([f"ps/server0.0/joins/{n}/answer"])
    assert store.get(f"ps/server0.0/joins/{n}/answer") == b"ok"
    # Admitted: connect its link, as the worker would, and leave.
    link = wire.Link(client(store.port), "ps/link/s0.0/w0.0", server_side=False, timeout_s=30)
    link.send(wire.header(kind=wire.Kind.DONE, worker=0, attempt=0))
    n = store.add("ps/server0.0/joins/count", 1)
    store.set(f"ps/server0.0/joins/{n}", good)
    store.wait([f"ps/server0.0/joins/{n}/answer"])
    assert store.get(f"ps/server0.0/joins/{n}/answer") == b"refused: replayed join record"
    assert record.split(":")[:2] == ["1", "0"]
    # The refused worker never became a member: the token holder is served alone.
    head, params, lease = Worker(store.port, 0, attempt=1).hello()
    assert int(head[wire.STATUS]) == wire.Status.OK and params.tolist() == [1.0, 1.0]
    assert [e["worker"] for e in events(tmp_path) if e["event"] == "joined"] == [0]
    store.set("ps/finish", "1")


def test_bsp_drops_a_silent_worker_after_the_barrier_timeout(tmp_path):
    store, server = start_server(tmp_path)
    a, b = Worker(store.port, 0), Worker(store.port, 1)
    # Server 0 deals the first step once both said hello.
    ta, hello_a = in_thread(a.hello)
    tb, hello_b = in_thread(b.hello)
    ta.join(30), tb.join(30)
    (_, _, lease_a), (_, _, lease_b) = hello_a["v"], hello_b["v"]
    assert len(lease_a) == len(lease_b) == BATCH and not set(lease_a) & set(lease_b)

    # a pushes step 1; b stays silent: a's reply comes once the barrier times out.
    head, params, next_a = a.push(1, [1.0, 3.0], BATCH)
    assert int(head[wire.STATUS]) == wire.Status.OK and int(head[wire.VERSION]) == 1
    assert int(head[wire.HELD_US]) >= 0.9e6  # held for the barrier timeout
    assert params.tolist() == [0.0, -2.0]  # 1 - lr * a's gradient alone
    assert next_a == lease_b  # b's batch, requeued, is dealt first
    [lost] = [e for e in events(tmp_path) if e["event"] == "worker_lost"]
    assert lost["worker"] == 1 and lost["how"] == "barrier timeout"

    # b's late push of step 1 is refused, and applies nothing.
    head, _, _ = b.push(1, [100.0, 100.0], BATCH)
    assert int(head[wire.STATUS]) == wire.Status.DROPPED and int(head[wire.VERSION]) == 1

    # b joins again: it waits for the next step, which a's push of step 2 closes. a pushes
    # only once the server holds b's hello: pushed first, step 2 would close without b and
    # step 3 be dealt to a alone (b would then wait for a step 4 that never comes).
    tb, again = in_thread(b.hello)
    wait_for(server, lambda s: 1 in s.live)
    head, params, next_a = a.push(2, [0.0, 1.0], BATCH)
    tb.join(30)
    head_b, params_b, lease_b3 = again["v"]
    assert int(head[wire.VERSION]) == int(head_b[wire.VERSION]) == 2
    assert params.tolist() == params_b.tolist() == [0.0, -3.0]
    assert int(head[wire.LEASE_STEP]) == int(head_b[wire.LEASE_STEP]) == 3
    assert len(next_a) == len(lease_b3) == BATCH and not set(next_a) & set(lease_b3)
    store.set("ps/finish", "1")


def test_ssp_holds_a_worker_that_is_too_far_ahead_until_the_slowest_catches_up(tmp_path):
    store, server = start_server(tmp_path, "ssp", staleness=1, num_train=64)
    a, b = Worker(store.port, 0), Worker(store.port, 1)
    _, _, lease_a = a.hello()
    _, _, lease_b = b.hello()
    head, _, lease_a = a.push(1, [1.0, 1.0], BATCH)  # a: 1 step done, b: 0; within 1
    assert int(head[wire.STATUS]) == wire.Status.OK and int(head[wire.STALENESS]) == 0
    held, second = in_thread(a.push, 2, [1.0, 1.0], BATCH)  # a would be 2 ahead: held
    wait_for(server, lambda s: s.clocks.get(0) == 2)  # a's second update is applied
    head_b, _, _ = b.push(1, [1.0, 1.0], BATCH)  # b catches up to 1: a may go on
    assert int(head_b[wire.STALENESS]) == 2  # b's gradient was computed before a's two updates
    held.join(30)
    head, params, _ = second["v"]
    # a's reply carries version 3: it was held until b's update, not answered at version 2.
    assert int(head[wire.VERSION]) == 3 and int(head[wire.HELD_US]) > 0
    # 1 - 3 updates of gradient 1, each at lr 1 / (1 + its staleness) (the default rule):
    # a's two (staleness 0, and as its header says), b's (2).
    stale_a = int(head[wire.STALENESS])
    assert params.tolist() == pytest.approx([1 - 1 - 1 / (1 + stale_a) - 1 / 3] * 2)
    assert wire.bits_float(int(head[wire.LR_FACTOR])) == 1 / (1 + stale_a)  # exactly
    store.set("ps/finish", "1")


def test_ssp_counts_a_worker_that_has_not_joined_yet_as_the_slowest(tmp_path):
    """At the start a worker that has not joined yet is at 0 pushes: the one that joined
    first is held at the bound for it, and it joins at clock 0, not level with the others.
    Both were missed: the first joiners ran ahead of --staleness before the last had joined
    (a lead of 3 under --staleness 1, in test_param_server's end-to-end bound)."""
    store, server = start_server(tmp_path, "ssp", staleness=1, num_train=64)
    a = Worker(store.port, 0)
    a.hello()
    a.push(1, [1.0, 1.0], BATCH)  # 1 ahead of the worker not joined yet: within the bound
    held, second = in_thread(a.push, 2, [1.0, 1.0], BATCH)  # 2 ahead: held
    wait_for(server, lambda s: s.clocks.get(0) == 2)
    b = Worker(store.port, 1, clock=-1)  # a new process: no clock until server 0 gives one
    b.hello()
    with server.cond:
        assert server.clocks[1] == 0  # its first join, at the start: no push yet
    assert held.is_alive()  # still 2 ahead of b
    b.clock = 0
    b.push(1, [1.0, 1.0], BATCH)
    held.join(30)
    head, _, _ = second["v"]
    assert int(head[wire.HELD_US]) > 0
    store.set("ps/finish", "1")


def test_a_restarted_server_holds_rejoining_workers_by_their_own_clocks(tmp_path):
    """Every server holds a worker by the same clock, the one the worker carries. A
    restarted server 1 that put rejoining workers level with each other (as it once did)
    would let a through here while server 0 still holds it by its true lead: two servers
    can then each hold a different worker waiting for the other, and the run hangs."""
    store, server = start_server(tmp_path, "ssp", staleness=1, index=1, num_servers=2,
                                 attempt=1)  # fmt: skip
    a = Worker(store.port, 0, server=1, clock=4, numel=1)  # a has pushed 4 times, b 3
    b = Worker(store.port, 1, server=1, clock=3, numel=1)
    a.hello(), b.hello()
    wait_for(server, lambda s: s.clocks == {0: 4, 1: 3})
    held, reply = in_thread(a.push, 1, [1.0], BATCH)  # a would be 2 ahead of b: held
    wait_for(server, lambda s: s.clocks.get(0) == 5)
    head_b, _, _ = b.push(1, [1.0], BATCH)
    assert int(head_b[wire.REPLY_CLOCK]) == 4
    held.join(30)
    head, _, _ = reply["v"]
    # a's reply was built after b's update: it was held, not answered at version 1.
    assert int(head[wire.VERSION]) == 2 and int(head[wire.REPLY_CLOCK]) == 5
    store.set("ps/finish", "1")


def test_a_worker_the_launcher_says_died_is_left_but_not_its_restarted_process(tmp_path):
    """A worker that dies mid-message leaves its handler waiting on gloo, which fails that
    op only at the link timeout; the launcher's death notice (transport.death_key) ends the
    wait. The handler of the dead process must then leave only that process: here worker 0's
    restart joined before the notice came, and is served on."""
    store, server = start_server(tmp_path, "asp", num_train=64)
    old, other = Worker(store.port, 0, attempt=0), Worker(store.port, 1)
    old.hello(), other.hello()
    new = Worker(store.port, 0, attempt=1)  # the restart rejoins while the old link is open
    new.hello()
    wait_for(server, lambda s: s.sessions.get(0) == 1)
    store.set(wire.death_key(0, 0), "killed by SIGKILL")
    # The old process's handler ends (its thread is named after worker and attempt).
    wait_for(server, lambda _: "worker0.0" not in {t.name for t in threading.enumerate()})
    assert not [e for e in events(tmp_path) if e["event"] == "worker_lost"]
    head, _, _ = new.push(1, [1.0, 1.0], BATCH)  # still a member: applied, committed
    assert int(head[wire.STATUS]) == wire.Status.OK and int(head[wire.COMMITTED]) == 1

    # The other worker's death, with no restart: it is left at once, its lease requeued.
    store.set(wire.death_key(1, 0), "killed by SIGKILL")
    wait_for(server, lambda s: 1 not in s.live)
    [lost] = [e for e in events(tmp_path) if e["event"] == "worker_lost"]
    assert lost["worker"] == 1 and lost["how"] == "died" and lost["requeued"] == BATCH
    store.set("ps/finish", "1")


def test_a_bsp_step_waits_for_workers_that_have_not_joined_this_server_yet(tmp_path):
    """Server 1 of 2 (it deals nothing): worker 0 joins it and pushes step 1 before worker 1
    has joined it. The step is held for worker 1 (every worker of the job is expected until
    each said hello, or the start's grace ran out), then applied once with both gradients.
    It was released with worker 0's alone, and worker 1's push of step 1 then waited for
    worker 0 there until the barrier timeout (28 workers, 4 servers: joins take seconds)."""
    store, server = start_server(tmp_path, index=1, num_servers=2, barrier_timeout_s=60.0)
    early = Worker(store.port, 0, server=1, numel=1)  # the slice of server 1: one parameter
    early.hello()
    pushing, first = in_thread(early.push, 1, [1.0], BATCH)
    # Held: a release clears the arrivals in the same critical section that would apply it.
    wait_for(server, lambda s: 0 in s.arrived and s.released_step == 0)
    late = Worker(store.port, 1, server=1, numel=1)
    late.hello()
    head, params, _ = late.push(1, [3.0], BATCH)
    pushing.join(30)
    assert int(head[wire.COMMITTED]) and int(first["v"][0][wire.COMMITTED])
    # SGD lr 1 from 1.0 by the mean of 1.0 and 3.0 (2 samples each): 1.0 - 2.0.
    assert params.tolist() == [-1.0] and first["v"][1].tolist() == [-1.0]


def test_a_worker_waits_for_a_server_that_starts_later_than_the_timeout(tmp_path, monkeypatch):
    """A worker reaches its first join while server 0 is still starting (imports, the task:
    on a loaded host the servers can come up seconds after the workers). That first
    announcement is waited for without a clock: the worker gave up after --timeout-s, and
    a three-host job on a busy CI machine failed. A restarted server must still come back
    within --timeout-s."""
    from scaletrain import env
    from scaletrain.runtime import DistContext
    from scaletrain.strategies.param_server.worker import PSWorkerStrategy, ServerLost

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv(env.PS_STORE, f"127.0.0.1:{store.port}")
    monkeypatch.setenv(env.JOIN_TOKEN, TOKEN)
    timeout_s = 0.5
    cfg = from_dict({"train": {"strategy": "ps"}, "ps": {"num_servers": 1},
                     "launch": {"timeout_s": timeout_s}})  # fmt: skip
    ctx = DistContext(rank=0, world_size=2, local_rank=0, local_world_size=2, restart_count=0,
                      attempt=0, device=torch.device("cpu"), backend="gloo", mode="ps")  # fmt: skip
    worker = PSWorkerStrategy(ctx, cfg)
    worker.setup(nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=1.0), nn.functional.mse_loss)
    waiting, got = in_thread(worker._await_incarnation, 0)
    started = time.monotonic()
    while time.monotonic() - started < 4 * timeout_s:  # the server is slower than the timeout
        assert waiting.is_alive(), got
        time.sleep(0.05)
    store.set("ps/server0/incarnation", "0")
    waiting.join(30)
    assert got["v"] == 0
    # Incarnation 0 failed: the next must come within --timeout-s.
    worker.incarnation[0] = 0
    with pytest.raises(ServerLost, match="did not come back within --timeout-s"):
        worker._await_incarnation(0)
    store.set("ps/server0/incarnation", "1")
    assert worker._await_incarnation(0) == 1


def test_a_cut_copies_the_pushes_it_holds_and_holds_back_the_next_ones(tmp_path):
    """asp, server 1 of 2, the test playing server 0's part of a cut (cuts.py). Frozen, the
    server reports the pushes it applied; the cut then holds one more of worker a (server 0
    had applied it, this one had not got it yet): the server applies it before its copy.
    Worker b's next push, beyond the cut, is not in the copy: it is applied after."""
    from scaletrain.fault.checkpoint import load_latest, read_index
    from scaletrain.strategies.param_server import cuts, keys

    store, server = start_server(tmp_path, "asp", index=1, num_servers=2, checkpoint_every=100)
    a = Worker(store.port, 0, server=1, numel=1)
    b = Worker(store.port, 1, server=1, numel=1)
    a.hello(), b.hello()
    a.push(1, [1.0], BATCH), b.push(2, [1.0], BATCH)
    store.set(keys.CUT_LATEST, "1")
    store.wait([keys.cut_applied(1, 1)])
    assert cuts.decode(store.get(keys.cut_applied(1, 1))) == {0: (0, 1), 1: (0, 1)}
    beyond, _ = in_thread(b.push, 3, [1.0], BATCH)  # b's clock 2: not in the cut
    owed, _ = in_thread(a.push, 4, [1.0], BATCH)  # a's clock 2: in it
    store.set(keys.cut_pushes(1), cuts.encode({0: (0, 2), 1: (0, 1)}))
    store.wait([keys.cut_copied(1, 1)])
    owed.join(30), beyond.join(30)
    directory = tmp_path / "checkpoints" / "server1"
    wait_for(server, lambda s: read_index(directory))  # written in the background
    copy = load_latest(directory)[0]
    assert copy["cut"] == [0, 1] and copy["clocks"] == {0: 2, 1: 1} and copy["version"] == 3
    wait_for(server, lambda s: s.version == 4 and s.clocks == {0: 2, 1: 2})
    store.set("ps/finish", "1")


def test_a_push_sent_again_after_a_server_death_is_applied_once(tmp_path):
    """--ps-replicas: a worker whose server died with its push unanswered sends it again to
    the restarted one, which may hold it already (its backup had it). The server knows a
    push by the worker's process attempt and clock: the same push twice is applied once
    (acknowledged both times, as applied), a later one is applied."""
    store, server = start_server(tmp_path, "asp")
    a = Worker(store.port, 0)
    a.hello()
    head, params, _ = a.push(1, [1.0, 2.0], BATCH)
    assert int(head[wire.VERSION]) == 1 and params.tolist() == [0.0, -1.0]
    a.clock -= 1  # the same push (same attempt, same clock) again
    head, params, _ = a.push(1, [1.0, 2.0], BATCH)
    assert int(head[wire.VERSION]) == 1 and params.tolist() == [0.0, -1.0]
    assert int(head[wire.COMMITTED]) == 1
    head, params, _ = a.push(2, [1.0, 1.0], BATCH)  # the next one is new (1 update stale)
    assert int(head[wire.VERSION]) == 2 and params.tolist() == [-0.5, -1.5]
    # A restarted worker process counts its pushes anew: its clock 1 is a new push.
    b = Worker(store.port, 0, attempt=1, clock=0)
    b.hello()
    head, params, _ = b.push(3, [1.0, 1.0], BATCH)
    assert int(head[wire.VERSION]) == 3
    with server.cond:
        assert server.applied == 3
    store.set("ps/finish", "1")
