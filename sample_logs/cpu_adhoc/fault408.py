"""A four-hundred-and-eighth hand-run batch: HUMAN KEYPOINT DETECTION (heatmap regression) WITH LIGHTNING.

Synthetic person crops: 32x32 grey images with 8 joints (a small COCO-like skeleton).  Every rank reads its
annotations from /tmp/fault408_work/anno/train/anno_R.json (joint name -> [x, y, visibility]) and its images
from images/images_R.pt; the dataset renders a Gaussian heatmap per joint at half resolution (16x16) and a
visibility vector.  The model is a tiny conv net with a heatmap head and a visibility head, initialised from
ckpt/kp8.ckpt.  It is trained with Lightning (Trainer + DDPStrategy over gloo, timeout from --pg-timeout), or
with Fabric and a hand-written loop (--fabric 1).  Each step the loss and the per-joint PCK vector are
all_gathered through the framework (self.all_gather / fabric.all_gather) before the progress line is printed;
at the end the checkpoint is written through the framework (trainer.save_checkpoint / fabric.save).

Faults (--fault NAME --rank R, R=-1 all ranks):
  badjoint    - rank R's annotation file names a joint "left_tail", missing from the joint table (KeyError)
  kpoob       - rank R's sample 9 has a wrist at x=37 on a 32-wide crop: heatmap peak index out of range (IndexError)
  noanno      - rank R reads its annotations from anno/val/ which does not exist (FileNotFoundError, in setup)
  ckptjoints  - rank R initialises from ckpt/kp17.ckpt, saved with a 17-joint head (size mismatch)
  weightsonly - rank R initialises from ckpt/kp8_meta.ckpt, which pickles a JointSpec object (weights_only refusal)
  gatherwidth - rank R all_gathers a 9-wide PCK vector (adds "head top") from step 2 on; the others send 8
  slowaug     - rank R runs a pure-Python elastic deformation of every pixel at step 2 (minutes)
  nanheat     - rank R's samples from index 8 on have sigma 0: heatmaps NaN, the program's check raises
  segv        - rank R sends itself SIGSEGV in on_train_batch_end after step 2
  exit4       - rank R prints its own ERROR line about crowd masks in on_train_start and calls sys.exit(4)
  headshape   - every rank: the visibility head is fed pooled features plus the 4-value box (20 wide, expects 16)
  none        - control, clean run

What happened (filled in after the runs):
  badjoint    - KeyError: 'left_tail' in __getitem__ on the first batch; peers Connection closed (np4 r2 pltorchrun; np5 r0 plfabric, peers in the backward all-reduce)
  kpoob       - IndexError 'index 18 is out of bounds for dimension 1 with size 16' loading the step-2 batch after two good steps (np3 r1 pltee, np4 r3 plown)
  noanno      - FileNotFoundError anno/val/anno_R.json in setup; peers Connection closed in the post_setup barrier (np4 r3 plloglevel, np3 r0 plbashloop)
  ckptjoints  - load_state_dict size mismatch heat/vis [17,...] vs [8,...]; peers closed in post_setup barrier / DDP set-up (np3 r2 plown, np5 r4 plfabric)
  weightsonly - UnpicklingError 'Weights only load failed' (__main__.JointSpec not an allowed global) in setup (np4 r1 pltorchrun)
  gatherwidth - a receiving rank aborts: gloo::EnforceNotMet '18 vs 16. Received data size doesn't match', SIGABRT (np3 r1 plloglevel: rank 2 aborts; np4 r3 pltee: rank 0 aborts)
  slowaug     - PG 12 s: peers 'Timed out waiting 12000ms' in all_gather, rank 2 left running, timeout 100 s exit 124 (np3 r2 plbashloop); PG 300 s: silent after step 1, killed at 60 s, exit 137 (np4 r1 pltorchrun)
  nanheat     - the program's check: 'loss is nan (8160 non-finite heatmap values)', FloatingPointError at step 2 (np4 r0 plfabric, np3 r2 plown)
  segv        - no output from rank R after step 2; Root Cause exitcode -11 (np5 r2 pltee); bash 'Segmentation fault', exit 139 (np3 r1 plbashloop)
  exit4       - rank 2's ERROR line about the crowd mask, exit 4; Root Cause rank 2 exitcode 4 (np4 r2 plloglevel)
  headshape   - every rank: 'mat1 and mat2 shapes cannot be multiplied (4x20 and 16x8)' in the first forward; Root Cause rank 2 (np3 plfabric)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/kpdt.ckpt, exit 0 (np3 plbashloop)
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
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault408_work"
JOINTS = {"nose": 0, "left_shoulder": 1, "right_shoulder": 2, "left_elbow": 3,
          "right_elbow": 4, "left_wrist": 5, "right_wrist": 6, "pelvis": 7}
NJ = len(JOINTS)
IMG = 32
HM = 16
BATCH = 4
NSAMPLES = 32


class JointSpec:
    def __init__(self, names):
        self.names = list(names)


def prepare():
    g = torch.Generator().manual_seed(408)
    for sub in ("anno/train", "images", "ckpt", "export"):
        os.makedirs(os.path.join(WORK, sub), exist_ok=True)
    for r in range(8):
        imgs = torch.rand(NSAMPLES, 1, IMG, IMG, generator=g)
        torch.save(imgs, os.path.join(WORK, "images", f"images_{r}.pt"))
        recs = []
        for i in range(NSAMPLES):
            pts = torch.randint(2, IMG - 2, (NJ, 2), generator=g).tolist()
            joints = {name: [pts[k][0], pts[k][1], 2] for name, k in JOINTS.items()}
            recs.append({"image": i, "sigma": 1.5, "box": [0, 0, IMG, IMG], "joints": joints})
        with open(os.path.join(WORK, "anno/train", f"anno_{r}.json"), "w") as f:
            json.dump(recs, f)
        bad = json.loads(json.dumps(recs))
        bad[1]["joints"]["left_tail"] = [10, 12, 2]
        with open(os.path.join(WORK, "anno/train", f"anno_{r}_badjoint.json"), "w") as f:
            json.dump(bad, f)
        oob = json.loads(json.dumps(recs))
        oob[9]["joints"]["left_wrist"] = [37, 14, 2]
        with open(os.path.join(WORK, "anno/train", f"anno_{r}_kpoob.json"), "w") as f:
            json.dump(oob, f)
        nan = json.loads(json.dumps(recs))
        for rec in nan[8:]:
            rec["sigma"] = 0.0
        with open(os.path.join(WORK, "anno/train", f"anno_{r}_nanheat.json"), "w") as f:
            json.dump(nan, f)
    torch.manual_seed(0)
    torch.save({"state_dict": KeypointNet(NJ).state_dict(), "joints": list(JOINTS)},
               os.path.join(WORK, "ckpt", "kp8.ckpt"))
    torch.save({"state_dict": KeypointNet(17).state_dict(), "joints": [f"j{i}" for i in range(17)]},
               os.path.join(WORK, "ckpt", "kp17.ckpt"))
    torch.save({"state_dict": KeypointNet(NJ).state_dict(), "spec": JointSpec(JOINTS)},
               os.path.join(WORK, "ckpt", "kp8_meta.ckpt"))
    print("prepared", WORK)


class KeypointSet(Dataset):
    def __init__(self, rank, fault, frank):
        hit = fault != "none" and frank in (-1, rank)
        split = "val" if (hit and fault == "noanno") else "train"
        suffix = f"_{fault}" if (hit and fault in ("badjoint", "kpoob", "nanheat")) else ""
        path = os.path.join(WORK, "anno", split, f"anno_{rank}{suffix}.json")
        with open(path) as f:
            self.recs = json.load(f)
        self.imgs = torch.load(os.path.join(WORK, "images", f"images_{rank % 8}.pt"))

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        rec = self.recs[i]
        heat = torch.zeros(NJ, HM, HM)
        vis = torch.zeros(NJ)
        ys, xs = torch.meshgrid(torch.arange(HM).float(), torch.arange(HM).float(), indexing="ij")
        sigma = rec["sigma"]
        for name, (x, y, v) in rec["joints"].items():
            k = JOINTS[name]
            hx, hy = x // 2, y // 2
            d2 = (xs - hx) ** 2 + (ys - hy) ** 2
            heat[k] = torch.exp(-d2 / (2 * sigma * sigma)) if sigma > 0 else d2 * float("nan")
            heat[k][hy, hx] = 1.0
            vis[k] = 1.0 if v > 0 else 0.0
        box = torch.tensor(rec["box"], dtype=torch.float32) / IMG
        return self.imgs[rec["image"]], heat, vis, box


class KeypointNet(nn.Module):
    def __init__(self, nj=NJ):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.heat = nn.Conv2d(16, nj, 1)
        self.vis = nn.Linear(16, nj)

    def forward(self, x, box=None):
        f = self.stem(x)
        pooled = f.mean(dim=(2, 3))
        if box is not None:
            pooled = torch.cat([pooled, box], dim=1)
        return self.heat(f), self.vis(pooled)


def pck(pred, heat):
    p = pred.flatten(2).argmax(-1)
    t = heat.flatten(2).argmax(-1)
    px, py, tx, ty = p % HM, p // HM, t % HM, t // HM
    d = ((px - tx) ** 2 + (py - ty) ** 2).float().sqrt()
    return (d <= 2.0).float().mean(0)


def slow_elastic(img, seconds):
    # pure-Python elastic deformation, pixel by pixel, pass after pass
    end = time.time() + seconds
    vals = img.flatten().tolist()
    out = 0.0
    while time.time() < end:
        for j, v in enumerate(vals):
            out += math.sin(v * j) * math.cos(j * 0.5)
    return out


def compute(model, batch, step, args, rank):
    img, heat, vis, box = batch
    if args.fault == "slowaug" and args.rank in (-1, rank) and step == 2:
        slow_elastic(img[0], 400)
    pred, vlog = model(img, box if args.fault == "headshape" else None)
    loss = F.mse_loss(pred, heat) * 100 + F.binary_cross_entropy_with_logits(vlog, vis)
    if not torch.isfinite(loss):
        bad = int((~torch.isfinite(heat)).sum())
        print(f"rank {rank} step {step}: loss is {loss.item()} ({bad} non-finite heatmap values in the batch)",
              flush=True)
        raise FloatingPointError(f"non-finite keypoint loss at step {step} on rank {rank}")
    p = pck(pred.detach(), heat)
    if args.fault == "gatherwidth" and args.rank in (-1, rank) and step >= 2:
        p = torch.cat([p, torch.tensor([0.5])])  # head top
    return loss, p


def init_weights(model, rank, args):
    name = "kp8.ckpt"
    if args.fault in ("ckptjoints", "weightsonly") and args.rank in (-1, rank):
        name = "kp17.ckpt" if args.fault == "ckptjoints" else "kp8_meta.ckpt"
    ckpt = torch.load(os.path.join(WORK, "ckpt", name), map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["state_dict"])


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class KeypointModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = KeypointNet(NJ)

        def setup(self, stage):
            self.ds = KeypointSet(self.global_rank, args.fault, args.rank)
            init_weights(self.net, self.global_rank, args)

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=BATCH, shuffle=False, num_workers=0)

        def training_step(self, batch, batch_idx):
            loss, p = compute(self.net, batch, batch_idx, args, self.global_rank)
            all_loss = self.all_gather(loss.detach())
            all_pck = self.all_gather(p)
            print(f"rank {self.global_rank} step {batch_idx} loss {all_loss.mean().item():.4f} "
                  f"pck {all_pck.mean().item():.3f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class FaultCallback(pl.Callback):
        def on_train_start(self, trainer, module):
            if args.fault == "exit4" and args.rank in (-1, trainer.global_rank):
                print(f"ERROR rank {trainer.global_rank}: crowd mask for image 12 covers 9 persons but the "
                      f"annotation lists 8; refusing to train on inconsistent crowd regions", flush=True)
                sys.exit(4)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if args.fault == "segv" and args.rank in (-1, trainer.global_rank) and batch_idx == 2:
                os.kill(os.getpid(), signal.SIGSEGV)

    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1,
                         strategy=DDPStrategy(process_group_backend="gloo",
                                              timeout=timedelta(seconds=args.pg_timeout)),
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[FaultCallback()])
    module = KeypointModule()
    trainer.fit(module)
    trainer.save_checkpoint(os.path.join(WORK, "export", "kpdt.ckpt"))
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/kpdt.ckpt after {args.steps} steps", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    if args.fault == "exit4" and args.rank in (-1, rank):
        print(f"ERROR rank {rank}: crowd mask for image 12 covers 9 persons but the annotation lists 8; "
              f"refusing to train on inconsistent crowd regions", flush=True)
        sys.exit(4)
    ds = KeypointSet(rank, args.fault, args.rank)
    model = KeypointNet(NJ)
    init_weights(model, rank, args)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    dl = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False), use_distributed_sampler=False)
    for step, batch in enumerate(dl):
        if step >= args.steps:
            break
        loss, p = compute(model, batch, step, args, rank)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        all_loss = fabric.all_gather(loss.detach())
        all_pck = fabric.all_gather(p)
        print(f"rank {rank} step {step} loss {all_loss.mean().item():.4f} pck {all_pck.mean().item():.3f}",
              flush=True)
        if args.fault == "segv" and args.rank in (-1, rank) and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    fabric.save(os.path.join(WORK, "export", "kpdt_fabric.ckpt"), {"model": model, "optimizer": opt})
    fabric.barrier()
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/kpdt_fabric.ckpt after {args.steps} steps", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--fabric", type=int, default=0)
    ap.add_argument("--prepare", action="store_true")
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(408)
    torch.set_num_threads(1)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
