"""One rank saves a checkpoint without a barrier; another rank loads it too early.

At --fault-step the saver (rank 0, or rank 1 when rank 0 is the fault rank: a rank reading its
own file finds it complete) evaluates (slowly) and then writes the checkpoint, with no barrier
before or after; the fault rank wants to resume from it right away. --write normal: the file
is not there yet (FileNotFoundError). --write partial: the saver writes the bytes in two halves
with a pause, so the early reader finds a truncated zip archive.
"""

from __future__ import annotations

import io
import os
import time

import torch
from _common import Training, finish, launch, make_parser


def write_slowly(state: dict, path: str) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])
        handle.flush()
        time.sleep(2.0)
        handle.write(data[len(data) // 2:])


def main(args) -> None:
    training = Training.start(args)
    run, model = training.run, training.model
    os.makedirs(args.scratch, exist_ok=True)
    path = os.path.join(args.scratch, f"step_{args.fault_step}.pt")
    saver = 1 if args.fault_rank == 0 else 0
    for step, inputs, targets in training.batches():
        training.step(step, inputs, targets)
        if step != args.fault_step:
            continue
        if run.rank == saver:
            if args.write == "partial":
                write_slowly(model.module.state_dict(), path)
            else:
                time.sleep(1.0)  # evaluation before saving
                torch.save(model.module.state_dict(), path)
        if run.rank == args.fault_rank:
            time.sleep(0.5 if args.write == "partial" else 0.0)
            model.module.load_state_dict(torch.load(path, map_location=run.device))
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--write", choices=("normal", "partial"), default="normal")
    launch(main, parser.parse_args())
