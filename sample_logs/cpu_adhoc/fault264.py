"""A two-hundred-and-sixty-fourth hand-run batch: WEATHER NOWCASTING WITH A CONVLSTM.

Radar nowcasting on synthetic data: every rank owns the archive of one radar site (radar/<SITE>_2026.pt under
/tmp/fault264_work, written by --prepare: sequences of 7 reflectivity frames, 16x16, 5 minutes apart, of
Gaussian echoes drifting across the domain, in dBZ and normalised by 70).  The site's beam range comes from the
site table sites.json.  A small ConvLSTM encoder-forecaster (one cell, 8 state channels, 3x3 kernel, its weights
initialised from ckpt/forecaster.pt) reads 4 frames and forecasts the next 3.  The loss is the MSE over the
forecast; the CSI at 20 dBZ at the 15-minute lead is computed per rank, checked, and all_reduced.  The model is
wrapped in DDP (gloo) or, with --ddp 0, parameters are broadcast and gradients all_reduced by hand.  Before
training the per-sequence frame counts are all_gathered; after training a validation CSI is all_reduced.

Faults:
  csi      - rank N compares normalised frames to 35 (dBZ, not /70): no hits/misses/false alarms, CSI 0/0 = NaN
  framelen - rank N counts one extra (partial) sequence: all_gathers 17 frame counts against 16 (size mismatch)
  archive  - rank N opens radar/<SITE>_2025.pt, which was never written (FileNotFoundError)
  site     - rank N is configured for site KOUN, missing from the site table (KeyError)
  hidden   - every rank: config state_ch 16 against the cell's 8 state channels, conv input mismatch
  lead     - rank N evaluates CSI at a 20-minute lead, beyond the 3-frame horizon (IndexError)
  ckpt     - rank N loads ckpt/forecaster_k5.pt, saved with a 5x5 kernel (size mismatch)
  slowval  - rank N unrolls validation frame by frame for an hour ahead for --stall s before the val all_reduce
  segv     - rank N sends itself SIGSEGV after step 2
  exit6    - rank N prints its own error line about a full clutter mask and calls os._exit(6) at step 1
  none     - control, clean run

What happened (filled in after the runs):
  csi      - rank N: FloatingPointError CSI at 15 min lead is nan at step 0; peers closed in backward
  framelen - rank N's ring neighbour aborts: gloo preamble 34 vs 32 (SIGABRT); others reset in all_gather
  archive  - rank N: FileNotFoundError .../radar/<SITE>_2025.pt; peers closed in the all_gather
  site     - rank N: KeyError 'KOUN' at the site-table lookup; peers closed in the all_gather
  hidden   - every rank: RuntimeError expected input[4, 17, 16, 16] to have 9 channels, but got 17
  lead     - rank N: IndexError index 3 is out of bounds for dimension 1 with size 3, step 0
  ckpt     - rank N: RuntimeError size mismatch for enc.conv.weight [32, 9, 5, 5] vs [32, 9, 3, 3]
  slowval  - rank N stalled: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  segv     - rank N: exitcode -11 (SIGSEGV) after step 2; peers reset/closed in the next collective
  exit6    - rank N logs its ERROR clutter-mask line, exitcode 6; peers closed/reset
  none     - clean, exit 0, rank 0 printed the validation CSI
"""
import argparse
import json
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

WORK = "/tmp/fault264_work"
SITES = ["KTLX", "KFWS", "KINX", "KVNX", "KAMA", "KLBB", "KDDC", "KICT"]
NSEQ = 16
T_IN, HORIZON = 4, 3
DBZ_SCALE = 70.0


def echoes(seed, n=NSEQ):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    seqs = torch.zeros(n, T_IN + HORIZON, 1, 16, 16)
    for i in range(n):
        cy, cx = torch.rand(2, generator=g) * 8 + 2
        vy, vx = torch.rand(2, generator=g) * 1.6 - 0.8
        peak = 30 + 25 * torch.rand(1, generator=g)
        for t in range(T_IN + HORIZON):
            d2 = (yy - cy - vy * t) ** 2 + (xx - cx - vx * t) ** 2
            seqs[i, t, 0] = peak * torch.exp(-d2 / 8.0)
    return seqs


