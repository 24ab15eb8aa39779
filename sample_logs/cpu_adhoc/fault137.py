"""A hundred-and-thirty-seventh hand-run batch: CURRICULUM LEARNING AND DYNAMIC BATCH SIZES.

A tiny causal token model (embedding + learned positional table of 32 slots + 2-layer MLP head) trained
next-token on synthetic sequences under a curriculum read from a schedule file: the sequence length grows
each epoch (8, 16, 24) and the batch size warms up (4, 6, 8). Each step buckets its sequences by length,
pads them, computes a summed token loss and a local token count, all-reduces [loss_sum, tokens] by hand
for the global per-token average, and backprops through DDP (`--ddp 0`: gradients all-reduced by hand).
At each epoch's end every rank all-reduces a per-token loss tensor [batch * length] for the stats and
saves its scheduler state. `--resume 1` restores the scheduler state from out/ckpt/sched_rankR.pt.

Faults:
- schedmis: rank N reads schedule_v2.json (batch 8 -> 10 at epoch 2): per-token stats tensor size differs.
- emptybucket: rank N's length bucket at epoch 1 is empty (off-by-one bound); it skips the token all_reduce.
- posidx: the schedule's last length is 40 on every rank, beyond the 32-slot positional table (IndexError).
- zerotok: rank N's epoch-1 batch is all padding; its local per-token loss divides by 0 tokens.
- oom: rank N sizes its epoch-2 activation buffer from a bad length (2**21); the CPU allocator refuses it.
- strsched: length_step is the string "8" in the schedule on every rank (TypeError in the curriculum).
- nan: rank N's longest-length batch gets an inf embedding scale; the program's check raises on NaN loss.
- abort: rank N hits a failed internal assertion at epoch 1 and calls os.abort() (SIGABRT).
- earlyexit: rank N believes its curriculum is finished after epoch 0 and calls sys.exit(0).
- ckptkey: with --resume 1, rank N's saved scheduler state (older format) has no 'curriculum' key.
What happened (filled in after the runs):
- schedmis: tee: gloo EnforceNotMet 120 vs 96 (SIGABRT on a peer); DETAIL: mismatch TensorShape=[240] vs [192] (line 200).
- emptybucket: PG 12 s: rank N loops 'waiting for refill', peers gloo timeouts 12000ms; PG 300 s: killed by timeout 60.
- posidx: every rank IndexError: index out of range in self at seq_len 40 (line 126, forward).
- zerotok: rank N ZeroDivisionError: float division by zero (line 178) at epoch 1; peers Connection closed.
- oom: rank N DefaultCPUAllocator: can't allocate memory: 2251799813685248 bytes (line 171) at epoch 2.
- strsched: every rank TypeError unsupported operand type(s) for +: 'int' and 'str' (line 97) after epoch 0.
- nan: rank N FloatingPointError non-finite loss nan at len 24 (line 184); peers Connection closed in backward.
- abort: rank N 'Check failed' line then SIGABRT (exitcode -6); the --max-restarts attempt dies in connectFullMesh.
- earlyexit: rank N 'curriculum complete ... exiting', exit 0; peers Connection closed by peer at epoch 1.
- ckptkey: rank N KeyError 'curriculum' in load_state_dict (line 112) on resume; peers Connection closed.
"""
import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--out", default="/tmp/fault137_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
VOCAB, DIM, MAX_POS = 48, 16, 32


def hit():
    return a.rank == -1 or a.rank == RANK


def write_schedules():
    os.makedirs(a.out, exist_ok=True)
    base = {"lengths": [8, 16, 24], "batch_sizes": [4, 6, 8], "length_step": 8}
    v2 = {"lengths": [8, 16, 24], "batch_sizes": [4, 6, 10], "length_step": 8}
    for name, s in (("schedule.json", base), ("schedule_v2.json", v2)):
        path = os.path.join(a.out, f"{name}.r{RANK}")
        with open(path, "w") as f:
            json.dump(s, f)


def load_schedule():
    name = "schedule_v2.json" if a.fault == "schedmis" and hit() else "schedule.json"
    with open(os.path.join(a.out, f"{name}.r{RANK}")) as f:
        s = json.load(f)
    if a.fault == "strsched":
        s["length_step"] = str(s["length_step"])
    if a.fault == "posidx":
        s["lengths"][-1] = 40
    return s


