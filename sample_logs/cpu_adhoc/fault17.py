"""A seventeenth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault16.py)."""
import argparse, datetime, os
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH, VOCAB, SEQ = 16, 100, 6


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class Net(nn.Module):
    def __init__(self, hit: bool):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 8)
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        if a.fault == "int_param" and hit:  # this rank's config turns on learned position offsets
            self.pos = nn.Parameter(torch.arange(SEQ))
        else:
            self.register_buffer("pos", torch.arange(SEQ))

    def forward(self, x, ids):
        h = x + self.tok(ids).mean(1)
        return self.head(torch.relu(self.body(h)))


class Shard(Dataset):
    """Items: features, token ids, label; the faulty rank's shard differs from step 3 on as each fault says."""

    def __init__(self, rank: int, hit: bool):
        self.rank, self.hit = rank, hit
        words = [f"w{i}" for i in range(VOCAB - 1)] + ["<pad>"]
        if self.hit and a.fault == "vocab_key":
            words = words[:-1]  # this rank read an older vocab file, written before <pad> was added
        self.vocab = {w: i for i, w in enumerate(words)}

    def __len__(self):
        return BATCH * a.steps

    def __getitem__(self, i):
        late = self.hit and i >= 2 * BATCH
        n_tok = SEQ + 2 if (late and a.fault == "stack_ragged" and i % 5 == 0) else SEQ
        toks = [f"w{(i * 7 + j) % (VOCAB - 1)}" for j in range(n_tok - 1)] + ["<pad>"]
        ids = torch.tensor([self.vocab[t] for t in toks])
        if late and a.fault == "embed_oob":
            ids = ids + 30  # this shard was tokenized with the 128-entry tokenizer
        y = i % 4
        if late and a.fault == "label_oob":
            y = i % 5  # this shard's label map has the new 'other' class
        return torch.randn(8), ids, torch.tensor(y)


def grad_norms(model):
    return {n: p.grad.norm().item() for n, p in model.named_parameters()}


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    say(rank, "building model")
    model = nn.parallel.DistributedDataParallel(Net(hit))
    params = [{"params": model.parameters()}]
    if a.fault == "pgroup_dup" and hit:  # this rank's config sets a separate head learning rate
        params.append({"params": model.module.head.parameters(), "lr": 0.01})
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if a.fault == "sched_model" and hit:  # this rank's config turns on step decay; the helper was handed the model
        sched = torch.optim.lr_scheduler.StepLR(model, step_size=2, gamma=0.5)
    loader = DataLoader(Shard(rank, hit), batch_size=BATCH)
    fp16 = a.fault == "half_cdist" and hit  # this rank's launch config says precision: fp16
    for step, (x, ids, y) in enumerate(loader, start=1):
        opt.zero_grad()
        out = model(x, ids)
        loss = F.cross_entropy(out, y)
        if a.fault == "half_cdist" and step >= 3:
            emb = out.half() if fp16 else out
            centers = torch.zeros(4, 4, dtype=emb.dtype)
            loss = loss + 0.01 * torch.cdist(emb, centers).mean().float()  # center loss from step 3 on
        if a.fault == "mask_shape" and step >= 3:
            keep = y != 3
            if hit:
                keep = torch.cat([keep, torch.ones(1, dtype=torch.bool)])  # mask built with the old +1 padding
            loss = loss + 0.0 * out[keep].sum()
        loss.backward()
        if a.fault == "grad_none" and hit and step == 3:
            opt.zero_grad(set_to_none=True)  # moved up by a refactor: frees grads before the logger reads them
            say(rank, f"grad norms {grad_norms(model)}")
        opt.step()
        if a.fault == "gather_obj" and step == 3:
            stats = {"rank": rank, "loss": loss.item()}
            if hit:
                stats["per_sample"] = (v for v in out.detach().max(1).values.tolist())  # lazy on this rank
            gathered = [None] * world
            dist.all_gather_object(gathered, stats)
        if a.fault == "reduce_opstr" and step == 3:
            op = "sum" if hit else dist.ReduceOp.SUM  # this rank's logger takes the op name from its YAML
            dist.all_reduce(torch.tensor([loss.item(), 1.0]), op=op)
        say(rank, f"step {step} loss {loss.item():.4f}")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29900 + os.getpid() % 90)
        mp.spawn(main, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()
