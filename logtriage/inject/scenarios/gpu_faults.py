"""GPU faults on one rank under NCCL (needs CUDA; runs with --backend nccl).

--fault oom: the fault rank asks the caching allocator for twice its GPU's memory;
--fault device_assert: the fault rank looks up an embedding row past the table's end
  (device-side assert, reported at the next synchronisation);
--fault invalid_ordinal: the fault rank selects a device index past the visible devices;
--fault duplicate_gpu: every rank selects device 0, so NCCL sees two ranks on one GPU.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from _common import launch, make_parser, train_with_fault
from torch import nn


def setup_on_wrong_device(args):
    """Device selection gone wrong before the process group exists."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ.get("RANK", "0"))
    if args.fault == "duplicate_gpu":
        torch.cuda.set_device(0)
    elif rank == args.fault_rank:
        torch.cuda.set_device(torch.cuda.device_count() + local_rank)
    dist.init_process_group(backend=args.backend,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    tensor = torch.ones(1, device="cuda")
    dist.all_reduce(tensor)


def inject(run, fault: str) -> None:
    if fault == "oom":
        total = torch.cuda.get_device_properties(run.device).total_memory
        torch.empty(2 * total, dtype=torch.uint8, device=run.device)
    elif fault == "device_assert":
        table = nn.Embedding(10, 16).to(run.device)
        table(torch.tensor([12], device=run.device))
        torch.cuda.synchronize(run.device)


def main(args) -> None:
    if args.fault in ("duplicate_gpu", "invalid_ordinal"):
        setup_on_wrong_device(args)
        raise SystemExit(f"the {args.fault} fault did not trigger on this machine")
    train_with_fault(args, lambda run: inject(run, args.fault))


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--fault", required=True,
                        choices=("oom", "device_assert", "invalid_ordinal", "duplicate_gpu"))
    parser.set_defaults(backend="nccl")
    launch(main, parser.parse_args())
