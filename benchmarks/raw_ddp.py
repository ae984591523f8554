"""The baseline: a plain, hand-written torch DDP training script, as a user would write it.

Launched by torchrun. Same model builder, dataset, batch and optimizer as scaletrain's ddp run
in ddp_overhead.py; torch's DistributedSampler, the built-in C++ all-reduce hook, no metrics.
Rank 0 writes the end time of every step, in seconds since the loop started, and the Unix
time it started, to --out, at its end or when it is sent SIGTERM; ddp_overhead.py compares
them with scaletrain's (metrics.jsonl's unix_time of rank 0) over the seconds in which both
ran.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from scaletrain.data.datasets import build_dataset, collate_batch
from scaletrain.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--num-samples", type=int, required=True)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--num-threads", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(args.num_threads)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = build_dataset(
        "synthetic", "train", num_samples=args.num_samples, image_size=args.image_size
    )
    model = DistributedDataParallel(build_model("cnn", data.input_shape, 10, args.width))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, collate_fn=collate_batch)

    step_ends: list[float] = []
    start, start_unix = time.perf_counter(), time.time()

    def write_step_ends() -> None:
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump({"step_ends": [t - start for t in step_ends],
                           "start_unix": start_unix}, f)  # fmt: skip

    def stop(signum: int, frame: object) -> None:
        """Stopped early (ddp_overhead.py ends the program that runs in the background once
        the other one has finished): the steps so far, and out."""
        write_step_ends()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if dist.get_rank() == 0:  # for ddp_overhead.py, which starts its pair once this trains
        open(args.out + ".started", "w").close()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        step_ends.append(time.perf_counter())
    write_step_ends()
    dist.destroy_process_group()
    os._exit(0)  # same exit as scaletrain's workers (see scaletrain/worker.py: exit_now)


if __name__ == "__main__":
    main()
