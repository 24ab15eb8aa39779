"""Training code that asks for CUDA on a machine (or a torch build) without it.

--how to_cuda: model.to("cuda") (Torch not compiled with CUDA enabled);
--how set_device: torch.cuda.set_device(local_rank) before init;
--how nccl: init_process_group(backend="nccl") (Distributed package doesn't have NCCL built in);
--how ddp_device_ids: DDP(model, device_ids=[local_rank]) around a CPU model;
--how bad_device: a config that says device "gpu".
Every rank fails the same way.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from _common import (Run, build_loader, finish, launch, make_parser, numbered_batches, report_step,
                     say, train_step)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main(args) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.how == "set_device":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if args.how == "nccl" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    device = torch.device("cuda" if args.how == "to_cuda" else "cpu")
    run = Run(dist.get_rank(), local_rank, dist.get_world_size(), device, args)
    if run.rank == 0:
        say(run, f"world_size={run.world_size} backend={backend} torch={torch.__version__}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if args.how == "bad_device":
        model = model.to(torch.device("gpu"))
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank] if args.how == "ddp_device_ids" else None)
    loader, sampler = build_loader(run)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, inputs, targets in numbered_batches(run, loader, sampler):
        report_step(run, step, train_step(run, model, optimizer, inputs, targets))
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--how", default="to_cuda",
                        choices=("to_cuda", "set_device", "nccl", "ddp_device_ids", "bad_device"))
    launch(main, parser.parse_args())
