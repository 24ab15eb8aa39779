"""A three-hundred-and-sixtieth hand-run batch: BIRD SPECIES RECOGNITION FROM SONG RECORDINGS (Lightning).

Synthetic bird-song clips as power mel spectrograms (16 mel bins x 40 frames) with a species name per clip,
looked up in an 8-entry species table.  Every rank reads its clips from /tmp/fault360_work/songs/songs_R.pt
(Lightning's DataLoader hook, no distributed sampler: each rank has its own file), takes the log of the mel
energies and trains a small 1-D CNN (two Conv1d layers over time, average pool, linear head) with
cross-entropy.  The Trainer (or, with --fabric 1, Lightning Fabric and a plain loop) runs DDP over gloo with
the process-group timeout from --pg-timeout.  Species metadata comes from ckpt/species_meta.pt; the loss and
accuracy are reduced through the strategy every step; at the end the per-species prediction counts are
all_gathered and rank 0 saves export/birdnet.ckpt (trainer.save_checkpoint / fabric.save).
Options: --fault NAME --rank R (-1 all), --steps, --pg-timeout, --prepare, --devices W, --fabric 1.

Faults:
  species    - rank N's clip list holds "Turdus pilaris", missing from the species table (KeyError, first step)
  nosongs    - rank N reads its clips from songs/val/, which does not exist (FileNotFoundError, start-up)
  ckptwide   - rank N resumes from ckpt/birdnet_wide.ckpt, saved with 48 channels (size mismatch, start-up)
  metapickle - rank N reads ckpt/species_meta_v1.pt, pickled with a SpeciesMeta class (weights_only refusal)
  countgather- rank N all_gathers 9 prediction counts (an extra "noise" class) at the end (gloo size error)
  slowflux   - rank N computes spectral flux for every clip in pure Python before step 2 (timeout / hang)
  silence    - rank N's clip 30 is digital silence: log(0) = -inf, NaN loss, the program's check (step 4)
  sigsegv    - rank N sends itself SIGSEGV after step 2 (on_train_batch_end hook)
  exit4      - rank N prints its own error line about the sample rate and calls sys.exit(4) (setup)
  melwidth   - every rank: the filterbank gives 20 mel bins, the first conv expects 16 (shape error)
  labelidx   - rank N maps clip 17 to class index 8 ("unidentified"), out of range for 8 classes (step 3)
  none       - control, clean run

What happened (filled in after the runs):
  species    - KeyError: 'Turdus pilaris' at the first batch; peers Connection closed (np4 r2 torchrun, np3 r0 fabric)
  nosongs    - FileNotFoundError songs/val/songs_N.pt in setup; peers closed in barrier("post_setup") (np3 r1 own, np5 r3 tee)
  ckptwide   - Trainer ckpt_path: the file's keys lack the 'net.' prefix, so Missing/Unexpected key(s) (np3 r2 loglevel);
               fabric.load: the intended size mismatch [48, 16, 5] vs [32, 16, 5] (np4 r1 fabric)
  metapickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SpeciesMeta' (np3 r1 torchrun)
  countgather- 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' after 6 steps on
               rank N; peers closed (np3 r2 fabric, np5 r0 bashloop)
  slowflux   - 12 s: ranks 0/2 'Timed out waiting 12000ms', rank 1's SIGTERM handler broadcast closed, Root Cause rank 2
               (np3 r1 torchrun); 300 s: silent after the flux line, killed at 60 s, exit 124 (np4 r2 bashloop)
  silence    - 'rank N step 4: non-finite loss nan (8 non-finite logits)', FloatingPointError (np3 r1 own, np6 r4 loglevel)
  sigsegv    - no traceback after step 2; peers reset/closed; Root Cause exitcode -11 SIGSEGV (np4 r3 tee, np3 r0 fabric)
  exit4      - rank N's ERROR line, exit 4, no traceback; Root Cause exitcode 4 (np3 r2 tee); loop exit 4 (np6 r0 bashloop)
  melwidth   - every rank: 'expected input[8, 20, 40] to have 16 channels, but got 20 channels instead' (np5 loglevel)
  labelidx   - 'IndexError: Target 8 is out of bounds.' at step 3 on rank 2; peers closed (np3 r2 fabric)
  none       - clean: 6 steps on 3 ranks, counts gathered, rank 0 saved export/birdnet.ckpt, exit 0 (np3 bashloop)
"""
import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning
import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault360_work"
SPECIES = ["Turdus merula", "Erithacus rubecula", "Parus major", "Fringilla coelebs",
           "Sylvia atricapilla", "Phylloscopus collybita", "Troglodytes troglodytes", "Cyanistes caeruleus"]
