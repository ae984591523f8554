#!/usr/bin/env bash
# GPUs: one worker per GPU, NCCL between them (chosen automatically on CUDA).
# Install torch for your CUDA first: `make install TORCH_CONSTRAINTS=` (the default pins the
# CPU build these examples' CI uses).
#
#   HEAD_ADDR=10.0.0.1 NODE_RANK=0 NNODES=2 bash gpu.sh
set -euo pipefail
: "${HEAD_ADDR:?the address of node 0}" "${NODE_RANK:?the index of this machine}"
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$GPUS" -ge 1 ] || { echo "gpu.sh: no GPU visible (set GPUS=N to override)" >&2; exit 2; }
export NCCL_SOCKET_IFNAME=${NETWORK_IFACE:-eth0}  # NCCL's bootstrap and socket transport
export GLOO_SOCKET_IFNAME=${NETWORK_IFACE:-eth0}  # the store and any gloo group
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Uncomment on hosts without InfiniBand, or to rule it out while debugging:
# export NCCL_IB_DISABLE=1

exec "${SCALETRAIN:-scaletrain}" run \
    --nnodes "${NNODES:-1}" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS" \
    --rdzv-endpoint "$HEAD_ADDR:29500" --rdzv-id "${JOB_ID:-gpu-job}" --device cuda \
    --strategy fsdp --dataset synthetic --num-samples 200000 --image-size 64 --model cnn \
    --width 128 --epochs 2 --batch-size 256 --lr 0.1 --deterministic \
    --checkpoint-every 200 --checkpoint-async --max-restarts 3 --out "${OUT:-runs/gpu}" "$@"
