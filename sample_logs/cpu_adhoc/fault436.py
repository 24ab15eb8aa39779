"""A four-hundred-and-thirty-sixth hand-run batch: EXOPLANET TRANSIT DETECTION IN LIGHT CURVES (Lightning).

Synthetic photometry: every rank reads 64 light curves (200 cadences of normalised flux, some with a box-shaped
transit dip) from /tmp/fault436_work/curves/curves_R.pt, looks each host star up in a stellar catalogue
(catalogue.json, star id -> radius in solar radii), converts flux to relative magnitudes and trains TransitNet
(two Conv1d blocks, a linear head that also sees the stellar radius) on a BCE loss (transit / no transit).
The model is initialised from ckpt/transitnet_k5.pt.  Each step the loss is all_gathered (self.all_gather or
fabric.all_gather) and the ranks print `rank R step S loss L acc A`; at step 2 the ranks all_gather a
12-bin phase-folded depth histogram.  At the end rank 0 saves export/transitnet.ckpt (trainer.save_checkpoint
or fabric.save).  Trainer(strategy=DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout)) by
default; --fabric 1 runs the same work with lightning.fabric.Fabric and a hand-written loop.
Launch: `python fault436.py --devices W` (Lightning's own launcher), torchrun, or one python per rank with
MASTER_ADDR/MASTER_PORT/NODE_RANK/LOCAL_RANK/WORLD_SIZE set.

Faults (--fault NAME --rank R, R = -1 for every rank):
  badflux     - rank R's curve 20 has a negative flux sample; the Dataset's magnitude conversion raises
                ValueError when the DataLoader reaches it (third batch)
  unknownstar - rank R's curves include host star 'TIC-000000', not in the catalogue (KeyError in setup())
  nocurves    - rank R reads curves/sector99/curves_R.pt, which does not exist (FileNotFoundError in setup())
  ckptsize    - rank R initialises from ckpt/transitnet_k7.pt, saved with kernel size 7 (size mismatch)
  ckptpickle  - rank R loads ckpt/transitnet_full.pt, which pickles a SectorMeta object (weights_only refusal)
  foldgather  - rank R all_gathers a 13-bin phase-folded histogram instead of 12 at step 2
  bls         - rank R runs a pure-Python box-least-squares period search before the step-2 all_gather
  nanflux     - rank R's curve 36 has a NaN data gap; the training_step's own check raises FloatingPointError
  sigsegv     - rank R sends itself SIGSEGV after step 2
  exit4       - rank R prints its own error about a saturated aperture in on_train_start and calls sys.exit(4)
  cadence     - every rank resamples its curves to 240 cadences; the head expects 200 (shape error, first step)
  none        - control, clean run

What happened (filled in after the runs):
  badflux     - 'ValueError: curve TIC-...: flux -0.0031 <= 0 at cadence 117' after step 2; peers Connection closed (np4 r2 torchrun, np3 r0 fabric)
  unknownstar - KeyError: 'TIC-000000' in setup(); peers closed (np3 r1 tee); np5 r3 plown never got there: rank 0's TCPStore
                'Timed out after 46 seconds waiting for clients. 1/5 clients joined.' on the loaded machine (relabelled rendezvous)
  nocurves    - FileNotFoundError for curves/sector99/curves_1.pt in setup(); peers closed in the barrier (np4 r1 loglevel)
  ckptsize    - load_state_dict size mismatch c1/c2 weight [.., 7] vs [.., 5] at start-up (np4 r0 fabric, np3 r2 plown)
  ckptpickle  - UnpicklingError 'Weights only load failed' ... 'Unsupported global: GLOBAL __main__.SectorMeta' (np4 r3 bashloop)
  foldgather  - a neighbour aborts: gloo::EnforceNotMet 'op.preamble.length <= op.nbytes. 26 vs 24'; Root Cause names the
                neighbour (SIGABRT), the odd rank prints nothing (np3 r1 tee, np5 r2 fabric)
  bls         - 12 s: ranks 0/1 'Timed out waiting 12000ms' in the fold all_gather, Root Cause rank 1 (np3 r2 torchrun);
                300 s: silent after 'running box-least-squares', killed at 60 s, exit 124 (np4 r3 bashloop; the first try,
                np4 r1, printed nothing at all in 60 s on the loaded machine and was dropped)
  nanflux     - 'FloatingPointError: rank N: 15 non-finite magnitudes in batch 5' after 4 clean steps (np6 r4 loglevel, np3 r1 plown)
  sigsegv     - no output from rank N after step 2; Root Cause exitcode -11 SIGSEGV (np4 r2 tee, np3 r0 fabric)
  exit4       - rank N's ERROR line; Root Cause rank 1 exitcode 4 (np5 r1 loglevel); np3 r2 bashloop: the exit ended in
                'terminate called without an active exception', bash 'Aborted', loop exit 134
  cadence     - every rank 'mat1 and mat2 shapes cannot be multiplied (8x193 and 161x32)' in the first step (np4 torchrun)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/transitnet.ckpt, exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault436_work"
NCAD = 200
NBINS = 12


@dataclasses.dataclass
class SectorMeta:
    sector: int
    camera: int
    ccd: int


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    return p.parse_args()


def faulty(args, rank):
    return args.fault != "none" and (args.rank == -1 or args.rank == rank)


class TransitNet(nn.Module):
    def __init__(self, k=5):
        super().__init__()
        self.c1 = nn.Conv1d(1, 8, k, padding=k // 2)
        self.c2 = nn.Conv1d(8, 16, k, padding=k // 2)
        self.h1 = nn.Linear(16 * (NCAD // 20) + 1, 32)
        self.h2 = nn.Linear(32, 1)

    def forward(self, mag, radius):
        z = F.max_pool1d(F.relu(self.c1(mag.unsqueeze(1))), 4)
        z = F.max_pool1d(F.relu(self.c2(z)), 5)
        z = torch.cat([z.flatten(1), radius.unsqueeze(1)], 1)
        return self.h2(F.relu(self.h1(z))).squeeze(1)


def prepare():
    g = torch.Generator().manual_seed(436)
    os.makedirs(f"{WORK}/curves", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    catalogue = {}
    for r in range(8):
        flux = 1.0 + 0.002 * torch.randn(64, NCAD, generator=g)
        label = (torch.rand(64, generator=g) < 0.5).float()
        stars = []
        for i in range(64):
            sid = f"TIC-{100000 + 97 * (r * 64 + i)}"
            stars.append(sid)
            catalogue[sid] = round(0.5 + 1.5 * torch.rand(1, generator=g).item(), 3)
            if label[i] > 0:
                t0 = int(torch.randint(10, NCAD - 20, (1,), generator=g))
                flux[i, t0:t0 + 8] -= 0.01
        torch.save({"flux": flux, "label": label, "star": stars, "sector": 14}, f"{WORK}/curves/curves_{r}.pt")
    with open(f"{WORK}/catalogue.json", "w") as f:
        json.dump(catalogue, f)
    torch.manual_seed(0)
    torch.save(TransitNet(5).state_dict(), f"{WORK}/ckpt/transitnet_k5.pt")
    torch.save(TransitNet(7).state_dict(), f"{WORK}/ckpt/transitnet_k7.pt")
    torch.save({"state_dict": TransitNet(5).state_dict(), "meta": SectorMeta(14, 2, 3)},
               f"{WORK}/ckpt/transitnet_full.pt")
    print(f"prepared {WORK}: 8 ranks x 64 curves, {len(catalogue)} stars, 3 checkpoints")


class CurveSet(Dataset):
    def __init__(self, flux, radius, label, stars):
        self.flux, self.radius, self.label, self.stars = flux, radius, label, stars

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        f = self.flux[i]
        bad = (f <= 0).nonzero()
        if len(bad):
            j = int(bad[0])
            raise ValueError(f"curve {self.stars[i]}: flux {float(f[j]):.4f} <= 0 at cadence {j}; "
                             "cannot convert to magnitudes")
        mag = -2.5 * torch.log10(f / f.nanmedian())
        return mag, self.radius[i], self.label[i]


def load_curves(args, rank):
    path = f"{WORK}/curves/curves_{rank}.pt"
    if faulty(args, rank) and args.fault == "nocurves":
        path = f"{WORK}/curves/sector99/curves_{rank}.pt"
    d = torch.load(path)
    flux, stars = d["flux"], list(d["star"])
    if faulty(args, rank) and args.fault == "unknownstar":
        stars[5] = "TIC-000000"
    if faulty(args, rank) and args.fault == "badflux":
        flux[20, 117] = -0.0031
    if faulty(args, rank) and args.fault == "nanflux":
        flux[36, 60:75] = float("nan")
    if args.fault == "cadence":
        flux = F.interpolate(flux.unsqueeze(1), size=240, mode="linear", align_corners=True).squeeze(1)
    with open(f"{WORK}/catalogue.json") as f:
        catalogue = json.load(f)
    radius = torch.tensor([catalogue[s] for s in stars])
    print(f"rank {rank}: {len(stars)} curves of {flux.shape[1]} cadences, sector {d['sector']}", flush=True)
    return CurveSet(flux, radius, d["label"], stars)


def build_model(args, rank):
    model = TransitNet(5)
    path = f"{WORK}/ckpt/transitnet_k5.pt"
    if faulty(args, rank) and args.fault == "ckptsize":
        path = f"{WORK}/ckpt/transitnet_k7.pt"
    if faulty(args, rank) and args.fault == "ckptpickle":
        path = f"{WORK}/ckpt/transitnet_full.pt"
    state = torch.load(path, map_location="cpu")
    if "state_dict" in state:
        state = state["state_dict"]
    model.load_state_dict(state)
    return model


def box_least_squares(mag):
    # deliberately slow, pure Python: every period, every epoch, every cadence
    best = (0.0, None)
    vals = mag.tolist()
    n = len(vals)
    period = 2.0
    while period < 1e9:
        for t0 in range(int(period)):
            s = 0.0
            for j in range(t0, n, max(1, int(period))):
                s += vals[j]
            if s > best[0]:
                best = (s, (period, t0))
        period += 0.001
    return best


def fold_hist(mag, nbins):
    phase = torch.arange(mag.shape[1]) % nbins
    return torch.zeros(nbins).index_add_(0, phase, mag.mean(0))


def step_faults(args, rank, step, mag):
    if faulty(args, rank) and args.fault == "nanflux":
        n = int((~torch.isfinite(mag)).sum())
        if n:
            raise FloatingPointError(f"rank {rank}: {n} non-finite magnitudes in batch {step} "
                                     "(data gap in the light curve)")
    if step == 2 and faulty(args, rank) and args.fault == "bls":
        print(f"rank {rank}: running box-least-squares period search before the fold", flush=True)
        box_least_squares(mag[0])


def fold_and_report(args, rank, step, mag, gather):
    if step == 2:
        nb = NBINS + 1 if faulty(args, rank) and args.fault == "foldgather" else NBINS
        h = gather(fold_hist(mag, nb))
        print(f"rank {rank}: folded depth histogram gathered {tuple(h.shape)}", flush=True)


def after_step(args, rank, step):
    if step == 2 and faulty(args, rank) and args.fault == "sigsegv":
        os.kill(os.getpid(), signal.SIGSEGV)


def saturated(args, rank):
    if faulty(args, rank) and args.fault == "exit4":
        print(f"ERROR rank {rank}: aperture saturated on TIC-{100000 + 97 * rank * 64} (peak 1.9e5 e-/s > "
              "full well); refusing to train on clipped photometry", flush=True)
        sys.exit(4)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class TransitModule(pl.LightningModule):
        def setup(self, stage):
            rank = self.global_rank
            self.ds = load_curves(args, rank)
            self.net = build_model(args, rank)

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=args.batch, shuffle=False)

        def on_train_start(self):
            saturated(args, self.global_rank)

        def training_step(self, batch, idx):
            mag, radius, label = batch
            step, rank = idx + 1, self.global_rank
            step_faults(args, rank, step, mag)
            logits = self.net(mag, radius)
            loss = F.binary_cross_entropy_with_logits(logits, label)
            acc = ((logits > 0).float() == label).float().mean()
            fold_and_report(args, rank, step, mag, self.all_gather)
            g = self.all_gather(torch.stack([loss.detach(), acc]))
            print(f"rank {rank} step {step} loss {g[:, 0].mean():.4f} acc {g[:, 1].mean():.3f}", flush=True)
            after_step(args, rank, step)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
                         strategy=DDPStrategy(process_group_backend="gloo",
                                              timeout=timedelta(seconds=args.pg_timeout)),
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(TransitModule())
    trainer.save_checkpoint(f"{WORK}/export/transitnet.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/transitnet.ckpt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    ds = load_curves(args, rank)
    net = build_model(args, rank)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=args.batch, shuffle=False),
                                      use_distributed_sampler=False)
    saturated(args, rank)
    for idx, (mag, radius, label) in enumerate(loader):
        step = idx + 1
        if step > args.steps:
            break
        step_faults(args, rank, step, mag)
        logits = net(mag, radius)
        loss = F.binary_cross_entropy_with_logits(logits, label)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        acc = ((logits > 0).float() == label).float().mean()
        fold_and_report(args, rank, step, mag, fabric.all_gather)
        g = fabric.all_gather(torch.stack([loss.detach(), acc]))
        print(f"rank {rank} step {step} loss {g[:, 0].mean():.4f} acc {g[:, 1].mean():.3f}", flush=True)
        after_step(args, rank, step)
    fabric.save(f"{WORK}/export/transitnet_fabric.ckpt", {"model": net, "optimizer": opt})
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/transitnet_fabric.ckpt", flush=True)


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
