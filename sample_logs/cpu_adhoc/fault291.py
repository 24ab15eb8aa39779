"""A two-hundred-and-ninety-first hand-run batch: QUESTION ANSWERING OVER TABLES WITH A CELL SELECTOR.

A weakly supervised table QA model trained on synthetic data: every rank reads the table store
(/tmp/fault291_work/tables/store.pt: numeric tables of 6 rows x 6 columns with header token ids) and builds its own
shard of questions (token sequences) with a gold cell, a gold aggregation operator and a denotation.  A row-column
transformer encoder (cell value projection + row and column embeddings + header tokens, one transformer layer with
the pooled question) scores every cell; an aggregation head picks NONE/SUM/AVERAGE/COUNT.  Loss: cross-entropy over
cells plus cross-entropy over operators.  The model starts from ckpt/tqa_init.pt and is wrapped in DDP (gloo); the
loss and the denotation accuracy are all_reduced every step, the per-operator answer counts all_gathered at step 3.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  cellidx    - rank N builds gold cell coordinates 1-based: a column index beyond the table (IndexError)
  avgempty   - rank N's selection threshold drops every cell of one example: AVERAGE over 0 cells, NaN check raises
  countgather- rank N counts answers per operator with an extra bucket: all_gather with another length (gloo)
  nostore    - rank N reads the table store from tables_v2/ which does not exist (FileNotFoundError)
  opname     - rank N's shard has operator 'MEDIAN', missing from the aggregation table (KeyError)
  widetable  - every rank: config gives 12-column tables, the column embedding has 8 rows (IndexError)
  ckptops    - rank N starts from ckpt/tqa_ops5.pt, saved with 5 aggregation operators (size mismatch)
  execall    - rank N executes every candidate program against its tables in Python for --stall s at step 2
  sigkill    - rank N sends itself SIGKILL after step 2
  collate    - rank N's collate leaves one question as a Python list (TypeError in torch.stack)
  none       - control, clean run

What happened (filled in after the runs):
  cellidx    - IndexError: index 6 is out of bounds for dimension 2 with size 6 in collate on rank N; peers Connection closed
  avgempty   - FloatingPointError: rank N: denotation is nan for 2 questions at step 2; peers Connection closed
  countgather- the receiving rank N+1 aborts: gloo::EnforceNotMet ... 10 vs 8. Received data size doesn't match
  nostore    - FileNotFoundError: ... '/tmp/fault291_work/tables_v2/store.pt' at startup on rank N
  opname     - KeyError: 'MEDIAN' in collate at step 0 or 1 on rank N; peers Connection closed
  widetable  - IndexError: index out of range in self (nn.Embedding) on every rank in step 0
  ckptops    - RuntimeError: Error(s) in loading state_dict for TableQA: size mismatch for agg.weight/agg.bias
  execall    - peers: Timed out waiting 12000ms for recv/send; with --pg-timeout 300 killed by timeout (hung)
  sigkill    - no traceback; Root Cause exitcode -9 (SIGKILL) / spawn ProcessExitedException ... SIGKILL
  collate    - TypeError: expected Tensor as element 3 in argument 0, but got list at step 1 on rank N
  none       - exit 0, answers per operator: [24.0, 24.0, 24.0, 24.0], every rank done: 6 steps
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

WORK = "/tmp/fault291_work"
VOCAB, DIM, MAXCOL, ROWS, QLEN = 120, 16, 8, 6, 10
AGG_OPS = {"NONE": 0, "SUM": 1, "AVERAGE": 2, "COUNT": 3}
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
    log = logging.getLogger("tqa")
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


class TableQA(nn.Module):
    def __init__(self, nops=4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.row = nn.Embedding(ROWS, DIM)
        self.col = nn.Embedding(MAXCOL, DIM)
        self.val = nn.Linear(1, DIM)
        self.layer = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)
        self.cell = nn.Linear(DIM, 1)
        self.agg = nn.Linear(DIM, nops)

    def forward(self, q, tables, headers):
        b, r, c = tables.shape
        rows = torch.arange(r).view(1, r, 1).expand(b, r, c)
        cols = torch.arange(c).view(1, 1, c).expand(b, r, c)
        x = self.val(tables.unsqueeze(-1)) + self.row(rows) + self.col(cols) + self.tok(headers).unsqueeze(1)
        qv = self.tok(q).mean(1, keepdim=True)
        h = self.layer(torch.cat([qv, x.view(b, r * c, DIM)], 1))
        return self.cell(h[:, 1:]).squeeze(-1), self.agg(h[:, 0])


def prepare():
    torch.manual_seed(0)
    os.makedirs(f"{WORK}/tables", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    store = {f"t{i:03d}": (torch.randint(0, 50, (ROWS, 6)).float(), torch.randint(1, VOCAB, (6,))) for i in range(40)}
    torch.save(store, f"{WORK}/tables/store.pt")
    torch.save(TableQA().state_dict(), f"{WORK}/ckpt/tqa_init.pt")
    torch.save(TableQA(nops=5).state_dict(), f"{WORK}/ckpt/tqa_ops5.pt")
    print("prepared", WORK)


def make_shard(rank, store, n, ncols, here, fault):
    g = torch.Generator().manual_seed(100 + rank)
    names, ops = sorted(store), list(AGG_OPS)
    items = []
    for i in range(n):
        tab, hdr = store[names[(i * 3 + rank) % len(names)]]
        if ncols > tab.shape[1]:
            tab = torch.cat([tab, tab[:, : ncols - tab.shape[1]]], 1)
            hdr = torch.cat([hdr, hdr[: ncols - hdr.shape[0]]])
        r, c = int(torch.randint(0, ROWS, (1,), generator=g)), int(torch.randint(0, ncols, (1,), generator=g))
        op = ops[(i + rank) % 4]
        if here and fault == "opname" and i == 9:
            op = "MEDIAN"
        q = torch.randint(1, VOCAB, (QLEN,), generator=g)
        items.append((q, tab, hdr, r, c, op))
    return items


def collate(items, step, bs, here, fault):
    chunk = [items[(step * bs + j) % len(items)] for j in range(bs)]
    qs = [q for q, _, _, _, _, _ in chunk]
    if here and fault == "collate" and step == 1:
        qs[3] = qs[3].tolist()
    q = torch.stack(qs)
    tables = torch.stack([t for _, t, _, _, _, _ in chunk])
    headers = torch.stack([h for _, _, h, _, _, _ in chunk])
    ncols = tables.shape[2]
    shift = 1 if (here and fault == "cellidx") else 0
    gold_cell = torch.tensor([r * ncols + c for _, _, _, r, c, _ in chunk])
    answers = torch.stack([tables[j, r, c + shift] for j, (_, _, _, r, c, _) in enumerate(chunk)])
    gold_op = torch.tensor([AGG_OPS[op] for _, _, _, _, _, op in chunk])
    return q, tables, headers, gold_cell, gold_op, answers


def execute(tables, scores, op_ids, thresh, guard=True):
    sel = (scores > thresh).float()
    sel[:, 0] = torch.where(sel.sum(1) == 0, 1.0, sel[:, 0]) if guard else sel[:, 0]  # never select nothing
    vals = (tables.flatten(1) * sel).sum(1)
    cnt = sel.sum(1)
    avg = vals / cnt
    return torch.where(op_ids == 1, vals, torch.where(op_ids == 2, avg, torch.where(op_ids == 3, cnt, vals)))


def run(a, rank, world):
    setup_log(rank, a.logfmt)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    here = a.rank in (-1, rank)
    torch.manual_seed(1234)
    say(f"rank {rank}/{world} up, pid {os.getpid()}")
    store_dir = "tables_v2" if (here and a.fault == "nostore") else "tables"
    store = torch.load(f"{WORK}/{store_dir}/store.pt")
    ncols = 12 if a.fault == "widetable" else a.cols
    items = make_shard(rank, store, 48, ncols, here, a.fault)
    model = TableQA(nops=len(AGG_OPS))
    ckpt = "ckpt/tqa_ops5.pt" if (here and a.fault == "ckptops") else "ckpt/tqa_init.pt"
    model.load_state_dict(torch.load(f"{WORK}/{ckpt}"))
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    if rank == 0:
        say(f"training {a.steps} steps, {world} ranks, {len(items)} questions per rank, {ncols} columns")
    counts_all = torch.zeros(len(AGG_OPS) + (1 if (here and a.fault == "countgather") else 0))
    for step in range(a.steps):
        q, tables, headers, gold_cell, gold_op, answers = collate(items, step, a.bs, here, a.fault)
        scores, agg = net(q, tables, headers)
        loss = F.cross_entropy(scores, gold_cell) + F.cross_entropy(agg, gold_op)
        opt.zero_grad()
        loss.backward()
        opt.step()
        empty = here and a.fault == "avgempty" and step == 2
        pred = execute(tables, scores.detach(), gold_op, 1e9 if empty else 0.0, guard=not empty)
        if not torch.isfinite(pred).all():
            raise FloatingPointError(f"rank {rank}: denotation is nan for {int((~torch.isfinite(pred)).sum())} questions at step {step}")
        correct = (pred - answers).abs().lt(1e-3).float()
        counts_all[: len(AGG_OPS)] += torch.bincount(gold_op, minlength=len(AGG_OPS)).float()
        if here and a.fault == "execall" and step == 2:
            say(f"rank {rank}: executing 4096 candidate programs against {len(items)} tables to refresh denotations")
            t0 = time.time()
            while time.time() - t0 < a.stall:
                time.sleep(0.5)
        stats = torch.tensor([loss.item(), correct.sum().item(), float(len(correct))])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} denot_acc {stats[1].item() / stats[2].item():.3f}")
        if here and a.fault == "sigkill" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 3:
            out = [torch.empty_like(counts_all) for _ in range(world)]
            dist.all_gather(out, counts_all)
            if rank == 0:
                say(f"answers per operator: {torch.stack(out).sum(0).tolist()}")
    say(f"rank {rank} done: {a.steps} steps")
    dist.destroy_process_group()


def worker(local_rank, a):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    main_guarded(a, local_rank, a.spawn)


def main_guarded(a, rank, world):
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--cols", type=int, default=6)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
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
