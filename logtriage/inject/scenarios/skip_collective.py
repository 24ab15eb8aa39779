"""One rank skips a collective the others run, then goes on with slow local work.

Each step all ranks average their loss for logging with an all_reduce; at --fault-step the
fault rank skips it (a rank-dependent condition) and starts a long local evaluation. The other
ranks wait in the all_reduce until the process-group timeout ends them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from _common import (build_loader, build_model, finish, launch, make_parser, progress,
                     report_step, setup, train_step)


def main(args) -> None:
    run = setup(args)
    model = build_model(run)
    loader, sampler = build_loader(run)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    for epoch in range(1):
        sampler.set_epoch(epoch)
        for inputs, targets in progress(run, loader):
            step += 1
            loss = train_step(run, model, optimizer, inputs, targets)
            metric = torch.tensor([loss])
            if run.rank != args.fault_rank or step != args.fault_step:
                dist.all_reduce(metric)
            else:
                time.sleep(args.pg_timeout * 3)  # "local evaluation" that outlasts the timeout
            report_step(run, step, metric.item() / run.world_size)
    finish(run)


if __name__ == "__main__":
    launch(main, make_parser(__doc__).parse_args())
