"""Healthy run (the control): train a few steps, save a checkpoint the DDP way, exit 0.

Rank 0 writes the checkpoint and every rank meets at a barrier afterwards; the process group
has an explicit timeout; the sampler reshuffles per epoch and drops the uneven tail.
"""

from __future__ import annotations

import os

import torch
from _common import (build_loader, build_model, finish, launch, make_parser, progress,
                     report_step, save_checkpoint, setup, train_step)


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
            report_step(run, step, loss)
        save_checkpoint(run, model, os.path.join(args.scratch, f"epoch_{epoch}.pt"))
    finish(run)


if __name__ == "__main__":
    launch(main, make_parser(__doc__).parse_args())
