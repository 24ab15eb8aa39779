"""DDP102 fixture: rank-0-only I/O followed by a collective with no barrier between."""
import torch.distributed as dist
import wandb
from torch.utils.tensorboard import SummaryWriter


def prepare_data():
    pass


def wandb_then_all_reduce(loss, rank):
    # ruleid: DDP102
    if rank == 0:
        wandb.log({"loss": loss.item()})
    dist.all_reduce(loss)


def tensorboard_then_all_gather(loss, step):
    writer = SummaryWriter("runs")
    # ruleid: DDP102
    if dist.get_rank() == 0:
        writer.add_scalar("loss", loss.item(), step)
    dist.all_gather([loss], loss)


def preprocessing_then_broadcast(rank, flag):
    # ruleid: DDP102
    if rank == 0:
        prepare_data()
    dist.broadcast(flag, src=0)


def barrier_after_the_block(loss, rank):
    # ok: DDP102
    if rank == 0:
        wandb.log({"loss": loss.item()})
    dist.barrier()
    dist.all_reduce(loss)


def no_io_in_the_block(loss, rank):
    # ok: DDP102
    if rank == 0:
        print(loss)
    dist.all_reduce(loss)


def no_collective_after(loss, rank):
    dist.all_reduce(loss)
    # ok: DDP102
    if rank == 0:
        wandb.log({"loss": loss.item()})
