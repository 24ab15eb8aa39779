"""A hundred-and-seventieth hand-run batch: REWARD MODELS TRAINED ON PAIRWISE PREFERENCES (RLHF STYLE).

A tiny reward model (token embedding -> tanh projection -> per-token score, length-normalised sum) scores synthetic
"responses" (token sequences).  At startup rank 0 writes a JSONL preference file (one {"prompt", "chosen",
"rejected"} record a line) and every rank reads its shard of pairs (records r, r+W, ...).  Training runs under DDP
on gloo (or --ddp 0: parameters broadcast and gradients all-reduced by hand) with the Bradley-Terry loss
-logsigmoid(r_chosen - r_rejected - margin); the pairwise accuracy counts are all_reduced every step for a
`rank R step S loss L acc A` line, and the rewards are checked for finiteness.  The model is initialised from a
base checkpoint (ckpt/base.pt, written by --export) and rank 0 saves rm.pt at the end.

Faults:
  norejected  - rank 0 writes one record of rank N's shard without its "rejected" field (KeyError at step 2)
  lencat      - every rank pads rejected responses to the batch's own max length, not max_len (torch.cat shape)
  rewardinf   - rank N reads lr 1e38 (a config typo) and its rewards blow up; the finite check raises
  prefmissing - rank N reads the preference file from a node-local data dir that was never synced
  acclen      - rank N all_reduces its per-pair correct vector (forgot .sum(): 5 elements instead of 2)
  emptyshard  - rank N's shard slice is empty (off by one) and it waits for the file to be refilled
  basehidden  - every rank loads the base checkpoint ckpt/base_h48.pt (hidden 48, model hidden 32)
  lennormzero - rank 0 writes an empty chosen response into rank N's shard; 1/len divides by zero at step 3
  vocabenv    - rank N reads RWD_VOCAB_SIZE=72 from its environment (DDP parameter shape mismatch)
  unbalanced  - rank N prints an error 'preference data unbalanced' line and sys.exit(2) after loading its shard
  segv        - rank N is killed by SIGSEGV at step 2
  none        - control, clean run

What happened (filled in after the runs):
  norejected  - rank N KeyError: 'rejected' building its step-2 batch; peers Connection closed by peer; Root Cause rank N
  lencat      - every rank RuntimeError 'Sizes of tensors must match except in dimension 0. Expected size 12 but got size K'
  rewardinf   - rank N loss ~1e36 by step 2, then FloatingPointError 'reward not finite at step 3: max |r| = inf'
  prefmissing - rank N FileNotFoundError 'data_local/prefs.jsonl' at startup (redirects: only in stderr.log); restart: connectFullMesh
  acclen      - no gloo size error: rank N timed out in the accuracy all_reduce, the others (acc 0.857) in the next backward
  emptyshard  - rank N loops 'shard empty, waiting ...'; pg 12 s: peers time out in the DDP backward; pg 300 s: exit 124
  basehidden  - every rank 'size mismatch for emb.weight: copying a param with shape torch.Size([64, 48]) ...'
  lennormzero - rank N ZeroDivisionError 'float division by zero' at step 3; DETAIL: rank 0 monitoredBarrier names rank N
  vocabenv    - rank N RuntimeError '[N]: params[0] in this process with sizes [72, 32] appears not to match ... process 0.'
  unbalanced  - rank N prints 'ERROR rank N: preference data unbalanced ...' and exits 2 (no traceback); Root Cause rank N
  segv        - rank N killed by SIGSEGV at step 2 ('failed (exitcode: -11) local_rank: N'); peers reset/closed by peer
  none        - all ranks ran 6 steps with loss/acc lines, rank 0 saved rm.pt, exit 0
"""
import argparse
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MAX_LEN = 12


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--margin", type=float, default=0.1)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--data", default="data/prefs.jsonl")
    p.add_argument("--base", default="ckpt/base.pt")
    p.add_argument("--out", default="/tmp/fault170_work")
    p.add_argument("--export", action="store_true")
    return p.parse_args()


