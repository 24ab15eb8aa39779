"""Print one LOGTRIAGE_ENVIRONMENT_JSON={...} line describing this machine's training stack.

    triage probe                   # put this at the top of a job script, before torchrun
    triage probe --pretty          # the same facts, indented, for a person to read

torch, CUDA, cuDNN and NCCL versions, the NVIDIA driver, GPU names and memory, the distributed
backends, rank variables and an allow-list of NCCL/torch.distributed settings. Never secrets,
host names or paths; torch is optional (the line then says why it could not be imported).
`triage` reads the line back from job logs.
"""

from __future__ import annotations

import argparse
import json

from logtriage.probe import collect, environment_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pretty", action="store_true", help="indented JSON without the prefix")
    parser.add_argument("--no-torch", action="store_true",
                        help="do not import torch (faster; versions and GPUs are then missing)")


def run(args: argparse.Namespace) -> int:
    facts = collect(with_torch=not args.no_torch)
    if args.pretty:
        print(json.dumps(facts.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(environment_line(facts), flush=True)
    return 0
