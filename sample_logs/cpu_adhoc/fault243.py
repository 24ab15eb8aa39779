"""A two-hundred-and-forty-third hand-run batch: CLICK MODEL FOR SEARCH LOGS (A POSITION-BIAS MODEL).

Synthetic search sessions: for every query id a feature store holds 12 candidate documents of 16 features; rank 0
exports one session shard per rank (/tmp/fault243_work/sessions/clicks_partRRR.pt: query ids, ranked positions and
clicks drawn from a hidden position-bias model). A small relevance tower (16 -> 32 -> 1) and an examination table
(one logit per position, the top position always examined) give P(click) = P(relevant) * P(examined); the loss is a
hand-written binary cross-entropy over the clicks, checked for non-finite values. The model is warm-started from
ckpt/clickmodel_p10.pt and wrapped in DDP (gloo); clicks and impressions are all_reduced every step (global CTR),
the per-position click counts are all_gathered at steps 3 and 6, and rank 0 saves the model at the end.

Faults:
  posidx    - rank N's shard was exported with depth 11: position 10 is beyond the 10-entry examination table
  probone   - rank N's shard has unstandardised features: P(relevant) saturates to 1 at the top position, log(1-p)
  ctrgather - rank N reports per-position click counts for 8 positions, the others for 10 (all_gather mismatch)
  nolog     - rank N opens clicks_partN.pt instead of the zero-padded clicks_part00N.pt (FileNotFoundError)
  qidkey    - rank N's shard holds query ids newer than the feature store snapshot (KeyError)
  docwidth  - every rank: the feature store is built with schema v2 (24 features), the tower takes 16
  ckpt      - rank N warm-starts from ckpt/clickmodel_p12.pt, saved with 12 positions (size mismatch)
  replay    - rank N replays every session click by click before the first step's all_reduce (others wait)
  sigterm   - rank N's wall-clock budget is 0 s, so it sends itself SIGTERM after step 2
  exit5     - rank N prints its own error line about clicks below the last examined position and sys.exit(5)
  none      - control, clean run

What happened (filled in after the runs):
  posidx    - rank N: IndexError index out of range in self (self.exam(pos), position 10) at step 1; peers closed
  probone   - rank N: FloatingPointError click log-likelihood is nan (max P(click) 1.000000) at step 1; peers closed
  ctrgather - rank N aborts: gloo EnforceNotMet op.preamble.length <= op.nbytes. 20 vs 16 in the step-3 all_gather
  nolog     - rank N: FileNotFoundError .../sessions/clicks_partN.pt at startup; peers SIGTERMed or closed
  qidkey    - rank N: KeyError 'q0207' / 'q0209' in batch_features at step 1; peers Connection closed by peer
  docwidth  - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (320x24 and 16x32) at step 1
  ckpt      - rank N: RuntimeError size mismatch for exam.weight [12, 1] vs [10, 1]; peers closed at DDP(model)
  replay    - rank N replays: peers gloo Timed out waiting 12000ms in backward; with PG 300 s killed by timeout (124)
  sigterm   - rank N prints its budget line after step 2 and dies by SIGTERM (exitcode -15); peers closed
  exit5     - rank N prints its ERROR clicks-below-last-examined line after step 1, exit status 5; peers closed
  none      - clean, exit 0, rank 0 saved ckpt/clickmodel_final.pt
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

POSITIONS = 10
FEATS = 16
DOCS_PER_QUERY = 12
STORE_QUERIES = 200


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sessions", type=int, default=256)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--work", default="/tmp/fault243_work")
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--replay-delay", type=float, default=0.02)
    return p.parse_args()


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def make_logger(a, rank):
    if not a.logfmt:
        return None
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    lg = logging.getLogger("clickmodel")
    lg.handlers[:] = [h]
    lg.setLevel(logging.INFO)
    return lg


class Console:
    def __init__(self, lg):
        self.lg = lg

    def info(self, msg):
        if self.lg:
            self.lg.info(msg)
        else:
            print(msg, flush=True)

    def error(self, msg):
        if self.lg:
            self.lg.error(msg)
        else:
            print(msg, file=sys.stderr, flush=True)


class ClickModel(nn.Module):
    def __init__(self, positions=POSITIONS, feats=FEATS, hidden=32):
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(feats, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.exam = nn.Embedding(positions, 1)

    def forward(self, x, pos):
        rel = torch.sigmoid(self.tower(x).squeeze(-1))
        exam = torch.sigmoid(self.exam(pos).squeeze(-1))
        exam = torch.where(pos == 0, torch.ones_like(exam), exam)
        return rel * exam


def build_store(width, scale):
    g = torch.Generator().manual_seed(1234)
    store = {}
    for q in range(STORE_QUERIES):
        store[f"q{q:04d}"] = torch.randn(DOCS_PER_QUERY, width, generator=g) * scale
    return store


def export_shards(work, world, sessions, plan):
    os.makedirs(os.path.join(work, "sessions"), exist_ok=True)
    g = torch.Generator().manual_seed(7)
    true_exam = 1.0 / (1.0 + torch.arange(POSITIONS + 2, dtype=torch.float32)) ** 0.7
    for r in range(world):
        depth, qid_lo, qid_hi = plan[r]
        qids = torch.randint(qid_lo, qid_hi, (sessions,), generator=g)
        order = torch.stack([torch.randperm(DOCS_PER_QUERY, generator=g)[:depth] for _ in range(sessions)])
        rel = torch.rand(sessions, depth, generator=g)
        clicks = (torch.rand(sessions, depth, generator=g) < rel * true_exam[:depth]).float()
        shard = {"qids": [f"q{int(q):04d}" for q in qids], "docs": order,
                 "pos": torch.arange(depth).expand(sessions, depth).clone(), "clicks": clicks}
        torch.save(shard, os.path.join(work, "sessions", f"clicks_part{r:03d}.pt"))


def save_warm_start(work):
    os.makedirs(os.path.join(work, "ckpt"), exist_ok=True)
    torch.manual_seed(0)
    torch.save(ClickModel(positions=POSITIONS).state_dict(), os.path.join(work, "ckpt", "clickmodel_p10.pt"))
    torch.save(ClickModel(positions=12).state_dict(), os.path.join(work, "ckpt", "clickmodel_p12.pt"))


def batch_features(store, shard, idx):
    rows = []
    for i in idx.tolist():
        qid = shard["qids"][i]
        feats = store[qid]
        rows.append(feats[shard["docs"][i]])
    return torch.stack(rows), shard["pos"][idx], shard["clicks"][idx]


def click_nll(p, clicks):
    p = p.clamp(min=1e-6, max=1.0)
    return -(clicks * torch.log(p) + (1 - clicks) * torch.log(1 - p)).mean()


def main(a, rank, world):
    con = Console(make_logger(a, rank))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(100 + rank)
    hit = a.fault != "none" and a.rank in (-1, rank)
    plan = [(POSITIONS, 0, STORE_QUERIES) for _ in range(world)]
    if a.fault in ("posidx", "qidkey") and a.rank >= 0:
        plan[a.rank] = (POSITIONS + 1, 0, STORE_QUERIES) if a.fault == "posidx" else (POSITIONS, 150, 240)
    width = 24 if a.fault == "docwidth" else FEATS
    scale = 60.0 if (hit and a.fault == "probone") else 1.0
    shard_name = "clicks_part{}.pt" if (hit and a.fault == "nolog") else "clicks_part{:03d}.pt"
    report_depth = 8 if (hit and a.fault == "ctrgather") else POSITIONS
    warm = "clickmodel_p12.pt" if (hit and a.fault == "ckpt") else "clickmodel_p10.pt"
    budget_s = 0.0 if (hit and a.fault == "sigterm") else 3600.0
    if rank == 0:
        export_shards(a.work, world, a.sessions, plan)
        save_warm_start(a.work)
        con.info(f"rank 0: exported {world} session shards of {a.sessions} sessions to {a.work}/sessions")
    dist.barrier()

    store = build_store(width, scale)
    shard = torch.load(os.path.join(a.work, "sessions", shard_name.format(rank)))
    con.info(f"rank {rank}: {len(shard['qids'])} sessions, depth {shard['pos'].shape[1]}, store {len(store)} queries")
    model = ClickModel()
    model.load_state_dict(torch.load(os.path.join(a.work, "ckpt", warm)))
    model = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    t0 = time.time()

    if hit and a.fault == "replay":
        con.info(f"rank {rank}: rebuilding examination counts by replaying {a.sessions * 16} sessions click by click")
        for s in range(a.sessions * 16):
            time.sleep(a.replay_delay)

    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        idx = torch.randint(0, len(shard["qids"]), (a.batch,), generator=g)
        x, pos, clicks = batch_features(store, shard, idx)
        p = model(x, pos)
        loss = click_nll(p, clicks)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: click log-likelihood is {loss.item()} "
                                     f"(max P(click) {p.max().item():.6f} at top position)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats = torch.tensor([clicks.sum().item(), float(clicks.numel())])
        dist.all_reduce(stats)
        con.info(f"rank {rank} step {step} loss {loss.item():.4f} global ctr {stats[0] / stats[1]:.4f}")
        if step == 1 and hit and a.fault == "exit5":
            bad = int((clicks.sum(1) > 0).sum().item()) + 5
            con.error(f"ERROR rank {rank}: shard clicks_part{rank:03d}.pt has {bad} sessions with clicks below "
                      f"the last examined position; refusing to train on an inconsistent click log")
            sys.exit(5)
        if step == 2 and time.time() - t0 > budget_s:
            con.info(f"rank {rank}: wall-clock budget of {budget_s:.0f}s used up after step {step}")
            os.kill(os.getpid(), signal.SIGTERM)
        if step % 3 == 0:
            per_pos = shard["clicks"].sum(0)[:report_depth].contiguous()
            gathered = [torch.zeros_like(per_pos) for _ in range(world)]
            dist.all_gather(gathered, per_pos)
            if rank == 0:
                tot = torch.stack(gathered).sum(0)
                con.info("rank 0: clicks per position " + " ".join(f"{int(c)}" for c in tot))

    with torch.no_grad():
        exam = torch.sigmoid(model.module.exam.weight.squeeze(-1))
    if rank == 0:
        con.info("rank 0: examination probabilities " + " ".join(f"{e:.3f}" for e in exam.tolist()))
        torch.save(model.module.state_dict(), os.path.join(a.work, "ckpt", "clickmodel_final.pt"))
        con.info(f"rank 0: saved {a.work}/ckpt/clickmodel_final.pt")
    dist.destroy_process_group()


def spawn_worker(local_rank, world, a):
    os.environ["RANK"] = str(local_rank)
    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["WORLD_SIZE"] = str(world)
    main(a, local_rank, world)


if __name__ == "__main__":
    args = parse()
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        mp.spawn(spawn_worker, args=(args.spawn, args), nprocs=args.spawn)
    else:
        main(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
