"""A three-hundred-and-fortieth hand-run batch: DENTAL X-RAY TOOTH DETECTION WITH AN ANCHOR-FREE HEAD.

Synthetic panoramic dental X-ray crops (1x48x96) with tooth boxes annotated by FDI tooth number (11..48).
Every rank reads its crops and annotations from /tmp/fault340_work/pano/pano_R.pt, maps each FDI number to
one of 4 tooth types (incisor, canine, premolar, molar) through the FDI table, and trains a CenterNet-style
anchor-free detector (a stride-4 conv backbone, a 4-class centre heatmap head and a 4-channel ltrb distance
head, log-encoded) with a BCE heatmap loss plus an L1 box loss at the positive cells.  The model starts from
ckpt/ctrnet_c4.pt.  Per-rank tooth-type counts are all_gathered at start-up, the loss is all_reduced every
step (metric: positive-cell recall), per-rank recall is all_gathered at the end, and rank 0 saves
export/ctrnet.pt.  Options: --ddp 0 (gradients all_reduced by hand), --spawn N (torch.multiprocessing.spawn,
--port), --logfmt 1 (progress and errors through logging).

Faults:
  fdi       - rank N's annotations include tooth 55 (a deciduous molar) missing from the FDI table (KeyError)
  boxidx    - rank N's step-3 batch has a tooth centred at x=97 past the 96-px edge: grid cell 24 of 24 (IndexError)
  nosplit   - rank N reads its crops from pano/val/, which does not exist (FileNotFoundError)
  ckpthead  - rank N starts from ckpt/ctrnet_c5.pt, saved with 5 heatmap classes (size mismatch)
  pickle    - rank N loads ckpt/ctrnet_meta.pt whose pixel-spacing object is a custom class (weights_only refusal)
  gathercls - rank N all_gathers 5 tooth-type counts (an extra deciduous count) instead of 4
  nms       - rank N runs a pure-Python NMS over every heatmap cell before the step-2 all_reduce (slow rank)
  logsize   - rank N's step-4 batch has a zero-width tooth box: log(0) in the box target, the program's check
  sigsegv   - rank N sends itself SIGSEGV after step 3
  canal     - rank N prints its own error line about the mandibular canal after training and calls sys.exit(4)
  headwh    - every rank: the box head outputs 2 channels (w, h) but the targets are 4 (ltrb) (shape error)
  none      - control, clean run

What happened (filled in after the runs):
  fdi       - KeyError: 55 at start-up; peers Connection closed by peer in all_gather (np4 r2 ranklabel); spawn ProcessRaisedException, others SIGTERM (np6 r0 spawn)
  boxidx    - after steps 0-2, 'IndexError: index 24 is out of bounds for dimension 3 with size 24' at step 3; peers closed (np3 r1 srunlabel)
  nosplit   - FileNotFoundError for pano/val/pano_3.pt at start-up; peers Connection closed by peer (np4 r3 mpitag)
  ckpthead  - load_state_dict size mismatch hm.weight [5,16,1,1] vs [4,16,1,1]; Root Cause rank N (np3 r2 tee, np4 r1 pdsh2)
  pickle    - weights_only UnpicklingError 'Unsupported global: GLOBAL __main__.PixelSpacing' in rank0.log; peers closed (np3 r0 files)
  gathercls - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))'; 5 peers closed (np6 r4 bashloop)
  nms       - 12 s: peers 'Timed out waiting 12000ms' after step 1 (np3 r1 mpitag); 300 s: silent after step 1, killed at 60 s, exit 124 (np3 r2 srunlabel)
  logsize   - program check at step 4: box loss inf, FloatingPointError; Root Cause rank 0 (np4 r0 logfmt)
  sigsegv   - after step 3 no traceback; 'process 1 terminated with signal SIGSEGV' (np3 r1 spawn)
  canal     - after 6 steps rank N's ERROR line and exit 4; peers closed in the final all_gather; Root Cause exitcode 4 (np3 r2 legacy)
  headwh    - every rank 'The size of tensor a (2) must match the size of tensor b (4) at non-singleton dimension 1' in the first step (np4 pdsh2)
  none      - clean: 6 steps on 3 ranks, rank 0 saved export/ctrnet.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault340_work"
FDI = {}
for q in (1, 2, 3, 4):
    for t in range(1, 9):
        FDI[q * 10 + t] = 0 if t <= 2 else 1 if t == 3 else 2 if t <= 5 else 3
NCLS = 4
H, W, STRIDE = 48, 96, 4
BATCH = 4
log = None


@dataclass
class PixelSpacing:
    mm_x: float
    mm_y: float


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
    log = logging.getLogger("dent")
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


class CenterNet(nn.Module):
    def __init__(self, ncls=NCLS, nbox=4):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.hm = nn.Conv2d(16, ncls, 1)
        self.box = nn.Conv2d(16, nbox, 1)

    def forward(self, x):
        f = self.backbone(x)
        return self.hm(f), self.box(f)


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    imgs = torch.rand(n, 1, H, W, generator=g) * 0.2
    anns = []
    for i in range(n):
        teeth = []
        for k in range(6):
            fdi = [11, 13, 15, 17, 24, 36, 42, 47][int(torch.randint(0, 8, (1,), generator=g))]
            cx, cy = 8 + 14 * k + int(torch.randint(0, 4, (1,), generator=g)), 24 + int(torch.randint(-6, 6, (1,), generator=g))
            w, h = 6 + int(torch.randint(0, 5, (1,), generator=g)), 14 + int(torch.randint(0, 8, (1,), generator=g))
            imgs[i, 0, max(cy - h // 2, 0):cy + h // 2, max(cx - w // 2, 0):cx + w // 2] += 0.7
            teeth.append((fdi, cx, cy, w, h))
        anns.append(teeth)
    return {"images": imgs, "anns": anns}


def prepare():
    os.makedirs(f"{WORK}/pano", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_split(32, 340 + r), f"{WORK}/pano/pano_{r}.pt")
    torch.manual_seed(0)
    torch.save(CenterNet(4).state_dict(), f"{WORK}/ckpt/ctrnet_c4.pt")
    torch.save(CenterNet(5).state_dict(), f"{WORK}/ckpt/ctrnet_c5.pt")
    torch.save({"spacing": PixelSpacing(0.1, 0.1), "sensor": "CS8100"}, f"{WORK}/ckpt/ctrnet_meta.pt")
    print("prepared", WORK)


def encode(anns, nbox):
    b = len(anns)
    hm = torch.zeros(b, NCLS, H // STRIDE, W // STRIDE)
    box = torch.zeros(b, nbox, H // STRIDE, W // STRIDE)
    mask = torch.zeros(b, H // STRIDE, W // STRIDE, dtype=torch.bool)
    for i, teeth in enumerate(anns):
        for fdi, cx, cy, w, h in teeth:
            gx, gy = cx // STRIDE, cy // STRIDE
            hm[i, FDI[fdi], gy, gx] = 1.0
            px, py = gx * STRIDE + 2, gy * STRIDE + 2
            ltrb = torch.tensor([px - (cx - w / 2), py - (cy - h / 2), (cx + w / 2) - px, (cy + h / 2) - py])
            box[i, :, gy, gx] = torch.log(ltrb.clamp(min=0) + (w > 0) * 0.5)
            mask[i, gy, gx] = True
    return hm, box, mask


def python_nms(hm, budget):
    t0, kept = time.time(), 0
    cells = [(float(v), i) for i, v in enumerate(hm.flatten().tolist())]
    while time.time() - t0 < budget:
        order = sorted(cells, reverse=True)
        alive = [True] * len(order)
        for a_i in range(len(order)):
            if not alive[a_i]:
                continue
            kept += 1
            for b_i in range(a_i + 1, len(order)):
                if abs(order[a_i][1] - order[b_i][1]) < 3:
                    alive[b_i] = False
    return kept


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading panoramic crops")
    split = "val/" if bad and a.fault == "nosplit" else ""
    data = torch.load(f"{WORK}/pano/{split}pano_{rank}.pt")
    imgs, anns = data["images"], data["anns"]
    if bad and a.fault == "fdi":
        anns[9][4] = (55,) + anns[9][4][1:]
    if bad and a.fault == "boxidx":
        anns[13][5] = (anns[13][5][0], 97) + anns[13][5][2:]
    if bad and a.fault == "logsize":
        anns[17][2] = anns[17][2][:3] + (0, anns[17][2][4])
    counts = torch.zeros(NCLS)
    for teeth in anns:
        for t in teeth:
            counts[FDI[t[0]]] += 1
    if bad and a.fault == "gathercls":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} teeth {int(counts.sum())} global {int(sum(c.sum() for c in allc))} "
        f"types {[int(v) for v in sum(allc).tolist()]}")
    nbox = 2 if a.fault == "headwh" else 4
    model = CenterNet(NCLS, nbox)
    ck = "ctrnet_c5.pt" if bad and a.fault == "ckpthead" else "ctrnet_c4.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    if nbox != 4:
        sd = {k: v for k, v in sd.items() if not k.startswith("box.")}
    model.load_state_dict(sd, strict=(nbox == 4))
    if bad and a.fault == "pickle":
        meta = torch.load(f"{WORK}/ckpt/ctrnet_meta.pt")
        say(f"rank {rank} pixel spacing {meta['spacing']}")
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    recall = 0.0
    for step in range(a.steps):
        lo = (step * BATCH) % len(anns)
        x, batch = imgs[lo:lo + BATCH], anns[lo:lo + BATCH]
        hm_t, box_t, mask = encode(batch, 4)
        hm_p, box_p = net(x)
        l_hm = F.binary_cross_entropy_with_logits(hm_p, hm_t)
        l_box = (box_p.permute(0, 2, 3, 1)[mask] - box_t.permute(0, 2, 3, 1)[mask]).abs().mean()
        loss = l_hm + l_box
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss at step {step} (heatmap {l_hm.item():.4f}, box {l_box.item()}); "
                f"box targets have {int((~torch.isfinite(box_t)).sum())} non-finite values", err=True)
            raise FloatingPointError(f"non-finite detection loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "nms" and step == 2:
            kept = python_nms(hm_p.detach(), a.nms_budget)
            say(f"rank {rank} python NMS kept {kept} peaks")
        with torch.no_grad():
            recall = float((torch.sigmoid(hm_p)[hm_t > 0] > 0.5).float().mean())
        red = loss.detach().reshape(1)
        dist.all_reduce(red)
        say(f"rank {rank} step {step} loss {red.item() / world:.4f} recall {recall:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "canal":
        say(f"rank {rank}: ERROR pano {lo + 2}: mandibular canal overlaps 3 molar boxes (47, 48, 46), "
            f"annotation set rejected", err=True)
        sys.exit(4)
    rec = torch.tensor([recall])
    allr = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allr, rec)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/ctrnet.pt")
        say(f"rank 0 done: {a.steps} steps, mean recall {sum(float(r) for r in allr) / world:.3f}, "
            f"saved export/ctrnet.pt")
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
    p.add_argument("--nms-budget", type=int, default=30)
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
