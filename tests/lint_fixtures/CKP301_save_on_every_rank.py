"""CKP301 fixture: checkpoints written by every rank to the same path."""
import io

import torch
import torch.distributed as dist


def save_checkpoint(state, path):
    # ok: CKP301
    torch.save(state, path)          # only called under a rank guard below


def save_each_epoch(model, epoch):
    # ruleid: CKP301
    torch.save(model.state_dict(), f"ckpt_{epoch}.pt")


def main(model, rank, world_size, args):
    # ruleid: PG201
    dist.init_process_group("gloo")
    for epoch in range(3):
        save_each_epoch(model, epoch)
        if rank == 0:
            save_checkpoint(model.state_dict(), "best.pt")
        if world_size == 1:
            # ok: CKP301
            torch.save(model.state_dict(), "single_process.pt")
        # ok: CKP301
        torch.save(model.state_dict(), f"shard_rank{rank}.pt")
        per_rank = f"optim_{rank}.pt"
        # ok: CKP301
        torch.save(model.state_dict(), per_rank)
        buffer = io.BytesIO()
        # ok: CKP301
        torch.save(model.state_dict(), buffer)
        if args.save and dist.get_rank() == 0:
            # ok: CKP301
            torch.save(model.state_dict(), "last.pt")
    # ruleid: CKP301
    model.save_pretrained("out")
    # ok: CKP301
    model.save_pretrained("out", is_main_process=rank == 0)


def never_called(model):
    # ok: CKP301
    torch.save(model.state_dict(), "unknown.pt")


if __name__ == "__main__":
    main(None, 0, 1, None)
