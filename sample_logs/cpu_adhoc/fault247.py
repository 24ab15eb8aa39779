"""A two-hundred-and-forty-seventh hand-run batch: 3-D MEDICAL VOLUME SEGMENTATION WITH A SMALL 3-D U-NET.

Synthetic CT-like volumes (32^3, Hounsfield-like noise) hold three spheres as organs (liver, spleen, kidney_l);
every rank reads its case ids from /tmp/fault247_work/data/index/index_rR.json, builds its volumes from the case
ids, takes random 12^3 crops around the foreground and trains a small 3-D U-Net (two levels, base channels 4,
one skip connection) initialised from ckpt/unet_init.pt with a Dice plus cross-entropy loss, wrapped in DDP over
gloo (or, with --ddp 0, with gradients all_reduced by hand).  The loss is all_reduced for the log.  After the
steps every rank runs a sliding-window validation (window 12) over a 48^3 validation volume, the per-organ Dice
sums are all_reduced, the per-organ voxel counts are all_gathered, and rank 0 prints the mean Dice.

Faults:
  emptygt   - rank N samples crops with fg_prob 0 from the corner: no organ in the crop, Dice weights 0/0, NaN check
  countlen  - rank N counts voxels for four organs (kidney_r too) and all_gathers 4 counts, others 3 (gloo mismatch)
  noindex   - rank N reads its case index from data/index_v2/, which does not exist (FileNotFoundError)
  bigcrop   - rank N's crop size is 40 on a 32^3 volume: narrow() beyond the dimension (RuntimeError)
  organkey  - rank N's organ list holds "pancreas", absent from the label map (KeyError)
  skipdepth - every rank concatenates the skip connection from the bottleneck depth (torch.cat shape error)
  ckpt      - rank N initialises from ckpt/unet_init_c8.pt, saved with 8 base channels (size mismatch)
  slidewin  - rank N runs the sliding-window validation with stride 1 and reaches the all_reduce far too late
  sigbus    - rank N sends itself SIGBUS after step 2's optimizer step
  exit5     - rank N prints its own error line about a volume header's spacing at step 1 and calls os._exit(5)
  spacing   - every rank: the voxel spacing default is the string "1.5mm" (ValueError in float())
  none      - control, clean run

What happened (filled in after the runs):
  emptygt   - rank N: FloatingPointError loss is nan at step 0 (0 of 3 organs in crop); peers closed / DETAIL monitoredBarrier
  countlen  - rank N itself: ProcessGroupGloo::allgather invalid tensor size (expected (4), got (3)); peers closed
  noindex   - rank N: FileNotFoundError .../data/index_v2/index_rN.json at startup; peers SIGTERMed
  bigcrop   - rank N: RuntimeError start (11) + length (40) exceeds dimension size (32) at step 0; peers closed
  organkey  - rank N: KeyError 'pancreas' at startup; peers SIGTERMed
  skipdepth - every rank: RuntimeError Sizes of tensors must match ... Expected size 12 but got size 6 in torch.cat
  ckpt      - rank N: size mismatch for enc1.0.weight [8, 1, 3, 3, 3] vs [4, 1, 3, 3, 3]; restart died in connectFullMesh
  slidewin  - rank N in stride-1 validation: peers Timed out waiting 12000ms; with PG 300 s killed by timeout 60 (124)
  sigbus    - rank N: exitcode -7 (SIGBUS) after step 2's optimizer step, no traceback; peers closed/reset
  exit5     - rank N: ERROR ... header spacing (0.0, 1.5, 1.5) has a zero axis line, exitcode 5; peers reset/closed
  spacing   - every rank: ValueError could not convert string to float: '1.5mm' before any step
  none      - clean, exit 0, rank 0 printed the validation dice line (mean 0.000 after 5 steps)
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault247_work"
LABEL_MAP = {"background": 0, "liver": 1, "spleen": 2, "kidney_l": 3, "kidney_r": 4}
ORGANS = ["liver", "spleen", "kidney_l"]


def block(cin, cout):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv3d(cout, cout, 3, padding=1), nn.ReLU())


class UNet3D(nn.Module):
    def __init__(self, base=4, n_classes=4, skip_from_bottleneck=False):
        super().__init__()
        self.enc1 = block(1, base)
        self.enc2 = block(base, 2 * base)
        self.up = nn.ConvTranspose3d(2 * base, base, 2, stride=2)
        self.dec1 = block(2 * base, base)
        self.head = nn.Conv3d(base, n_classes, 1)
        self.skip_from_bottleneck = skip_from_bottleneck

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool3d(e1, 2))
        u = self.up(e2)
        skip = e2 if self.skip_from_bottleneck else e1
        d = self.dec1(torch.cat([u, skip], dim=1))
        return self.head(d)


def make_volume(case_id, size=32, spacing=1.5):
    g = torch.Generator().manual_seed(case_id)
    vol = torch.randn(size, size, size, generator=g) * 20.0 - 100.0
    lab = torch.zeros(size, size, size, dtype=torch.long)
    zz, yy, xx = torch.meshgrid(*(torch.arange(size, dtype=torch.float32),) * 3, indexing="ij")
    for k, organ in enumerate(ORGANS):
        c = size / 2 + (torch.rand(3, generator=g) - 0.5) * 4
        r = (3.0 + 1.5 * torch.rand(1, generator=g).item()) * 1.5 / spacing
        m = (zz - c[0]) ** 2 + (yy - c[1]) ** 2 + (xx - c[2]) ** 2 <= r * r
        lab[m] = LABEL_MAP[organ]
        vol[m] = 40.0 + 30.0 * k + torch.randn(int(m.sum()), generator=g) * 10.0
    return (vol.clamp(-200, 300) / 300.0), lab


def crop(vol, lab, cs, fg_prob, g):
    size = vol.shape[0]
    if torch.rand(1, generator=g).item() < fg_prob:
        lo, hi = size // 2 - cs + 2, size // 2 - 2
        o = [int(torch.randint(max(0, lo), max(1, hi), (1,), generator=g)) for _ in range(3)]
    else:
        o = [0, 0, 0]
    v, l = vol, lab
    for d in range(3):
        v = v.narrow(d, o[d], cs)
        l = l.narrow(d, o[d], cs)
    return v, l


def dice_ce_loss(logits, lab, n_classes):
    ce = F.cross_entropy(logits, lab)
    p = logits.softmax(1)
    oh = F.one_hot(lab, n_classes).permute(0, 4, 1, 2, 3).float()
    inter = (p * oh).sum((0, 2, 3, 4))[1:]
    denom = (p + oh).sum((0, 2, 3, 4))[1:]
    dice = 2 * inter / (denom + 1e-5)
    present = (oh.sum((0, 2, 3, 4))[1:] > 0).float()
    w = present / present.sum()
    return ce + 1 - (dice * w).sum(), present


def sliding_window(model, vol, lab, win, stride, n_classes):
    size = vol.shape[0]
    pos = list(range(0, size - win + 1, stride))
    if pos[-1] != size - win:
        pos.append(size - win)
    inter = torch.zeros(n_classes - 1)
    denom = torch.zeros(n_classes - 1)
    n = 0
    with torch.no_grad():
        for z in pos:
            for y in pos:
                for x in pos:
                    v = vol[z:z + win, y:y + win, x:x + win][None, None]
                    l = lab[z:z + win, y:y + win, x:x + win][None]
                    pred = model(v).argmax(1)
                    for c in range(1, n_classes):
                        inter[c - 1] += ((pred == c) & (l == c)).sum()
                        denom[c - 1] += (pred == c).sum() + (l == c).sum()
                    n += 1
    return inter, denom, n


def prepare():
    os.makedirs(f"{WORK}/data/index", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        with open(f"{WORK}/data/index/index_r{r}.json", "w") as f:
            json.dump({"cases": [1000 + 10 * r + i for i in range(4)], "modality": "CT"}, f)
    torch.manual_seed(0)
    torch.save(UNet3D(base=4).state_dict(), f"{WORK}/ckpt/unet_init.pt")
    torch.save(UNet3D(base=8).state_dict(), f"{WORK}/ckpt/unet_init_c8.pt")
    print("prepared", WORK)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ddp", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--prepare", type=int, default=0)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hit = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))

    spacing_default = "1.5mm" if a.fault == "spacing" else "1.5"
    spacing = float(os.environ.get("MED_SPACING", spacing_default))
    index_dir = "data/index_v2" if hit and a.fault == "noindex" else "data/index"
    with open(f"{WORK}/{index_dir}/index_r{rank}.json") as f:
        cases = json.load(f)["cases"]
    organs = ORGANS + ["kidney_r"] if hit and a.fault == "countlen" else list(ORGANS)
    if hit and a.fault == "organkey":
        organs = ["liver", "spleen", "pancreas"]
    organ_ids = [LABEL_MAP[o] for o in organs]
    crop_size = 40 if hit and a.fault == "bigcrop" else 12
    fg_prob = 0.0 if hit and a.fault == "emptygt" else 1.0
    print(f"rank {rank}: {len(cases)} cases, spacing {spacing} mm, crop {crop_size}, organs {organ_ids}", flush=True)

    base = 4
    model = UNet3D(base=base, skip_from_bottleneck=(a.fault == "skipdepth"))
    ck = "ckpt/unet_init_c8.pt" if hit and a.fault == "ckpt" else "ckpt/unet_init.pt"
    model.load_state_dict(torch.load(f"{WORK}/{ck}"))
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    vols = [make_volume(c, spacing=spacing) for c in cases]
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        vs, ls = zip(*(crop(v, l, crop_size, fg_prob, g) for v, l in (vols[step % len(vols)], vols[(step + 1) % len(vols)])))
        x, y = torch.stack(vs)[:, None], torch.stack(ls)
        loss, present = dice_ce_loss(net(x), y, 4)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} "
                                     f"(organs present in crop: {int(present.sum())} of {present.numel()})")
        if hit and a.fault == "exit5" and step == 1:
            print(f"ERROR rank {rank}: case {cases[1]} header spacing (0.0, 1.5, 1.5) has a zero axis; "
                  f"cannot resample, aborting", file=sys.stderr, flush=True)
            os._exit(5)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if hit and a.fault == "sigbus" and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f}", flush=True)

    stride = 1 if hit and a.fault == "slidewin" else 12
    vvol, vlab = make_volume(5000 + rank, size=48, spacing=spacing)
    t0 = time.time()
    print(f"rank {rank}: sliding-window validation, window 12, stride {stride}", flush=True)
    inter, denom, n = sliding_window(model, vvol, vlab, 12, stride, 4)
    print(f"rank {rank}: {n} windows in {time.time() - t0:.1f}s", flush=True)
    dist.all_reduce(inter)
    dist.all_reduce(denom)
    counts = torch.tensor([float((vlab == i).sum()) for i in organ_ids])
    gathered = [torch.zeros(len(ORGANS)) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        dice = 2 * inter / denom.clamp(min=1)
        total = torch.stack(gathered).sum(0)
        print("validation dice " + " ".join(f"{o}={d:.3f}" for o, d in zip(ORGANS, dice.tolist()))
              + f" mean={dice.mean():.3f} voxels={total.int().tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