SPECIES_IDX = {s: i for i, s in enumerate(SPECIES)}
NMEL, NFRAMES, NCLIPS, BATCH = 16, 40, 64, 8


@dataclass
class SpeciesMeta:
    names: list
    sample_rate: int


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    return p.parse_args()


class BirdNet(nn.Module):
    def __init__(self, ch=32):
        super().__init__()
        self.conv1 = nn.Conv1d(NMEL, ch, 5, padding=2)
        self.conv2 = nn.Conv1d(ch, ch, 3, padding=1)
        self.head = nn.Linear(ch, len(SPECIES))

    def forward(self, mel):
        x = torch.log(mel)                      # log-mel energies
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=2))


def prepare():
    os.makedirs(f"{WORK}/songs", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(100 + r)
        labels = torch.randint(0, len(SPECIES), (NCLIPS,), generator=g)
        base = torch.rand(NCLIPS, NMEL, NFRAMES, generator=g) + 0.05
        # each species sings louder in its own band of mel bins
        for i, l in enumerate(labels.tolist()):
            base[i, 2 * l:2 * l + 2] += 2.0
        torch.save({"mels": base, "species": [SPECIES[l] for l in labels.tolist()], "sample_rate": 44100},
                   f"{WORK}/songs/songs_{r}.pt")
    wide = BirdNet(48).state_dict()
    torch.save({"state_dict": wide, "model": wide, "epoch": 0, "global_step": 0,
                "pytorch-lightning_version": lightning.__version__}, f"{WORK}/ckpt/birdnet_wide.ckpt")
    torch.save({"names": SPECIES, "sample_rate": 44100}, f"{WORK}/ckpt/species_meta.pt")
    torch.save(SpeciesMeta(SPECIES, 44100), f"{WORK}/ckpt/species_meta_v1.pt")
    print("prepared", WORK)


class SongClips(Dataset):
    def __init__(self, blob, fault, faulty):
        self.mels, self.species, self.fault, self.faulty = blob["mels"], list(blob["species"]), fault, faulty
        if faulty and fault == "species":
            self.species[5] = "Turdus pilaris"           # fieldfare: not in the table
        if faulty and fault == "silence":
            self.mels = self.mels.clone()
            self.mels[30] = 0.0                          # a dropped-out recording
        if fault == "melwidth":                          # filterbank re-computed with 20 bands
            self.mels = F.interpolate(self.mels.transpose(1, 2), size=20, mode="linear").transpose(1, 2)

    def __len__(self):
        return len(self.species)

    def __getitem__(self, i):
        if self.faulty and self.fault == "labelidx" and i == 17:
            return self.mels[i], torch.tensor(len(SPECIES))    # "unidentified" -> class 8
        return self.mels[i], torch.tensor(SPECIES_IDX[self.species[i]])


def load_clips(rank, fault, faulty):
    sub = "songs/val" if (faulty and fault == "nosongs") else "songs"
    blob = torch.load(f"{WORK}/{sub}/songs_{rank}.pt")
    if faulty and fault == "exit4":
        blob["sample_rate"] = 22050
    meta_file = "species_meta_v1.pt" if (faulty and fault == "metapickle") else "species_meta.pt"
    meta = torch.load(f"{WORK}/ckpt/{meta_file}", weights_only=True)
    if blob["sample_rate"] != meta["sample_rate"]:
        print(f"ERROR rank {rank}: songs_{rank}.pt was resampled to {blob['sample_rate']} Hz but the species "
              f"model expects {meta['sample_rate']} Hz; refusing to train", flush=True)
        sys.exit(4)
    return SongClips(blob, fault, faulty)


def spectral_flux_python(ds, budget):
    """Pure-Python spectral flux over every clip (the slow path)."""
    t0, total = time.time(), 0.0
    while time.time() - t0 < budget:
        for i in range(len(ds)):
            m = ds.mels[i].tolist()
            for f in range(1, NFRAMES):
                total += sum(max(0.0, m[b][f] - m[b][f - 1]) for b in range(NMEL))
            time.sleep(0.05)
            if time.time() - t0 >= budget:
                break
    return total


def check_finite(rank, step, loss, logits):
    if not torch.isfinite(loss):
        bad = (~torch.isfinite(logits)).sum().item()
        print(f"rank {rank} step {step}: non-finite loss {loss.item()} ({bad} non-finite logits)", flush=True)
        raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")


def pred_counts(fault, faulty, preds):
    n = len(SPECIES) + 1 if (faulty and fault == "countgather") else len(SPECIES)   # + "noise"
    return torch.bincount(preds, minlength=n).float()


class BirdModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = BirdNet()
        self.preds = []

    def faulty(self):
        return self.args.rank in (-1, self.global_rank)

    def setup(self, stage):
        self.clips = load_clips(self.global_rank, self.args.fault, self.faulty())

    def train_dataloader(self):
        return DataLoader(self.clips, batch_size=BATCH, shuffle=False)

    def on_train_batch_start(self, batch, batch_idx):
        if self.args.fault == "slowflux" and self.faulty() and batch_idx == 1:
            print(f"rank {self.global_rank}: computing spectral flux for {len(self.clips)} clips", flush=True)
            spectral_flux_python(self.clips, 3 * self.args.pg_timeout)

    def training_step(self, batch, batch_idx):
        mel, y = batch
        logits = self.net(mel)
        loss = F.cross_entropy(logits, y)
        check_finite(self.global_rank, batch_idx + 1, loss, logits)
        acc = (logits.argmax(1) == y).float().mean()
        self.preds.append(logits.argmax(1).detach())
        mloss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        macc = self.trainer.strategy.reduce(acc, reduce_op="mean")
        print(f"rank {self.global_rank} step {batch_idx + 1} loss {mloss.item():.4f} acc {macc.item():.3f}",
              flush=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.args.fault == "sigsegv" and self.faulty() and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGSEGV)

    def on_train_end(self):
        counts = pred_counts(self.args.fault, self.faulty(), torch.cat(self.preds))
        out = [torch.zeros(len(SPECIES)) for _ in range(self.trainer.world_size)]
        dist.all_gather(out, counts)
        if self.global_rank == 0:
            print("predicted per species:", torch.stack(out).sum(0).long().tolist(), flush=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run_trainer(args):
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0)
    model = BirdModule(args)
    ckpt = None
    if args.fault == "ckptwide":
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
        if args.rank in (-1, rank):
            ckpt = f"{WORK}/ckpt/birdnet_wide.ckpt"
    trainer.fit(model, ckpt_path=ckpt)
    trainer.save_checkpoint(f"{WORK}/export/birdnet.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/birdnet.ckpt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=FabricDDP(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    faulty = args.rank in (-1, rank)
    clips = load_clips(rank, args.fault, faulty)
    net = BirdNet()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    if args.fault == "ckptwide" and faulty:
        fabric.load(f"{WORK}/ckpt/birdnet_wide.ckpt", {"model": net})
    loader = fabric.setup_dataloaders(DataLoader(clips, batch_size=BATCH), use_distributed_sampler=False)
    preds = []
    for step, (mel, y) in enumerate(loader, start=1):
        if step > args.steps:
            break
        if args.fault == "slowflux" and faulty and step == 2:
            print(f"rank {rank}: computing spectral flux for {len(clips)} clips", flush=True)
            spectral_flux_python(clips, 3 * args.pg_timeout)
        logits = net(mel)
        loss = F.cross_entropy(logits, y)
        check_finite(rank, step, loss, logits)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        acc = (logits.argmax(1) == y).float().mean()
        preds.append(logits.argmax(1).detach())
        mloss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        macc = fabric.all_reduce(acc, reduce_op="mean")
        print(f"rank {rank} step {step} loss {mloss.item():.4f} acc {macc.item():.3f}", flush=True)
        if args.fault == "sigsegv" and faulty and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    counts = pred_counts(args.fault, faulty, torch.cat(preds))
    out = [torch.zeros(len(SPECIES)) for _ in range(fabric.world_size)]
    dist.all_gather(out, counts)
    if rank == 0:
        print("predicted per species:", torch.stack(out).sum(0).long().tolist(), flush=True)
    fabric.save(f"{WORK}/export/birdnet.ckpt", {"model": net})
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/birdnet.ckpt", flush=True)


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(0)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
