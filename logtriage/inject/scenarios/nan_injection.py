"""One rank gets a non-finite input value at --fault-step; the gradient average spreads it.

--check none: nothing notices; every rank's loss turns nan and the run exits 0.
--check anomaly: torch.autograd.detect_anomaly() makes the fault rank's backward raise.
--check clip: clip_grad_norm_(error_if_nonfinite=True) raises on every rank (after all-reduce).
--value picks the injected value (nan or inf).
"""

from __future__ import annotations

import contextlib
import time

import torch
from _common import (build_loader, build_model, finish, launch, make_parser, numbered_batches,
                     report_step, setup)
from torch import nn


def main(args) -> None:
    run = setup(args)
    model = build_model(run)
    loader, sampler = build_loader(run)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    anomaly = torch.autograd.detect_anomaly() if args.check == "anomaly" \
        else contextlib.nullcontext()
    with anomaly:
        for step, inputs, targets in numbered_batches(run, loader, sampler):
            if run.is_fault_rank and step == args.fault_step:
                inputs = inputs.clone()
                inputs[0, 0] = float(args.value)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_norm=1.0, error_if_nonfinite=args.check == "clip")
            optimizer.step()
            time.sleep(args.step_sleep)
            report_step(run, step, loss.item(), f" grad_norm {grad_norm.item():.4f}")
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--check", choices=("none", "anomaly", "clip"), default="none")
    parser.add_argument("--value", choices=("nan", "inf"), default="nan")
    launch(main, parser.parse_args())
