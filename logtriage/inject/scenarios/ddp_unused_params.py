"""DDP with a parameter that gets no gradient on one rank (find_unused_parameters=False).

The model has an auxiliary head; the fault rank's loss skips it from --fault-step on (a
config switch that differs per rank). DDP on that rank never finishes reducing the head's
bucket and raises "Expected to have finished reduction in the prior iteration" at its next
forward; the other ranks wait in the all-reduce.
"""

from __future__ import annotations

import time

import torch
from _common import build_loader, finish, launch, make_parser, numbered_batches, report_step, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)
        self.aux_head = nn.Linear(32, 1)

    def forward(self, inputs: torch.Tensor, use_aux: bool = True) -> torch.Tensor:
        hidden = self.body(inputs)
        out = self.head(hidden)
        return out + 0.1 * self.aux_head(hidden) if use_aux else out


def main(args) -> None:
    run = setup(args)
    model = DDP(TwoHeads().to(run.device), find_unused_parameters=False)
    loader, sampler = build_loader(run)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, inputs, targets in numbered_batches(run, loader, sampler):
        use_aux = not (run.is_fault_rank and step >= args.fault_step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs, use_aux=use_aux), targets)
        loss.backward()
        optimizer.step()
        time.sleep(args.step_sleep)
        report_step(run, step, loss.item())
    finish(run)


if __name__ == "__main__":
    launch(main, make_parser(__doc__).parse_args())
