"""Shared pieces of the fault-injection scripts: a small DDP training run done by the rules.

Every script trains a 16->32->1 MLP with DDP and SGD for a few steps, sleeping a little per
step, and prints ``[rank R] step S loss L``. The pieces here follow the DDP rules the linter
checks (explicit process-group timeout, DistributedSampler with drop_last, rank-0 saves
followed by a barrier), so a script is flagged only for the bug it injects itself.

Noise options shared by all scripts: ``--record`` (the elastic ``@record`` wrapper),
``--probe`` (a LOGTRIAGE_ENVIRONMENT_JSON= line per rank), ``--log-format`` (timestamped
``logging`` instead of print), ``--tqdm`` (a progress bar per rank), ``--spawn N``
(start N workers with ``torch.multiprocessing.spawn`` instead of a launcher).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH_SIZE = 8
logger = logging.getLogger("trainer")


def make_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--fault-rank", type=int, default=1, help="the rank that misbehaves")
    parser.add_argument("--fault-step", type=int, default=3, help="the step at which it does")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--pg-timeout", type=float, default=10.0, help="process-group timeout, s")
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--scratch", default="run", help="folder for checkpoints")
    parser.add_argument("--record", action="store_true", help="wrap main in @record")
    parser.add_argument("--probe", action="store_true", help="print the environment probe line")
    parser.add_argument("--log-format", action="store_true", help="timestamped logging output")
    parser.add_argument("--tqdm", action="store_true", help="show a tqdm progress bar")
    parser.add_argument("--spawn", type=int, default=0, metavar="N", help="use mp.spawn with N")
    # torch.distributed.launch without --use-env passes --local-rank=N.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None)
    return parser


@dataclass(frozen=True)
class Run:
    """Who this process is in the job, and the options it was started with."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    args: argparse.Namespace

    @property
    def is_fault_rank(self) -> bool:
        return self.rank == self.args.fault_rank


def setup(args: argparse.Namespace) -> Run:
    """Join the process group (with an explicit timeout) and set up the noise options."""
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend=args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout)
    )
    run = Run(dist.get_rank(), local_rank, dist.get_world_size(), device, args)
    if args.log_format:
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s [%(levelname)s] [rank{run.rank}] %(name)s: %(message)s",
        )
    if args.probe:
        from logtriage.probe import environment_line

        print(environment_line(), flush=True)
    if run.rank == 0:
        say(run, f"world_size={run.world_size} backend={args.backend} torch={torch.__version__}")
    torch.manual_seed(0)
    return run


def say(run: Run, text: str) -> None:
    if run.args.log_format:
        logger.info(text)
    else:
        print(text)


def build_model(run: Run, find_unused_parameters: bool = False) -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(run.device)
    device_ids = [run.local_rank] if run.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters)


def build_loader(run: Run) -> tuple[DataLoader, DistributedSampler]:
    """Equal shards on every rank: a DistributedSampler and drop_last=True."""
    generator = torch.Generator().manual_seed(1234)
    count = BATCH_SIZE * run.world_size * run.args.steps
    inputs = torch.randn(count, 16, generator=generator)
    targets = inputs[:, :1] * 0.5 + 0.1 * torch.randn(count, 1, generator=generator)
    dataset = TensorDataset(inputs, targets)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)
    return loader, sampler


def train_step(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer,
               inputs: torch.Tensor, targets: torch.Tensor) -> float:
    optimizer.zero_grad()
    outputs = model(inputs.to(run.device))
    loss = nn.functional.mse_loss(outputs, targets.to(run.device))
    loss.backward()
    optimizer.step()
    time.sleep(run.args.step_sleep)
    return loss.item()


def report_step(run: Run, step: int, loss: float, extra: str = "") -> None:
    say(run, f"[rank {run.rank}] step {step} loss {loss:.4f}{extra}")


def progress(run: Run, loader: DataLoader):
    """The loader itself, or wrapped in a tqdm bar when --tqdm is given."""
    if not run.args.tqdm:
        return loader
    from tqdm import tqdm

    return tqdm(loader, desc=f"rank {run.rank}", file=sys.stderr, mininterval=0)


def numbered_batches(run: Run, loader: DataLoader, sampler: DistributedSampler):
    """(step, inputs, targets) over one epoch, steps counted from 1: the loop every script runs."""
    sampler.set_epoch(0)
    for step, (inputs, targets) in enumerate(progress(run, loader), start=1):
        yield step, inputs, targets


@dataclass(frozen=True)
class Training:
    """The standard run: DDP model, sharded loader and SGD, built the DDP way."""

    run: Run
    model: nn.Module
    loader: DataLoader
    sampler: DistributedSampler
    optimizer: torch.optim.Optimizer

    @classmethod
    def start(cls, args: argparse.Namespace) -> "Training":
        run = setup(args)
        model = build_model(run)
        loader, sampler = build_loader(run)
        return cls(run, model, loader, sampler, torch.optim.SGD(model.parameters(), lr=0.05))

    def batches(self):
        return numbered_batches(self.run, self.loader, self.sampler)

    def step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step, printed as `[rank R] step S loss L`."""
        loss = train_step(self.run, self.model, self.optimizer, inputs, targets)
        report_step(self.run, step, loss)
        return loss


def train_with_fault(args: argparse.Namespace, fault: Callable[[Run], None] | None) -> None:
    """The standard run, with `fault(run)` called on the fault rank just before its
    `--fault-step` (None: a healthy run)."""
    training = Training.start(args)
    for step, inputs, targets in training.batches():
        if fault is not None and training.run.is_fault_rank and step == args.fault_step:
            fault(training.run)
        training.step(step, inputs, targets)
    finish(training.run)


def save_checkpoint(run: Run, model: nn.Module, path: str) -> None:
    """Rank 0 writes, then everyone waits at a barrier before anyone reads it."""
    if run.rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(model.module.state_dict(), path)
    dist.barrier()


def finish(run: Run) -> None:
    dist.barrier()
    if run.rank == 0:
        say(run, "training finished")
    dist.destroy_process_group()


def launch(main: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """Run ``main`` under the chosen entry: plain, @record, or mp.spawn with N processes."""
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        # started by Open MPI's mpirun: take the process-group coordinates from its variables
        os.environ.update(RANK=os.environ["OMPI_COMM_WORLD_RANK"],
                          WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"],
                          LOCAL_RANK=os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        # started by `srun python ...`: one task per rank, coordinates from Slurm's variables
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    if args.spawn:
        import torch.multiprocessing as mp

        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29500")
        mp.spawn(_spawned, args=(main, args), nprocs=args.spawn)
        return
    if args.record:
        from torch.distributed.elastic.multiprocessing.errors import record

        record(main)(args)
        return
    main(args)


def _spawned(index: int, main: Callable[[argparse.Namespace], None],
             args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(args.spawn))
    main(args)
