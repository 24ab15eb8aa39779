"""A four-hundred-and-sixty-first hand-run batch: MOSQUITO WINGBEAT AUDIO CLASSIFICATION (Lightning).

Synthetic wingbeat recordings, already turned into log-mel features (32 mel bins x 24 frames, the wingbeat
fundamental near 400-700 Hz showing as a bright band), each labelled with a species name looked up in a
6-entry species table.  Every rank reads its clips from /tmp/fault461_work/wav/wing_R.pt through a
LightningDataModule and trains a small 1-D conv net (conv over frames, mean-pool, linear head) with
cross-entropy, under lightning.pytorch's Trainer and DDPStrategy (gloo, timeout from --pg-timeout), or with
--fabric 1 under lightning.fabric.Fabric with its own loop.  The model is initialised from ckpt/wingnet.pt.
Each step the loss and accuracy are reduced over the ranks (strategy.reduce / fabric.all_reduce) and printed
as `rank R step S loss L acc A`; rank 0 saves export/wingnet.pt at the end (strategy / fabric save).
Options: --fault NAME --rank R (-1 all), --steps, --pg-timeout, --prepare, --devices W, --fabric 1.

Faults:
  species     - rank N's clip table contains "Culex tarsalis", missing from the species table (KeyError, in the DataLoader)
  nofile      - rank N reads its clips from wav/field/wing_N.pt, which does not exist (FileNotFoundError, in setup())
  ckptsize    - rank N initialises from ckpt/wingnet_h48.pt, saved with 48 hidden channels (size mismatch)
  pickle      - rank N re-reads ckpt/wingnet_meta.pt at the end of training; it holds a RecorderMeta object (weights_only refusal)
  gathershape - rank N all_gathers its per-species counts plus an "unknown" bin (7 vs 6 entries) at step 3
  slowpeak    - rank N runs a pure-Python peak search over every clip before the step-2 reduce (peers time out / hang)
  nanfreq     - rank N normalises by a zero noise floor from step 4 on: non-finite features, the program's check
  sigkill     - rank N sends itself SIGKILL after step 2
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error line about the recorder's sample rate and calls sys.exit(4) at fit start
  melwidth    - every rank: features computed with 40 mel bins, the conv expects 32 (shape error in the first forward)
  none        - control, clean run

What happened (filled in after the runs):
  species     - KeyError: 'Culex tarsalis' in the DataLoader at step 2; peers Connection closed by peer (np4 r2 torchrun, np5 r0 bashloop)
  nofile      - FileNotFoundError for wav/field/wing_N.pt before the first step; peers Connection closed by peer (np3 r1 tee, np4 r3 fabric)
  ckptsize    - load_state_dict size mismatch [48,32,3] vs [32,32,3] etc. in setup(); peers Connection closed (np4 r1 own launcher, np3 r2 fabric)
  pickle      - after 6 clean steps, UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.RecorderMeta'; only rank N fails (np3 r1 loglevel)
  gathershape - a receiving peer aborts: gloo::EnforceNotMet 'Received data size doesn't match expected size' (SIGABRT, Root Cause names that peer) (np4 r2 torchrun, np3 r0 fabric)
  slowpeak    - 12 s: ranks 0/2 'Timed out waiting 12000ms', rank 1 kept searching, loop ended by timeout, exit 124 (np3 r1 bashloop); 300 s: silent, killed at 60 s, exit 137 (np4 r2 loglevel)
  nanfreq     - the program's check: FloatingPointError '6144 non-finite feature values' at step 4; peers closed (np5 r3 tee, np3 r1 fabric)
  sigkill     - no traceback from rank N after step 2; bash 'Killed', exit 137 (np4 r1 bashloop); Root Cause exitcode -9 SIGKILL (np3 r2 torchrun)
  sigsegv     - no traceback from rank 4 after step 3; Root Cause exitcode -11 SIGSEGV (np6 r4 loglevel)
  exit4       - rank N's ERROR line (8000 Hz) and exit 4 at fit start; peers closed in a barrier (np3 r0 own launcher exit 4, np4 r2 tee exit 1)
  melwidth    - every rank: 'expected input[8, 40, 24] to have 32 channels, but got 40 channels instead' in the first forward (np3 bashloop)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/wingnet.pt, exit 0 (np3 own launcher)
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault461_work"
SPECIES = {"Aedes aegypti": 0, "Aedes albopictus": 1, "Anopheles gambiae": 2,
           "Anopheles arabiensis": 3, "Culex pipiens": 4, "Culex quinquefasciatus": 5}
NMEL = 32
FRAMES = 24
HID = 32
NCLS = len(SPECIES)


class RecorderMeta:
    """Calibration notes for the field recorder, pickled beside a checkpoint."""
    def __init__(self, rate, gain):
        self.rate = rate
        self.gain = gain


class WingNet(nn.Module):
    def __init__(self, nmel=NMEL, hid=HID):
        super().__init__()
        self.conv1 = nn.Conv1d(nmel, hid, 3, padding=1)
        self.conv2 = nn.Conv1d(hid, hid, 3, padding=1)
        self.head = nn.Linear(hid, NCLS)

    def forward(self, x):                      # x: [B, mel, frames]
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.head(h.mean(dim=2))


def synth_clips(n, seed, nmel=NMEL):
    g = torch.Generator().manual_seed(seed)
    names = list(SPECIES)
    labels = [names[int(i)] for i in torch.randint(0, NCLS, (n,), generator=g)]
    feats = torch.randn(n, nmel, FRAMES, generator=g) * 0.3
    for i, name in enumerate(labels):          # the wingbeat band sits lower for the larger species
        band = 4 + 3 * SPECIES[name]
        feats[i, band % nmel:band % nmel + 2, :] += 2.0
    return {"feats": feats, "species": labels, "noise_floor": torch.full((n,), 0.05)}


def prepare(world=6):
    os.makedirs(f"{WORK}/wav", exist_ok=True)
    os.makedirs(f"{WORK}/wav40", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(world):
        torch.save(synth_clips(64, 100 + r), f"{WORK}/wav/wing_{r}.pt")
        torch.save(synth_clips(64, 100 + r, nmel=40), f"{WORK}/wav40/wing_{r}.pt")
    torch.manual_seed(0)
    torch.save(WingNet().state_dict(), f"{WORK}/ckpt/wingnet.pt")
    torch.save(WingNet(hid=48).state_dict(), f"{WORK}/ckpt/wingnet_h48.pt")
    torch.save({"model": WingNet().state_dict(), "meta": RecorderMeta(16000, 1.5)}, f"{WORK}/ckpt/wingnet_meta.pt")
    print(f"prepared clips for {world} ranks and 3 checkpoints under {WORK}")


class WingClips(Dataset):
    def __init__(self, path, rank, fault, bad):
        blob = torch.load(path)
        self.feats = blob["feats"]
        self.species = list(blob["species"])
        self.floor = blob["noise_floor"]
        if fault == "species" and bad:
            self.species[13] = "Culex tarsalis"   # a field label the table does not know

    def __len__(self):
        return len(self.species)

    def __getitem__(self, i):
        return self.feats[i], SPECIES[self.species[i]], self.floor[i]


class WingData(pl.LightningDataModule):
    def __init__(self, args, rank):
        super().__init__()
        self.args, self.rank = args, rank

    def setup(self, stage=None):
        self.ds = make_dataset(self.args, self.rank)

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=8, shuffle=False)


def is_bad(args, rank):
    return args.rank == -1 or args.rank == rank


def make_dataset(args, rank):
    bad = is_bad(args, rank)
    sub = "wav"
    if args.fault == "melwidth" and bad:
        sub = "wav40"
    if args.fault == "nofile" and bad:
        sub = "wav/field"
    return WingClips(f"{WORK}/{sub}/wing_{rank}.pt", rank, args.fault, bad)


def init_weights(net, args, rank):
    path = f"{WORK}/ckpt/wingnet.pt"
    if args.fault == "ckptsize" and is_bad(args, rank):
        path = f"{WORK}/ckpt/wingnet_h48.pt"
    net.load_state_dict(torch.load(path, map_location="cpu"))


def featurise(x, floor, step, args, rank):
    if args.fault == "nanfreq" and is_bad(args, rank) and step >= 4:
        floor = floor * 0.0                      # the noise-floor estimate came back as zero
    x = x / (floor.view(-1, 1, 1) * 20.0)
    if args.fault == "nanfreq" and is_bad(args, rank) and step >= 4:
        x = torch.log(x.clamp(min=0.0)) - torch.log(x.abs()).nan_to_num(0)
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise FloatingPointError(f"rank {rank} step {step}: {bad} non-finite feature values after noise-floor "
                                 f"normalisation (min floor {floor.min().item():.3f})")
    return x


def slow_peaks(ds, rank):
    print(f"rank {rank} searching wingbeat peaks clip by clip", flush=True)
    t0 = time.time()
    while time.time() - t0 < 200:
        for i in range(len(ds)):
            clip = ds.feats[i].tolist()
            peaks = [(m, f) for m, row in enumerate(clip) for f in range(1, FRAMES - 1)
                     if row[f] > row[f - 1] and row[f] > row[f + 1]]
            time.sleep(0.02)
    return peaks


def step_faults(args, rank, step, ds, gather_fn):
    bad = is_bad(args, rank)
    if args.fault == "slowpeak" and bad and step == 2:
        slow_peaks(ds, rank)
    if args.fault == "gathershape" and step == 3:
        counts = torch.bincount(torch.tensor([SPECIES[s] for s in ds.species]), minlength=NCLS).float()
        if bad:
            counts = torch.cat([counts, torch.zeros(1)])   # an "unknown" bin
        allc = gather_fn(counts)
        if rank == 0:
            print(f"rank 0 species counts gathered: {tuple(allc.shape)}", flush=True)


def after_step(args, rank, step):
    bad = is_bad(args, rank)
    if args.fault == "sigkill" and bad and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fault == "sigsegv" and bad and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)


def end_faults(args, rank):
    if args.fault == "pickle" and is_bad(args, rank):
        blob = torch.load(f"{WORK}/ckpt/wingnet_meta.pt")
        print(f"rank {rank} reference recorder rate {blob['meta'].rate}", flush=True)


def exit_fault(args, rank):
    if args.fault == "exit4" and is_bad(args, rank):
        print(f"ERROR rank {rank}: recorder calibration for wing_{rank}.pt reports a sample rate of 8000 Hz, "
              f"expected 16000 Hz; refusing to train on aliased wingbeats", flush=True)
        sys.exit(4)


class WingModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = WingNet()

    def setup(self, stage=None):
        init_weights(self.net, self.args, self.global_rank)

    def on_fit_start(self):
        exit_fault(self.args, self.global_rank)

    def training_step(self, batch, idx):
        x, y, floor = batch
        step = self.global_step + 1
        x = featurise(x, floor, step, self.args, self.global_rank)
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(1) == y).float().mean()
        step_faults(self.args, self.global_rank, step, self.trainer.datamodule.ds,
                    lambda t: self.all_gather(t))
        rl = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        ra = self.trainer.strategy.reduce(acc, reduce_op="mean")
        print(f"rank {self.global_rank} step {step} loss {rl.item():.4f} acc {ra.item():.3f}", flush=True)
        return loss

    def on_train_batch_end(self, outputs, batch, idx):
        after_step(self.args, self.global_rank, self.global_step)

    def on_train_end(self):
        end_faults(self.args, self.global_rank)
        self.trainer.strategy.save_checkpoint({"model": self.net.state_dict()}, f"{WORK}/export/wingnet.pt")
        if self.global_rank == 0:
            print(f"rank 0 done: {self.global_step} steps, saved export/wingnet.pt", flush=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run_trainer(args):
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    rank = trainer.global_rank
    trainer.fit(WingModule(args), datamodule=WingData(args, rank))


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=FabricDDP(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    ds = make_dataset(args, rank)
    net = WingNet()
    init_weights(net, args, rank)
    exit_fault(args, rank)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    model, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=8, shuffle=False), use_distributed_sampler=False)
    step = 0
    for x, y, floor in loader:
        step += 1
        x = featurise(x, floor, step, args, rank)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        step_faults(args, rank, step, ds, lambda t: fabric.all_gather(t))
        rl = fabric.all_reduce(loss.detach(), reduce_op="mean")
        ra = fabric.all_reduce(acc, reduce_op="mean")
        print(f"rank {rank} step {step} loss {rl.item():.4f} acc {ra.item():.3f}", flush=True)
        after_step(args, rank, step)
        if step >= args.steps:
            break
    end_faults(args, rank)
    fabric.save(f"{WORK}/export/wingnet.pt", {"model": model})
    if rank == 0:
        print(f"rank 0 done: {step} steps, saved export/wingnet.pt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
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
