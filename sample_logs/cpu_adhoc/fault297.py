"""A two-hundred-and-ninety-seventh hand-run batch: SEQUENTIAL RECOMMENDATION WITH A SELF-ATTENTIVE (SASREC) MODEL.

Synthetic user histories: every rank reads 48 users' item sequences (item ids 1..500, 0 = padding, 32 positions
plus the next item) from /tmp/fault297_work/seqs/seqs_R.pt, and every item's genre from meta/items.json (looked
up in an 8-entry genre table).  The model is a one-block SASRec: item + genre + position embeddings, causal
self-attention, a feed-forward layer, and a BCE loss of the next item against one sampled negative per position.
It is initialised from ckpt/sasrec.pt and wrapped in DDP (gloo), or with --ddp 0 its gradients are all_reduced
by hand.  Per-rank sequence-length histograms are all_gathered at the start, the AUC is all_reduced every step,
every rank all_reduces its hold-out hit count at the end, and rank 0 saves export/sasrec.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  itemid     - rank N's step-2 batch holds item 507, added after the catalogue export (IndexError in the lookup)
  genre      - rank N's metadata gives item 417 the genre "film-noir", missing from the genre table (KeyError)
  emptybatch - rank N's step-3 batch is all padding: 0 target positions, the masked loss is NaN, program's check
  noseq      - rank N reads its sequences from seqs/val/, which does not exist (FileNotFoundError)
  ckptlen    - rank N initialises from ckpt/sasrec_len64.pt, saved with 64 positions (size mismatch)
  ckptpickle - rank N initialises from ckpt/sasrec_full.pt, pickled with a config object (weights_only refusal)
  lenhist    - rank N all_gathers a 9-bin sequence-length histogram (an overflow bin) where peers send 8
  slowneg    - rank N re-samples negatives in pure Python against each user's history before step 2's all_reduce
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own error line about an empty hold-out split at the end and calls sys.exit(4)
  maskshape  - every rank: the causal mask is built for 33 positions (target included), attention expects 32
  none       - control, clean run

What happened (filled in after the runs):
  itemid     - IndexError 'index out of range in self' in the item embedding at step 2; peers Connection closed / DETAIL monitoredBarrier names the rank (np4 r2 tee, np3 r0 detail)
  genre      - KeyError: 'film-noir' building the genre table at start-up; peers closed in the first all_gather (np5 r1 pymodule, np3 r2 prefix)
  emptybatch - 'rank N step 3: loss is nan (0 target positions in batch)', FloatingPointError; peers closed (np4 r3 loglevel, np3 r1 filter)
  noseq      - FileNotFoundError seqs/val/seqs_N.pt at start-up; console only Root Cause with --redirects (np4 r1 redirects, np3 r2 wrapper)
  ckptlen    - load_state_dict size mismatch for pos.weight [64, 32] vs [32, 32]; peers closed or SIGTERM (np4 r1 pdsh2, np5 r3 tee_trainer)
  ckptpickle - UnpicklingError 'Weights only load failed' (SASRecConfig); attempt 1 Gloo connectFullMesh refused (np3 r0 restart)
  lenhist    - 'ProcessGroupGloo::allgather: invalid tensor size ... (expected (9), got (8))' (np4 r2 plain); DETAIL 'Detected mismatch between collectives' (np5 r4)
  slowneg    - 12 s: peers 'Timed out waiting 12000ms' in step 2's all_reduce (np3 r1 tee); 300 s: silent after step 1, exit 124 (np4 r2 plain)
  sigsegv    - exitcode -11 after step 3 (np5 r0 filter); restart: attempt 1 connectFullMesh refused, final Root Cause exit 1 (np4 r1 restart)
  exit4      - rank N's 'ERROR hold-out split is empty' line, Root Cause exitcode 4, peers closed in final all_reduce (np3 r1 tee_trainer, np4 r3 wrapper)
  maskshape  - every rank: 'The shape of the 2D attn_mask is torch.Size([33, 33]), but should be (32, 32).' (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/sasrec.pt, exit 0 (np3 plain)
"""
import argparse
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault297_work"
GENRES = {"drama": 0, "comedy": 1, "action": 2, "horror": 3, "romance": 4, "scifi": 5, "docu": 6, "kids": 7}
NITEMS = 500
MAXLEN = 32
DIM = 32
BATCH = 16
log = None


@dataclass
class SASRecConfig:
    n_items: int = NITEMS
    maxlen: int = MAXLEN
    dim: int = DIM


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
    log = logging.getLogger("sasrec")
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


