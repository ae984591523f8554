"""The cluster examples (examples/cluster/) as a scheduler would run them, with
`scaletrain run --dry-run`: each script's command line passes every check scaletrain makes
before starting a job, and maps the scheduler's variables onto the right node, world and
rendezvous. No scheduler is here: SLURM's srun is a stand-in that runs its command; the
PyTorchJob's container command runs under bash with the environment the operator sets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "cluster"
BIN = Path(sys.executable).parent


def run_example(argv: list[str], env: dict[str, str], tmp_path: Path) -> str:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    srun = fake_bin / "srun"  # drops srun's own options, runs the command once
    srun.write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    full = {
        **os.environ,
        "PATH": f"{fake_bin}:{BIN}:{os.environ['PATH']}",
        "SCALETRAIN": str(BIN / "scaletrain"),
        **env,
    }
    result = subprocess.run(argv, env=full, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dry run: every check passed" in result.stdout
    assert not (tmp_path / "runs").exists()  # nothing written
    return result.stdout


def test_bare_multinode_script(tmp_path):
    out = run_example(
        ["bash", str(EXAMPLES / "multinode.sh"), "--dry-run"],
        {"HEAD_ADDR": "10.0.0.1", "NODE_RANK": "1", "NNODES": "2", "NETWORK_IFACE": "eth7",
         "OUT": "/shared/runs/job1"},
        tmp_path,
    )  # fmt: skip
    assert "this is node 1, 2 processes per node; world size 4" in out
    assert 'out = "/shared/runs/job1"' in out
    assert "this node's ranks: 2 to 3" in out
    assert "c10d at 10.0.0.1:29500, id digits-ddp; node 0 hosts it" in out
    assert "gloo interface: eth7" in out


def test_slurm_batch_script(tmp_path):
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-a,gpu-b", "SLURM_CPUS_PER_TASK": "8"}  # fmt: skip
    out = run_example(["bash", str(EXAMPLES / "slurm.sbatch"), "--dry-run"], env, tmp_path)
    assert "this is node 0, 8 processes per node; world size 16" in out
    assert "c10d at gpu-a:29500, id slurm-4242; this node hosts it" in out
    assert 'out = "runs/slurm-4242"' in out  # one directory for every node
    directives = [line for line in (EXAMPLES / "slurm.sbatch").read_text().splitlines()
                  if line.startswith("#SBATCH")]  # fmt: skip
    assert "#SBATCH --nodes=2" in directives and "#SBATCH --ntasks-per-node=1" in directives
    # Preemption: warned with SIGUSR1, requeued when the launchers exit 3 (checkpointed).
    assert "#SBATCH --signal=B:USR1@120" in directives and "#SBATCH --requeue" in directives


def test_gpu_script_sets_nccl_and_one_worker_per_gpu(tmp_path):
    out = run_example(
        ["bash", str(EXAMPLES / "gpu.sh"), "--dry-run"],
        {"HEAD_ADDR": "10.0.0.1", "NODE_RANK": "0", "GPUS": "8", "NETWORK_IFACE": "ib0"},
        tmp_path,
    )
    assert "8 processes per node" in out and "device: cuda" in out
    assert "NCCL interface: ib0" in out and "strategy: fsdp" in out


def test_kubernetes_pytorchjob(tmp_path):
    job = yaml.safe_load((EXAMPLES / "k8s-pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1
    pod = replicas["Worker"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 60  # time to checkpoint on SIGTERM
    [container] = pod["containers"]
    assert container["name"] == "pytorch"  # the name the operator looks for
    env = {e["name"]: e["value"] for e in container["env"]}
    # The operator's variables for the second pod (RANK 1) of two.
    env |= {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "scaletrain-digits-master-0",
            "MASTER_PORT": "23456"}  # fmt: skip
    command = [*container["command"], container["args"][0] + " --dry-run"]
    out = run_example(command, env, tmp_path)
    assert "this is node 1, 4 processes per node; world size 8" in out
    assert "c10d at scaletrain-digits-master-0:23456" in out and "gloo interface: eth0" in out


def test_slurm_script_forwards_usr1_and_requeues_a_preempted_job(tmp_path):
    """SLURM's warning (SIGUSR1 to the batch shell) reaches the launcher, and the launcher's
    exit status 3 (preempted, checkpointed) requeues the job. The launcher here is a stand-in
    that waits for SIGUSR1 and exits 3 as scaletrain does; scontrol records its calls."""
    import signal
    import time

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                               'exec "$@"\n')  # fmt: skip
    (fake / "scontrol").write_text(f'#!/usr/bin/env bash\necho "$@" >> {tmp_path}/scontrol\n')
    ready = tmp_path / "ready"
    (fake / "launcher").write_text(
        f"#!/usr/bin/env bash\ntrap 'exit 3' USR1\ntouch {ready}\nwhile true; do sleep 0.1; done\n"
    )
    for tool in ("srun", "scontrol", "launcher"):
        (fake / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
           "SCALETRAIN": str(fake / "launcher"), "SLURM_NNODES": "1", "SLURM_NODEID": "0",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a"}  # fmt: skip
    script = subprocess.Popen(["bash", str(EXAMPLES / "slurm.sbatch")], env=env, cwd=tmp_path,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 30
    while not ready.exists():  # the launcher runs
        assert script.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    script.send_signal(signal.SIGUSR1)
    assert script.wait(timeout=30) == 3
    assert "requeue 4242" in (tmp_path / "scontrol").read_text()
