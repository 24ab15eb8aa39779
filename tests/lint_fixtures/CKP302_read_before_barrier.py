"""CKP302 fixture: a file written on one rank and read by all ranks without a barrier."""
import torch
import torch.distributed as dist


def resume(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    # ruleid: CKP302
    model.load_state_dict(torch.load(path, map_location="cpu"))


def resume_after_barrier(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    # ok: CKP302
    model.load_state_dict(torch.load(path, map_location="cpu"))


def another_file(model, rank, path, other):
    if rank == 0:
        torch.save(model.state_dict(), path)
    # ok: CKP302
    model.load_state_dict(torch.load(other, map_location="cpu"))


def the_writer_reads_it(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
        # ok: CKP302
        torch.load(path, map_location="cpu")


def rank_zero_writes_a_vocabulary(tokens, rank, vocab_path):
    if rank == 0:
        torch.save(tokens, vocab_path)
    # ruleid: CKP302
    with open(vocab_path, "rb") as handle:
        return torch.load(handle, map_location="cpu")


def another_rank_resumes(model, rank, path, resume_rank):
    if rank == 0:
        torch.save(model.state_dict(), path)
    if rank == resume_rank:
        # ruleid: CKP302
        model.load_state_dict(torch.load(path, map_location="cpu"))


def the_same_rank_reads_later(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    if rank == 0:
        # ok: CKP302
        model.load_state_dict(torch.load(path, map_location="cpu"))
