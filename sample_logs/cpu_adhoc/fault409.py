"""A four-hundred-and-ninth hand-run batch: TABLE QUESTION ANSWERING (cell selection plus aggregation).

Synthetic tables: 8 rows x 6 columns, the columns drawn from a 12-entry header vocabulary (COLUMNS), the
cells numbers or short strings hashed into 512 token buckets.  Every rank reads its tables and questions from
/tmp/fault409_work/tables/tables_R.pt; a question names a column, a row and an aggregation (NONE, SUM, COUNT,
AVG).  A small TAPAS-like model scores every cell of the question's table against an EmbeddingBag encoding of
the question (cell-selection cross entropy over 48 cells) and classifies the aggregation.  The model is
initialised from ckpt/tqa_v512.pt and wrapped in DDP over gloo (or, with --ddp 0, its gradients are
all_reduced by hand).  Per-rank table statistics are all_gathered at the start, the loss and cell accuracy
are all_reduced every step, per-rank accuracy counts are all_gathered at the end, and rank 0 saves
export/tqa.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging format).

Faults:
  colname    - rank N has a question about column "net_margin", missing from the header vocabulary (KeyError)
  badnum     - rank N's table 3 has the numeric cell "1,2O4" (letter O) that float() cannot parse (ValueError)
  cellidx    - rank N's step-3 batch points at row 11 of an 8-row table: target beyond 48 cells (IndexError)
  notables   - rank N reads its tables from tables/dev/ which does not exist (FileNotFoundError)
  ckptvocab  - rank N initialises from ckpt/tqa_v1024.pt, saved with 1024 token buckets (size mismatch)
  ckptpickle - rank N initialises from ckpt/tqa_schema.pt, which pickles a TableSchema object (weights_only)
  statgather - rank N all_gathers 5 accuracy counts at the end (an extra 'aggregation hits'), the others 4
  slowparse  - rank N re-validates every table cell by cell in Python before the step-2 all_reduce
  nanlogit   - rank N's step-3 batch has the cell "1e400" (inf): the program's own loss check (FloatingPointError)
  segv       - rank N sends itself SIGSEGV after step 4
  exit4      - rank N prints its own error about a duplicate header in table 12 at step 1 and calls sys.exit(4)
  cellwidth  - every rank: cell numeric features 8 wide (two extra flags), the model expects 6 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  colname    - rank N: KeyError: 'net_margin' in featurise at start-up; peers Connection closed in the first all_gather (np4 r1 tee, np6 r0 loglevel)
  badnum     - rank 3: ValueError: could not convert string to float: '12O4' (comma stripped) at start-up; peers closed (np5 r3 prefix)
  cellidx    - rank N: IndexError: Target 68 is out of bounds. at step 3; DETAIL: rank 0 'Ranks 2 failed to pass monitoredBarrier' (np3 r2 detail); rank 0 closed (np5 r4 filter)
  notables   - rank 2: FileNotFoundError for tables/dev/tables_2.pt at start-up; peers closed (np4 r2 pymodule)
  ckptvocab  - size mismatch for tok.weight/qenc.weight [1024,32] vs [512,32] (np4 r1 pdsh2: node 1's agent then loses the store; np3 r0 wrapper)
  ckptpickle - rank 4: UnpicklingError Weights only load failed, Unsupported global __main__.TableSchema; others SIGTERMed (np6 r4 tee_trainer)
  statgather - after all 6 steps, rank N: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' (np3 r1 redirects: only in the files; np8 r5 plain)
  slowparse  - 12 s: ranks 0, 1, 3 'Timed out waiting 12000ms' for recv/send, Root Cause names rank 0, rank 2 silent (np4 r2 loglevel); 300 s: output stops after step 1, killed at 60 s, exit 124 (np3 r0 plain)
  nanlogit   - rank N: 'non-finite loss nan at step 3' then FloatingPointError (np6 r2 detail: rank 0 monitoredBarrier names rank 2; np4 r3 filter)
  segv       - rank N SIGSEGV after step 4, peers Connection reset by peer, exitcode -11 (np8 r0 tee_trainer); np4 r2 restart: attempt 2 failed in init_process_group (Gloo connectFullMesh Connection refused)
  exit4      - rank N's own ERROR line about a duplicate 'year' header and exit 4 at step 1; Root Cause exitcode 4, torchrun exit 1 (np3 r2 wrapper, np6 r5 pymodule)
  cellwidth  - every rank: 'mat1 and mat2 shapes cannot be multiplied (768x8 and 6x32)' in the first forward; Root Cause rank 0 (np4 prefix)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/tqa.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import os
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

WORK = "/tmp/fault409_work"
COLUMNS = {"year": 0, "country": 1, "revenue": 2, "profit": 3, "employees": 4, "city": 5, "team": 6,
           "points": 7, "wins": 8, "losses": 9, "price": 10, "units": 11}
AGGS = ["NONE", "SUM", "COUNT", "AVG"]
NROW, NCOL, CELLF, DIM = 8, 6, 6, 32
log = None


@dataclass
class TableSchema:
    columns: tuple
    nrow: int


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
    log = logging.getLogger("tbqa")
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
    def __init__(self, vocab=512, cellf=CELLF, dim=DIM):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.col = nn.Embedding(len(COLUMNS), dim)
        self.row = nn.Embedding(NROW, dim)
        self.num = nn.Linear(cellf, dim)
        self.qenc = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.proj = nn.Linear(dim, dim)
        self.agg = nn.Linear(2 * dim, len(AGGS))

    def forward(self, ctok, ccol, crow, cnum, qtok):
        c = torch.tanh(self.tok(ctok) + self.col(ccol) + self.row(crow) + self.num(cnum))
        q = torch.tanh(self.proj(self.qenc(qtok)))
        scores = torch.einsum("bcd,bd->bc", c, q)
        agg = self.agg(torch.cat([c.mean(1), q], 1))
        return scores, agg


def bucket(s, vocab=512):
    return sum(ord(ch) * (i + 7) for i, ch in enumerate(s)) % vocab


def make_tables(nt, nq, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(COLUMNS)
    tables, qs = [], []
    for _ in range(nt):
        cols = [names[int(i)] for i in torch.randperm(len(names), generator=g)[:NCOL]]
        rows = []
        for r in range(NROW):
            rows.append([str(int(torch.randint(0, 5000, (1,), generator=g))) if c not in ("country", "city", "team")
                         else f"{c[:2]}{int(torch.randint(0, 40, (1,), generator=g))}" for c in cols])
        tables.append({"header": cols, "rows": rows})
    for _ in range(nq):
        t = int(torch.randint(0, nt, (1,), generator=g))
        ci = int(torch.randint(0, NCOL, (1,), generator=g))
        r = int(torch.randint(0, NROW, (1,), generator=g))
        col = tables[t]["header"][ci]
        agg = int(torch.randint(0, 4, (1,), generator=g))
        words = ["what", "is", "the", AGGS[agg].lower(), "of", col, "in", "row", str(r)]
        qs.append({"table": t, "col": col, "row": r, "agg": agg, "words": words})
    return {"tables": tables, "questions": qs}


def prepare():
    os.makedirs(f"{WORK}/tables", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_tables(24, 160, 409 + r), f"{WORK}/tables/tables_{r}.pt")
    torch.manual_seed(0)
    sd = TableQA().state_dict()
    torch.save(sd, f"{WORK}/ckpt/tqa_v512.pt")
    torch.save(TableQA(vocab=1024).state_dict(), f"{WORK}/ckpt/tqa_v1024.pt")
    torch.save({"state": sd, "schema": TableSchema(tuple(COLUMNS), NROW)}, f"{WORK}/ckpt/tqa_schema.pt")
    print("prepared", WORK)


def cell_features(cell, width):
    f = torch.zeros(width)
    if cell[:1].isdigit():
        v = float(cell.replace(",", ""))
        f[0], f[1], f[2] = 1.0, v / 5000.0, len(cell) / 6.0
    else:
        f[3], f[4] = 1.0, len(cell) / 6.0
    f[5] = 0.5
    return f


def featurise(data, a, bad):
    width = 8 if a.fault == "cellwidth" else CELLF
    ctok, ccol, cnum = [], [], []
    for t in data["tables"]:
        ctok.append(torch.tensor([bucket(c) for row in t["rows"] for c in row]))
        ccol.append(torch.tensor([COLUMNS[h] for _ in t["rows"] for h in t["header"]]))
        cnum.append(torch.stack([cell_features(c, width) for row in t["rows"] for c in row]))
    qtok, qt, tgt, agg = [], [], [], []
    for q in data["questions"]:
        cid = COLUMNS[q["col"]]
        qtok.append(torch.tensor([bucket(w) for w in q["words"]] + [cid]))
        qt.append(q["table"])
        tgt.append(q["row"] * NCOL + data["tables"][q["table"]]["header"].index(q["col"]))
        agg.append(q["agg"])
    return (torch.stack(ctok), torch.stack(ccol), torch.stack(cnum), torch.stack(qtok), torch.tensor(qt),
            torch.tensor(tgt), torch.tensor(agg))


def revalidate(data, budget):
    t0, n = time.time(), 0
    while time.time() - t0 < budget:
        for t in data["tables"]:
            for row in t["rows"]:
                for c in row:
                    n += sum(1 for ch in c if ch.isdigit()) + len(set(c) & set("0123456789"))
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(409 + rank)
    say(f"rank {rank}/{world} up, loading tables")
    split = "dev/" if bad and a.fault == "notables" else ""
    data = torch.load(f"{WORK}/tables/{split}tables_{rank}.pt")
    if bad and a.fault == "colname":
        data["questions"][9]["col"] = "net_margin"
    if bad and a.fault == "badnum":
        t = data["tables"][3]
        ci = next(i for i, h in enumerate(t["header"]) if h not in ("country", "city", "team"))
        t["rows"][2][ci] = "1,2O4"
    ctok, ccol, cnum, qtok, qt, tgt, agg = featurise(data, a, bad)
    crow = torch.arange(NROW).repeat_interleave(NCOL).expand(ctok.shape[0], -1)
    stats = torch.tensor([float(len(data["tables"])), float(ctok.numel()), float(len(qt)),
                          float((cnum[..., 0] > 0).sum())])
    allst = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allst, stats)
    say(f"rank {rank} tables {int(stats[0])} cells {int(stats[1])} questions {int(stats[2])} "
        f"global questions {int(sum(s[2] for s in allst))}")
    model = TableQA(cellf=cnum.shape[-1] if a.fault != "cellwidth" else CELLF)
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/tqa_schema.pt")["state"])
    else:
        ck = "tqa_v1024.pt" if bad and a.fault == "ckptvocab" else "tqa_v512.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    hits = torch.zeros(4)
    bs = 16
    for step in range(a.steps):
        idx = torch.arange(step * bs, (step + 1) * bs) % len(qt)
        b_t, b_tgt, b_cnum = qt[idx], tgt[idx].clone(), cnum[qt[idx]].clone()
        if bad and a.fault == "cellidx" and step == 3:
            b_tgt[5] = 11 * NCOL + 2
        if bad and a.fault == "nanlogit" and step == 3:
            b_cnum[4, 7, 1] = float("1e400")
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR table 12 header has duplicate column 'year' (columns 1 and 4); "
                f"refusing to train on an ambiguous table", err=True)
            sys.exit(4)
        b_cnum[..., 1] = b_cnum[..., 1] / b_cnum[..., 1].amax(1, keepdim=True).clamp_min(1e-3)
        scores, aggl = net(ctok[b_t], ccol[b_t], crow[b_t], b_cnum, qtok[idx])
        loss = F.cross_entropy(scores, b_tgt) + 0.5 * F.cross_entropy(aggl, agg[idx])
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(scores)).sum())} non-finite cell scores)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowparse" and step == 2:
            n = revalidate(data, a.parse_budget)
            say(f"rank {rank} re-validated tables: {n} digit checks")
        acc = (scores.argmax(1) == b_tgt).float().mean()
        red = torch.stack([loss.detach(), acc])
        dist.all_reduce(red)
        hits += torch.tensor([float((scores.argmax(1) == b_tgt).sum()), float((aggl.argmax(1) == agg[idx]).sum()),
                              float(bs), 1.0])
        say(f"rank {rank} step {step} loss {red[0].item() / world:.4f} cell_acc {red[1].item() / world:.3f}")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    mine = torch.cat([hits, hits[1:2]]) if bad and a.fault == "statgather" else hits
    allh = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allh, mine)
    tot = torch.stack(allh).sum(0)
    say(f"rank {rank} final cell hits {int(hits[0])}/{int(hits[2])} global {int(tot[0])}/{int(tot[2])}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/tqa.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/tqa.pt")
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(rank))
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--parse-budget", type=int, default=90)
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
