"""A two-hundred-and-seventy-first hand-run batch: FACIAL LANDMARK REGRESSION WITH A HOURGLASS NETWORK.

Synthetic face-like 32x32 images (Gaussian blobs at 68 landmark points around a template face, plus noise),
written per rank as ann/face-RRR.npz by `--export` together with pretrained 2-stack and 3-stack hourglass
checkpoints (ckpt/hg2.pt, ckpt/hg3.pt). A small stacked hourglass predicts 68 heatmaps per stack (intermediate
supervision with Gaussian target heatmaps), a soft-argmax turns the last stack's heatmaps into coordinates with
a per-group weighted L2 loss, DDP on gloo, loss all_reduced per step; eval computes the normalised mean error
(NME, point error over the inter-ocular distance 36-45), all_reduced, and all_gathers per-rank NME histograms.

Faults:
  lmkidx    - rank N's group table has the mouth as range(48, 69); the weight table is indexed at 68 (IndexError)
  iod0      - rank N's val face 0 has both outer eye corners at one point; IOD 0, NME inf (program's check)
  hist      - rank N builds its NME histogram with 25 bins (others 20) and all_gathers it (gloo size mismatch)
  noann     - rank N reads its annotations from ann_v2/, which was never exported (FileNotFoundError)
  pose      - rank N re-buckets poses with the 5-bucket scheme; 'profile_left' is not in the aug table (KeyError)
  hmres     - every rank renders target heatmaps at 32x32 while the head outputs 16x16 (shape error)
  ckpt      - rank N loads the 3-stack checkpoint into its 2-stack model (unexpected keys)
  slowheat  - rank N renders its eval heatmaps point by point in Python; reaches the NME all_reduce far too late
  abort     - rank N sends itself SIGABRT at step 2
  collate   - rank N flips half its samples with an hflip that returns None; the collate fails (TypeError)
  exit3     - rank N prints an error about its annotation file and calls os._exit(3) at step 1
  none      - control

What happened (filled in after the runs):
  lmkidx    - IndexError: index 68 is out of bounds for dimension 0 with size 68 on rank N at startup; peers Connection closed
  iod0      - FloatingPointError: rank N: NME is inf over 16 val faces (min inter-ocular distance 0.0000); peers closed
  hist      - a peer aborts: gloo::EnforceNotMet ... Received data size doesn't match expected size (SIGABRT); others reset
  noann     - FileNotFoundError for data/ann_v2/face-00N.npz on rank N; peers Connection closed or SIGTERMed
  pose      - KeyError: 'profile_left' in augment on rank N at step 0; peers Connection closed by peer in backward
  hmres     - RuntimeError: The size of tensor a (16) must match the size of tensor b (32) ... on every rank at step 0
  ckpt      - RuntimeError: Error(s) in loading state_dict for StackedHG: Unexpected key(s) stacks.2.* on rank N
  slowheat  - peers 'Timed out waiting 12000ms' in the NME all_reduce (PG 12 s); with PG 300 s nothing until timeout 124
  abort     - rank N killed by SIGABRT at step 2, no traceback; spawn: ProcessExitedException process N SIGABRT
  collate   - TypeError: 'NoneType' object is not subscriptable in collate on rank N; peers Connection closed
  exit3     - rank N prints ERROR ... 67 landmarks per face ... aborting and exits 3; peers Connection reset/closed
  none      - exit 0, rank 0 done: 4 steps, NME 0.5890 over 48 val faces
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

NPTS = 68
EYES = (36, 45)
GROUPS = {"jaw": range(0, 17), "brows": range(17, 27), "nose": range(27, 36), "eyes": range(36, 48),
          "mouth": range(48, 68)}
GROUP_W = {"jaw": 0.5, "brows": 1.0, "nose": 1.0, "eyes": 2.0, "mouth": 1.5}
AUG = {"frontal": (0.10, 8.0), "left": (0.05, 15.0), "right": (0.05, 15.0)}  # scale jitter, max rotation (deg)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--img", type=int, default=32)
    p.add_argument("--hm-res", type=int, default=16)
    p.add_argument("--stacks", type=int, default=2)
    p.add_argument("--data", default="/tmp/fault271_work/data")
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--export", type=int, default=0)
    return p.parse_args()


class Hourglass(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.skip = nn.Conv2d(c, c, 3, padding=1)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(c, c, 3, padding=1)
        self.up = nn.ConvTranspose2d(c, c, 2, stride=2)

    def forward(self, x):
        return F.relu(self.skip(x) + self.up(F.relu(self.mid(F.relu(self.down(x))))))


class StackedHG(nn.Module):
    def __init__(self, stacks=2, c=16):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, stride=2, padding=1)
        self.stacks = nn.ModuleList(Hourglass(c) for _ in range(stacks))
        self.heads = nn.ModuleList(nn.Conv2d(c, NPTS, 1) for _ in range(stacks))
        self.remap = nn.ModuleList(nn.Conv2d(NPTS, c, 1) for _ in range(stacks - 1))

    def forward(self, x):
        x = F.relu(self.stem(x))
        outs = []
        for i, hg in enumerate(self.stacks):
            y = hg(x)
            h = self.heads[i](y)
            outs.append(h)
            if i < len(self.remap):
                x = x + y + self.remap[i](h)
        return outs


def soft_argmax(h):
    b, k, hh, ww = h.shape
    p = F.softmax(h.reshape(b, k, hh * ww), -1).reshape(b, k, hh, ww)
    xs = (torch.arange(ww) + 0.5) / ww
    ys = (torch.arange(hh) + 0.5) / hh
    return torch.stack([(p.sum(2) * xs).sum(-1), (p.sum(3) * ys).sum(-1)], -1)


def render(lmk, res, sigma=1.0):
    g = torch.arange(res, dtype=torch.float32) + 0.5
    dx = g.view(1, 1, 1, res) - lmk[..., 0, None, None] * res
    dy = g.view(1, 1, res, 1) - lmk[..., 1, None, None] * res
    return torch.exp(-(dx ** 2 + dy ** 2) / (2 * sigma ** 2))


def render_slow(lmk, res, stall, sigma=1.0):
    out = torch.zeros(lmk.shape[0], lmk.shape[1], res, res)
    per = stall / (lmk.shape[0] * lmk.shape[1])
    for b in range(lmk.shape[0]):
        for k in range(lmk.shape[1]):
            cx, cy = float(lmk[b, k, 0]) * res, float(lmk[b, k, 1]) * res
            for y in range(res):
                for x in range(res):
                    out[b, k, y, x] = np.exp(-((x + 0.5 - cx) ** 2 + (y + 0.5 - cy) ** 2) / (2 * sigma ** 2))
            time.sleep(per)
    return out


def faces_to_images(lmk, res, gen):
    img = render(lmk, res, sigma=1.2).amax(1, keepdim=True)
    return img + 0.05 * torch.randn(img.shape, generator=gen)


def export(a):
    rng = np.random.default_rng(271)
    tmpl = rng.uniform(0.2, 0.8, size=(NPTS, 2)).astype(np.float32)
    tmpl[EYES[0]] = (0.3, 0.4)
    tmpl[EYES[1]] = (0.7, 0.4)
    os.makedirs(os.path.join(a.data, "ann"), exist_ok=True)
    os.makedirs(os.path.join(a.data, "ckpt"), exist_ok=True)
    for r in range(8):
        lmk = np.clip(tmpl + rng.normal(0, 0.02, size=(80, NPTS, 2)), 0.05, 0.95).astype(np.float32)
        pose = rng.choice(["frontal", "left", "right"], size=80)
        np.savez(os.path.join(a.data, "ann", f"face-{r:03d}.npz"), lmk=lmk, pose=pose)
    torch.manual_seed(271)
    torch.save(StackedHG(2).state_dict(), os.path.join(a.data, "ckpt", "hg2.pt"))
    torch.save(StackedHG(3).state_dict(), os.path.join(a.data, "ckpt", "hg3.pt"))
    print("exported to", a.data)


def augment(lmk, pose, gen):
    out = lmk.clone()
    for i, p in enumerate(pose):
        scale, rot = AUG[p]
        s = 1 + scale * (2 * torch.rand(1, generator=gen).item() - 1)
        t = np.deg2rad(rot * (2 * torch.rand(1, generator=gen).item() - 1))
        R = torch.tensor([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]], dtype=torch.float32)
        out[i] = 0.5 + s * (lmk[i] - 0.5) @ R.T
    return out.clamp(0.02, 0.98)


def hflip(s):
    s["img"] = s["img"].flip(-1)
    lm = s["lmk"].clone()
    lm[:, 0] = 1 - lm[:, 0]
    s["lmk"] = lm


def collate(batch):
    return torch.stack([s["img"] for s in batch]), torch.stack([s["lmk"] for s in batch])


def main(a):
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hit = lambda name: a.fault == name and (a.rank == -1 or a.rank == rank)
    log = logging.LoggerAdapter(logging.getLogger("lmk"), {"rank": rank})
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s")
        say, err = log.info, log.error
    else:
        say = lambda m: print(m, flush=True)
        err = lambda m: print(m, file=sys.stderr, flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1000 + rank)

    ann_dir = os.path.join(a.data, "ann_v2" if hit("noann") else "ann")
    d = np.load(os.path.join(ann_dir, f"face-{rank:03d}.npz"))
    lmk_all, pose_all = torch.from_numpy(d["lmk"]), [str(p) for p in d["pose"]]
    if hit("pose"):
        pose_all = ["profile_left" if p == "left" else p for p in pose_all]
    train_lmk, val_lmk = lmk_all[:64], lmk_all[64:].clone()
    train_pose = pose_all[:64]
    say(f"rank {rank} loaded {len(lmk_all)} faces ({len(train_lmk)} train, {len(val_lmk)} val) from {ann_dir}")

    groups = dict(GROUPS)
    if hit("lmkidx"):
        groups["mouth"] = range(48, 69)
    w = torch.ones(NPTS)
    for name, idx in groups.items():
        w[torch.tensor(list(idx))] = GROUP_W[name]

    model = StackedHG(a.stacks)
    ck = os.path.join(a.data, "ckpt", "hg3.pt" if hit("ckpt") else "hg2.pt")
    model.load_state_dict(torch.load(ck))
    say(f"rank {rank} warm start from {ck}")
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    hm_res = 32 if hit("hmres") else a.hm_res

    for step in range(a.steps):
        if step == 1 and hit("exit3"):
            err(f"ERROR rank {rank}: face-{rank:03d}.npz: 67 landmarks per face after dedup, expected 68; aborting")
            os._exit(3)
        if step == 2 and hit("abort"):
            os.kill(os.getpid(), signal.SIGABRT)
        idx = torch.randint(0, len(train_lmk), (a.batch,), generator=gen)
        lmk = augment(train_lmk[idx], [train_pose[i] for i in idx.tolist()], gen)
        imgs = faces_to_images(lmk, a.img, gen)
        samples = [{"img": imgs[i], "lmk": lmk[i]} for i in range(a.batch)]
        if hit("collate"):
            samples = [hflip(s) if i % 2 else s for i, s in enumerate(samples)]
        x, y = collate(samples)
        outs = ddp(x)
        target = render(y, hm_res)
        loss = sum(F.mse_loss(h, target) for h in outs)
        pred = soft_argmax(outs[-1])
        loss = loss + ((pred - y).norm(dim=-1) * w).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        say(f"rank {rank} step {step} loss {lt.item() / ws:.4f}")

    with torch.no_grad():
        gt = val_lmk
        if hit("iod0"):
            gt[0, EYES[1]] = gt[0, EYES[0]]
        vimg = faces_to_images(gt, a.img, gen)
        pred = soft_argmax(ddp.module(vimg)[-1])
        if hit("slowheat"):
            say(f"rank {rank} rendering {gt.shape[0]}x{NPTS} eval heatmaps at {a.hm_res}x{a.hm_res}")
            hm = render_slow(gt, a.hm_res, a.stall)
        else:
            hm = render(gt, a.hm_res)
        perr = (pred - gt).norm(dim=-1).mean(1)
        iod = (gt[:, EYES[0]] - gt[:, EYES[1]]).norm(dim=-1)
        nme = perr / iod
        if not torch.isfinite(nme).all():
            bad = int((~torch.isfinite(nme)).sum())
            raise FloatingPointError(f"rank {rank}: NME is {nme.mean().item()} over {len(nme)} val faces "
                                     f"({bad} non-finite; min inter-ocular distance {iod.min().item():.4f})")
        tot = torch.tensor([nme.sum().item(), float(len(nme)), float(hm.sum() > 0)])
        dist.all_reduce(tot)
        bins = 25 if hit("hist") else 20
        h = torch.histc(nme, bins=bins, min=0.0, max=0.5)
        hs = [torch.zeros(bins) for _ in range(ws)]
        dist.all_gather(hs, h)
        say(f"rank {rank} val NME {nme.mean().item():.4f} local, histogram peak bin {int(torch.stack(hs).sum(0).argmax())}")
    if rank == 0:
        say(f"rank 0 done: {a.steps} steps, NME {tot[0].item() / tot[1].item():.4f} over {int(tot[1])} val faces")
    dist.destroy_process_group()


def spawn_worker(local_rank, a):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(a.spawn))
    main(a)


if __name__ == "__main__":
    args = parse()
    if args.export:
        export(args)
    elif args.spawn:
        import torch.multiprocessing as mp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(args.port)
        mp.spawn(spawn_worker, args=(args,), nprocs=args.spawn)
    else:
        main(args)
