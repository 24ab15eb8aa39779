"""One rank runs out of host memory under an address-space cap (RLIMIT_AS).

The fault rank caps its own address space a little above what it uses, then builds an 8 GiB
buffer: --alloc torch asks torch's CPU allocator (RuntimeError ... DefaultCPUAllocator: can't
allocate memory), --alloc python asks Python (a bare MemoryError).
"""

from __future__ import annotations

import resource

import torch
from _common import (build_loader, build_model, finish, launch, make_parser, progress,
                     report_step, setup, train_step)

HEADROOM = 1 << 30
REQUEST = 8 << 30


def current_address_space() -> int:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    return pages * resource.getpagesize()


def exhaust_memory(alloc: str) -> None:
    limit = current_address_space() + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if alloc == "torch":
        torch.empty(REQUEST, dtype=torch.uint8)
    else:
        bytearray(REQUEST)


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
                exhaust_memory(args.alloc)
            loss = train_step(run, model, optimizer, inputs, targets)
            report_step(run, step, loss)
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--alloc", choices=("torch", "python"), default="torch")
    launch(main, parser.parse_args())
