"""A two-hundred-and-sixty-seventh hand-run batch: OPTICAL FLOW WITH A TINY PWC-STYLE NETWORK.

Optical flow on synthetic data: every rank owns the image-pair archive of one scene (pairs/<SCENE>_train.pt under
/tmp/fault267_work, written by --prepare: 16 pairs of smoothed random 24x24 textures, the second image the first
shifted by a known integer flow of up to 2 pixels).  The scene's texture settings come from the scene table
scenes.json.  A tiny PWC-style network builds a feature pyramid (the image, then two stride-2 conv levels), builds a
cost volume by correlation at level 1 within a search radius of 2 pixels, and a flow decoder (its weights
initialised from ckpt/decoder.pt) predicts the flow normalised by the image size, upsampled to full resolution.
The loss is the end-point error (EPE); the EPE in pixels is all_reduced every step.  The model is wrapped in DDP
(gloo) or, with --ddp 0, parameters are broadcast and gradients all_reduced by hand.  After training the validation
EPE is all_reduced and per-rank EPE histograms (10 bins) are all_gathered.

Faults:
  level    - rank N reads the cost volume from pyramid level 3 of a 3-entry pyramid (IndexError)
  imgsize  - rank N normalises the flow by an image size of 0 from its config: inf/NaN EPE, the loss check raises
  hist     - rank N all_gathers an EPE histogram of 12 bins against 10 (size mismatch in the all_gather)
  archive  - rank N opens pairs/<SCENE>_val.pt, which was never written (FileNotFoundError)
  scene    - rank N is configured for scene alley_7, missing from the scene table (KeyError)
  radius   - every rank: cost volume radius 3 (49 channels) against a decoder built for radius 2 (25 + 8 channels)
  ckpt     - rank N loads ckpt/decoder_v0.pt, an older decoder without its output layer (missing keys, strict load)
  slowcv   - rank N computes a full-resolution cost volume with nested Python loops for --stall s before the val all_reduce
  segv     - rank N sends itself SIGSEGV after step 2
  exit3    - rank N prints its own error line about a pair archive of zero flows and calls sys.exit(3) at step 1
  none     - control, clean run

What happened (filled in after the runs):
  level    - rank N: IndexError list index out of range at pa[level] in the first forward; peers closed by peer
  imgsize  - rank N: FloatingPointError EPE loss is nan at step 0 (img_size 0); DETAIL run: monitoredBarrier on rank 0
  hist     - rank N: RuntimeError ProcessGroupGloo::allgather invalid tensor size (expected (12), got (10)) after training
  archive  - rank N: FileNotFoundError .../pairs/<SCENE>_val.pt before the DDP constructor; peers SIGTERMed
  scene    - rank N: KeyError 'alley_7' at the scene-table lookup; peers SIGTERMed
  radius   - every rank: RuntimeError weight [16, 33, 3, 3] expected input[4, 57, 12, 12] to have 33 channels, got 57
  ckpt     - rank N: RuntimeError Missing key(s) in state_dict: "out.weight", "out.bias" (strict decoder load)
  slowcv   - rank N stalled: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  segv     - rank N: exitcode -11 (SIGSEGV) after step 2; peers Connection reset by peer at step 3
  exit3    - rank N logs its ERROR zero-flow line, exitcode 3; peers closed; the restarted attempt timed out in DDP init
  none     - clean, exit 0, rank 0 printed the validation EPE
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

WORK = "/tmp/fault267_work"
SCENES = ["alley_1", "bamboo_2", "cave_4", "market_2", "mountain_1", "shaman_3", "temple_2", "bandage_1"]
NPAIR = 16
SIZE = 24


def make_pairs(seed, n=NPAIR):
    g = torch.Generator().manual_seed(seed)
    tex = torch.rand(n, 1, SIZE + 4, SIZE + 4, generator=g)
    tex = F.avg_pool2d(tex, 3, stride=1)[:, :, :SIZE, :SIZE]
    flows = torch.randint(-2, 3, (n, 2), generator=g).float()
    img2 = torch.stack([torch.roll(tex[i], (int(flows[i, 1]), int(flows[i, 0])), dims=(1, 2)) for i in range(n)])
    flow = flows[:, :, None, None].expand(n, 2, SIZE, SIZE).clone()
    return tex, img2, flow


def prepare():
    os.makedirs(f"{WORK}/pairs", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    table = {s: {"texture_seed": 500 + k, "max_flow_px": 2} for k, s in enumerate(SCENES)}
    with open(f"{WORK}/scenes.json", "w") as f:
        json.dump(table, f)
    for k, s in enumerate(SCENES):
        a, b, fl = make_pairs(500 + k)
        torch.save({"scene": s, "img1": a, "img2": b, "flow": fl}, f"{WORK}/pairs/{s}_train.pt")
    torch.manual_seed(0)
    dec = Decoder(2)
    torch.save(dec.state_dict(), f"{WORK}/ckpt/decoder.pt")
    torch.save({k: v for k, v in dec.state_dict().items() if k.startswith("c1.")}, f"{WORK}/ckpt/decoder_v0.pt")
    print("prepared", WORK)


def correlate(fa, fb, radius):
    h, w = fa.shape[-2:]
    fb = F.pad(fb, (radius,) * 4)
    vols = []
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            vols.append((fa * fb[:, :, dy:dy + h, dx:dx + w]).mean(1))
    return torch.stack(vols, 1)


class Pyramid(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Conv2d(1, 8, 3, stride=2, padding=1)
        self.l2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)

    def forward(self, x):
        f1 = F.leaky_relu(self.l1(x), 0.1)
        return [x, f1, F.leaky_relu(self.l2(f1), 0.1)]


class Decoder(nn.Module):
    def __init__(self, radius):
        super().__init__()
        self.c1 = nn.Conv2d((2 * radius + 1) ** 2 + 8, 16, 3, padding=1)
        self.out = nn.Conv2d(16, 2, 3, padding=1)

    def forward(self, cost, feat):
        return self.out(F.leaky_relu(self.c1(torch.cat([cost, feat], 1)), 0.1))


class PWCTiny(nn.Module):
    def __init__(self, radius):
        super().__init__()
        self.pyr = Pyramid()
        self.dec = Decoder(radius)

    def forward(self, a, b, level, radius):
        pa, pb = self.pyr(a), self.pyr(b)
        cost = correlate(pa[level], pb[level], radius)
        ctx = pa[level] + F.interpolate(pa[-1], size=cost.shape[-2:], mode="nearest")
        flow = self.dec(cost, ctx)
        return F.interpolate(flow, size=a.shape[-2:], mode="bilinear", align_corners=False)


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
    cfg = {"radius": 3 if a.fault == "radius" else 2, "level": 1, "img_size": SIZE, "hist_bins": 10}
    if bad and a.fault == "level":
        cfg["level"] = 3
    if bad and a.fault == "imgsize":
        cfg["img_size"] = 0
    if bad and a.fault == "hist":
        cfg["hist_bins"] = 12
    scene = "alley_7" if bad and a.fault == "scene" else SCENES[r]
    with open(f"{WORK}/scenes.json") as f:
        table = json.load(f)
    tex = table[scene]
    split = "val" if bad and a.fault == "archive" else "train"
    arch = torch.load(f"{WORK}/pairs/{SCENES[r]}_{split}.pt")
    img1, img2, flow = arch["img1"], arch["img2"], arch["flow"]
    model = PWCTiny(2)
    ck = f"{WORK}/ckpt/decoder_v0.pt" if bad and a.fault == "ckpt" else f"{WORK}/ckpt/decoder.pt"
    model.dec.load_state_dict(torch.load(ck))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    print(f"rank {r}/{w}: scene {scene} (texture seed {tex['texture_seed']}), {img1.shape[0]} pairs, "
          f"pyramid level {cfg['level']}, search radius {cfg['radius']}, ddp {a.ddp}", flush=True)
    bs = a.batch
    nb = img1.shape[0] // bs
    for step in range(a.steps):
        b = step % nb
        sl = slice(b * bs, (b + 1) * bs)
        pred = net(img1[sl], img2[sl], cfg["level"], cfg["radius"])
        target = flow[sl] / cfg["img_size"]
        epe_map = torch.norm(pred - target, dim=1)
        loss = epe_map.mean()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {r}: EPE loss is {loss.item()} at step {step} "
                                     f"(scene {scene}, img_size {cfg['img_size']})")
        if bad and a.fault == "exit3" and step == 1:
            print(f"ERROR rank {r}: {WORK}/pairs/{SCENES[r]}_train.pt: all {img1.shape[0]} ground-truth flows "
                  f"are zero after the occlusion mask; nothing to learn, aborting", file=sys.stderr, flush=True)
            sys.exit(3)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= w
        opt.step()
        e = (loss.detach() * SIZE).reshape(1)
        dist.all_reduce(e)
        print(f"rank {r} step {step} loss {loss.item():.5f} epe {e.item() / w:.3f}px", flush=True)
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        if bad and a.fault == "slowcv":
            print(f"rank {r} validating with the full-resolution cost volume (nested loops, 24x24x81 "
                  f"correlations per pair)", flush=True)
            time.sleep(a.stall)
        vp = model(img1[-bs:], img2[-bs:], cfg["level"], cfg["radius"])
        vmap = torch.norm(vp * SIZE - flow[-bs:], dim=1)
    v = vmap.mean().reshape(1)
    dist.all_reduce(v)
    hist = torch.histc(vmap, bins=cfg["hist_bins"], min=0.0, max=4.0)
    hists = [torch.zeros(10) for _ in range(w)]
    dist.all_gather(hists, hist)
    if r == 0:
        tot = torch.stack(hists).sum(0)
        print(f"rank 0 done: {a.steps} steps, validation EPE {v.item() / w:.3f}px, "
              f"{int(tot[:3].sum())}/{int(tot.sum())} pixels under 1.2px", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
