"""CKP303 fixture: checkpoints loaded without map_location in multi-GPU code."""
import torch
import torch.distributed as dist


def load(args, local_rank):
    torch.cuda.set_device(local_rank)
    # ruleid: PG201
    dist.init_process_group("nccl")
    # ruleid: CKP303
    state = torch.load(args.resume)
    # ruleid: CKP303
    ckpt = torch.load("checkpoints/last.pt")
    # ok: CKP303
    state = torch.load(args.resume, map_location="cpu")
    # ok: CKP303
    state = torch.load(args.resume, f"cuda:{local_rank}")
    # ok: CKP303
    counts = torch.load("vocab_counts.data")
    return state, ckpt, counts


def one_process_per_node_branch(args, loc):
    if args.gpu is None:
        # ok: CKP303
        checkpoint = torch.load(args.resume)    # one process drives every GPU of the node
    else:
        checkpoint = torch.load(args.resume, map_location=loc)
    return checkpoint


def into_load_state_dict(model, path):
    # ruleid: CKP303
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    # ruleid: CKP303
    model.load_state_dict(torch.load(path))
    # ok: CKP303
    features = torch.load(path + "/trainfeat.pth")      # tensors the program saved from the CPU
    return features


def in_memory_round_trip(model):
    import io
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    # ok: CKP303
    model.load_state_dict(torch.load(buffer))
