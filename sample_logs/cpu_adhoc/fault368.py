"""A three-hundred-and-sixty-eighth hand-run batch: E-COMMERCE QUERY-PRODUCT RELEVANCE RANKING.

Synthetic search sessions: each query is a bag of token ids (vocabulary of 500) and comes with a list of 8
candidate products; a product has title tokens, a category (looked up in a 10-entry category table), a price
and a graded relevance label 0..3 from click logs.  Every rank reads its sessions from
/tmp/fault368_work/shards/sessions_R.pt, turns them into tensors, and trains a two-tower ranker (EmbeddingBag
query tower, EmbeddingBag title tower plus a category embedding and dense price features, a small MLP scorer)
with a listwise softmax loss weighted by log-relevance gains, wrapped in DDP (gloo) or, with --ddp 0, with the
gradients all_reduced by hand.  The model starts from ckpt/ranker_v500.pt.  Per-rank click-through statistics
are all_gathered at the start, the loss and NDCG@8 are all_reduced every step, a final all_gather of per-rank
query counts comes at the end, and rank 0 saves export/ranker.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  category   - rank N has products in category "pet_supplies", missing from the category table (KeyError)
  tokenid    - rank N's tokenizer emits id 500 (the padding sentinel) into a query: embedding index out of range
  noshard    - rank N reads its sessions from shards/holdout/, which does not exist (FileNotFoundError)
  ckptvocab  - rank N initialises from ckpt/ranker_v640.pt, saved with a 640-token vocabulary (size mismatch)
  ckptpickle - rank N loads ckpt/ranker_cfg.pt, which pickles a RankerConfig object (weights_only refusal)
  statgather - rank N all_gathers its CTR statistics with an extra add-to-cart rate (5 entries vs 4)
  rerank     - rank N brute-forces every permutation of its candidate lists in Python before the step-3
               all_reduce (slow rank; --rerank-budget seconds)
  logzero    - rank N computes gains as log2(relevance) instead of log2(1 + relevance) at step 2: -inf gains,
               caught by the program's finiteness check (FloatingPointError)
  segv       - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line about duplicate query ids at the end and calls sys.exit(5)
  featbug    - every rank: the price features gain a discount column (3 wide), the scorer expects 2 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  category   - KeyError: 'pet_supplies' at start-up; peers Connection closed by peer in all_gather (np4 r2 tee, np6 r0 prefix)
  tokenid    - RuntimeError 'Index N of input takes value 500 which is not in the valid range [0, 500)' in the first forward (np3 r1 pymodule, np4 r3 filter)
  noshard    - FileNotFoundError for shards/holdout/sessions_1.pt, only in rank 1's stderr.log; console shows exitcode 1 (np4 r1 redirects)
  ckptvocab  - load_state_dict size mismatch [640, 24] vs [500, 24] (np3 r2 loglevel; np4 r1 pdsh2, node 1's agent then loses the store)
  ckptpickle - UnpicklingError 'Weights only load failed' (np5 r3 tee_trainer)
  statgather - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[5] (np3 r1 detail);
               'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank 4 (np6 r4 plain)
  rerank     - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv' after step 2 (np3 r2 plain); 300 s: silent after step 2,
               killed at 60 s, exit 124 (np4 r1 tee)
  logzero    - the check: 'relevance gains have N non-finite values at step 2', FloatingPointError (np3 r2 wrapper; np4 r0
               restart, where the restart then fails at Gloo connectFullMesh)
  segv       - no traceback after step 3, 'exitcode: -11' / SIGSEGV for rank N (np8 r5 tee; np3 r1 restart, restart fails at connectFullMesh)
  exit5      - rank N's duplicate-query ERROR line after the last step and exitcode 5 (np4 r2 wrapper, np8 r6 loglevel)
  featbug    - every rank: 'mat1 and mat2 shapes cannot be multiplied (384x3 and 2x8)', Root Cause rank 0 (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/ranker.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta
from itertools import permutations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault368_work"
CATEGORIES = {"electronics": 0, "books": 1, "apparel": 2, "home": 3, "toys": 4, "grocery": 5, "beauty": 6,
              "sports": 7, "garden": 8, "auto": 9}
VOCAB = 500
DIM = 24
NCAND = 8
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
    log = logging.getLogger("ranker")
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


class RankerConfig:
    def __init__(self, vocab, dim):
        self.vocab = vocab
        self.dim = dim


class TwoTowerRanker(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, ndense=2):
        super().__init__()
        self.query = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.title = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.cat = nn.Embedding(len(CATEGORIES), 8)
        self.dense = nn.Linear(ndense, 8)
        self.scorer = nn.Sequential(nn.Linear(2 * dim + 16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, q, qoff, t, toff, cat, dense):
        qv = self.query(q, qoff)                      # [Q, dim]
        tv = self.title(t, toff).view(qv.shape[0], NCAND, -1)
        qx = qv.unsqueeze(1).expand(-1, NCAND, -1)
        feats = torch.cat([qx, tv * qx, self.cat(cat), self.dense(dense)], dim=-1)
        return self.scorer(feats).squeeze(-1)         # [Q, NCAND]


def make_sessions(n, seed):
    g = torch.Generator().manual_seed(seed)
    cats = list(CATEGORIES)
    sessions = []
    for qi in range(n):
        qlen = int(torch.randint(2, 6, (1,), generator=g))
        qtok = torch.randint(0, VOCAB, (qlen,), generator=g).tolist()
        cands = []
        for _ in range(NCAND):
            tlen = int(torch.randint(3, 9, (1,), generator=g))
            ttok = torch.randint(0, VOCAB, (tlen,), generator=g).tolist()
            overlap = len(set(qtok) & set(ttok))
            if torch.rand(1, generator=g) < 0.4:
                ttok += qtok[:2]
                overlap += 2
            rel = min(3, overlap + int(torch.rand(1, generator=g) < 0.2))
            price = float(torch.empty(1).uniform_(2.0, 400.0, generator=g))
            cands.append({"title": ttok, "category": cats[int(torch.randint(0, 10, (1,), generator=g))],
                          "price": price, "rel": rel})
        sessions.append({"qid": seed * 1000 + qi, "query": qtok, "cands": cands,
                         "clicks": int(torch.randint(0, 5, (1,), generator=g))})
    return sessions


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_sessions(48, 200 + r), f"{WORK}/shards/sessions_{r}.pt")
    torch.manual_seed(0)
    torch.save(TwoTowerRanker().state_dict(), f"{WORK}/ckpt/ranker_v500.pt")
    torch.save(TwoTowerRanker(vocab=640).state_dict(), f"{WORK}/ckpt/ranker_v640.pt")
    torch.save({"config": RankerConfig(VOCAB, DIM), "state_dict": TwoTowerRanker().state_dict()},
               f"{WORK}/ckpt/ranker_cfg.pt")
    print("prepared", WORK)


def tensorise(sessions, a, bad):
    q, qoff, t, toff, cat, dense, rel = [], [], [], [], [], [], []
    for s in sessions:
        qoff.append(len(q))
        q += s["query"]
        for c in s["cands"]:
            toff.append(len(t))
            t += c["title"]
            cat.append(CATEGORIES[c["category"]])
            feat = [math.log1p(c["price"]) / 6.0, len(c["title"]) / 8.0]
            if a.fault == "featbug":
                feat.append(0.1)
            dense.append(feat)
            rel.append(c["rel"])
    n = len(sessions)
    return (torch.tensor(q), torch.tensor(qoff), torch.tensor(t), torch.tensor(toff),
            torch.tensor(cat).view(n, NCAND), torch.tensor(dense).view(n, NCAND, -1),
            torch.tensor(rel, dtype=torch.float).view(n, NCAND))


def ndcg_at_k(scores, rel):
    order = scores.argsort(dim=1, descending=True)
    disc = 1.0 / torch.log2(torch.arange(NCAND, dtype=torch.float) + 2.0)
    dcg = ((2 ** rel.gather(1, order) - 1) * disc).sum(1)
    ideal = ((2 ** rel.sort(dim=1, descending=True).values - 1) * disc).sum(1).clamp_min(1e-6)
    return (dcg / ideal).mean()


def brute_rerank(sessions):
    best = 0.0
    for s in sessions:
        rels = [c["rel"] for c in s["cands"]]
        for perm in permutations(range(NCAND)):
            v = sum((2 ** rels[p] - 1) / math.log2(i + 2) for i, p in enumerate(perm))
            best = max(best, v)
    return best


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading search sessions")
    split = "holdout/" if bad and a.fault == "noshard" else ""
    sessions = torch.load(f"{WORK}/shards/{split}sessions_{rank}.pt")
    if bad and a.fault == "category":
        sessions[11]["cands"][4]["category"] = "pet_supplies"
    if bad and a.fault == "tokenid":
        sessions[7]["query"].append(VOCAB)
    q, qoff, t, toff, cat, dense, rel = tensorise(sessions, a, bad)
    clicks = torch.tensor([float(s["clicks"]) for s in sessions])
    stats = torch.tensor([float(len(sessions)), clicks.mean().item(), (rel > 0).float().mean().item(),
                          rel.mean().item()])
    if bad and a.fault == "statgather":
        stats = torch.cat([stats, torch.tensor([0.031])])
    allstats = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allstats, stats)
    say(f"rank {rank} sessions {len(sessions)} ctr {stats[1]:.3f} global sessions "
        f"{int(sum(s[0] for s in allstats))}")
    model = TwoTowerRanker()
    if bad and a.fault == "ckptpickle":
        blob = torch.load(f"{WORK}/ckpt/ranker_cfg.pt")
        model.load_state_dict(blob["state_dict"])
    else:
        ck = "ranker_v640.pt" if bad and a.fault == "ckptvocab" else "ranker_v500.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        scores = net(q, qoff, t, toff, cat, dense)
        if bad and a.fault == "logzero" and step == 2:
            gains = torch.log2(rel)
        else:
            gains = torch.log2(1.0 + rel)
        if not torch.isfinite(gains).all():
            say(f"rank {rank}: relevance gains have {int((~torch.isfinite(gains)).sum())} non-finite values "
                f"at step {step} (min rel {rel.min():.0f})", err=True)
            raise FloatingPointError(f"non-finite relevance gains on rank {rank} at step {step}")
        target = torch.softmax(gains, dim=1)
        loss = -(target * torch.log_softmax(scores, dim=1)).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if bad and a.fault == "rerank" and step == 3:
            t0 = time.time()
            best = 0.0
            while time.time() - t0 < a.rerank_budget:
                best = max(best, brute_rerank(sessions[:4]))
            say(f"rank {rank} brute-force rerank best dcg {best:.3f}")
        met = torch.stack([loss.detach(), ndcg_at_k(scores.detach(), rel)])
        dist.all_reduce(met)
        say(f"rank {rank} step {step} loss {met[0].item() / world:.4f} ndcg@8 {met[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR found 3 duplicate query ids in sessions_{rank}.pt (qid {sessions[0]['qid']}), "
            f"refusing to export a ranker trained on leaked queries", err=True)
        sys.exit(5)
    nq = torch.tensor([len(sessions)])
    allq = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(allq, nq)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/ranker.pt")
        say(f"rank 0 done: {a.steps} steps, {int(sum(x.item() for x in allq))} queries, saved export/ranker.pt")
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
    p.add_argument("--rerank-budget", type=int, default=120)
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
