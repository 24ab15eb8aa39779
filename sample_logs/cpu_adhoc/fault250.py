"""A two-hundred-and-fiftieth hand-run batch: HANDWRITING TRAJECTORY GENERATION WITH A MIXTURE-DENSITY LSTM.

Synthetic pen strokes (dx, dy, pen-up) of random glyphs are read per rank from
/tmp/fault250_work/strokes/archive_R.pt.  A glyph embedding and a writer-style embedding (style table in
styles.json) are fed with every stroke point into a one-layer LSTM (hidden 32, initialised from
ckpt/lstm_init.pt) whose head emits a 5-component bivariate Gaussian mixture per step plus a Bernoulli pen
state.  Training runs under DDP (gloo); the stroke NLL is all_reduced for the log, the per-glyph stroke counts
are all_gathered and a validation NLL is all_reduced; at the end rank 0 samples a few glyphs.

Faults:
  corr     - rank N reads rho_scale 1e4: tanh saturates, correlation exactly 1, det 0, NLL non-finite (check)
  counts   - rank N counts strokes of 9 glyphs (an extra pad glyph) against 8: all_gather size mismatch
  archive  - rank N reads its archive from strokes/v2/ which does not exist (FileNotFoundError)
  glyph    - rank N maps glyph ids with an off-by-one: id 26 beyond the 26-char embedding (IndexError)
  style    - rank N's split names the writer style w7, missing from the style table (KeyError)
  mixhead  - every rank: the head is built with 6 mixture components, the loss expects 5 (shape error)
  ckpt     - rank N initialises the LSTM from ckpt/lstm_init_h48.pt saved with hidden 48 (size mismatch)
  render   - rank N renders every validation glyph stroke by stroke (--stall s) before the val all_reduce
  abort    - rank N sends itself SIGABRT after step 2
  exit3    - rank N prints its own error line about a truncated stroke file and calls os._exit(3)
  none     - control, clean run

What happened (filled in after the runs):
  corr     - rank N: FloatingPointError stroke NLL is nan at step 0 (own check); peers Connection closed
  counts   - rank N's 9 vs 8: a peer aborts, gloo EnforceNotMet op.preamble.length 36 vs 32 (SIGABRT)
  archive  - rank N: FileNotFoundError .../strokes/v2/archive_N.pt at startup; peers Connection closed
  glyph    - rank N: IndexError index out of range in self at step 0 (glyph embedding); peers closed
  style    - rank N: KeyError 'w7' at startup; peers closed or SIGTERMed by the agent
  mixhead  - every rank: RuntimeError shape '[8, 12, 5, 6]' is invalid for input of size 3456
  ckpt     - rank N: RuntimeError size mismatch for weight_ih_l0 [192, 15] vs [128, 15] etc.
  render   - rank N rendered for 40 s: peers gloo Timed out waiting 12000ms for recv; N then closed
  abort    - rank N: SIGABRT after step 2 (exitcode -6 / spawn ProcessExitedException); peers reset
  exit3    - rank N prints its ERROR truncated stroke file line after step 1, exit 3; peers closed
  none     - clean, exit 0; rank 0 printed validation NLL and sampled 3 glyphs
"""
import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault250_work"
N_CHARS, N_GLYPHS, T_LEN, M = 26, 8, 12, 5


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class Out:
    def __init__(self, rank, logfmt):
        self.rank, self.log = rank, None
        if logfmt:
            h = logging.StreamHandler(sys.stdout)
            h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
            self.log = logging.getLogger("hwgen")
            self.log.addFilter(RankFilter(rank))
            self.log.addHandler(h)
            self.log.setLevel(logging.INFO)

    def info(self, msg):
        if self.log:
            self.log.info(msg)
        else:
            print(f"rank {self.rank} {msg}", flush=True)

    def error(self, msg):
        if self.log:
            self.log.error(msg)
        else:
            print(f"rank {self.rank} ERROR {msg}", file=sys.stderr, flush=True)
        sys.stdout.flush()


