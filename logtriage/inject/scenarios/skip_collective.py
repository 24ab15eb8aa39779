"""One rank skips a collective the others run, then goes on with slow local work.

Each step all ranks average their loss for logging with an all_reduce; at --fault-step the
fault rank skips it (a rank-dependent condition) and starts a long local evaluation. The other
ranks wait in the all_reduce until the process-group timeout ends them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from _common import Training, finish, launch, make_parser, report_step, train_step


def main(args) -> None:
    training = Training.start(args)
    run = training.run
    for step, inputs, targets in training.batches():
        loss = train_step(run, training.model, training.optimizer, inputs, targets)
        metric = torch.tensor([loss])
        if run.rank != args.fault_rank or step != args.fault_step:
            dist.all_reduce(metric)
        else:
            time.sleep(args.pg_timeout * 3)  # "local evaluation" that outlasts the timeout
        report_step(run, step, metric.item() / run.world_size)
    finish(run)


if __name__ == "__main__":
    launch(main, make_parser(__doc__).parse_args())
