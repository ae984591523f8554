#!/usr/bin/env bash
# Bare multi-node: run this on every machine, the same command with its own NODE_RANK.
# torchrun's flags, under the same names. Node 0 hosts the rendezvous at HEAD_ADDR:29500; every
# node must reach it and each other on NETWORK_IFACE (a private network: see docs/cluster.md).
#
#   OUT=/mnt/nfs/runs/job1 HEAD_ADDR=10.0.0.1 NODE_RANK=0 NETWORK_IFACE=eth0 bash multinode.sh
#   OUT=/mnt/nfs/runs/job1 HEAD_ADDR=10.0.0.1 NODE_RANK=1 NETWORK_IFACE=eth0 bash multinode.sh
#
# OUT is one directory for all machines, on a file system they share (restarts read its
# checkpoints on every machine).
# Extra arguments go to `scaletrain run` (e.g. --dry-run to check the plan first).
set -euo pipefail
: "${HEAD_ADDR:?the address of node 0}" "${NODE_RANK:?the index of this machine, 0..NNODES-1}"
NNODES=${NNODES:-2}
export GLOO_SOCKET_IFNAME=${NETWORK_IFACE:-eth0}  # the interface gloo binds and connects on

exec "${SCALETRAIN:-scaletrain}" run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${NPROC_PER_NODE:-2}" \
    --rdzv-endpoint "$HEAD_ADDR:29500" --rdzv-id "${JOB_ID:-digits-ddp}" \
    --local-addr "${LOCAL_ADDR:-$(hostname -i 2>/dev/null | cut -d' ' -f1)}" \
    --strategy ddp --dataset digits --epochs 10 --batch-size 32 --lr 0.05 \
    --checkpoint-every 20 --max-restarts 3 --out "${OUT:?a run directory on a file system every machine shares}" "$@"
