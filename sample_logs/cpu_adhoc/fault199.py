"""A hundred-and-ninety-ninth hand-run batch: MATRIX-FACTORISATION RECOMMENDERS.

A dot-product recommender trained on synthetic ratings: every rank owns a shard of the users (a local user
embedding table and user biases, trained by a local optimiser) and reads its ratings from
/tmp/fault199_work/data/ratings_R.pt; the item embeddings and item biases sit in a small module wrapped in
DDP (gloo), initialised from ckpt/items_init.pt.  Each step takes a batch of (user, item, rating) triples plus
negative items sampled from the items the user never rated, computes MSE on the ratings and a logistic loss
on the negatives, and all_reduces the loss for the log.  At the end the RMSE sums are all_reduced, per-rank
recall@10 is all_gathered, and rank 0 exports the top-10 items of its first users to export/topk.pt.

Faults:
  uid      - rank N maps its users with an off-by-one offset: a user id beyond the local table (IndexError)
  dim      - every rank: config gives user_dim 16 while the item checkpoint has dim 8 (dot-product shape error)
  nofile   - rank N reads its ratings from data/ratings_v2/ which does not exist (FileNotFoundError)
  nanlr    - rank N reads lr 1e6 for its user table: the loss goes NaN, the program's check raises
  negpool  - rank N builds its negative pool from rated items only: empty pool, the program's ValueError
  rmselen  - rank N all_gathers its per-rank RMSE sums with an extra count element (gloo size mismatch)
  ckpt     - rank N initialises the items from ckpt/items_init_v0.pt, saved with 48 items (size mismatch)
  regstr   - every rank: the regularisation weight comes from the env as a string (TypeError)
  late     - rank N rebuilds its user index for --stall seconds before the step-2 loss all_reduce
  segv     - rank N sends itself SIGSEGV after step 2
  exit6    - rank N prints its own error line about a corrupt rating row and exits with code 6
  none     - control, clean run

What happened (filled in after the runs):
  uid      - rank N: IndexError index out of range in self at the user embedding, step 0; peers closed
  dim      - every rank: RuntimeError size of tensor a (16) must match tensor b (8) at the dot product
  nofile   - rank N: FileNotFoundError .../data/ratings_v2/ratings_N.pt before DDP; peers closed in DDP init
  nanlr    - rank N: FloatingPointError loss is inf at step 2 (user lr 1e6), not NaN; peers closed
  negpool  - rank N: ValueError negative pool for rank N is empty, step 0; peers closed in backward
  rmselen  - one rank (not named) aborted: gloo EnforceNotMet 6 vs 4 size mismatch; others closed/reset
  ckpt     - rank N: RuntimeError size mismatch for emb.weight [48, 8] vs [64, 8]; peers closed in DDP init
  regstr   - every rank: TypeError only integer tensors of a single element can be converted to an index
  late     - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (exit 124)
  segv     - rank N: exitcode -11 (SIGSEGV) after step 2; spawn ProcessExitedException; peers closed/reset
  exit6    - rank N logs its ERROR corrupt ratings file line, exitcode 6; peers closed in backward
  none     - clean, exit 0, rank 0 exported the top-10 to export/topk.pt
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
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault199_work"
N_ITEMS = 64
USERS_PER_RANK = 20


class ItemTower(nn.Module):
    def __init__(self, n_items, dim):
        super().__init__()
        self.emb = nn.Embedding(n_items, dim)
        self.bias = nn.Embedding(n_items, 1)

    def forward(self, items):
        return self.emb(items), self.bias(items).squeeze(-1)


def get_logger(rank, use_logging):
    if not use_logging:
        return None
    class RankFilter(logging.Filter):
        def filter(self, record):
            record.rank = rank
            return True
    log = logging.getLogger("mf")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter())
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return log


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    logger = get_logger(rank, a.logfmt)

    def say(msg, err=False):
        if logger is None:
            print(msg, file=sys.stderr if err else sys.stdout, flush=True)
        elif err:
            logger.error(msg)
        else:
            logger.info(msg)

    torch.manual_seed(1234 + rank)
    user_dim = 16 if (a.fault == "dim" and bad) else 8
    item_dim = 8
    split = "ratings_v2" if (a.fault == "nofile" and bad) else ""
    path = os.path.join(WORK, "data", split, f"ratings_{rank}.pt")
    data = torch.load(path)
    users, items, ratings = data["users"], data["items"], data["ratings"]
    say(f"rank {rank}: loaded {len(ratings)} ratings for users {rank * USERS_PER_RANK}..{(rank + 1) * USERS_PER_RANK - 1}")

    offset = rank * USERS_PER_RANK - (1 if (a.fault == "uid" and bad) else 0)
    local_users = users - offset
    user_emb = nn.Embedding(USERS_PER_RANK, user_dim)
    user_bias = nn.Embedding(USERS_PER_RANK, 1)
    tower = ItemTower(N_ITEMS, item_dim)
    ck = "items_init_v0.pt" if (a.fault == "ckpt" and bad) else "items_init.pt"
    tower.load_state_dict(torch.load(os.path.join(WORK, "ckpt", ck)))
    model = DDP(tower)
    reg = os.environ.get("MF_REG", "0.01") if (a.fault == "regstr") else 0.01
    user_lr = 1e6 if (a.fault == "nanlr" and bad) else 0.05
    opt_items = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_users = torch.optim.SGD(list(user_emb.parameters()) + list(user_bias.parameters()), lr=user_lr)
    mean = ratings.mean()

    rated = [set(items[local_users == u].tolist()) for u in range(USERS_PER_RANK)]
    candidates = sorted(rated[0]) if (a.fault == "negpool" and bad) else range(N_ITEMS)
    pool = [i for i in candidates if i not in rated[0]]
    for step in range(a.steps):
        idx = torch.randint(0, len(ratings), (32,))
        u, it, r = local_users[idx], items[idx], ratings[idx]
        if step == 2 and a.fault == "exit6" and bad:
            say(f"ERROR rank {rank}: rating row {int(idx[0])} has item id -1 (corrupt ratings file); aborting", err=True)
            sys.exit(6)
        if not pool:
            raise ValueError(f"negative pool for rank {rank} is empty: all {N_ITEMS} candidate items filtered out")
        neg = torch.tensor(pool)[torch.randint(0, len(pool), (32,))]
        iv, ib = model(torch.cat([it, neg]))
        uv = user_emb(torch.cat([u, u]))
        ub = user_bias(torch.cat([u, u])).squeeze(-1)
        score = (uv * iv).sum(-1) + ub + ib
        pred, neg_score = score[:32] + mean, score[32:]
        mse = ((pred - r) ** 2).mean()
        neg_loss = nn.functional.softplus(neg_score).mean()
        loss = mse + 0.1 * neg_loss + reg * (uv.pow(2).sum(-1).mean() + iv.pow(2).sum(-1).mean())
        opt_items.zero_grad()
        opt_users.zero_grad()
        loss.backward()
        opt_items.step()
        opt_users.step()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (user lr {user_lr})")
        if step == 2 and a.fault == "late" and bad:
            say(f"rank {rank}: user index stale, rebuilding user index from {WORK}/data")
            time.sleep(a.stall)
        t = loss.detach().clone()
        dist.all_reduce(t)
        say(f"rank {rank} step {step} loss {t.item() / world:.4f} mse {mse.item():.4f}")
        if step == 2 and a.fault == "segv" and bad:
            os.kill(os.getpid(), signal.SIGSEGV)

    with torch.no_grad():
        iv, ib = model(items)
        pred = (user_emb(local_users) * iv).sum(-1) + user_bias(local_users).squeeze(-1) + ib + mean
        sums = torch.tensor([((pred - ratings) ** 2).sum().item(), float(len(ratings))])
        if a.fault == "rmselen" and bad:
            sums = torch.cat([sums, torch.tensor([float(USERS_PER_RANK)])])
        gathered = [torch.zeros(len(sums)) for _ in range(world)]
        dist.all_gather(gathered, sums)
        tot = torch.stack(gathered).sum(0)
        all_scores = user_emb.weight @ model.module.emb.weight.T + model.module.bias.weight.T
        top = all_scores.topk(10, dim=1).indices
        hits = sum(len(set(top[k].tolist()) & rated[k]) for k in range(USERS_PER_RANK))
        recall = torch.tensor([hits / max(1, sum(len(s) for s in rated))])
        recalls = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(recalls, recall)
    say(f"rank {rank}: rmse {(tot[0] / tot[1]).sqrt().item():.4f} recall@10 {recall.item():.4f}")
    if rank == 0:
        os.makedirs(os.path.join(WORK, "export"), exist_ok=True)
        torch.save({"topk": top[:5], "recall": torch.cat(recalls)}, os.path.join(WORK, "export", "topk.pt"))
        say(f"rank 0: global rmse {(tot[0] / tot[1]).sqrt().item():.4f}; exported top-10 to {WORK}/export/topk.pt")
    dist.destroy_process_group()


def spawn_worker(local_rank, a, nprocs):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    train(a)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        train(a)
