"""One rank dies without a Python exception: SIGKILL, a real NULL-pointer SIGSEGV, or exit(3).

--how kill sends SIGKILL to itself (what the kernel OOM killer does), --how segv reads address 0
through ctypes, --how exit3 calls sys.exit(3) from the training loop.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import torch
from _common import (build_loader, build_model, finish, launch, make_parser, progress,
                     report_step, setup, train_step)


def die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segv":
        ctypes.string_at(0)
    else:
        sys.exit(3)


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
            if run.is_fault_rank and step == args.fault_step:
                die(args.how)
            loss = train_step(run, model, optimizer, inputs, targets)
            report_step(run, step, loss)
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--how", choices=("kill", "segv", "exit3"), default="kill")
    launch(main, parser.parse_args())
