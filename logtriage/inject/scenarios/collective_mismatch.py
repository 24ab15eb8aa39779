"""Ranks call different collectives at the same step: another op, shape or dtype.

Gradients are averaged by hand with all_reduce (no DDP: TORCH_DISTRIBUTED_DEBUG=DETAIL and DDP
segfault together in torch 2.13 CPU). At --fault-step the fault rank calls a broadcast instead
of the all_reduce (--kind op), or all_reduces a tensor of another length (shape) or dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _common import build_loader, finish, launch, make_parser, numbered_batches, report_step, setup
from torch import nn


def average_gradients(model: nn.Module, world_size: int) -> None:
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world_size


def odd_metric(metric: torch.Tensor, kind: str) -> torch.Tensor:
    """The fault rank's version of the metric: another length or another dtype."""
    return torch.cat([metric, metric[:1]]) if kind == "shape" else metric.double()


def main(args) -> None:
    run = setup(args)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    for param in model.parameters():
        dist.broadcast(param.data, src=0)
    loader, sampler = build_loader(run)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, inputs, targets in numbered_batches(run, loader, sampler):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        average_gradients(model, run.world_size)
        optimizer.step()
        metric = loss.detach().reshape(1).repeat(4)
        if run.rank == args.fault_rank and step == args.fault_step and args.kind == "op":
            dist.broadcast(metric, src=0)
        elif run.rank == args.fault_rank and step == args.fault_step:
            dist.all_reduce(odd_metric(metric, args.kind))
        else:
            dist.all_reduce(metric)
        report_step(run, step, loss.item())
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--kind", choices=("op", "shape", "dtype"), default="op")
    launch(main, parser.parse_args())
