"""A three-hundred-and-first hand-run batch: CITATION INTENT CLASSIFICATION WITH A SMALL TRANSFORMER.

Synthetic citation contexts (SciCite-like): each context is a list of word-piece ids (vocabulary of 500,
0 = padding) around a citation marker, the section it comes from (looked up in a 5-entry section table) and
an intent label (background, method, result).  Every rank reads its contexts from
/tmp/fault301_work/data/contexts_R.pt, encodes the labels, and trains a one-block transformer encoder
(token + section embeddings, a fixed sinusoidal position table of 32, masked self-attention written out by
hand, a [CLS]-style first-position pooling and a linear intent head) with cross-entropy, wrapped in DDP
(gloo) or with gradients all_reduced by hand (--ddp 0).  The model is initialised from
ckpt/citeformer_3cls.pt.  Per-rank label histograms are all_gathered at the start, the loss and accuracy
are all_reduced every step, per-class accuracies are all_gathered at the end and rank 0 saves
export/citeformer.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  intent     - rank N's contexts carry the ACL-ARC label "comparison", missing from the intent table (KeyError)
  tokid      - rank N's contexts were tokenised with a newer vocabulary: id 517 >= 500 (IndexError, first forward)
  nocontexts - rank N reads data/acl_arc/contexts_N.pt which does not exist (FileNotFoundError, start-up)
  ckptheads  - rank N initialises from ckpt/citeformer_6cls.pt, an ACL-ARC head with 6 intents (size mismatch)
  ckptpickle - rank N loads ckpt/citeformer_full.pt, which pickles a CiteConfig object (weights_only refusal)
  f1gather   - rank N all_gathers its per-class accuracies plus a macro average (4 vs 3 entries, at the end)
  bpe        - rank N re-segments its contexts with a pure-Python BPE merge loop before the step-2 all_reduce
  emptyctx   - rank N's step-3 batch holds contexts emptied by citation-marker stripping: fully masked
               attention rows, NaN loss, the program's own finiteness check (FloatingPointError)
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit2      - rank N prints its own error about a collapsed classifier at the end and calls sys.exit(2)
  posenc     - every rank: contexts padded to 40 positions, the position table has 32 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  intent     - KeyError: 'comparison' in encode at start-up; peers Connection closed in all_gather (np4 r2 ranklabel); spawn hides it: only Process 1's Connection closed (np3 r0)
  tokid      - IndexError 'index out of range in self' in the first forward; peers closed in backward (np4 r1 srunlabel, ranks 2,3 abort; np5 r3 logfmt)
  nocontexts - FileNotFoundError for data/acl_arc/contexts_1.pt before the first all_gather; peers closed (np3 r1 mpitag)
  ckptheads  - size mismatch for head.weight [6, 32] vs [3, 32] and head.bias (np4 r1 pdsh2; np3 r2 legacy, Root Cause rank 2)
  ckptpickle - UnpicklingError: Weights only load failed, Unsupported global __main__.CiteConfig; peers closed in DDP init (np5 r4 bashloop)
  f1gather   - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4), got (3))' after 6 steps (np4 r2 files, np3 r1 tee)
  bpe        - 12 s: rank 1 'Timed out waiting 12000ms for recv', rank 0 closed (np3 r2 srunlabel); 300 s: silent after step 1, exit 124 (np4 r1 bashloop)
  emptyctx   - own check 'non-finite loss nan at step 3', FloatingPointError; peers closed in backward (np4 r3 mpitag, np3 r0 logfmt)
  sigsegv    - no traceback after step 3; bash 'Segmentation fault' pid only, exit 1 (np4 r2 ranklabel); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit2      - rank N's collapsed-classifier ERROR and exit 2; Root Cause rank 1 exitcode 2 (np5 r1 legacy); loop exit 2 (np3 r0 files)
  posenc     - every rank: 'The size of tensor a (40) must match the size of tensor b (32)'; Root Cause rank 0 SIGABRT (np3 tee)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/citeformer.pt, exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
import logging
import math
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

WORK = "/tmp/fault301_work"
INTENTS = {"background": 0, "method": 1, "result": 2}
SECTIONS = {"introduction": 0, "related work": 1, "method": 2, "experiments": 3, "conclusion": 4}
VOCAB = 500
MAXLEN = 32
DIM = 32
log = None


@dataclasses.dataclass
class CiteConfig:
    vocab: int = VOCAB
    dim: int = DIM
    heads: int = 4
    classes: int = 3


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
    log = logging.getLogger("citeintent")
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


def sinusoid(n, d):
    pos = torch.arange(n).float().unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h, mask):
        b, n, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
        h = h + self.out((att @ v).transpose(1, 2).reshape(b, n, d))
        return h + self.ff(self.ln2(h))


class CiteFormer(nn.Module):
    def __init__(self, classes=3, dim=DIM, heads=4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim, padding_idx=0)
        self.sec = nn.Embedding(len(SECTIONS), dim)
        self.register_buffer("pe", sinusoid(MAXLEN, dim))
        self.block = Block(dim, heads)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids, sec):
        mask = ids != 0
        h = self.tok(ids) + self.pe[: ids.shape[1]] + self.sec(sec)[:, None, :]
        h = self.block(h, mask)
        return self.head(h[:, 0])


def make_contexts(n, seed):
    g = torch.Generator().manual_seed(seed)
    secs, labs = list(SECTIONS), list(INTENTS)
    out = []
    for _ in range(n):
        lab = int(torch.randint(0, 3, (1,), generator=g))
        ln = int(torch.randint(8, 24, (1,), generator=g))
        toks = (torch.randint(1, VOCAB, (ln,), generator=g) // 3 * 3 + lab).clamp(1, VOCAB - 1).tolist()
        out.append({"tokens": toks, "section": secs[int(torch.randint(0, 5, (1,), generator=g))],
                    "intent": labs[lab], "cites": int(torch.randint(1, 4, (1,), generator=g))})
    return out


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_contexts(64, 300 + r), f"{WORK}/data/contexts_{r}.pt")
    torch.manual_seed(0)
    m = CiteFormer(3)
    torch.save(m.state_dict(), f"{WORK}/ckpt/citeformer_3cls.pt")
    torch.save(CiteFormer(6).state_dict(), f"{WORK}/ckpt/citeformer_6cls.pt")
    torch.save({"model": m.state_dict(), "config": CiteConfig()}, f"{WORK}/ckpt/citeformer_full.pt")
    print("prepared", WORK)


def encode(ctxs, width):
    ids = torch.zeros(len(ctxs), width, dtype=torch.long)
    for i, c in enumerate(ctxs):
        t = c["tokens"][:width]
        ids[i, : len(t)] = torch.tensor(t, dtype=torch.long) if t else ids[i, :0]
    sec = torch.tensor([SECTIONS[c["section"]] for c in ctxs])
    y = torch.tensor([INTENTS[c["intent"]] for c in ctxs])
    return ids, sec, y


def bpe_resegment(ctxs, budget):
    t0, merges = time.time(), 0
    while time.time() - t0 < budget:
        for c in ctxs:
            pieces = [str(t) for t in c["tokens"]]
            while len(pieces) > 1:
                pairs = {}
                for a, b in zip(pieces, pieces[1:]):
                    pairs[a + "|" + b] = pairs.get(a + "|" + b, 0) + 1
                best = max(pairs, key=pairs.get)
                i = next(i for i in range(len(pieces) - 1) if pieces[i] + "|" + pieces[i + 1] == best)
                pieces[i:i + 2] = [best]
                merges += 1
    return merges


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading citation contexts")
    sub = "acl_arc/" if bad and a.fault == "nocontexts" else ""
    ctxs = torch.load(f"{WORK}/data/{sub}contexts_{rank}.pt")
    if bad and a.fault == "intent":
        ctxs[11]["intent"] = "comparison"
    if bad and a.fault == "tokid":
        ctxs[3]["tokens"][5] = 517
    width = 40 if a.fault == "posenc" else 24
    ids, sec, y = encode(ctxs, width)
    hist = torch.bincount(y, minlength=3).float()
    allh = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} contexts {len(ctxs)} labels {hist.tolist()} global {torch.stack(allh).sum(0).tolist()}")
    model = CiteFormer()
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/citeformer_full.pt")["model"])
    else:
        ck = "citeformer_6cls.pt" if bad and a.fault == "ckptheads" else "citeformer_3cls.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    bs = 16
    for step in range(a.steps):
        j = (step * bs) % len(ctxs)
        bi, bsec, by = ids[j:j + bs].clone(), sec[j:j + bs], y[j:j + bs]
        if bad and a.fault == "emptyctx" and step == 3:
            bi[2:5] = 0
        logits = net(bi, bsec)
        loss = nn.functional.cross_entropy(logits, by)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(logits)).any(1).sum())} of {bs} contexts with non-finite logits)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if bad and a.fault == "bpe" and step == 2:
            say(f"rank {rank} re-segmenting contexts with BPE merges")
            say(f"rank {rank} BPE done: {bpe_resegment(ctxs, a.bpe_budget)} merges")
        stats = torch.tensor([loss.item(), (logits.argmax(1) == by).float().mean().item()])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        pred = model(ids, sec).argmax(1)
    acc = torch.stack([(pred[y == c] == c).float().mean() for c in range(3)])
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR intent 'result' predicted for 0 of {len(ctxs)} dev contexts "
            f"(collapsed classifier), refusing to export", err=True)
        sys.exit(2)
    if bad and a.fault == "f1gather":
        acc = torch.cat([acc, acc.mean().reshape(1)])
    alla = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(alla, acc)
    say(f"rank {rank} per-class acc {[round(v, 3) for v in acc.tolist()]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/citeformer.pt")
        say(f"rank 0 done: {a.steps} steps, mean per-class acc {torch.stack(alla).mean():.3f}, "
            f"saved export/citeformer.pt")
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
    p.add_argument("--bpe-budget", type=int, default=30)
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
