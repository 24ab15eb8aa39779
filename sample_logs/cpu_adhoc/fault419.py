"""Batch 419 hand-run fault script: CONVERSATIONAL QUERY REWRITING.

Synthetic dialogues: each has a few turns (speaker tag + token ids), a context-dependent user query ("what about
its price?") and its self-contained rewrite ("what is the price of the X200?") of the same padded length, plus
the index of the antecedent turn the rewrite resolves against.  Every rank reads /tmp/fault419_work/dialogs/
dialogs_R.pt, flattens the last turns into a 16-token context (speaker ids looked up in a 2-entry table), and
trains a tiny rewriter (token + speaker + position embeddings, one self-attention block over context+query, a
copy-style output head at the query positions) on a masked cross-entropy, wrapped in DDP (gloo) or, with
--ddp 0, with gradients all_reduced by hand.  The model is initialised from ckpt/rewriter_v1.pt.  Per-rank
dialogue/token counts are all_gathered at the start, the token accuracy is all_reduced every step, a
rewrite-length histogram is all_gathered at the end, and rank 0 saves export/rewriter.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  speaker    - rank N's dialogues contain a turn by speaker "system", missing from the speaker table (KeyError)
  turnidx    - rank N's step-3 batch holds a dialogue whose antecedent points at turn 7 of 4 (IndexError)
  nodialogs  - rank N reads its dialogues from dialogs/dev/ which does not exist (FileNotFoundError)
  ckptvocab  - rank N initialises from ckpt/rewriter_v2.pt, saved with a 600-token vocabulary (size mismatch)
  ckptpickle - rank N initialises from ckpt/rewriter_full.pt, a pickled config object (weights_only refusal)
  lengather  - rank N all_gathers a 9-bucket rewrite-length histogram at the end (the others 8)
  bleuslow   - rank N scores every rewrite pair by edit distance in pure Python before the step-2 all_reduce
  nanloss    - rank N's step-2 batch has empty rewrites: masked mean 0/0, the program's check (FloatingPointError)
  segv       - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line about leaked answer spans after training and calls sys.exit(5)
  maskshape  - every rank: the padding mask is built one position too long (shape error in the first forward)
  none       - control, clean run

What happened (filled in after the runs):
  speaker    - KeyError: 'system' in featurise at start-up; peers Connection closed in the first all_gather (np4 r2 plain, np6 r0 tee)
  turnidx    - IndexError 'list index out of range' at step 3 after three good steps; peers Connection closed (np3 r1 tee_trainer, np8 r5 loglevel)
  nodialogs  - FileNotFoundError for dialogs/dev/dialogs_N.pt at start-up (np4 r3 redirects: only in rank 3's stderr.log; np3 r0 pymodule)
  ckptvocab  - load_state_dict size mismatch tok.weight/head.weight/head.bias 600 vs 512 (np4 r1 pdsh2, np3 r2 wrapper)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' on rewriter_full.pt; others SIGTERMed (np5 r4 filter)
  lengather  - DETAIL: every rank 'Detected mismatch between collectives', rank N TensorShape=[9], Root Cause rank 0 (np6 r3 detail);
               plain gloo: 'allgather: invalid tensor size at index 0 (expected (9), got (8))', then SIGABRT at exit (np3 r1 prefix)
  bleuslow   - 12 s: peers 'Timed out waiting 12000ms for recv' in the step-2 all_reduce (np3 r2 plain); 300 s: silent after step 1,
               killed at 60 s, exit 124, the orphaned agent SIGTERMed in clean-up (np4 r1 wrapper)
  nanloss    - 'non-finite loss nan at step 2 (0 target tokens in batch)', FloatingPointError (np3 r2 pymodule logfmt; np4 r0 restart,
               where the restarted attempt failed in init with Gloo connectFullMesh 'Connection refused')
  segv       - no traceback after step 3, exitcode -11 SIGSEGV (np4 r3 tee; np3 r1 restart, second attempt failed in init as above)
  exit5      - rank N's label-leakage ERROR line and exit 5 after training; Root Cause rank 2 exitcode 5 (np6 r2 filter)
  maskshape  - every rank: 'The size of tensor a (25) must match the size of tensor b (24)' in the first forward (np3 all loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/rewriter.pt, exit 0 (np3 prefix)
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

WORK = "/tmp/fault419_work"
SPEAKERS = {"user": 0, "assistant": 1}
VOCAB = 512
CTX = 16
QLEN = 8
DIM = 32
PAD = 0
BATCH = 16
log = None


@dataclass
class RewriterConfig:
    vocab: int = VOCAB
    dim: int = DIM
    ctx: int = CTX
    qlen: int = QLEN


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
    log = logging.getLogger("cqr")
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


class Rewriter(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.spk = nn.Embedding(3, dim)
        self.pos = nn.Embedding(CTX + QLEN, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.ante = nn.Embedding(8, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, spk, mask, ante):
        t = ids.shape[1]
        h = self.tok(ids) + self.spk(spk) + self.pos(torch.arange(t)) + self.ante(ante).unsqueeze(1)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / DIM ** 0.5
        scores = scores.masked_fill(~mask.unsqueeze(1), -1e9)
        h = h + torch.softmax(scores, -1) @ v
        h = h + self.ff(h)
        return self.head(h[:, CTX:])


def make_dialogs(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        nt = int(torch.randint(2, 5, (1,), generator=g))
        turns = []
        for i in range(nt):
            ln = int(torch.randint(3, 8, (1,), generator=g))
            turns.append(("user" if i % 2 == 0 else "assistant", torch.randint(10, VOCAB, (ln,), generator=g).tolist()))
        ante = int(torch.randint(0, nt, (1,), generator=g))
        ql = int(torch.randint(3, QLEN, (1,), generator=g))
        query = torch.randint(10, VOCAB, (ql,), generator=g).tolist()
        rewrite = (query[:2] + turns[ante][1])[:QLEN]
        out.append({"turns": turns, "query": query, "rewrite": rewrite, "antecedent": ante})
    return out


def prepare():
    os.makedirs(f"{WORK}/dialogs", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_dialogs(128, 500 + r), f"{WORK}/dialogs/dialogs_{r}.pt")
    torch.manual_seed(0)
    torch.save(Rewriter().state_dict(), f"{WORK}/ckpt/rewriter_v1.pt")
    torch.save(Rewriter(vocab=600).state_dict(), f"{WORK}/ckpt/rewriter_v2.pt")
    torch.save({"config": RewriterConfig(), "state_dict": Rewriter().state_dict()}, f"{WORK}/ckpt/rewriter_full.pt")
    print("prepared", WORK)


def pad(seq, n):
    seq = seq[-n:]
    return seq + [PAD] * (n - len(seq))


def featurise(dialogs, a, bad):
    ids, spk, mask, tgt, ante, starts = [], [], [], [], [], []
    extra = 1 if a.fault == "maskshape" else 0
    for d in dialogs:
        ctx, cspk, st = [], [], []
        for who, toks in d["turns"]:
            st.append(len(ctx))
            ctx += toks
            cspk += [SPEAKERS[who]] * len(toks)
        ids.append(pad(ctx, CTX) + pad(d["query"], QLEN))
        spk.append(pad(cspk, CTX) + [2] * QLEN)
        mask.append([t != PAD for t in pad(ctx, CTX)] + [True] * QLEN + [True] * extra)
        tgt.append(pad(d["rewrite"], QLEN))
        ante.append(d["antecedent"])
        starts.append(st)
    return (torch.tensor(ids), torch.tensor(spk), torch.tensor(mask), torch.tensor(tgt), ante, starts)


def edit_distance(x, y):
    prev = list(range(len(y) + 1))
    for i, cx in enumerate(x, 1):
        cur = [i]
        for j, cy in enumerate(y, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (cx != cy)))
        prev = cur
    return prev[-1]


def pairwise_scores(dialogs, budget):
    t0, total, n = time.time(), 0, 0
    while time.time() - t0 < budget:
        for d1 in dialogs:
            for d2 in dialogs:
                total += edit_distance(d1["rewrite"] * 4, d2["rewrite"] * 4)
                n += 1
    return total / max(n, 1)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4190 + rank)
    say(f"rank {rank}/{world} up, loading dialogues")
    split = "dev/" if bad and a.fault == "nodialogs" else ""
    dialogs = torch.load(f"{WORK}/dialogs/{split}dialogs_{rank}.pt")
    if bad and a.fault == "speaker":
        dialogs[9]["turns"][1] = ("system", dialogs[9]["turns"][1][1])
    if bad and a.fault == "turnidx":
        dialogs[3 * BATCH + 5]["antecedent"] = 7
    if bad and a.fault == "nanloss":
        for d in dialogs[2 * BATCH:3 * BATCH]:
            d["rewrite"] = []
    ids, spk, mask, tgt, ante, starts = featurise(dialogs, a, bad)
    stats = torch.tensor([float(len(dialogs)), float((ids != PAD).sum())])
    allstats = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(allstats, stats)
    say(f"rank {rank} dialogues {len(dialogs)} tokens {int(stats[1])} "
        f"global tokens {int(sum(s[1] for s in allstats))}")
    model = Rewriter()
    ck = {"ckptvocab": "rewriter_v2.pt", "ckptpickle": "rewriter_full.pt"}.get(a.fault, "rewriter_v1.pt")
    ck = ck if bad else "rewriter_v1.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    nb = len(dialogs) // BATCH
    for step in range(a.steps):
        sl = slice((step % nb) * BATCH, (step % nb + 1) * BATCH)
        bante = []
        for i in range(sl.start, sl.stop):
            first = starts[i][ante[i]]
            bante.append(min(ante[i], 7) if first >= 0 else 0)
        logits = net(ids[sl], spk[sl], mask[sl], torch.tensor(bante))
        tm = (tgt[sl] != PAD).float()
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), tgt[sl].reshape(-1), reduction="none")
        loss = (ce * tm.reshape(-1)).sum() / tm.sum()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int(tm.sum())} target tokens in batch)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "bleuslow" and step == 2:
            say(f"rank {rank} pairwise edit-distance score {pairwise_scores(dialogs, a.slow_budget):.2f}")
        acc = (((logits.argmax(-1) == tgt[sl]).float() * tm).sum() / tm.sum()).reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} tok_acc {acc.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR 37 rewrites copy answer spans from assistant turns after the antecedent "
            f"(label leakage), refusing to export", err=True)
        sys.exit(5)
    nbk = 9 if bad and a.fault == "lengather" else 8
    lens = torch.tensor([float(len(d["rewrite"])) for d in dialogs])
    hist = torch.histc(lens, bins=nbk, min=0, max=QLEN)
    allh = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} rewrite lengths {hist.tolist()}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/rewriter.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/rewriter.pt")
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
    p.add_argument("--slow-budget", type=int, default=90)
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
