"""A three-hundred-and-sixteenth hand-run batch: TEMPORAL KNOWLEDGE GRAPH COMPLETION.

Synthetic temporal knowledge graph: quadruples (subject, relation, object, day) over 40 entities, 6 named
relations (looked up in a relation table) and 24 days.  Every rank reads its quadruples from
/tmp/fault316_work/quads/quads_R.pt, maps relation names to ids, and trains a TTransE-style scorer
(entity, relation and day embeddings; score = -|e_s + r + tau - e_o|, a softmax over all objects) on a
cross-entropy loss, wrapped in DDP (gloo), or with --ddp 0 gradients all_reduced by hand.  The model is
initialised from ckpt/ttranse_e40.pt.  Per-rank quadruple counts per day bucket are all_gathered at the
start, the loss and hits@3 are all_reduced every step, and rank 0 saves export/ttranse.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  unkrel     - rank N's shard names a relation "succeeded_by" missing from the relation table (KeyError)
  timeidx    - rank N converts days with a 1-based offset: day 24 indexes a 24-row day table (IndexError)
  noshard    - rank N reads its quadruples from quads/valid/ which does not exist (FileNotFoundError)
  ckptent    - rank N initialises from ckpt/ttranse_e48.pt, saved with 48 entities (size mismatch)
  rankgather - rank N all_gathers its per-bucket counts with an extra "future" bucket (7 vs 6 entries)
  slowneg    - rank N filters its negatives against every known quadruple in Python before the step-2 all_reduce
  nanscore   - rank N's day embedding is divided by a zero norm at step 3: loss NaN, the program's check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N finds test days in its training shard after the last step, prints an error, sys.exit(4)
  timedim    - every rank: the day embedding is built 12 wide, the entity embedding 16 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  unkrel     - KeyError: 'succeeded_by' in encode before the first all_gather; peers Connection closed by peer (np4 r2 tee, np3 r0 wrapper)
  timeidx    - IndexError 'index out of range in self' from the day embedding in the first forward; peers closed (np3 r1 loglevel, np5 r3 redirects: only in rank 3's stderr.log)
  noshard    - FileNotFoundError for quads/valid/quads_N.pt at start-up; peers closed in all_gather (np4 r1 pymodule, np3 r2 prefix)
  ckptent    - size mismatch for ent.weight [48,16] vs [40,16] (np4 r0 pdsh2); np3 r1 restart: attempt 1 died in Gloo connectFullMesh instead
  rankgather - DETAIL: 'Detected mismatch between collectives', TensorShape=[7] vs [6] (np3 r2 detail); 'allgather: invalid tensor size at index 0 (expected (7), got (6))' (np5 r1 tee_trainer)
  slowneg    - 12 s: rank 0 'Timed out waiting 12000ms for recv' (np3 r1 filter); 300 s: silent, killed at 60 s, exit 124 (np4 r2 plain)
  nanscore   - the program's check: 'non-finite loss nan at step 3', FloatingPointError (np4 r3 detail: rank 0 monitoredBarrier; np3 r0 pymodule)
  sigsegv    - no traceback; Root Cause exitcode -11 (SIGSEGV) (np3 r1 wrapper); np5 r2 restart: -11 in attempt 0, then connectFullMesh
  exit4      - rank N's temporal-leakage ERROR line after the last step, Root Cause exitcode 4 (np4 r1 prefix, np5 r4 filter)
  timedim    - every rank: 'size of tensor a (16) must match the size of tensor b (12)' in the first forward (np4 tee_trainer, np5 loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/ttranse.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault316_work"
RELS = {"allied_with": 0, "traded_with": 1, "visited": 2, "sanctioned": 3, "negotiated": 4, "criticised": 5}
NENT = 40
NDAY = 24
NBUCKET = 6
DIM = 16
log = None


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("tkg")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class TTransE(nn.Module):
    def __init__(self, nent=NENT, nrel=len(RELS), nday=NDAY, dim=DIM, tdim=DIM):
        super().__init__()
        self.ent = nn.Embedding(nent, dim)
        self.rel = nn.Embedding(nrel, dim)
        self.day = nn.Embedding(nday, tdim)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, s, r, t, day_norm=None):
        tau = self.day(t)
        if day_norm is not None:
            tau = tau / day_norm
        q = self.ent(s) + self.rel(r) + tau
        d = (q.unsqueeze(1) - self.ent.weight.unsqueeze(0)).abs().sum(-1)
        return -self.scale * d


def make_quads(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(RELS)
    quads = []
    for _ in range(n):
        s = int(torch.randint(0, NENT, (1,), generator=g))
        r = names[int(torch.randint(0, len(names), (1,), generator=g))]
        day = int(torch.randint(0, NDAY, (1,), generator=g))
        o = (s * 7 + RELS[r] * 3 + day // 4) % NENT
        quads.append({"s": s, "rel": r, "o": o, "date": f"2026-03-{day + 1:02d}", "split": "train"})
    return quads


def prepare():
    os.makedirs(f"{WORK}/quads", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_quads(96, 300 + r), f"{WORK}/quads/quads_{r}.pt")
    torch.manual_seed(0)
    torch.save(TTransE(NENT).state_dict(), f"{WORK}/ckpt/ttranse_e40.pt")
    torch.save(TTransE(48).state_dict(), f"{WORK}/ckpt/ttranse_e48.pt")
    print("prepared", WORK)


def encode(quads, a, bad):
    s, r, o, t = [], [], [], []
    for q in quads:
        day = int(q["date"][-2:]) - (0 if bad and a.fault == "timeidx" else 1)
        s.append(q["s"])
        r.append(RELS[q["rel"]])
        o.append(q["o"])
        t.append(day)
    return torch.tensor(s), torch.tensor(r), torch.tensor(o), torch.tensor(t)


def filtered_negatives(quads, budget):
    """Filter every corrupted object against the known quadruples, in pure Python (slow on purpose)."""
    known = [(q["s"], q["rel"], q["o"], q["date"]) for q in quads]
    t0 = time.time()
    kept = 0
    while time.time() - t0 < budget:
        for q in quads:
            for e in range(NENT):
                cand = (q["s"], q["rel"], e, q["date"])
                if cand not in known:
                    kept += 1
    return kept


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading quadruples")
    split = "valid/" if bad and a.fault == "noshard" else ""
    quads = torch.load(f"{WORK}/quads/{split}quads_{rank}.pt")
    if bad and a.fault == "unkrel":
        quads[41]["rel"] = "succeeded_by"
    s, r, o, t = encode(quads, a, bad)
    counts = torch.bincount(t.clamp(0, NDAY - 1) // (NDAY // NBUCKET), minlength=NBUCKET).float()
    if bad and a.fault == "rankgather":
        counts = torch.cat([counts, torch.tensor([0.0])])
    allc = [torch.zeros(NBUCKET) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} quads {int(counts.sum())} global {int(sum(c.sum() for c in allc))} "
        f"buckets {[int(x) for x in counts.tolist()]}")
    model = TTransE(tdim=12 if a.fault == "timedim" else DIM)
    ck = "ttranse_e48.pt" if bad and a.fault == "ckptent" else "ttranse_e40.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    if a.fault == "timedim":
        state.pop("day.weight")
        model.load_state_dict(state, strict=False)
    else:
        model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for step in range(a.steps):
        norm = None
        if bad and a.fault == "nanscore" and step == 3:
            norm = model.day.weight.new_zeros(1) * model.scale
        logits = net(s, r, t, norm)
        loss = nn.functional.cross_entropy(logits, o)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(logits)).sum())} of {logits.numel()} scores non-finite)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if bad and a.fault == "slowneg" and step == 2:
            say(f"rank {rank} filtering negatives against {len(quads)} known quadruples")
            n = filtered_negatives(quads, a.neg_budget)
            say(f"rank {rank} kept {n} filtered negatives")
        hits = (logits.detach().topk(3, 1).indices == o.unsqueeze(1)).any(1).float().mean()
        stat = torch.stack([loss.detach(), hits])
        dist.all_reduce(stat)
        say(f"rank {rank} step {step} loss {stat[0].item() / world:.4f} hits@3 {stat[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR temporal leakage: 17 quadruples dated after 2026-03-20 (the test window) "
            f"found in quads_{rank}.pt, results would be invalid", err=True)
        sys.exit(4)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/ttranse.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/ttranse.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--neg-budget", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()
