"""A rank-0-only branch calls a collective: rank 0 waits for peers that never join.

After training, rank 0 computes a validation metric and all_reduces it inside `if rank == 0`.
--others exit: the other ranks leave the process group and exit 0, so rank 0's all_reduce
fails with "Connection closed by peer". --others barrier: they wait in a closing barrier that
gloo cannot pair with the all_reduce, and everyone sits until the process-group timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _common import Training, finish, launch, make_parser


def main(args) -> None:
    training = Training.start(args)
    run = training.run
    for step, inputs, targets in training.batches():
        loss = training.step(step, inputs, targets)
    if run.rank == 0:
        val_loss = torch.tensor([loss])
        dist.all_reduce(val_loss)
        print(f"[rank 0] epoch 0 val_loss {val_loss.item() / run.world_size:.4f}")
    if args.others == "barrier":
        finish(run)
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--others", choices=("exit", "barrier"), default="exit")
    launch(main, parser.parse_args())