def prepare():
    g = torch.Generator().manual_seed(250)
    os.makedirs(f"{WORK}/strokes", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        d = torch.randn(N_GLYPHS, T_LEN, 2, generator=g) * 0.3
        pen = (torch.rand(N_GLYPHS, T_LEN, generator=g) < 0.2).float()
        glyph = torch.randint(0, N_CHARS, (N_GLYPHS,), generator=g)
        style = ["w%d" % ((r + i) % 6) for i in range(N_GLYPHS)]
        torch.save({"xy": d, "pen": pen, "glyph": glyph, "style": style}, f"{WORK}/strokes/archive_{r}.pt")
    with open(f"{WORK}/styles.json", "w") as f:
        json.dump({"w%d" % i: i for i in range(6)}, f)
    torch.manual_seed(0)
    torch.save(nn.LSTM(3 + 8 + 4, 32, batch_first=True).state_dict(), f"{WORK}/ckpt/lstm_init.pt")
    torch.save(nn.LSTM(3 + 8 + 4, 48, batch_first=True).state_dict(), f"{WORK}/ckpt/lstm_init_h48.pt")


class StrokeMDN(nn.Module):
    def __init__(self, n_styles, hidden=32, comps=M):
        super().__init__()
        self.glyph = nn.Embedding(N_CHARS, 8)
        self.style = nn.Embedding(n_styles, 4)
        self.lstm = nn.LSTM(3 + 8 + 4, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 6 * comps + 1)

    def forward(self, pts, glyph, style):
        B, T, _ = pts.shape
        cond = torch.cat([self.glyph(glyph), self.style(style)], -1).unsqueeze(1).expand(B, T, 12)
        h, _ = self.lstm(torch.cat([pts, cond], -1))
        return self.head(h)


def mdn_nll(out, target, rho_scale):
    B, T, _ = out.shape
    mix = out[..., :-1].reshape(B, T, M, 6)
    logit_pi, mu_x, mu_y, ls_x, ls_y, r = mix.unbind(-1)
    rho = torch.tanh(r * rho_scale)
    sx, sy = ls_x.exp(), ls_y.exp()
    x, y, pen = target[..., 0:1], target[..., 1:2], target[..., 2]
    zx, zy = (x - mu_x) / sx, (y - mu_y) / sy
    one_m = 1 - rho * rho
    z = zx * zx + zy * zy - 2 * rho * zx * zy
    logn = -z / (2 * one_m) - torch.log(2 * math.pi * sx * sy * torch.sqrt(one_m))
    nll = -torch.logsumexp(F.log_softmax(logit_pi, -1) + logn, -1).mean()
    return nll + F.binary_cross_entropy_with_logits(out[..., -1], pen)


def run(rank, world, a):
    if a.spawn:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(a.port)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.pg_timeout))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Out(rank, a.logfmt)
    bad = a.rank in (rank, -1)
    torch.manual_seed(1000 + rank)
    sub = "strokes/v2" if a.fault == "archive" and bad else "strokes"
    arc = torch.load(f"{WORK}/{sub}/archive_{rank}.pt")
    with open(f"{WORK}/styles.json") as f:
        table = json.load(f)
    styles = list(arc["style"])
    if a.fault == "style" and bad:
        styles[3] = "w7"
    style_ids = torch.tensor([table[s] for s in styles])
    glyph = arc["glyph"].clone()
    if a.fault == "glyph" and bad:
        glyph = glyph + 1
        glyph[glyph.argmax()] = N_CHARS
    comps = 6 if a.fault == "mixhead" else M
    model = StrokeMDN(len(table), comps=comps)
    init = "ckpt/lstm_init_h48.pt" if a.fault == "ckpt" and bad else "ckpt/lstm_init.pt"
    model.lstm.load_state_dict(torch.load(f"{WORK}/{init}"))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    rho_scale = 1e4 if a.fault == "corr" and bad else 1.0
    xy, pen = arc["xy"], arc["pen"]
    pts = torch.cat([torch.zeros(N_GLYPHS, 1, 3), torch.cat([xy, pen.unsqueeze(-1)], -1)[:, :-1]], 1)
    target = torch.cat([xy, pen.unsqueeze(-1)], -1)
    out.info(f"loaded {N_GLYPHS} glyphs x {T_LEN} points, {len(table)} writer styles, world {world}")
    for step in range(a.steps):
        loss = mdn_nll(ddp(pts, glyph, style_ids), target, rho_scale)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"stroke NLL is {loss.item()} at step {step} (rho_scale={rho_scale})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        out.info(f"step {step} loss {loss.item():.4f} mean {avg.item() / world:.4f}")
        if a.fault == "abort" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if a.fault == "exit3" and bad and step == 1:
            out.error(f"stroke file {WORK}/strokes/archive_{rank}.pt truncated: glyph 5 has 7 of {T_LEN} points")
            os._exit(3)
    counts = (pen.sum(1) + 1).long()
    if a.fault == "counts" and bad:
        counts = torch.cat([counts, torch.ones(1, dtype=torch.long)])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    out.info(f"strokes per glyph gathered: {torch.stack(gathered).sum(0).tolist()}")
    with torch.no_grad():
        val = mdn_nll(model(pts, glyph, style_ids), target, rho_scale)
    if a.fault == "render" and bad:
        out.info(f"rendering {N_GLYPHS} validation glyphs stroke by stroke")
        for g_ in range(N_GLYPHS):
            time.sleep(a.stall / N_GLYPHS)
    dist.all_reduce(val)
    out.info(f"validation NLL {val.item() / world:.4f}")
    if rank == 0:
        with torch.no_grad():
            p, h, lens = torch.zeros(1, 1, 3), None, []
            for gi in range(3):
                n_up = 0
                for t in range(T_LEN):
                    o = model.head(model.lstm(torch.cat([p, torch.cat([model.glyph.weight[gi], model.style.weight[0]]).view(1, 1, 12)], -1), h)[0])
                    n_up += int(torch.sigmoid(o[0, 0, -1]) > 0.5)
                lens.append(n_up)
            out.info(f"sampled 3 glyphs of {T_LEN} points, pen-ups {lens}")
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prep", type=int, default=0)
    a = p.parse_args()
    if a.prep:
        prepare()
        return
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(run, args=(a.spawn, a), nprocs=a.spawn)
    else:
        run(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), a)


if __name__ == "__main__":
    main()
