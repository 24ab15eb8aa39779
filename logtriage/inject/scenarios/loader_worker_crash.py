"""A DataLoader worker process of one rank dies (SIGKILL, or a segfault in a decoding library).

The fault rank's dataset kills the worker process that fetches the sample of --fault-step;
the rank's main process then raises "DataLoader worker (pid N) is killed by signal" and the
other ranks wait in the all-reduce.
"""

from __future__ import annotations

import ctypes
import os
import signal

import torch
from _common import (BATCH_SIZE, build_model, finish, launch, make_parser, report_step, setup,
                     train_step)
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class FragileDataset(Dataset):
    """Synthetic samples; the sample at index ``poison`` crashes the worker that loads it."""

    def __init__(self, count: int, poison: int, how: str) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.inputs = torch.randn(count, 16, generator=generator)
        self.targets = self.inputs[:, :1] * 0.5
        self.poison = poison
        self.how = how

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        if index == self.poison:
            if self.how == "segv":
                ctypes.string_at(0)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inputs[index], self.targets[index]


def main(args) -> None:
    run = setup(args)
    model = build_model(run)
    count = BATCH_SIZE * run.world_size * args.steps
    sampler = DistributedSampler(range(count), shuffle=False, drop_last=True)
    own = list(iter(sampler))
    poison = own[(args.fault_step - 1) * BATCH_SIZE] if run.is_fault_rank else -1
    dataset = FragileDataset(count, poison, args.how)
    sampler = DistributedSampler(dataset, shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True,
                        num_workers=1, persistent_workers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    for epoch in range(1):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            step += 1
            loss = train_step(run, model, optimizer, inputs, targets)
            report_step(run, step, loss)
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--how", choices=("kill", "segv"), default="kill")
    launch(main, parser.parse_args())
