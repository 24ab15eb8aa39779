"""A three-hundred-and-ninety-first hand-run batch: PATENT CITATION LINK PREDICTION.

Synthetic patents carry a CPC subclass code (looked up in a 12-entry CPC table), a grant year and 8 claim
features.  Every rank reads the shared patent table /tmp/fault391_work/data/patents.pt and its own shard of
citation pairs data/citations_R.pt, samples as many random non-citing pairs as negatives, and trains a
two-tower-free link scorer: a patent id embedding plus a CPC embedding plus a claim-feature projection, an
MLP encoder, and a dot-product score on (citing, cited) pairs with a BCE loss, wrapped in DDP (gloo) or with
gradients all_reduced by hand (--ddp 0).  The encoder is initialised from ckpt/encoder_d16.pt.  The pair
accuracy is all_reduced every step; at the end every rank all_gathers its hits@{1,5,10} and rank 0 saves
export/citelink.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults:
  cpcclass   - rank N's patent table holds a withdrawn CPC code "Z99Z", missing from the CPC table (KeyError)
  patentid   - rank N adds citations to newly granted patents at step 1: ids beyond the embedding (IndexError)
  noedges    - rank N reads its citations from data/examiner/ which does not exist (FileNotFoundError)
  ckptdim    - rank N initialises from ckpt/encoder_d32.pt, saved with 32-dim embeddings (size mismatch)
  ckptpickle - rank N loads ckpt/cpc_meta.pt, pickled with a CpcVocab object (weights_only refusal)
  hitsgather - rank N all_gathers hits@{1,5,10,50}: 4 entries where the others send 3 (at the end)
  slowsim    - rank N computes Jaccard similarity of citation sets in pure Python before the step-2 all_reduce
  nanloss    - rank N weights pairs by 1/(citation lag) at step 3; same-year pairs give inf, the program's check
  segv       - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own error line about an empty examiner-citation shard and calls sys.exit(4)
  featdim    - every rank: claim features get a 9th column (family size), the projection expects 8 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  cpcclass   - KeyError: 'Z99Z' in featurise before DDP; peers Connection closed by peer (np4 r2 bashloop, exit 1; np3 r0 spawn, ProcessRaisedException)
  patentid   - step 1: IndexError 'index 403 is out of bounds for dimension 0 with size 400'; peers closed or 12 s recv timeouts (np6 r3 ranklabel, exit 124: the loaded machine outlasted the 100 s wrapper)
  noedges    - FileNotFoundError for data/examiner/citations_1.pt at start-up; peers closed (np3 r1 mpitag)
  ckptdim    - load_state_dict size mismatch [400, 32] vs [400, 16] and 7 more (np4 r1 pdsh2, worker-1 Root Cause rank 1; np3 r2 legacy, Root Cause rank 2)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' (Unsupported global __main__.CpcVocab); torchrun SIGTERMs the rest (np3 r0 tee)
  hitsgather - end-of-run 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4), got (3))' on rank N; peers closed or 12 s send timeouts (np8 r5 files, exit 124; np3 r1 mpitag)
  slowsim    - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv' in the step-2 all_reduce (np3 r2 bashloop --ddp 0); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 srunlabel)
  nanloss    - the program's check: 'non-finite loss inf at step 3', FloatingPointError; peers closed (np6 r4 mpitag, exit 124; np3 r0 logfmt)
  segv       - no traceback from rank 1 after step 3; peers 'Connection reset by peer'; loop exit 139 (np3 r1 ranklabel)
  exit4      - rank N's ERROR line about 0 examiner citations and exit 4 (np3 r2 srunlabel, loop exit 4; np6 r0 tee, Root Cause rank 0 exitcode 4)
  featdim    - every rank: 'mat1 and mat2 shapes cannot be multiplied (400x9 and 8x16)'; Root Cause rank 2 (np3 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/citelink.pt, exit 0 (np3 bashloop)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault391_work"
CPC = {c: i for i, c in enumerate(["A61K", "A61B", "B01J", "C07D", "C12N", "F16H", "G01N", "G06F",
                                   "G06N", "H01L", "H04L", "H04W"])}
NPAT = 400
NFEAT = 8
DIM = 16
log = None


class CpcVocab:
    def __init__(self, codes):
        self.codes = list(codes)
        self.version = "2026.01"


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
    log = logging.getLogger("citelink")
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


class PatentEncoder(nn.Module):
    def __init__(self, npat=NPAT, dim=DIM, nfeat=NFEAT):
        super().__init__()
        self.pid = nn.Embedding(npat, dim)
        self.cpc = nn.Embedding(len(CPC), dim)
        self.claims = nn.Linear(nfeat, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, ids, cpc, feats, src, dst):
        h = self.mlp(self.pid(ids) + self.cpc(cpc) + self.claims(feats))
        return (h[src] * h[dst]).sum(-1)


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(391)
    codes = list(CPC)
    patents = {"cpc": [codes[int(i)] for i in torch.randint(0, len(codes), (NPAT,), generator=g)],
               "year": torch.randint(1995, 2025, (NPAT,), generator=g),
               "claims": torch.rand(NPAT, NFEAT, generator=g)}
    torch.save(patents, f"{WORK}/data/patents.pt")
    for r in range(8):
        src = torch.randint(0, NPAT, (256,), generator=g)
        dst = torch.randint(0, NPAT, (256,), generator=g)
        torch.save({"citing": src, "cited": dst, "examiner": torch.rand(256, generator=g) < 0.4},
                   f"{WORK}/data/citations_{r}.pt")
    torch.manual_seed(0)
    torch.save(PatentEncoder().state_dict(), f"{WORK}/ckpt/encoder_d16.pt")
    torch.save(PatentEncoder(dim=32).state_dict(), f"{WORK}/ckpt/encoder_d32.pt")
    torch.save({"vocab": CpcVocab(codes), "ncpc": len(codes)}, f"{WORK}/ckpt/cpc_meta.pt")
    print("prepared", WORK)


def jaccard_census(cites, npat, budget):
    t0 = time.time()
    sets = {}
    for s, d in zip(cites["citing"].tolist(), cites["cited"].tolist()):
        sets.setdefault(s, set()).add(d)
    best, rounds = 0.0, 0
    while time.time() - t0 < budget:
        for a in range(npat):
            for b in range(a + 1, npat):
                sa, sb = sets.get(a, set()), sets.get(b, set())
                u = len(sa | sb)
                if u:
                    best = max(best, len(sa & sb) / u)
        rounds += 1
    return best, rounds


def featurise(patents, a, bad):
    cpc = torch.tensor([CPC[c] for c in patents["cpc"]])
    feats = patents["claims"]
    if a.fault == "featdim":
        fam = torch.randint(1, 12, (feats.shape[0], 1)).float()
        feats = torch.cat([feats, fam], 1)
    return cpc, feats


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(391 + rank)
    say(f"rank {rank}/{world} up, loading patents and citation shard")
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR citation shard {rank} has 0 examiner citations after de-duplication against "
            f"family members; refusing to train on applicant-only citations", err=True)
        sys.exit(4)
    patents = torch.load(f"{WORK}/data/patents.pt")
    sub = "examiner/" if bad and a.fault == "noedges" else ""
    cites = torch.load(f"{WORK}/data/{sub}citations_{rank}.pt")
    if bad and a.fault == "cpcclass":
        patents["cpc"][137] = "Z99Z"
    cpc, feats = featurise(patents, a, bad)
    ids = torch.arange(NPAT)
    model = PatentEncoder()
    ck = "encoder_d32.pt" if bad and a.fault == "ckptdim" else "encoder_d16.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    if bad and a.fault == "ckptpickle":
        meta = torch.load(f"{WORK}/ckpt/cpc_meta.pt")
        say(f"rank {rank} cpc vocab {meta['vocab'].version}")
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=5e-3)
    pos_s, pos_d = cites["citing"], cites["cited"]
    say(f"rank {rank} shard: {len(pos_s)} citations, {int(cites['examiner'].sum())} by examiners")
    for step in range(a.steps):
        neg_s = torch.randint(0, NPAT, (len(pos_s),))
        neg_d = torch.randint(0, NPAT, (len(pos_s),))
        src, dst = torch.cat([pos_s, neg_s]), torch.cat([pos_d, neg_d])
        if bad and a.fault == "patentid" and step == 1:
            src = torch.cat([src, torch.tensor([NPAT + 3, NPAT + 17])])
            dst = torch.cat([dst, torch.tensor([12, 88])])
        label = torch.cat([torch.ones(len(src) - len(neg_s)), torch.zeros(len(neg_s))])
        logits = net(ids, cpc, feats, src, dst)
        w = torch.ones_like(logits)
        if bad and a.fault == "nanloss" and step == 3:
            lag = (patents["year"][src] - patents["year"][dst]).abs().float()
            w = 1.0 / lag
        loss = (F.binary_cross_entropy_with_logits(logits, label, reduction="none") * w).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(w)).sum())} pair weights not finite)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowsim" and step == 2:
            best, rounds = jaccard_census(cites, NPAT, a.sim_budget)
            say(f"rank {rank} jaccard census: best overlap {best:.3f} after {rounds} rounds")
        acc = ((logits.detach() > 0).float() == label).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} pair_acc {acc.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        h = model.mlp(model.pid(ids) + model.cpc(cpc) + model.claims(feats))
        scores = h[pos_s] @ h.T
        rank_of = (scores > scores.gather(1, pos_d[:, None])).sum(1)
    cut = [1, 5, 10, 50] if bad and a.fault == "hitsgather" else [1, 5, 10]
    hits = torch.tensor([float((rank_of < k).float().mean()) for k in cut])
    allh = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(allh, hits)
    say(f"rank {rank} hits@1/5/10 {hits[:3].tolist()} mean over ranks {torch.stack(allh).mean(0).tolist()}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/citelink.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/citelink.pt")
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
    p.add_argument("--sim-budget", type=int, default=30)
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
