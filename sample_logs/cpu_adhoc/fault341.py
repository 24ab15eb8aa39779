"""A three-hundred-and-forty-first hand-run batch: LANGUAGE IDENTIFICATION OF SHORT TEXTS WITH A CHAR CNN.

Synthetic short texts (8 to 40 characters) in six made-up "languages", each drawn from its own letter
distribution, with an ISO-like label looked up in a 6-entry language table.  Every rank reads its texts from
/tmp/fault341_work/data/shard_R.pt, encodes them as ASCII code points (a 128-entry character vocabulary,
padded to 48), and trains a char CNN (embedding 16, Conv1d 16->32 with kernel 5, max over time, a linear
head over the 6 languages) on cross-entropy, wrapped in DDP (gloo) or, with --ddp 0, with gradients
all_reduced by hand.  The model is initialised from ckpt/charcnn_v128.pt.  Per-rank label counts are
all_gathered at the start, the accuracy is all_reduced every step, per-rank validation accuracy is
all_gathered at the end, and rank 0 saves export/charcnn.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  unklang     - rank N's shard labels one text "pt-BR", missing from the language table (KeyError, start-up)
  charidx     - rank N keeps accented characters (code points > 127): embedding index out of range (IndexError, step 0)
  nodata      - rank N reads its shard from data/v2/, which does not exist (FileNotFoundError, start-up)
  ckptvocab   - rank N initialises from ckpt/charcnn_v256.pt, saved with a 256-char vocabulary (size mismatch)
  vocabpickle - rank N initialises from ckpt/charcnn_full.pt, which pickles a CharVocab object (weights_only refusal)
  histgather  - rank N all_gathers its label counts plus an "und" bucket (7 vs 6 entries)
  ngramslow   - rank N counts character trigrams in pure Python before the step-2 all_reduce (--ngram-budget s)
  nanlogit    - rank N's softmax temperature decays to 0.0 at step 3: logits inf, loss NaN (the program's check)
  segv        - rank N sends itself SIGSEGV after step 3
  exit5       - after training rank N prints its own error line about an empty validation shard, sys.exit(5)
  kernelwidth - every rank: the conv has 48 output channels, the head expects 32 (shape error, step 0)
  none        - control, clean run

What happened (filled in after the runs):
  unklang     - KeyError: 'pt-BR' in the label lookup at start-up; peers Connection closed in all_gather (np4 r2 ranklabel, np3 r0 spawn)
  charidx     - IndexError 'index out of range in self' in the embedding at step 0; peers closed/reset, one 'terminate called' (np3 r1 srunlabel, np6 r4 mpitag)
  nodata      - FileNotFoundError for data/v2/shard_N.pt before the first all_gather; peers closed (np4 r3 bashloop, np3 r1 legacy)
  ckptvocab   - size mismatch for emb.weight [256,16] vs [128,16]; Root Cause rank N (np4 r1 pdsh2, np3 r2 logfmt)
  vocabpickle - UnpicklingError 'Weights only load failed' (__main__.CharVocab not allowed); Root Cause rank 0 (np3 r0 tee)
  histgather  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (7), got (6))'; peers closed (np6 r2 files, np3 r1 mpitag)
  ngramslow   - 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r2 srunlabel); 300 s: silent, killed at 60 s (np4 r1 ranklabel)
  nanlogit    - the program's check 'non-finite loss nan at step 3 (temperature 0.0)', FloatingPointError (np8 r5 logfmt, np4 r0 tee --ddp 0)
  segv        - no traceback after step 3; bash 'Segmentation fault' exit 139 (np4 r2 bashloop --ddp 0); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit5       - rank N's ERROR line about val_N.pt and exit 5 after training; Root Cause rank 3 exitcode 5 (np6 r3 legacy)
  kernelwidth - every rank: 'mat1 and mat2 shapes cannot be multiplied (96x48 and 32x6)' at step 0 (np3 files)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/charcnn.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault341_work"
LANGS = {"en": 0, "de": 1, "fr": 2, "es": 3, "it": 4, "nl": 5}
VOCAB = 128
MAXLEN = 48
EMB = 16
CH = 32
log = None


class CharVocab:
    def __init__(self, size):
        self.size = size
        self.itos = [chr(i) for i in range(size)]


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("langid")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base.addHandler(h)
    base.setLevel(logging.INFO)
    log = RankAdapter(base, {"rank": rank})


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class CharCNN(nn.Module):
    def __init__(self, vocab=VOCAB, ch=CH, head_in=CH):
        super().__init__()
        self.emb = nn.Embedding(vocab, EMB, padding_idx=0)
        self.conv = nn.Conv1d(EMB, ch, kernel_size=5, padding=2)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(head_in, len(LANGS))

    def forward(self, x):
        h = self.emb(x).transpose(1, 2)
        h = torch.relu(self.conv(h)).max(dim=2).values
        return self.head(self.drop(h))


def make_texts(n, seed):
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    texts = []
    for _ in range(n):
        lang = list(LANGS)[int(torch.randint(0, len(LANGS), (1,), generator=g))]
        li = LANGS[lang]
        w = torch.ones(len(letters))
        w[(li * 4) % 26:(li * 4) % 26 + 5] += 6.0
        w[-1] = 4.0
        k = int(torch.randint(8, 41, (1,), generator=g))
        idx = torch.multinomial(w, k, replacement=True, generator=g)
        texts.append({"text": "".join(letters[int(i)] for i in idx), "lang": lang})
    return texts


def prepare():
    for d in ("data", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_texts(96, 500 + r), f"{WORK}/data/shard_{r}.pt")
        torch.save(make_texts(32, 900 + r), f"{WORK}/data/val_{r}.pt")
    torch.manual_seed(0)
    torch.save(CharCNN().state_dict(), f"{WORK}/ckpt/charcnn_v128.pt")
    torch.save(CharCNN(vocab=256).state_dict(), f"{WORK}/ckpt/charcnn_v256.pt")
    torch.save({"vocab": CharVocab(VOCAB), "model": CharCNN().state_dict()}, f"{WORK}/ckpt/charcnn_full.pt")
    print("prepared", WORK)


def encode(texts, bad, fault):
    rows = []
    for t in texts:
        s = t["text"]
        if bad and fault == "charidx":
            s = s.replace("e", "\u00e9").replace("a", "\u00e0")
        ids = [ord(c) for c in s[:MAXLEN]]
        rows.append(ids + [0] * (MAXLEN - len(ids)))
    return torch.tensor(rows, dtype=torch.long)


def trigram_census(texts):
    counts = {}
    for t in texts:
        s = " " + t["text"] + " "
        for i in range(len(s) - 2):
            for j in range(i + 1, len(s) - 1):
                key = s[i] + s[j] + s[j + 1]
                counts[key] = counts.get(key, 0) + 1
    return len(counts)


def allreduce_grads(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading texts")
    sub = "v2/" if bad and a.fault == "nodata" else ""
    texts = torch.load(f"{WORK}/data/{sub}shard_{rank}.pt")
    if bad and a.fault == "unklang":
        texts[41]["lang"] = "pt-BR"
    y = torch.tensor([LANGS[t["lang"]] for t in texts])
    x = encode(texts, bad, a.fault)
    counts = torch.bincount(y, minlength=len(LANGS)).float()
    if bad and a.fault == "histgather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(len(LANGS)) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} texts {len(texts)} global label counts {[int(v) for v in sum(allc).tolist()]}")
    if a.fault == "kernelwidth":
        model = CharCNN(ch=48, head_in=CH)
    else:
        model = CharCNN()
        ck = {"ckptvocab": "charcnn_v256.pt", "vocabpickle": "charcnn_full.pt"}.get(a.fault) if bad else None
        state = torch.load(f"{WORK}/ckpt/{ck or 'charcnn_v128.pt'}")
        model.load_state_dict(state["model"] if "model" in state else state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    temp = 1.0
    for step in range(a.steps):
        if bad and a.fault == "nanlogit":
            temp = 0.0 if step >= 3 else temp * 0.5
        logits = net(x) / temp
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} (temperature {temp}, "
                f"max |logit| {logits.detach().abs().max().item()})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            allreduce_grads(model, world)
        opt.step()
        if bad and a.fault == "ngramslow" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.ngram_budget:
                n += trigram_census(texts)
            say(f"rank {rank} trigram census: {n} distinct")
        acc = (logits.argmax(1) == y).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR validation shard val_{rank}.pt has 0 texts left after de-duplication against "
            f"the training shard, refusing to report accuracy", err=True)
        sys.exit(5)
    val = torch.load(f"{WORK}/data/val_{rank}.pt")
    model.eval()
    with torch.no_grad():
        vacc = (model(encode(val, False, "")).argmax(1) == torch.tensor([LANGS[t["lang"]] for t in val]))
    vacc = vacc.float().mean().reshape(1)
    allv = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allv, vacc)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/charcnn.pt")
        say(f"rank 0 done: {a.steps} steps, val acc {sum(v.item() for v in allv) / world:.4f}, "
            f"saved export/charcnn.pt")
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
    p.add_argument("--ngram-budget", type=int, default=30)
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
