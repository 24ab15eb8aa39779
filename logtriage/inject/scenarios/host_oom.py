"""One rank runs out of host memory under an address-space cap (RLIMIT_AS).

The fault rank caps its own address space a little above what it uses, then builds an 8 GiB
buffer: --alloc torch asks torch's CPU allocator (RuntimeError ... DefaultCPUAllocator: can't
allocate memory), --alloc python asks Python (a bare MemoryError).
"""

from __future__ import annotations

import resource

import torch
from _common import launch, make_parser, train_with_fault

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
    train_with_fault(args, lambda run: exhaust_memory(args.alloc))


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--alloc", choices=("torch", "python"), default="torch")
    launch(main, parser.parse_args())
