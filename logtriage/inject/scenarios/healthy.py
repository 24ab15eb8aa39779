"""Healthy run (the control): train a few steps, save a checkpoint the DDP way, exit 0.

Rank 0 writes the checkpoint and every rank meets at a barrier afterwards; the process group
has an explicit timeout; the sampler reshuffles per epoch and drops the uneven tail.
"""

from __future__ import annotations

import os

from _common import Training, finish, launch, make_parser, save_checkpoint


def main(args) -> None:
    training = Training.start(args)
    for step, inputs, targets in training.batches():
        training.step(step, inputs, targets)
    save_checkpoint(training.run, training.model, os.path.join(args.scratch, "epoch_0.pt"))
    finish(training.run)


if __name__ == "__main__":
    launch(main, make_parser(__doc__).parse_args())
