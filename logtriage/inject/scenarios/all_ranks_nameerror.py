"""Every rank hits the same NameError at the same step (a scheduler that was never created)."""

from __future__ import annotations

import torch
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
            report_step(run, step, loss)
            if step == args.fault_step:
                scheduler.step()  # noqa: F821  (the injected bug)
    finish(run)


if __name__ == "__main__":
    launch(main, make_parser(__doc__).parse_args())
