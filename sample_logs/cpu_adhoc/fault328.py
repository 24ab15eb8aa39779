"""A three-hundred-and-twenty-eighth hand-run batch: BANK STATEMENT TRANSACTION CATEGORISATION WITH A TRANSFORMER.

Synthetic bank statements: every rank reads its transactions from /tmp/fault328_work/statements/stmt_R.csv
(date, merchant, description, amount).  The merchant is looked up in a merchant table that gives the spending
category (12 categories: groceries, rent, salary, ...), the description is split into words and mapped to ids
in a 512-word vocabulary, and the signed log-amount is one extra input feature.  A small transformer encoder
(token + position embeddings, one encoder layer, mean pooling, a linear head) classifies each transaction, with
class weights against the rare categories.  The model is initialised from ckpt/stmt_v512.pt and wrapped in DDP
(gloo), or with --ddp 0 its gradients are all_reduced by hand.  The accuracy is all_reduced every step, the
per-rank category counts are all_gathered at the end, and rank 0 saves export/stmt_cls.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  merchant   - rank N's statement has a merchant "REVOLUT*TOPUP" missing from the merchant table (KeyError, start-up)
  amount     - rank N's step-2 batch has an amount in European format "1.234,50" (ValueError in float())
  catidx     - rank N's step-3 batch maps a transaction to category 12 ("transfers-internal"), past the
               12-entry class-weight table (IndexError)
  nofile     - rank N reads statements/test/stmt_N.csv, which does not exist (FileNotFoundError, start-up)
  ckptvocab  - rank N initialises from ckpt/stmt_v600.pt, saved with a 600-word vocabulary (size mismatch)
  ckptpickle - rank N initialises from ckpt/stmt_meta.pt, which pickles a TokenizerConfig object
               (torch.load weights_only refusal)
  gather     - rank N all_gathers 13 category counts (an extra "uncategorised" bucket) at the end, peers 12
  slow       - rank N reconciles running balances in pure Python before the step-2 all_reduce
  nanscale   - rank N takes log(amount) instead of log|amount| from step 3 on: refunds give NaN, the program's
               finite-loss check raises FloatingPointError
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line (closing balance does not match) and calls sys.exit(5) at the end
  seqlen     - every rank: descriptions padded to 40 tokens, position table has 32 rows (shape error, first step)
  none       - control, clean run

What happened (filled in after the runs):
  merchant   - KeyError: 'REVOLUT*TOPUP' at start-up; peers SIGTERMed while waiting (np4 r2 plain, np6 r0 tee)
  amount     - ValueError "could not convert string to float: '1.234,50'" at step 2; peers Connection closed (np3 r1 loglevel, np4 r2 pymodule)
  catidx     - IndexError 'index 12 is out of bounds for dimension 0 with size 12' at step 3 (np3 r0 detail: peers monitoredBarrier naming rank 0; np4 r3 prefix)
  nofile     - FileNotFoundError for statements/test/stmt_N.csv at start-up; peers SIGTERMed (np5 r4 tee_trainer, np3 r1 wrapper)
  ckptvocab  - load_state_dict size mismatch for tok.weight [600, 32] vs [512, 32] (np4 r1 pdsh2, np3 r2 pymodule)
  ckptpickle - UnpicklingError 'Weights only load failed' ... Unsupported global __main__.TokenizerConfig (np6 r3 filter)
  gather     - after 6 steps: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (13), got (12))' (np4 r1 redirects, np3 r2 tee)
  slow       - 12 s: ranks 0, 2 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r1 plain); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 loglevel)
  nanscale   - 'non-finite loss nan at step 3 (N NaN amount features)', FloatingPointError (np8 r5 tee_trainer; np3 r0 restart, both attempts)
  sigsegv    - Root Cause exitcode -11 (SIGSEGV) after step 3 (np6 r4 plain); np3 r1 restart: SIGSEGV, then the restart died in Gloo connectFullMesh
  exit5      - rank 0's 'ERROR closing balance ... does not match statement footer' and exit 5 at the end (np4 r0 wrapper)
  seqlen     - every rank: 'The size of tensor a (40) must match the size of tensor b (32) at non-singleton dimension 1'; Root Cause rank 2 (np3 prefix)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/stmt_cls.pt, exit 0 (np3 detail, --ddp 0)
"""
import argparse
import csv
import logging
import math
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault328_work"
CATS = ["groceries", "rent", "salary", "utilities", "dining", "transport", "shopping", "health",
        "entertainment", "cash", "fees", "travel"]
MERCHANTS = {"TESCO": 0, "SAINSBURYS": 0, "LANDLORD-LTD": 1, "ACME-PAYROLL": 2, "BRITISH-GAS": 3,
             "THAMES-WATER": 3, "PRET": 4, "DELIVEROO": 4, "TFL": 5, "UBER": 5, "AMAZON": 6, "ARGOS": 6,
             "BOOTS": 7, "NETFLIX": 8, "SPOTIFY": 8, "ATM": 9, "BANK-FEE": 10, "EASYJET": 11}
WORDS = ["card", "payment", "to", "from", "ref", "dd", "so", "pos", "contactless", "online", "monthly",
         "london", "gbp", "refund", "purchase", "transfer", "bill", "store", "app", "fare"]
VOCAB = 512
MAXLEN = 32
DIM = 32
log = None


