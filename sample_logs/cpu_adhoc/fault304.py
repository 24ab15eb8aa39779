"""A three-hundred-and-fourth hand-run batch: SPELLING CORRECTION WITH A CHARACTER-LEVEL SEQ2SEQ.

Synthetic (misspelled, correct) word pairs: made-up words from a syllable list, each corrupted by one typo
(a swap of two neighbours, a dropped letter or a doubled letter).  Every rank reads its pairs from
/tmp/fault304_work/data/pairs_R.pt, counts its character frequencies through the 29-entry character table
(<pad>, <s>, </s>, a-z), all_gathers them, and trains a GRU encoder-decoder (teacher forcing, the encoder's
last state concatenated to every decoder input) on a cross-entropy loss, wrapped in DDP (gloo) or, with
--ddp 0, with gradients all_reduced by hand.  The model is initialised from ckpt/s2s_v29.pt.  The token
accuracy is all_reduced every step; at the end every rank all_gathers its per-length error histogram and
rank 0 saves export/speller.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badchar     - rank N's pairs contain "café": 'é' is not in the character table (KeyError at start-up)
  padidx      - rank N's step-3 batch holds a 20-letter word; encoding into 16 slots (IndexError)
  nodata      - rank N reads data/valid/pairs_N.pt, which does not exist (FileNotFoundError)
  ckptvocab   - rank N initialises from ckpt/s2s_v31.pt, saved with a 31-character table (size mismatch)
  weightsonly - rank N initialises from ckpt/s2s_full.pt, which pickles the Vocab object (weights_only refusal)
  histgather  - rank N's per-length error histogram has 17 bins instead of 16 in the final all_gather
  editscan    - rank N recomputes Levenshtein distances of all its pairs in Python before the step-2 all_reduce
  temp0       - rank N anneals its softmax temperature to 0 at step 2: inf/NaN loss, the program's check
  segv        - rank N sends itself SIGSEGV after step 3
  exit5       - rank N prints its own error line about untouched pairs and calls sys.exit(5)
  ctxtwice    - every rank concatenates the context vector twice: decoder input 120 wide, GRU expects 72
  none        - control, clean run

What happened (filled in after the runs):
  badchar     - KeyError: 'é' counting character frequencies at start-up; peers Connection closed in the all_gather (np4 r2 ranklabel); ProcessRaisedException process 0 (np3 r0 spawn)
  padidx      - IndexError 'index 16 is out of bounds for dimension 1 with size 16' at step 3; peers closed (np5 r1 srunlabel; np3 r2 tee, Root Cause rank 1 SIGABRT)
  nodata      - FileNotFoundError for data/valid/pairs_N.pt before the first all_gather; peers closed (np4 r3 mpitag, np3 r1 legacy)
  ckptvocab   - load_state_dict size mismatch emb.weight [31,24] vs [29,24], out.weight, out.bias (np4 r1 pdsh2, np3 r2 files)
  weightsonly - UnpicklingError 'Weights only load failed' (Unsupported global __main__.Vocab); Root Cause rank 3 (np5 r3 logfmt)
  histgather  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' after 6 steps (np3 r1 bashloop --ddp 0, np4 r0 mpitag)
  editscan    - 12 s: peers 'Timed out waiting 12000ms for recv' at step 2 (np3 r2 srunlabel); 300 s: output stops after step 1, killed at 60 s, exit 124 (np4 r1 ranklabel)
  temp0       - 'non-finite loss nan (softmax temperature 0.0)' at step 2, FloatingPointError; Root Cause rank N (np4 r0 tee, np3 r1 logfmt --ddp 0)
  segv        - no traceback after step 3; bash 'Segmentation fault' exit 139 (np4 r2 bashloop); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit5       - rank N's ERROR line about 23 untouched pairs and exit 5; Root Cause rank 4 exitcode 5 (np5 r4 legacy); loop exit 5 (np3 r0 files)
  ctxtwice    - every rank: 'input.size(-1) must be equal to input_size. Expected 72, got 120' in the first forward (np3 srunlabel)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/speller.pt, exit 0 (np3 bashloop)
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault304_work"
CHARS = ["<pad>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)]
CHAR = {c: i for i, c in enumerate(CHARS)}
MAXLEN = 16
EMB = 24
HID = 48
BATCH = 16
SYLL = ["ka", "ro", "mi", "sen", "tal", "bu", "dor", "vey", "lin", "qua", "pes", "th", "or", "gi", "ne"]
log = None


class Vocab:
    def __init__(self, chars):
        self.chars = list(chars)


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
    log = logging.getLogger("speller")
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


class Speller(nn.Module):
    def __init__(self, nchar=len(CHARS)):
        super().__init__()
        self.emb = nn.Embedding(nchar, EMB, padding_idx=0)
        self.enc = nn.GRU(EMB, HID, batch_first=True)
        self.dec = nn.GRU(EMB + HID, HID, batch_first=True)
        self.out = nn.Linear(HID, nchar)
        self.twice = False

    def forward(self, src, tgt_in):
        _, h = self.enc(self.emb(src))
        ctx = h[-1].unsqueeze(1).expand(-1, tgt_in.shape[1], -1)
        parts = [self.emb(tgt_in), ctx] + ([ctx] if self.twice else [])
        o, _ = self.dec(torch.cat(parts, dim=2), h)
        return self.out(o)


def typo(w, g):
    k = int(torch.randint(0, 3, (1,), generator=g))
    i = int(torch.randint(0, len(w) - 1, (1,), generator=g))
    if k == 0:
        return w[:i] + w[i + 1] + w[i] + w[i + 2:]
    if k == 1:
        return w[:i] + w[i + 1:]
    return w[:i] + w[i] + w[i:]


def make_pairs(n, seed):
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        ns = int(torch.randint(2, 5, (1,), generator=g))
        w = "".join(SYLL[int(j)] for j in torch.randint(0, len(SYLL), (ns,), generator=g))[:MAXLEN - 2]
        pairs.append((typo(w, g), w))
    return pairs


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_pairs(96, 300 + r), f"{WORK}/data/pairs_{r}.pt")
    torch.manual_seed(0)
    torch.save(Speller().state_dict(), f"{WORK}/ckpt/s2s_v29.pt")
    torch.save(Speller(31).state_dict(), f"{WORK}/ckpt/s2s_v31.pt")
    torch.save({"model": Speller().state_dict(), "vocab": Vocab(CHARS)}, f"{WORK}/ckpt/s2s_full.pt")
    print("prepared", WORK)


def encode(words, bos=False):
    t = torch.zeros(len(words), MAXLEN, dtype=torch.long)
    for i, w in enumerate(words):
        seq = (["<s>"] if bos else []) + list(w) + ["</s>"]
        for j, c in enumerate(seq):
            t[i, j] = CHAR[c]
    return t


def levenshtein(a, b):
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def average_grads(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading word pairs")
    split = "valid/" if bad and a.fault == "nodata" else ""
    pairs = torch.load(f"{WORK}/data/{split}pairs_{rank}.pt")
    if bad and a.fault == "badchar":
        pairs[7] = ("cafe", "café")
    if bad and a.fault == "padidx":
        pairs[3 * BATCH + 5] = ("internationalsation", "internationalisation")
    if bad and a.fault == "exit5":
        same = 23
        say(f"rank {rank}: ERROR {same} of {len(pairs)} pairs have identical noisy and clean spellings; "
            f"the typo generator is broken, refusing to train", err=True)
        sys.exit(5)
    freq = torch.zeros(len(CHARS))
    for noisy, clean in pairs:
        for c in noisy + clean:
            freq[CHAR[c]] += 1
    allf = [torch.zeros(len(CHARS)) for _ in range(world)]
    dist.all_gather(allf, freq)
    say(f"rank {rank} pairs {len(pairs)} chars {int(freq.sum())} global {int(sum(f.sum() for f in allf))}")
    model = Speller()
    ck = {"ckptvocab": "s2s_v31.pt", "weightsonly": "s2s_full.pt"}.get(a.fault if bad else "", "s2s_v29.pt")
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    model.twice = bad and a.fault == "ctxtwice"
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    crit = nn.CrossEntropyLoss(ignore_index=0)
    nb = len(pairs) // BATCH
    for step in range(a.steps):
        chunk = pairs[(step % nb) * BATCH:(step % nb + 1) * BATCH]
        src = encode([p[0] for p in chunk])
        tgt = encode([p[1] for p in chunk], bos=True)
        logits = net(src, tgt[:, :-1])
        temp = max(0.0, 1.0 - 0.5 * step) if bad and a.fault == "temp0" else 1.0
        loss = crit((logits / temp).reshape(-1, len(CHARS)), tgt[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} (softmax temperature {temp})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            average_grads(model, world)
        opt.step()
        if bad and a.fault == "editscan" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.scan_budget:
                n += sum(levenshtein(x, y) for x, y in pairs)
            say(f"rank {rank} edit-distance scan: total distance {n}")
        mask = tgt[:, 1:] != 0
        acc = ((logits.argmax(-1) == tgt[:, 1:]) & mask).sum().float().reshape(1) / mask.sum()
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} tok_acc {acc.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    hist = torch.zeros(MAXLEN + (1 if bad and a.fault == "histgather" else 0))
    with torch.no_grad():
        pred = net(src, tgt[:, :-1]).argmax(-1)
    for i, (_, clean) in enumerate(chunk):
        if not torch.equal(pred[i, :len(clean)], tgt[i, 1:len(clean) + 1]):
            hist[len(clean)] += 1
    allh = [torch.zeros(MAXLEN) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} words wrong {int(hist.sum())}/{len(chunk)}, global {int(sum(h.sum() for h in allh))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/speller.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/speller.pt")
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
    p.add_argument("--scan-budget", type=int, default=45)
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