class RewardModel(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.score = nn.Linear(hidden, 1)

    def forward(self, tokens, mask, inv_len):
        h = torch.tanh(self.proj(self.emb(tokens)))
        s = self.score(h).squeeze(-1) * mask
        return s.sum(dim=1) * inv_len


def hit(a, rank):
    return a.rank == -1 or a.rank == rank


def write_prefs(path, n, a, world):
    rng = random.Random(170)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            chosen = [rng.randrange(1, 64) for _ in range(rng.randint(6, MAX_LEN))]
            rejected = [rng.randrange(1, 64) for _ in range(rng.randint(3, 10))]
            rec = {"prompt": f"p{i}", "chosen": chosen, "rejected": rejected}
            if a.fault == "norejected" and i == a.rank + world * (a.batch * 2 + 1):
                del rec["rejected"]
            if a.fault == "lennormzero" and i == a.rank + world * (a.batch * 3 + 2):
                rec["chosen"] = []
            f.write(json.dumps(rec) + "\n")


def pad(seqs, length):
    t = torch.zeros(len(seqs), length, dtype=torch.long)
    m = torch.zeros(len(seqs), length)
    for i, s in enumerate(seqs):
        t[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        m[i, : len(s)] = 1.0
    return t, m


def make_batch(recs, a):
    chosen = [r["chosen"] for r in recs]
    rejected = [r["rejected"] for r in recs]
    inv = [1.0 / len(c) for c in chosen] + [1.0 / len(r) for r in rejected]
    ct, cm = pad(chosen, MAX_LEN)
    rlen = max(len(r) for r in rejected) if a.fault == "lencat" else MAX_LEN
    rt, rm = pad(rejected, rlen)
    return torch.cat([ct, rt]), torch.cat([cm, rm]), torch.tensor(inv)


def main():
    a = parse()
    if a.export:
        os.makedirs("ckpt", exist_ok=True)
        torch.manual_seed(0)
        torch.save(RewardModel(64, 32).state_dict(), "ckpt/base.pt")
        torch.save(RewardModel(64, 48).state_dict(), "ckpt/base_h48.pt")
        print("exported ckpt/base.pt ckpt/base_h48.pt")
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} reward model training, margin {a.margin}, ddp {a.ddp}", flush=True)
    if rank == 0:
        write_prefs(a.data, world * a.batch * a.steps, a, world)
    dist.barrier()

    if a.fault == "vocabenv" and hit(a, rank):
        os.environ["RWD_VOCAB_SIZE"] = "72"
    vocab = int(os.environ.get("RWD_VOCAB_SIZE", "64"))
    base = "ckpt/base_h48.pt" if a.fault == "basehidden" else a.base
    torch.manual_seed(0)
    model = RewardModel(vocab, 32)
    if vocab == 64:
        model.load_state_dict(torch.load(base, map_location="cpu"))
    if a.ddp:
        model = DDP(model)
    else:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    lr = 1e38 if a.fault == "rewardinf" and hit(a, rank) else a.lr
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    path = a.data
    if a.fault == "prefmissing" and hit(a, rank):
        path = "data_local/prefs.jsonl"
    with open(path) as f:
        lines = f.readlines()
    shard = [json.loads(l) for l in lines[rank::world]]
    if a.fault == "emptyshard" and hit(a, rank):
        shard = shard[len(shard):]
    while not shard:
        print(f"rank {rank}: shard empty, waiting for {path} to be refilled", flush=True)
        time.sleep(5)
        with open(path) as f:
            shard = [json.loads(l) for l in f.readlines()[rank::world]]
        if a.fault == "emptyshard" and hit(a, rank):
            shard = shard[len(shard):]
    print(f"rank {rank} loaded {len(shard)} preference pairs from {path}", flush=True)
    if a.fault == "unbalanced" and hit(a, rank):
        print(f"ERROR rank {rank}: preference data unbalanced: 0 of {len(shard)} pairs have a longer chosen response",
              file=sys.stderr, flush=True)
        sys.exit(2)

    for step in range(a.steps):
        recs = shard[step * a.batch:(step + 1) * a.batch]
        tokens, mask, inv = make_batch(recs, a)
        r = model(tokens, mask, inv)
        rc, rr = r[: len(recs)], r[len(recs):]
        if not torch.isfinite(r).all():
            raise FloatingPointError(f"rank {rank}: reward not finite at step {step}: max |r| = {r.abs().max().item()}")
        loss = -F.logsigmoid(rc - rr - a.margin).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if a.fault == "segv" and hit(a, rank) and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        counts = torch.tensor([(rc > rr).sum().item(), len(recs)], dtype=torch.float)
        if a.fault == "acclen" and hit(a, rank):
            counts = torch.cat([(rc > rr).float(), torch.tensor([len(recs)], dtype=torch.float)])
        dist.all_reduce(counts)
        print(f"rank {rank} step {step} loss {loss.item():.4f} acc {counts[0].item() / counts[1].item():.3f}",
              flush=True)

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        sd = model.module.state_dict() if a.ddp else model.state_dict()
        torch.save(sd, os.path.join(a.out, "rm.pt"))
        print(f"rank 0 saved {a.out}/rm.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
