"""A four-hundredth hand-run batch: RNA SECONDARY STRUCTURE FOLDING (base-pair contact maps).

Synthetic RNA: each record is a sequence over A/C/G/U (looked up in a 4-entry nucleotide table) with a
dot-bracket structure built from stems of Watson-Crick and G-U wobble pairs.  Every rank reads its shard
from /tmp/fault400_work/shards/shard_R.pt, parses the dot-bracket strings of each batch into a pair matrix,
and trains a small folding net (nucleotide embedding, two dilated Conv1d layers, a pairwise head on
[h_i, h_j] giving a contact logit per (i, j)) on a masked BCE loss plus a small stacking free-energy term,
wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised from
ckpt/fold_v4.pt.  Per-rank histograms of stem lengths are all_gathered at the start, the pair F1 is
all_reduced every step, the predicted pair count is all_reduced at the end, and rank 0 saves export/fold.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  nucleotide - rank N's shard holds a sequence with an ambiguous base "N", missing from the table (KeyError)
  bracket    - rank N's step-3 batch has a structure with an unmatched ')' (ValueError from the parser)
  noshard    - rank N reads its shard from shards/holdout/ which does not exist (FileNotFoundError)
  ckptsize   - rank N initialises from ckpt/fold_v5.pt, saved with a 5-token embedding (size mismatch)
  ckptpickle - rank N initialises from ckpt/fold_full.pt, which pickles a FoldConfig object (weights_only refusal)
  lengather  - rank N all_gathers its stem-length histogram with an overflow bin (9 vs 8 entries)
  nussinov   - rank N runs a pure-Python Nussinov DP over its shard before the step-2 all_reduce (slow)
  energynan  - rank N's stacking energy takes log(0) for a hairpin of length 2 at step 3: the program's check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit2      - rank N finds a pseudoknot in its predicted structures at the end, prints an error, sys.exit(2)
  pairshape  - every rank: the pair head is fed [h_i, h_j, h_i*h_j] (3x16 wide), it expects 2x16 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  nucleotide - KeyError: 'N' tokenising the shard before the first all_gather; peers Connection closed by peer (np4 r2 tee, np6 r0 filter)
  bracket    - after steps 0-2, "ValueError: unbalanced ')' at position 0 in structure of record 29"; peers closed (np3 r1 tee_trainer);
               under DETAIL rank 0 'Ranks 3 failed to pass monitoredBarrier in 12000 ms' (np4 r3 detail)
  noshard    - FileNotFoundError for shards/holdout/shard_N.pt at start-up (np3 r2 pymodule; np4 r1 redirects: console only Root Cause rank 1)
  ckptsize   - load_state_dict size mismatch for emb.weight [5,16] vs [4,16] (np4 r1 pdsh2: worker-1's agent RendezvousConnectionError;
               np3 r0 restart: attempt 2 ranks 1 and 2 'Gloo connectFullMesh failed ... Connection refused', final Root Cause rank 1)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' (Unsupported global __main__.FoldConfig) (np5 r3 loglevel)
  lengather  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' on rank N (np6 r4 prefix);
               DETAIL: every rank 'Detected mismatch between collectives', rank 1's fingerprint TensorShape=[9] (np3 r1 detail)
  nussinov   - 12 s: ranks 0 and 1 'Timed out waiting 12000ms for recv operation', the slow rank 2 silent (np3 r2 plain);
               300 s: output stops after step 1, killed by timeout at 60 s, exit 124 (np4 r1 tee)
  energynan  - the program's check: 'stacking free energy is inf ...' then FloatingPointError at step 3 (np8 r5 wrapper, np3 r0 loglevel+logfmt)
  sigsegv    - no traceback after step 3, Root Cause exitcode -11 (SIGSEGV) (np4 r2 prefix); np3 r1 restart: attempt 2 every rank
               'Gloo connectFullMesh failed ... Connect timeout' after ~60 s, final Root Cause rank 0 exitcode 1
  exit2      - after all 6 steps rank 3's pseudoknot ERROR line and exit 2; peers closed in the final all_reduce (np6 r3 tee_trainer)
  pairshape  - every rank 'mat1 and mat2 shapes cannot be multiplied (8192x48 and 32x1)' in the first forward (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/fold.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault400_work"
NUC = {"A": 0, "C": 1, "G": 2, "U": 3}
PAIRS = {("A", "U"), ("U", "A"), ("G", "C"), ("C", "G"), ("G", "U"), ("U", "G")}
SEQLEN = 32
BATCH = 8
DIM = 16
log = None


class FoldConfig:
    def __init__(self, dim=DIM, vocab=4):
        self.dim = dim
        self.vocab = vocab


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
    log = logging.getLogger("rnafold")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s rnafold[%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class FoldNet(nn.Module):
    def __init__(self, vocab=4, dim=DIM, triple=False):
        super().__init__()
        self.triple = triple
        self.emb = nn.Embedding(vocab, dim)
        self.c1 = nn.Conv1d(dim, dim, 3, padding=1)
        self.c2 = nn.Conv1d(dim, dim, 3, padding=2, dilation=2)
        self.pair = nn.Linear(2 * dim, 1)

    def forward(self, tok):
        h = self.emb(tok).transpose(1, 2)
        h = torch.relu(self.c1(h))
        h = torch.relu(self.c2(h) + h).transpose(1, 2)
        n = h.shape[1]
        hi = h.unsqueeze(2).expand(-1, n, n, -1)
        hj = h.unsqueeze(1).expand(-1, n, n, -1)
        feats = [hi, hj, hi * hj] if self.triple else [hi, hj]
        z = self.pair(torch.cat(feats, -1)).squeeze(-1)
        return (z + z.transpose(1, 2)) / 2


def make_rna(n, seed):
    g = torch.Generator().manual_seed(seed)
    bases = "ACGU"
    recs = []
    for _ in range(n):
        seq = [bases[int(i)] for i in torch.randint(0, 4, (SEQLEN,), generator=g)]
        st = ["."] * SEQLEN
        i = int(torch.randint(0, 6, (1,), generator=g))
        while i + 10 < SEQLEN:
            stem = int(torch.randint(3, 6, (1,), generator=g))
            loop = int(torch.randint(3, 6, (1,), generator=g))
            j = i + 2 * stem + loop - 1
            if j >= SEQLEN:
                break
            for k in range(stem):
                a, b = i + k, j - k
                seq[b] = {"A": "U", "U": "G", "G": "C", "C": "G"}[seq[a]]
                st[a], st[b] = "(", ")"
            i = j + 1 + int(torch.randint(1, 4, (1,), generator=g))
        recs.append({"seq": "".join(seq), "db": "".join(st)})
    return recs


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_rna(64, 400 + r), f"{WORK}/shards/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(FoldNet(4).state_dict(), f"{WORK}/ckpt/fold_v4.pt")
    torch.save(FoldNet(5).state_dict(), f"{WORK}/ckpt/fold_v5.pt")
    torch.save({"config": FoldConfig(), "model": FoldNet(4).state_dict()}, f"{WORK}/ckpt/fold_full.pt")
    print("prepared", WORK)


def parse_db(db, idx):
    pm = torch.zeros(len(db), len(db))
    stack = []
    for p, c in enumerate(db):
        if c == "(":
            stack.append(p)
        elif c == ")":
            if not stack:
                raise ValueError(f"unbalanced ')' at position {p} in structure of record {idx}: {db}")
            q = stack.pop()
            pm[q, p] = pm[p, q] = 1.0
    if stack:
        raise ValueError(f"unbalanced '(' at position {stack[-1]} in structure of record {idx}")
    return pm


def stem_hist(recs):
    h = torch.zeros(8)
    for r in recs:
        for run in r["db"].replace(")", " ").replace(".", " ").split():
            h[min(len(run), 7)] += 1
    return h


def nussinov(seq):
    n = len(seq)
    dp = [[0] * n for _ in range(n)]
    for span in range(4, n):
        for i in range(n - span):
            j = i + span
            best = max(dp[i + 1][j], dp[i][j - 1])
            if (seq[i], seq[j]) in PAIRS:
                best = max(best, dp[i + 1][j - 1] + 1)
            for k in range(i + 1, j):
                best = max(best, dp[i][k] + dp[k + 1][j])
            dp[i][j] = best
    return dp[0][n - 1]


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4000 + rank)
    say(f"rank {rank}/{world} up, loading RNA shard")
    split = "holdout/" if bad and a.fault == "noshard" else ""
    recs = torch.load(f"{WORK}/shards/{split}shard_{rank}.pt")
    if bad and a.fault == "nucleotide":
        s = recs[9]["seq"]
        recs[9]["seq"] = s[:14] + "N" + s[15:]
    if bad and a.fault == "bracket":
        db = recs[3 * BATCH + 5]["db"]
        p = db.index(")")
        recs[3 * BATCH + 5]["db"] = db[:p] + "))" + db[p + 2:] if db[p + 1] == "." else db[:p] + ")" + db[p + 1:]
        recs[3 * BATCH + 5]["db"] = ")" + recs[3 * BATCH + 5]["db"][1:]
    tok = torch.tensor([[NUC[c] for c in r["seq"]] for r in recs])
    hist = stem_hist(recs)
    if bad and a.fault == "lengather":
        hist = torch.cat([hist, torch.tensor([0.0])])
    allh = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} stems {int(hist.sum())} global {int(sum(h.sum() for h in allh))}")
    model = FoldNet(triple=(a.fault == "pairshape" and bad))
    ck = {"ckptsize": "fold_v5.pt", "ckptpickle": "fold_full.pt"}.get(a.fault, "fold_v4.pt") if bad else "fold_v4.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    nb = len(recs) // BATCH
    for step in range(a.steps):
        b = step % nb
        pm = torch.stack([parse_db(recs[b * BATCH + k]["db"], b * BATCH + k) for k in range(BATCH)])
        x = tok[b * BATCH:(b + 1) * BATCH]
        logit = net(x)
        bce = F.binary_cross_entropy_with_logits(logit, pm)
        prob = torch.sigmoid(logit)
        stack_p = (prob[:, :-1, 1:] * pm[:, :-1, 1:]).sum() / pm[:, :-1, 1:].sum().clamp(min=1)
        if bad and a.fault == "energynan" and step == 3:
            stack_p = stack_p * 0.0
        energy = -torch.log(stack_p)
        loss = bce + 0.1 * energy
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: stacking free energy is {energy.item()} (hairpin loop of 2 nt in "
                f"record {b * BATCH + 2}), loss {loss.item()}", err=True)
            raise FloatingPointError(f"non-finite folding loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "nussinov" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.dp_budget:
                n += sum(nussinov(r["seq"]) for r in recs[:8])
            say(f"rank {rank} Nussinov baseline: {n} pairs")
        pred = (prob.detach() > 0.5).float()
        tp = (pred * pm).sum()
        f1 = (2 * tp / (pred.sum() + pm.sum()).clamp(min=1)).reshape(1)
        dist.all_reduce(f1)
        say(f"rank {rank} step {step} loss {loss.item():.4f} f1 {f1.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    npairs = (prob.detach() > 0.5).float().sum().reshape(1)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR predicted structure for record 12 contains a pseudoknot (pairs 4-19 and 11-27 "
            f"cross), cannot write dot-bracket; refusing to export", err=True)
        sys.exit(2)
    dist.all_reduce(npairs)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/fold.pt")
        say(f"rank 0 done: {a.steps} steps, {int(npairs.item())} predicted pairs, saved export/fold.pt")
    dist.barrier()
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
    p.add_argument("--dp-budget", type=int, default=45)
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
