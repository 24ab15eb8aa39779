"""One rank exhausts a per-process resource or skips the process-group set-up.

--how fds: at --fault-step the fault rank lowers its open-file limit (RLIMIT_NOFILE) a little
above what it holds and opens per-sample files until open() fails with EMFILE
(OSError: [Errno 24] Too many open files), as a dataset that never closes its files does.
--how no_init: the fault rank takes a code path that never calls init_process_group (a
`--distributed` flag read wrongly) and asks torch.distributed for its rank; the other ranks
wait in init_process_group until the launcher stops them.
"""

from __future__ import annotations

import os
import resource
import tempfile

import torch.distributed as dist
from _common import launch, make_parser, train_with_fault


def open_sample_files(count: int) -> list:
    """Open one scratch file per sample and keep them (the leak)."""
    folder = tempfile.mkdtemp(prefix="samples-")
    held = []
    for index in range(count):
        held.append(open(os.path.join(folder, f"{index:06d}.bin"), "wb"))
    return held


def exhaust_file_descriptors() -> None:
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 16, hard))
    open_sample_files(10_000)


def main(args) -> None:
    if args.how == "no_init" and int(os.environ.get("RANK", "0")) == args.fault_rank:
        distributed = os.environ.get("DISTRIBUTED", "0") == "1"   # the flag the launcher never sets
        if not distributed:
            print(f"[rank {os.environ.get('RANK')}] running without init_process_group", flush=True)
        dist.get_rank()
    train_with_fault(args, (lambda run: exhaust_file_descriptors()) if args.how == "fds" else None)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--how", choices=("fds", "no_init"), default="fds")
    launch(main, parser.parse_args())
