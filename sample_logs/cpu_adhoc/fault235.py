"""A two-hundred-and-thirty-fifth hand-run batch: LEARNING TO RANK FOR SEARCH RESULTS.

A small LambdaRank-style scorer over synthetic query/document feature lists.  Rank 0 writes the run config
(config/ltr.json), the relevance judgements of every shard (qrels/qrels.shard<R>.tsv: qid, doc, grade 0-4) and
the initial scorer checkpoint (ckpt/scorer_init_h32.pt); every rank reads its shard's judgements, pads each
query's document list to a fixed length with a mask, all_gathers the per-query list lengths for a length
summary, and trains an MLP scorer (features -> hidden -> 1) with pairwise lambdas weighted by the change in
NDCG@k, wrapped in DDP over gloo (or with gradients all_reduced by hand, --ddp 0).  Each step checks that the
batch NDCG is finite.  After the steps the validation NDCG@10 sums are all_reduced and rank 0 saves
ltr_scorer_final.pt.

Faults:
  idcg0    - rank N drops grade-1 judgements as noise: a query with no relevant documents, ideal DCG 0, NaN NDCG
  listlen  - rank N counts one padded query in its list lengths: all_gather with another count (gloo size)
  noqrels  - rank N reads its judgements from qrels/2024-06/ which does not exist (FileNotFoundError)
  qid      - rank N lists its queries with an off-by-one range: a query id absent from the judgements (KeyError)
  featw    - every rank: the config gives 23 features while the feature lists have 24 (first Linear shape error)
  grade    - rank N's judgement shard is on the editorial 1-5 scale: grade 5 beyond the gain table (IndexError)
  ckpt     - rank N initialises from ckpt/scorer_init_h48.pt of an older sweep (hidden width 48, size mismatch)
  slowval  - rank N recomputes its whole validation list unbatched for --stall s before the validation all_reduce
  sigbus   - rank N sends itself SIGBUS after step 2
  exit4    - rank N prints its own error line about an empty judgement shard and calls sys.exit(4)
  topk     - every rank: the NDCG cut-off comes from the config as the string "10" (TypeError in the slice)
  none     - control, clean run

What happened (filled in after the runs):
  idcg0    - rank N: FloatingPointError NDCG@10 is nan for query qN_2 (ideal DCG 0.0) at step 0; peers closed
  listlen  - an unnamed peer aborted: gloo EnforceNotMet 50 vs 48 size mismatch (SIGABRT); others reset
  noqrels  - rank N: FileNotFoundError .../qrels/2024-06/qrels.shardN.tsv; peers closed in the all_gather
  qid      - rank N: KeyError 'qN_24' reading the judgements; peers closed in the all_gather
  featw    - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (120x24 and 23x32)
  grade    - rank N: IndexError index 5 is out of bounds for dimension 0 with size 5; peers closed
  ckpt     - rank N: RuntimeError size mismatch for net.0.weight [48, 24] vs [32, 24]; peers SIGTERMed
  slowval  - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  sigbus   - rank N: exitcode -7 (SIGBUS) after step 2; peers Connection reset by peer
  exit4    - rank N logs its ERROR empty judgement shard line and exits 4; peers closed (np4: rank 0 SIGABRT)
  topk     - every rank: TypeError slice indices must be integers or None or have an __index__ method
  none     - np4 run: rank 2 SIGABRT at teardown (dropped); np3 rerun: clean, exit 0
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault235_work"
N_FEAT = 24
LIST_LEN = 20
N_QUERIES = 24
BATCH_Q = 6
GAIN = torch.tensor([0.0, 1.0, 3.0, 7.0, 15.0])


class Scorer(nn.Module):
    def __init__(self, n_feat, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_feat, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def make_shard(shard):
    g = torch.Generator().manual_seed(1000 + shard)
    lens = torch.randint(8, LIST_LEN + 1, (N_QUERIES,), generator=g)
    feats = torch.randn(N_QUERIES, LIST_LEN, N_FEAT, generator=g)
    return lens, feats


def write_inputs(world, fault, frank, hidden):
    os.makedirs(f"{WORK}/config", exist_ok=True)
    os.makedirs(f"{WORK}/qrels", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    cfg = {"n_features": 23 if fault == "featw" else N_FEAT, "hidden": hidden, "lr": 0.05, "steps": 4,
           "ndcg_cutoff": "10" if fault == "topk" else 10, "sigma": 1.0}
    with open(f"{WORK}/config/ltr.json", "w") as f:
        json.dump(cfg, f)
    w_true = torch.linspace(-1.0, 1.0, N_FEAT)
    for r in range(world):
        lens, feats = make_shard(r)
        shift = 1 if (fault == "grade" and r == frank) else 0
        with open(f"{WORK}/qrels/qrels.shard{r}.tsv", "w") as f:
            for q in range(N_QUERIES):
                s = feats[q, : lens[q]] @ w_true
                grade = torch.bucketize(s, torch.tensor([-1.0, 0.5, 2.0, 3.5]))
                if q % 5 == 2:
                    grade = grade.clamp(max=1)
                grade[s.argmax()] = max(int(grade.max()), 1)
                for d in range(int(lens[q])):
                    f.write(f"q{r}_{q}\t{d}\t{int(grade[d]) + shift}\n")
    torch.manual_seed(7)
    torch.save(Scorer(cfg["n_features"], hidden).state_dict(), f"{WORK}/ckpt/scorer_init_h{hidden}.pt")
    if not os.path.exists(f"{WORK}/ckpt/scorer_init_h48.pt"):
        torch.save(Scorer(N_FEAT, 48).state_dict(), f"{WORK}/ckpt/scorer_init_h48.pt")


def read_qrels(path, min_grade):
    qrels = {}
    with open(path) as f:
        for line in f:
            qid, doc, grade = line.rstrip("\n").split("\t")
            g = int(grade)
            qrels.setdefault(qid, {})[int(doc)] = g if g >= min_grade else 0
    return qrels


def ndcg_at(scores, rel, mask, k):
    gains = GAIN[rel] * mask
    disc = 1.0 / torch.log2(torch.arange(LIST_LEN, dtype=torch.float32) + 2.0)
    order = torch.argsort(scores.masked_fill(mask == 0, -1e9), dim=1, descending=True)
    dcg = (torch.gather(gains, 1, order) * disc)[:, :k].sum(1)
    ideal = (torch.sort(gains, dim=1, descending=True).values * disc)[:, :k].sum(1)
    return dcg / ideal, gains, disc, order, ideal


def lambda_loss(scores, rel, mask, k, sigma):
    ndcg, gains, disc, order, ideal = ndcg_at(scores.detach(), rel, mask, k)
    rank_pos = torch.empty_like(order)
    rank_pos.scatter_(1, order, torch.arange(LIST_LEN).expand_as(order))
    d = disc[rank_pos]
    delta = (gains.unsqueeze(2) - gains.unsqueeze(1)).abs() * (d.unsqueeze(2) - d.unsqueeze(1)).abs()
    delta = delta / ideal.view(-1, 1, 1)
    pair = (rel.unsqueeze(2) > rel.unsqueeze(1)) & (mask.unsqueeze(2) > 0) & (mask.unsqueeze(1) > 0)
    diff = scores.unsqueeze(2) - scores.unsqueeze(1)
    loss = (delta * nn.functional.softplus(-sigma * diff))[pair].sum() / pair.sum().clamp(min=1)
    return loss, ndcg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    fr = a.rank
    me = fr == -1 or fr == rank
    torch.manual_seed(0)
    if rank == 0:
        write_inputs(world, a.fault, fr, 32)
        print(f"rank 0 wrote config, {world} judgement shards and ckpt/scorer_init_h32.pt", flush=True)
    dist.barrier()
    with open(f"{WORK}/config/ltr.json") as f:
        cfg = json.load(f)

    lens, feats = make_shard(rank)
    qdir = f"{WORK}/qrels/2024-06" if (a.fault == "noqrels" and me) else f"{WORK}/qrels"
    min_grade = 2 if (a.fault == "idcg0" and me) else 0
    qrels = read_qrels(f"{qdir}/qrels.shard{rank}.tsv", min_grade)
    qids = [f"q{rank}_{q}" for q in range(1, N_QUERIES + 1)] if (a.fault == "qid" and me) else \
        [f"q{rank}_{q}" for q in range(N_QUERIES)]
    rel = torch.zeros(N_QUERIES, LIST_LEN, dtype=torch.long)
    mask = torch.zeros(N_QUERIES, LIST_LEN)
    for i, qid in enumerate(qids):
        judged = qrels[qid]
        for d, g in judged.items():
            rel[i, d] = g
        mask[i, : len(judged)] = 1.0
    print(f"rank {rank} loaded {len(qids)} queries, {int(mask.sum())} judged documents", flush=True)

    counts = mask.sum(1)
    if a.fault == "listlen" and me:
        counts = torch.cat([counts, torch.tensor([float(LIST_LEN)])])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        allc = torch.cat(gathered)
        print(f"list lengths: {allc.numel()} queries, mean {allc.mean():.1f}, max {int(allc.max())}", flush=True)

    hidden = 48 if (a.fault == "ckpt" and me) else cfg["hidden"]
    model = Scorer(cfg["n_features"], cfg["hidden"])
    model.load_state_dict(torch.load(f"{WORK}/ckpt/scorer_init_h{hidden}.pt"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"])
    k = cfg["ndcg_cutoff"]
    train_q = N_QUERIES - BATCH_Q

    for step in range(cfg["steps"]):
        lo = (step * BATCH_Q) % train_q
        x, y, m = feats[lo:lo + BATCH_Q], rel[lo:lo + BATCH_Q], mask[lo:lo + BATCH_Q]
        scores = net(x)
        loss, ndcg = lambda_loss(scores, y, m, k, cfg["sigma"])
        if not torch.isfinite(ndcg).all():
            bad = int((~torch.isfinite(ndcg)).nonzero()[0])
            raise FloatingPointError(f"NDCG@{k} is {ndcg[bad].item()} for query {qids[lo + bad]} on rank {rank} "
                                     f"at step {step} (ideal DCG {float(ndcg_at(scores.detach(), y, m, k)[4][bad])})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        tot = loss.detach().clone()
        dist.all_reduce(tot)
        print(f"rank {rank} step {step} loss {tot.item() / world:.4f} ndcg@{k} {ndcg.mean().item():.4f}", flush=True)
        if a.fault == "exit4" and me and step == 1:
            print(f"ERROR rank {rank}: judgement shard qrels.shard{rank}.tsv has 0 judged documents for 3 validation "
                  f"queries after dedup; abort", flush=True)
            sys.exit(4)
        if a.fault == "sigbus" and me and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)

    with torch.no_grad():
        if a.fault == "slowval" and me:
            print(f"rank {rank}: scoring the full validation list ({BATCH_Q * LIST_LEN} docs) without batching", flush=True)
            time.sleep(a.stall)
        vs = model(feats[train_q:])
        vn = ndcg_at(vs, rel[train_q:], mask[train_q:], k)[0]
        acc = torch.tensor([vn.sum().item(), float(vn.numel())])
        dist.all_reduce(acc)
    if rank == 0:
        print(f"validation NDCG@{k} {acc[0].item() / acc[1].item():.4f} over {int(acc[1])} queries", flush=True)
        torch.save(model.state_dict(), f"{WORK}/ltr_scorer_final.pt")
        print(f"saved {WORK}/ltr_scorer_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
