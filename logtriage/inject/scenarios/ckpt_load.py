"""Resuming from a checkpoint that does not fit: every rank's load fails the same way.

Rank 0 saves a checkpoint (then a barrier), and every rank loads it back into a fresh model:
--defect missing_keys saves the DDP wrapper's state_dict ("module." prefixes) and loads it into
the bare model; --defect size_mismatch loads into a model with a wider hidden layer;
--defect weights_only stores the argparse options beside the weights, which torch.load's
default weights_only=True refuses to unpickle.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _common import Training, finish, launch, make_parser
from torch import nn


def checkpoint_payload(model: nn.Module, args) -> dict:
    if args.defect == "missing_keys":
        return model.state_dict()                 # keys start with "module."
    if args.defect == "weights_only":
        return {"model": model.module.state_dict(), "args": args}
    return model.module.state_dict()


def resume(model_width: int, path: str, defect: str, device: torch.device) -> nn.Module:
    fresh = nn.Sequential(nn.Linear(16, model_width), nn.ReLU(), nn.Linear(model_width, 1))
    state = torch.load(path, map_location=device)
    fresh.load_state_dict(state["model"] if defect == "weights_only" else state)
    return fresh


def main(args) -> None:
    training = Training.start(args)
    run = training.run
    path = os.path.join(args.scratch, "last.pt")
    for step, inputs, targets in training.batches():
        training.step(step, inputs, targets)
        if step == args.fault_step:
            if run.rank == 0:
                torch.save(checkpoint_payload(training.model, args), path)
            dist.barrier()
            width = 64 if args.defect == "size_mismatch" else 32
            resume(width, path, args.defect, run.device)
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--defect", choices=("missing_keys", "size_mismatch", "weights_only"),
                        default="missing_keys")
    launch(main, parser.parse_args())