def prepare():
    os.makedirs(f"{WORK}/radar", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    table = {s: {"range_km": 230 + 10 * k, "elev_deg": 0.5} for k, s in enumerate(SITES)}
    with open(f"{WORK}/sites.json", "w") as f:
        json.dump(table, f)
    for k, s in enumerate(SITES):
        torch.save({"site": s, "dbz": echoes(1000 + k)}, f"{WORK}/radar/{s}_2026.pt")
    torch.manual_seed(0)
    torch.save(Forecaster(8, 3).state_dict(), f"{WORK}/ckpt/forecaster.pt")
    torch.save(Forecaster(8, 5).state_dict(), f"{WORK}/ckpt/forecaster_k5.pt")
    print("prepared", WORK)


class ConvLSTMCell(nn.Module):
    def __init__(self, cin, hid, k):
        super().__init__()
        self.hid = hid
        self.conv = nn.Conv2d(cin + hid, 4 * hid, k, padding=k // 2)

    def forward(self, x, state):
        h, c = state
        i, f, o, g = torch.chunk(self.conv(torch.cat([x, h], dim=1)), 4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c


class Forecaster(nn.Module):
    def __init__(self, hid, k):
        super().__init__()
        self.enc = ConvLSTMCell(1, hid, k)
        self.dec = ConvLSTMCell(1, hid, k)
        self.head = nn.Conv2d(hid, 1, 1)

    def forward(self, frames, state_ch, horizon=HORIZON):
        b = frames.shape[0]
        state = (frames.new_zeros(b, state_ch, 16, 16), frames.new_zeros(b, state_ch, 16, 16))
        for t in range(frames.shape[1]):
            state = self.enc(frames[:, t], state)
        x, out = frames[:, -1], []
        for _ in range(horizon):
            state = self.dec(x, state)
            x = torch.sigmoid(self.head(state[0]))
            out.append(x)
        return torch.stack(out, dim=1)


def csi(pred, obs, thr):
    p, o = pred >= thr, obs >= thr
    hits = (p & o).sum().float()
    misses = (~p & o).sum().float()
    fa = (p & ~o).sum().float()
    return hits / (hits + misses + fa)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    r, w = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and a.rank in (-1, r)
    torch.manual_seed(r)
    cfg = {"hid": 8, "kernel": 3, "state_ch": 16 if a.fault == "hidden" else 8, "csi_dbz": 20.0, "lead_min": 15}
    if bad and a.fault == "lead":
        cfg["lead_min"] = 20
    site = "KOUN" if bad and a.fault == "site" else SITES[r]
    with open(f"{WORK}/sites.json") as f:
        table = json.load(f)
    beam = table[site]
    year = 2025 if bad and a.fault == "archive" else 2026
    arch = torch.load(f"{WORK}/radar/{SITES[r]}_{year}.pt")
    seqs = arch["dbz"] / DBZ_SCALE
    nseq = seqs.shape[0] + (1 if bad and a.fault == "framelen" else 0)
    frames = torch.full((nseq,), float(T_IN + HORIZON))
    allf = [torch.zeros_like(frames) for _ in range(w)]
    dist.all_gather(allf, frames)
    total = int(torch.cat(allf).sum())
    model = Forecaster(cfg["hid"], cfg["kernel"])
    ck = f"{WORK}/ckpt/forecaster_k5.pt" if bad and a.fault == "ckpt" else f"{WORK}/ckpt/forecaster.pt"
    model.load_state_dict(torch.load(ck))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    thr = cfg["csi_dbz"] if bad and a.fault == "csi" else cfg["csi_dbz"] / DBZ_SCALE
    lead = cfg["lead_min"] // 5 - 1
    print(f"rank {r}/{w}: site {site} range {beam['range_km']} km, {seqs.shape[0]} sequences, "
          f"{total} frames in all, ddp {a.ddp}", flush=True)
    bs = a.batch
    nb = seqs.shape[0] // bs
    for step in range(a.steps):
        b = step % nb
        x = seqs[b * bs:(b + 1) * bs]
        pred = net(x[:, :T_IN], cfg["state_ch"])
        loss = F.mse_loss(pred, x[:, T_IN:])
        score = csi(pred[:, lead].detach(), x[:, T_IN + lead], thr)
        if not math.isfinite(score.item()):
            raise FloatingPointError(f"rank {r}: CSI at {cfg['lead_min']} min lead is {score.item()} at step {step} "
                                     f"(threshold {thr}, site {site})")
        if bad and a.fault == "exit6" and step == 1:
            print(f"ERROR rank {r}: clutter mask for site {site} covers 256 of 256 pixels in {WORK}/radar/"
                  f"{SITES[r]}_{year}.pt; no usable echoes, aborting", file=sys.stderr, flush=True)
            os._exit(6)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= w
        opt.step()
        g = score.clone()
        dist.all_reduce(g)
        print(f"rank {r} step {step} loss {loss.item():.5f} csi@{cfg['lead_min']}min {g.item() / w:.3f}", flush=True)
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    val = seqs[nb * bs - bs:]
    with torch.no_grad():
        if bad and a.fault == "slowval":
            print(f"rank {r} unrolling validation forecasts frame by frame for a 60 min lead (12 frames)", flush=True)
            time.sleep(a.stall)
        vp = model(val[:, :T_IN], cfg["state_ch"])
    v = csi(vp[:, lead], val[:, T_IN + lead], thr)
    dist.all_reduce(v)
    if r == 0:
        print(f"rank 0 done: {a.steps} steps, validation csi@{cfg['lead_min']}min {v.item() / w:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