@dataclass
class TokenizerConfig:
    vocab: int
    lowercase: bool


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
    log = logging.getLogger("stmt")
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


class StmtClassifier(nn.Module):
    def __init__(self, vocab=VOCAB, maxlen=MAXLEN, dim=DIM, ncat=len(CATS)):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(maxlen, dim) * 0.02)
        self.amt = nn.Linear(1, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, dim * 2, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(dim, ncat)

    def forward(self, ids, amt):
        h = self.tok(ids) + self.pos.unsqueeze(0) + self.amt(amt).unsqueeze(1)
        h = self.enc(h, src_key_padding_mask=ids.eq(0))
        return self.head(h.mean(1))


def prepare():
    os.makedirs(f"{WORK}/statements", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    names = list(MERCHANTS)
    for r in range(8):
        g = torch.Generator().manual_seed(500 + r)
        with open(f"{WORK}/statements/stmt_{r}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["date", "merchant", "description", "amount"])
            for i in range(192):
                m = names[int(torch.randint(0, len(names), (1,), generator=g))]
                words = [WORDS[int(k)] for k in torch.randint(0, len(WORDS), (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)]
                amt = float(torch.randn(1, generator=g)) * 60 - 20
                if MERCHANTS[m] == 2:
                    amt = 2150.0
                w.writerow([f"2026-{1 + i // 31 % 12:02d}-{1 + i % 28:02d}", m, " ".join([m.lower()] + words), f"{amt:.2f}"])
    torch.manual_seed(0)
    torch.save(StmtClassifier().state_dict(), f"{WORK}/ckpt/stmt_v512.pt")
    torch.save(StmtClassifier(vocab=600).state_dict(), f"{WORK}/ckpt/stmt_v600.pt")
    torch.save({"model": StmtClassifier().state_dict(), "tokenizer": TokenizerConfig(VOCAB, True)},
               f"{WORK}/ckpt/stmt_meta.pt")
    print("prepared", WORK)


def word_id(wd):
    return 1 + (sum(ord(c) * (i + 7) for i, c in enumerate(wd)) % (VOCAB - 1))


def encode_batch(rows, a, bad, step):
    maxlen = 40 if a.fault == "seqlen" else MAXLEN
    ids = torch.zeros(len(rows), maxlen, dtype=torch.long)
    amts = []
    for i, r in enumerate(rows):
        toks = [word_id(wd) for wd in r["description"].split()][:maxlen]
        ids[i, :len(toks)] = torch.tensor(toks)
        raw = r["amount"]
        if bad and a.fault == "amount" and step == 2 and i == 5:
            raw = "1.234,50"
        v = float(raw)
        if bad and a.fault == "nanscale" and step >= 3:
            amts.append(math.log(v) if v > 0 else float("nan"))
        else:
            amts.append(math.copysign(math.log1p(abs(v)), v))
    return ids, torch.tensor(amts).unsqueeze(1)


def reconcile(rows, seconds):
    t0, passes, bal = time.time(), 0, 0.0
    while time.time() - t0 < seconds:
        bal = 0.0
        for r in rows:
            for _ in range(200):
                bal = round(bal + float(r["amount"]) / 200, 6)
        passes += 1
    return passes, bal


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading statement")
    split = "test/" if bad and a.fault == "nofile" else ""
    with open(f"{WORK}/statements/{split}stmt_{rank}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if bad and a.fault == "merchant":
        rows[41]["merchant"] = "REVOLUT*TOPUP"
    labels = [MERCHANTS[r["merchant"]] for r in rows]
    say(f"rank {rank}: {len(rows)} transactions, {len(set(labels))} categories")
    model = StmtClassifier()
    ck = {"ckptvocab": "stmt_v600.pt", "ckptpickle": "stmt_meta.pt"}.get(a.fault if bad else "", "stmt_v512.pt")
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    cls_w = torch.ones(len(CATS))
    bs = 32
    for step in range(a.steps):
        lo = (step * bs) % len(rows)
        batch = rows[lo:lo + bs]
        ids, amt = encode_batch(batch, a, bad, step)
        ys = labels[lo:lo + bs]
        if bad and a.fault == "catidx" and step == 3:
            ys = ys[:7] + [12] + ys[8:]
        w = cls_w[torch.tensor(ys)] if max(ys) < len(CATS) else torch.stack([cls_w[y] for y in ys])
        y = torch.tensor(ys)
        logits = net(ids, amt)
        loss = (nn.functional.cross_entropy(logits, y, reduction="none") * w).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int(torch.isnan(amt).sum())} NaN amount features in batch)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if bad and a.fault == "slow" and step == 2:
            n, bal = reconcile(rows, a.slow_s)
            say(f"rank {rank} reconciled balances: {n} passes, closing {bal:.2f}")
        acc = (logits.argmax(1) == y).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR closing balance {sum(float(r['amount']) for r in rows):.2f} does not match "
            f"statement footer 18432.17, refusing to export categories", err=True)
        sys.exit(5)
    counts = torch.bincount(torch.tensor(labels), minlength=len(CATS)).float()
    if bad and a.fault == "gather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(len(CATS)) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} transactions {int(counts.sum())} global {int(sum(c.sum() for c in allc))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/stmt_cls.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/stmt_cls.pt")
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
    p.add_argument("--slow-s", type=int, default=45)
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
