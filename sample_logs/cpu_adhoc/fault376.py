"""A three-hundred-and-seventy-sixth hand-run batch: HANDWRITTEN MATH EXPRESSION RECOGNITION.

Synthetic handwritten expressions: every rank reads rendered ink images (1x16x48, one expression each) and
their LaTeX token strings from /tmp/fault376_work/ink/ink_R.pt, maps the tokens through a 20-entry symbol
table, and trains a small CNN column encoder with a per-column symbol classifier on a CTC loss (blank = 0),
wrapped in DDP over gloo (or with gradients all_reduced by hand, --ddp 0).  The model is initialised from
ckpt/hmer_v20.pt.  The loss is all_reduced every step (progress line with the token error proxy), every rank
all_gathers its symbol histogram at the end, and rank 0 saves export/hmer.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  symbol     - rank N's transcriptions contain "\\int", missing from the symbol table (KeyError, start-up)
  tokidx     - rank N appends an <eos> id (20) to its targets; the per-symbol weight table has 20 rows (IndexError, step 0)
  noink      - rank N reads its ink from ink/val/ which does not exist (FileNotFoundError, start-up)
  ckptvocab  - rank N initialises from ckpt/hmer_v24.pt, saved with a 24-symbol head (size mismatch)
  ckptpickle - rank N initialises from ckpt/hmer_meta.pt, which pickles a VocabInfo object (weights_only refusal)
  histgather - rank N all_gathers its histogram with the blank counted (21 vs 20 entries, the end)
  beam       - rank N runs a pure-Python beam-search decode for 45 s at step 2 (peers' 12 s PG timeout)
  stuck      - rank N waits at step 3 for a render lock file that never appears (a hang)
  nanstroke  - rank N's step-3 batch has an empty canvas; ink / max(ink) = 0/0, NaN loss, the program's check
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit4      - rank N prints its own error line about unbalanced braces at the end and calls sys.exit(4)
  tallglyph  - every rank renders glyphs 20 px high; the column classifier expects 16 px (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  symbol     - KeyError: '\\int' at start-up; peers closed in DDP construction (np4 r2 ranklabel); Root Cause rank 0, others SIGTERM (np6 r0 logfmt)
  tokidx     - IndexError 'index 20 is out of bounds for dimension 0 with size 20' at step 0 (np3 r1 srunlabel; np3 r0 spawn --ddp 0, ProcessRaisedException)
  noink      - FileNotFoundError for ink/val/ink_N.pt at start-up; peers Connection closed by peer (np5 r3 mpitag, np3 r0 files)
  ckptvocab  - load_state_dict size mismatch head.weight [24, 32] vs [20, 32] (np4 r1 pdsh2, the other agent RendezvousConnectionError; np3 r2 legacy)
  ckptpickle - UnpicklingError 'Weights only load failed' (VocabInfo); Root Cause rank 1 (np3 r1 tee)
  histgather - after 6 steps 'allgather: invalid tensor size at index 0 (expected (21), got (20))' (np4 r1 bashloop, np6 r4 tee)
  beam       - rank 1 'Timed out waiting 12000ms for recv', the others closed by peer; nothing names rank 2 (np3 r2 ranklabel, budget 30 s)
  stuck      - rank 0 'waiting for render lock', others silent; killed at 60 s, exit 124 (np3 r0 ranklabel).  A first np4 r1
               srunlabel run was so slow under load that it never reached step 3 before the 60 s kill: dropped
  nanstroke  - own check 'non-finite CTC loss nan at step 3', FloatingPointError (np4 r2 files, np3 r0 logfmt)
  sigsegv    - after step 4: bash 'Segmentation fault' exit 139 (np6 r5 bashloop); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit4      - rank 2's unbalanced-braces ERROR line after 6 steps and exit 4; peers closed in the all_gather (np3 r2 mpitag)
  tallglyph  - every rank 'mat1 and mat2 shapes cannot be multiplied (192x80 and 64x32)'; Root Cause rank 2 (np3 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/hmer.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import random
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

WORK = "/tmp/fault376_work"
SYMBOLS = ["<blank>", "0", "1", "2", "3", "x", "y", "+", "-", "=", "(", ")", "\\frac", "{", "}", "^",
           "\\sqrt", "\\alpha", "\\pi", "\\sum"]
VOCAB = {s: i for i, s in enumerate(SYMBOLS)}
H, W = 16, 48
log = None


@dataclass
class VocabInfo:
    symbols: list
    height: int


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("hmer")
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


class ColumnRecognizer(nn.Module):
    def __init__(self, nsym=len(SYMBOLS), height=H):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.proj = nn.Linear(16 * (height // 4), 32)
        self.head = nn.Linear(32, nsym)

    def forward(self, img):
        h = F.max_pool2d(torch.relu(self.c1(img)), 2)
        h = F.max_pool2d(torch.relu(self.c2(h)), 2)
        b, c, hh, ww = h.shape
        cols = h.permute(0, 3, 1, 2).reshape(b, ww, c * hh)
        return self.head(torch.relu(self.proj(cols))).log_softmax(-1)


def make_expr(rng):
    a, b = rng.choice("0123xy"), rng.choice("0123xy")
    forms = [f"{a} + {b}", f"{a} ^ {{ 2 }} - {b}", f"\\frac {{ {a} }} {{ {b} }}", f"( {a} - {b} ) = 0",
             f"\\sqrt {{ {a} }} + \\pi", f"\\sum x ^ {{ {b} }}", f"\\alpha = {a} + {b}"]
    return rng.choice(forms)


def render(expr, rng, height=H):
    img = torch.zeros(1, height, W)
    for k, tok in enumerate(expr.split()[:10]):
        x0 = 2 + 4 * k + rng.randint(0, 1)
        y0 = rng.randint(2, height - 6)
        img[0, y0:y0 + 4, x0:x0 + 2] = 0.5 + 0.5 * rng.random() + 0.05 * (VOCAB.get(tok, 0) % 5)
    return img


def prepare():
    os.makedirs(f"{WORK}/ink", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        rng = random.Random(700 + r)
        exprs = [make_expr(rng) for _ in range(48)]
        torch.save({"img": torch.stack([render(e, rng) for e in exprs]),
                    "tall": torch.stack([render(e, rng, 20) for e in exprs]), "tex": exprs},
                   f"{WORK}/ink/ink_{r}.pt")
    torch.manual_seed(0)
    torch.save(ColumnRecognizer().state_dict(), f"{WORK}/ckpt/hmer_v20.pt")
    torch.save(ColumnRecognizer(24).state_dict(), f"{WORK}/ckpt/hmer_v24.pt")
    torch.save({"model": ColumnRecognizer().state_dict(), "vocab": VocabInfo(SYMBOLS, H)},
               f"{WORK}/ckpt/hmer_meta.pt")
    print("prepared", WORK)


def beam_decode(logp, width=8):
    beams = [((), 0.0)]
    for t in range(logp.shape[0]):
        row = logp[t].tolist()
        cand = [(seq + (k,), s + row[k]) for seq, s in beams for k in range(len(row))]
        beams = sorted(cand, key=lambda z: -z[1])[:width]
    return beams[0][0]


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading ink")
    split = "val/" if bad and a.fault == "noink" else ""
    data = torch.load(f"{WORK}/ink/{split}ink_{rank}.pt")
    tex = list(data["tex"])
    if bad and a.fault == "symbol":
        tex[11] = "\\int _ { 0 } ^ { 1 } x"
    img = data["tall"] if a.fault == "tallglyph" else data["img"]
    targets = [[VOCAB[t] for t in e.split()] for e in tex]
    if bad and a.fault == "tokidx":
        targets = [t + [len(SYMBOLS)] for t in targets]
    tlen = torch.tensor([len(t) for t in targets])
    tcat = torch.tensor([i for t in targets for i in t])
    say(f"rank {rank}: {len(tex)} expressions, {int(tlen.sum())} symbols")
    model = ColumnRecognizer()
    ck = {"ckptvocab": "hmer_v24.pt", "ckptpickle": "hmer_meta.pt"}.get(a.fault, "hmer_v20.pt") if bad else "hmer_v20.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    symw = torch.ones(len(SYMBOLS))
    bs = 16
    for step in range(a.steps):
        lo = (step * bs) % len(tex)
        x = img[lo:lo + bs].clone()
        if bad and a.fault == "nanstroke" and step == 3:
            x[5].zero_()
        x = x / x.amax(dim=(1, 2, 3), keepdim=True)
        logp = net(x)
        tl = tlen[lo:lo + bs]
        start = int(tlen[:lo].sum())
        tg = tcat[start:start + int(tl.sum())]
        weight = symw[tg].mean()
        loss = weight * F.ctc_loss(logp.transpose(0, 1), tg, torch.full((x.shape[0],), logp.shape[1]), tl,
                                   blank=0, zero_infinity=False)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite CTC loss {loss.item()} at step {step} "
                f"(batch {lo}-{lo + bs}, {int(torch.isnan(x).any(dim=(1, 2, 3)).sum())} canvases with NaN ink)", err=True)
            raise FloatingPointError(f"CTC loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "beam" and step == 2:
            t0, n = time.time(), 0
            while time.time() - t0 < a.beam_budget:
                beam_decode(logp[n % x.shape[0]].detach())
                n += 1
            say(f"rank {rank} beam-search check decoded {n} expressions")
        if bad and a.fault == "stuck" and step == 3:
            say(f"rank {rank} waiting for render lock {WORK}/render.lock.done")
            while not os.path.exists(f"{WORK}/render.lock.done"):
                time.sleep(0.5)
        pred = logp.detach().argmax(-1)
        blank_frac = (pred == 0).float().mean().reshape(1)
        l = loss.detach().reshape(1)
        dist.all_reduce(l)
        dist.all_reduce(blank_frac)
        say(f"rank {rank} step {step} loss {l.item() / world:.4f} blank_frac {blank_frac.item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR 3 of {len(tex)} decoded expressions have unbalanced braces "
            f"(e.g. '\\frac {{ x }} {{ 2'), refusing to export", err=True)
        sys.exit(4)
    hist = torch.bincount(tcat, minlength=len(SYMBOLS)).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([torch.tensor([float((pred == 0).sum())]), hist])
    allh = [torch.zeros(len(SYMBOLS)) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} symbols {int(hist.sum())} global {int(sum(h.sum() for h in allh))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/hmer.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/hmer.pt")
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
    p.add_argument("--beam-budget", type=int, default=45)
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
