"""NaN under mixed precision on one rank (needs CUDA; runs with --backend nccl).

From --fault-step on, the fault rank's batch carries a NaN. --precision fp16 trains under
autocast(float16) with a GradScaler, which skips every step with non-finite gradients and keeps
lowering the loss scale; --precision bf16 trains under autocast(bfloat16) without a scaler, so
the weights go NaN. The run exits 0 either way; the printed losses tell the story.
"""

from __future__ import annotations

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
    dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")
    for step, inputs, targets in numbered_batches(run, loader, sampler):
        inputs, targets = inputs.to(run.device), targets.to(run.device)
        if run.is_fault_rank and step >= args.fault_step:
            inputs[0, 0] = float("nan")
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = nn.functional.mse_loss(model(inputs).float(), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        time.sleep(args.step_sleep)
        report_step(run, step, loss.item(), f" scale {scaler.get_scale():.1f}")
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--precision", choices=("fp16", "bf16"), default="fp16")
    parser.set_defaults(backend="nccl")
    launch(main, parser.parse_args())