class Curriculum:
    def __init__(self, sched):
        self.sched = sched
        self.epoch = 0
        self.cur_len = sched["lengths"][0]

    def advance(self):
        self.epoch += 1
        nxt = self.cur_len + self.sched["length_step"]
        self.cur_len = min(nxt, self.sched["lengths"][min(self.epoch, len(self.sched["lengths"]) - 1)])
        if a.fault == "posidx":
            self.cur_len = self.sched["lengths"][min(self.epoch, len(self.sched["lengths"]) - 1)]

    def batch_size(self):
        return self.sched["batch_sizes"][min(self.epoch, len(self.sched["batch_sizes"]) - 1)]

    def state_dict(self):
        if a.fault == "ckptkey" and hit():
            return {"epoch": self.epoch, "schedule": self.sched, "format": 1}
        return {"epoch": self.epoch, "curriculum": {"cur_len": self.cur_len, "sched": self.sched}, "format": 2}

    def load_state_dict(self, sd):
        self.epoch = sd["epoch"]
        self.cur_len = sd["curriculum"]["cur_len"]
        self.sched = sd["curriculum"]["sched"]


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_POS, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, VOCAB))
        self.scale = 1.0

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        h = self.tok(x) * self.scale + self.pos(pos)
        return self.mlp(h)


def make_batch(g, bs, length, epoch):
    lens = torch.randint(length // 2, length + 1, (bs,), generator=g)
    lo = length // 2 + (1 if a.fault == "emptybucket" and hit() and epoch == 1 else 0)
    bucket = [i for i in range(bs) if lo <= lens[i] <= length and (epoch != 1 or not (a.fault == "emptybucket" and hit()))]
    x = torch.randint(1, VOCAB, (bs, length + 1), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lens.unsqueeze(1)
    if a.fault == "zerotok" and hit() and epoch == 1:
        mask[:] = False
    return x[bucket], mask[bucket]


def main():
    write_schedules()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(100 + RANK)
    model = TinyLM()
    net = DDP(model) if a.ddp else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cur = Curriculum(load_schedule())
    ckdir = os.path.join(a.out, "ckpt")
    os.makedirs(ckdir, exist_ok=True)
    if a.resume:
        sd = torch.load(os.path.join(ckdir, f"sched_rank{RANK}.pt"))
        cur.load_state_dict(sd)
        print(f"rank {RANK} resumed curriculum at epoch {cur.epoch} len {cur.cur_len}", flush=True)
    if RANK == 0:
        print(f"curriculum: lengths {cur.sched['lengths']} batch sizes {cur.sched['batch_sizes']} world {WORLD}", flush=True)
    step = 0
    for epoch in range(cur.epoch, a.epochs):
        bs, length = cur.batch_size(), cur.cur_len
        print(f"rank {RANK} epoch {epoch} seq_len {length} batch {bs}", flush=True)
        last_tok_loss = None
        for s in range(a.steps):
            x, mask = make_batch(g, bs, length, epoch)
            while x.shape[0] == 0:
                print(f"rank {RANK} step {step} empty length bucket, waiting for refill", flush=True)
                time.sleep(2.0)
                x, mask = make_batch(g, bs, length, epoch)
            if a.fault == "oom" and hit() and epoch == 2:
                bad_len = 2 ** 21
                act = torch.empty(x.shape[0] * bad_len * bad_len, DIM)
            if a.fault == "nan" and hit() and length == max(cur.sched["lengths"]):
                model.scale = float("inf")
            logits = net(x[:, :-1])
            tok_loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="none")
            tok_loss = tok_loss * mask.reshape(-1).float()
            ntok = int(mask.sum())
            local_avg = tok_loss.sum().item() / ntok
            stats = torch.tensor([float(tok_loss.sum().detach()), float(ntok)])
            dist.all_reduce(stats)
            gavg = stats[0].item() / max(stats[1].item(), 1.0)
            loss = tok_loss.sum() / max(ntok, 1)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"rank {RANK} epoch {epoch} len {length}: non-finite loss {loss.item()}")
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                for prm in model.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= WORLD
            opt.step()
            print(f"rank {RANK} step {step} loss {gavg:.4f} local {local_avg:.4f} tokens {int(stats[1])}", flush=True)
            last_tok_loss = tok_loss.detach()
            step += 1
        if a.fault == "abort" and hit() and epoch == 1:
            print(f"rank {RANK} curriculum.cc:212: Check failed: bucket_offsets.size() == num_buckets", flush=True)
            os.abort()
        per_tok = last_tok_loss if last_tok_loss is not None else torch.zeros(bs * length)
        per_tok = F.pad(per_tok, (0, max(0, bs * length - per_tok.numel())))
        dist.all_reduce(per_tok)
        if RANK == 0:
            print(f"epoch {epoch} per-token stats: {per_tok.numel()} tokens mean {per_tok.mean().item():.4f}", flush=True)
        if a.fault == "earlyexit" and hit() and epoch == 0:
            print(f"rank {RANK} curriculum complete at len {length}; exiting", flush=True)
            sys.exit(0)
        cur.advance()
        torch.save(cur.state_dict(), os.path.join(ckdir, f"sched_rank{RANK}.pt"))
    dist.barrier()
    if RANK == 0:
        print("training done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