class SASRec(nn.Module):
    def __init__(self, n_items=NITEMS, maxlen=MAXLEN, dim=DIM):
        super().__init__()
        self.item = nn.Embedding(n_items + 1, dim, padding_idx=0)
        self.genre = nn.Embedding(len(GENRES), dim)
        self.pos = nn.Embedding(maxlen, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ln1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.ln2 = nn.LayerNorm(dim)

    def embed(self, ids, item_genre):
        return self.item(ids) + self.genre(item_genre[ids])

    def forward(self, seq, pos_ids, neg_ids, item_genre, mask_len):
        L = seq.shape[1]
        h = self.embed(seq, item_genre) + self.pos(torch.arange(L))
        causal = torch.triu(torch.ones(mask_len, mask_len, dtype=torch.bool), 1)
        a, _ = self.attn(h, h, h, attn_mask=causal, need_weights=False)
        h = self.ln1(h + a)
        h = self.ln2(h + self.ff(h))
        pl = (h * self.embed(pos_ids, item_genre)).sum(-1)
        nl = (h * self.embed(neg_ids, item_genre)).sum(-1)
        return pl, nl


def make_seqs(n, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = torch.zeros(n, MAXLEN + 1, dtype=torch.long)
    for u in range(n):
        ln = int(torch.randint(6, MAXLEN + 2, (1,), generator=g))
        start = int(torch.randint(1, NITEMS - 40, (1,), generator=g))
        items = (start + torch.randint(0, 40, (ln,), generator=g)).clamp(1, NITEMS)
        seqs[u, MAXLEN + 1 - ln:] = items
    return seqs


def prepare():
    for d in ("seqs", "meta", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save({"seqs": make_seqs(48, 300 + r), "users": list(range(r * 48, r * 48 + 48))},
                   f"{WORK}/seqs/seqs_{r}.pt")
    names = list(GENRES)
    with open(f"{WORK}/meta/items.json", "w") as f:
        json.dump({str(i): names[(i * 7) % 8] for i in range(NITEMS + 1)}, f)
    torch.manual_seed(0)
    torch.save(SASRec().state_dict(), f"{WORK}/ckpt/sasrec.pt")
    torch.save(SASRec(maxlen=64).state_dict(), f"{WORK}/ckpt/sasrec_len64.pt")
    torch.save({"model": SASRec().state_dict(), "config": SASRecConfig()}, f"{WORK}/ckpt/sasrec_full.pt")
    print("prepared", WORK)


def sample_negs(pos_ids, gen):
    return torch.where(pos_ids > 0, torch.randint(1, NITEMS + 1, pos_ids.shape, generator=gen), 0)


def python_negs(seqs, budget):
    t0, n = time.time(), 0
    while time.time() - t0 < budget:
        for row in seqs.tolist():
            seen = set(row)
            for _ in row:
                c = random.randint(1, NITEMS)
                while c in seen:
                    c = random.randint(1, NITEMS)
                n += 1
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(97 + rank)
    gen = torch.Generator().manual_seed(7 + rank)
    say(f"rank {rank}/{world} up, loading user sequences")
    split = "val/" if bad and a.fault == "noseq" else ""
    data = torch.load(f"{WORK}/seqs/{split}seqs_{rank}.pt")
    seqs = data["seqs"]
    with open(f"{WORK}/meta/items.json") as f:
        meta = json.load(f)
    if bad and a.fault == "genre":
        meta["417"] = "film-noir"
    item_genre = torch.tensor([GENRES[meta[str(i)]] for i in range(NITEMS + 1)])
    lens = (seqs[:, :-1] > 0).sum(1)
    hist = torch.histc(lens.float(), bins=8, min=0, max=MAXLEN)
    if bad and a.fault == "lenhist":
        hist = torch.cat([hist, (lens >= MAXLEN).sum().float().reshape(1)])
    allh = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} users {len(seqs)} mean length {lens.float().mean():.1f} "
        f"global users {int(sum(h.sum() for h in allh))}")
    model = SASRec()
    ck = {"ckptlen": "sasrec_len64.pt", "ckptpickle": "sasrec_full.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'sasrec.pt'}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    mask_len = MAXLEN + 1 if a.fault == "maskshape" else MAXLEN
    for step in range(a.steps):
        lo = (step * BATCH) % len(seqs)
        batch = seqs[lo:lo + BATCH].clone()
        if bad and a.fault == "itemid" and step == 2:
            batch[3, -4] = NITEMS + 7
        if bad and a.fault == "emptybatch" and step == 3:
            batch.zero_()
        inp, pos_ids = batch[:, :-1], batch[:, 1:]
        neg_ids = sample_negs(pos_ids, gen)
        pl, nl = net(inp, pos_ids, neg_ids, item_genre, mask_len)
        m = (pos_ids > 0).float()
        bce = F.binary_cross_entropy_with_logits(pl, torch.ones_like(pl), reduction="none") \
            + F.binary_cross_entropy_with_logits(nl, torch.zeros_like(nl), reduction="none")
        loss = (bce * m).sum() / m.sum()
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: loss is {loss.item()} ({int(m.sum())} target positions in batch)",
                err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if bad and a.fault == "slowneg" and step == 2:
            n = python_negs(seqs, a.neg_budget)
            say(f"rank {rank} re-sampled {n} negatives in Python")
        auc = (((pl > nl).float() * m).sum() / m.sum()).reshape(1).detach()
        dist.all_reduce(auc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} auc {auc.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    holdout = seqs[:, -1]
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR hold-out split is empty: 0 of {len(seqs)} users kept a last item after "
            f"deduplication, cannot compute HR@10", err=True)
        sys.exit(4)
    hits = (holdout > 0).sum().float().reshape(1)
    dist.all_reduce(hits)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/sasrec.pt")
        say(f"rank 0 done: {a.steps} steps, {int(hits.item())} hold-out users, saved export/sasrec.pt")
    dist.barrier()
    del net
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
