"""A three-hundred-and-sixty-ninth hand-run batch: RETROSYNTHESIS REACTION CLASSIFICATION (Lightning).

Synthetic reactions: each product carries a 256-bit count fingerprint, the index of the reaction template that
was extracted for it (a 64-entry template library) and a reaction class name (10 named classes, looked up in a
class table).  Every rank reads its reactions from /tmp/fault369_work/data/rxn_R.pt, and a small classifier
(fingerprint MLP plus a template embedding, a linear head over the 10 classes) is trained with
lightning.pytorch's Trainer under DDPStrategy (gloo, timeout --pg-timeout) or, with --fabric 1, with
lightning.fabric.Fabric and an own loop.  The weights are initialised from ckpt/rxnc_init.ckpt (read with
Lightning's cloud_io loader), the loss and accuracy are reduced every step through the strategy, per-class
counts are all_gathered at step 2, and rank 0 saves export/rxnc.ckpt at the end.

Faults (--fault NAME --rank R, R=-1 all ranks):
  unknownclass - rank R's reaction 20 is labelled "mitsunobu", not in the class table (KeyError in the dataset, step 3)
  templateidx  - rank R's first reaction names template 71 of a 64-entry library (IndexError in the embedding, step 1)
  nodata       - rank R reads its reactions from data/valid/, which does not exist (FileNotFoundError at setup)
  ckptsize     - rank R initialises from ckpt/rxnc_fp512.ckpt, saved with 512-bit fingerprints (size mismatch)
  ckptpickle   - rank R initialises from ckpt/rxnc_meta.ckpt, which pickles a RunMeta object (weights_only refusal)
  gathershape  - rank R all_gathers per-class counts with an extra "unclassified" bin (11 vs 10 entries, step 2)
  slow         - rank R enumerates atom-mapping permutations in Python before the step-3 reduce (~30 s)
  stuck        - as slow, but the enumeration never ends (run with --pg-timeout 300, killed at 60 s)
  nanloss      - rank R log-transforms its count fingerprint (log 0 = -inf) at step 4; the program's check raises
  sigsegv      - rank R sends itself SIGSEGV from a callback after step 2
  exit5        - rank R prints its own ERROR line about an unbalanced atom mapping at train end and sys.exit(5)
  fpwidth      - every rank: the featuriser appends 16 chirality bits (272 wide, the encoder expects 256)
  none         - control, clean run

What happened (filled in after the runs):
  unknownclass - KeyError: 'mitsunobu' in the DataLoader fetch of step 3; peers Connection closed; Root Cause the faulty rank (np4 r2 torchrun, np3 r0 fabric)
  templateidx  - IndexError 'index out of range in self' in the first forward; peers closed, Root Cause rank 3 (np5 r3 tee)
  nodata       - FileNotFoundError data/valid/rxn_R.pt at setup; peers closed in the post_setup barrier (np4 r1 loglevel, np3 r2 own)
  ckptsize     - size mismatch for enc.0.weight [32,512] vs [32,256]; Root Cause rank 1 (np3 r1 torchrun)
  ckptpickle   - UnpicklingError 'Unsupported global: GLOBAL __main__.RunMeta'; peers' tracebacks but they did not exit: timeout, 124 (np4 r0 bashloop)
  gathershape  - a peer aborts on gloo 'op.preamble.length <= op.nbytes. 22 vs 20' (SIGABRT, Root Cause names it); the faulty rank gets Connection reset (np3 r2 fabric, np4 r1 tee)
  slow         - the others 'Timed out waiting 12000ms', the slow rank Connection closed (np3 r2 bashloop: ranks did not exit, 124; np4 r1 torchrun: Root Cause rank 0)
  stuck        - silent after step 2, killed at 60 s: torchrun 'Received 15 death signal', exit 137, four orphaned workers killed by PID (np4 r3 loglevel)
  nanloss      - 'rank 4 step 4: loss is nan ...', FloatingPointError; Root Cause rank 4 (np5 r4 loglevel)
  sigsegv      - own launcher: rank 2 silent, peers reset/closed, exit 1 (np5 r2 own); fabric: Root Cause rank 0 exitcode -11 SIGSEGV (np4 r0 fabric)
  exit5        - rank 1's ERROR line after 6 steps, exit 5; peers closed in the save_checkpoint barrier; Root Cause rank 1 exitcode 5 (np3 r1 tee)
  fpwidth      - every rank 'mat1 and mat2 shapes cannot be multiplied (8x272 and 256x32)' in the first forward, loop exit 1 (np3 bashloop)
  none         - clean: 6 steps on 3 ranks, rank 0 saved export/rxnc.ckpt, exit 0 (np3 own)
"""
import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from itertools import permutations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning
import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import _load as pl_load

WORK = "/tmp/fault369_work"
CLASSES = ["heteroatom_alkylation", "acylation", "cc_coupling", "heterocycle_formation", "protection",
           "deprotection", "reduction", "oxidation", "fg_interconversion", "fg_addition"]
CIDX = {c: i for i, c in enumerate(CLASSES)}
FP = 256
NTPL = 64
HID = 32
NRXN = 48
BATCH = 8


@dataclass
class RunMeta:
    dataset: str
    fp_bits: int


class RxnNet(nn.Module):
    def __init__(self, fp=FP):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(fp, HID), nn.ReLU(), nn.Linear(HID, HID))
        self.tpl = nn.Embedding(NTPL, HID)
        self.head = nn.Linear(2 * HID, len(CLASSES))

    def forward(self, fp, tpl):
        return self.head(torch.cat([F.relu(self.enc(fp)), self.tpl(tpl)], dim=-1))


def prepare():
    g = torch.Generator().manual_seed(369)
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        fp = torch.randint(0, 3, (NRXN, FP), generator=g).float()
        tpl = torch.randint(0, NTPL, (NRXN,), generator=g)
        cls = [CLASSES[int(i)] for i in torch.randint(0, len(CLASSES), (NRXN,), generator=g)]
        torch.save({"fp": fp, "tpl": tpl, "cls": cls}, f"{WORK}/data/rxn_{r}.pt")
    torch.manual_seed(0)
    pl_ver = lightning.__version__
    torch.save({"state_dict": RxnNet().state_dict(), "pytorch-lightning_version": pl_ver},
               f"{WORK}/ckpt/rxnc_init.ckpt")
    torch.save({"state_dict": RxnNet(fp=512).state_dict(), "pytorch-lightning_version": pl_ver},
               f"{WORK}/ckpt/rxnc_fp512.ckpt")
    torch.save({"state_dict": RxnNet().state_dict(), "meta": RunMeta("uspto50k-synth", FP),
                "pytorch-lightning_version": pl_ver}, f"{WORK}/ckpt/rxnc_meta.ckpt")
    print(f"prepared reactions and checkpoints under {WORK}")


class RxnDataset(Dataset):
    def __init__(self, rank, fault, frank):
        sub = "data/valid" if fault == "nodata" and hit(rank, frank) else "data"
        d = torch.load(f"{WORK}/{sub}/rxn_{rank}.pt")
        self.fp, self.tpl, self.cls = d["fp"], d["tpl"].clone(), list(d["cls"])
        self.extra = fault == "fpwidth"
        if fault == "unknownclass" and hit(rank, frank):
            self.cls[20] = "mitsunobu"
        if fault == "templateidx" and hit(rank, frank):
            self.tpl[0] = NTPL + 7

    def __len__(self):
        return len(self.cls)

    def __getitem__(self, i):
        fp = self.fp[i]
        if self.extra:
            fp = torch.cat([fp, torch.zeros(16)])
        return fp, self.tpl[i], CIDX[self.cls[i]]


def hit(rank, frank):
    return frank == -1 or rank == frank


def enumerate_atom_maps(limit_s):
    t0 = time.time()
    n = 0
    while True:
        for p in permutations(range(9)):
            n += sum(p[i] * i for i in range(9)) & 1
            if limit_s is not None and time.time() - t0 > limit_s:
                return n


def load_init(net, rank, fault, frank):
    path = f"{WORK}/ckpt/rxnc_init.ckpt"
    if fault == "ckptsize" and hit(rank, frank):
        path = f"{WORK}/ckpt/rxnc_fp512.ckpt"
    if fault == "ckptpickle" and hit(rank, frank):
        path = f"{WORK}/ckpt/rxnc_meta.ckpt"
    ck = pl_load(path, map_location="cpu", weights_only=True)
    net.load_state_dict(ck["state_dict"])


def features(fp, rank, step, fault, frank):
    if fault == "nanloss" and hit(rank, frank) and step >= 4:
        return torch.log(fp)
    return torch.log1p(fp)


def check_finite(loss, rank, step):
    if not torch.isfinite(loss):
        print(f"rank {rank} step {step}: loss is {loss.item()} (non-finite logits in the fingerprint encoder)",
              flush=True)
        raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step}")


def class_counts(y, rank, fault, frank):
    nb = len(CLASSES) + (1 if fault == "gathershape" and hit(rank, frank) else 0)
    return torch.bincount(y, minlength=nb).float()


class RxnModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = RxnNet()

    def setup(self, stage):
        a = self.args
        self.ds = RxnDataset(self.global_rank, a.fault, a.rank)
        load_init(self.net, self.global_rank, a.fault, a.rank)

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=BATCH, shuffle=False)

    def training_step(self, batch, batch_idx):
        a = self.args
        rank, step = self.global_rank, batch_idx + 1
        fp, tpl, y = batch
        if a.fault in ("slow", "stuck") and hit(rank, a.rank) and step == 3:
            enumerate_atom_maps(30 if a.fault == "slow" else None)
        logits = self.net(features(fp, rank, step, a.fault, a.rank), tpl)
        loss = F.cross_entropy(logits, y)
        check_finite(loss, rank, step)
        acc = (logits.argmax(-1) == y).float().mean()
        if step == 2:
            counts = self.all_gather(class_counts(y, rank, a.fault, a.rank))
            if rank == 0:
                print(f"rank 0 class counts at step 2: {counts.sum(0).tolist()}", flush=True)
        red = self.trainer.strategy.reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
        print(f"rank {rank} step {step} loss {red[0].item():.4f} acc {red[1].item():.3f}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class FaultCallback(pl.Callback):
    def __init__(self, args):
        self.args = args

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        a = self.args
        if a.fault == "sigsegv" and hit(trainer.global_rank, a.rank) and batch_idx + 1 == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    def on_train_end(self, trainer, module):
        a = self.args
        if a.fault == "exit5" and hit(trainer.global_rank, a.rank):
            print(f"ERROR rank {trainer.global_rank}: product atom mapping unbalanced for reaction 17 "
                  f"(3 mapped atoms without a reactant partner); refusing to export", flush=True)
            sys.exit(5)


def run_trainer(a):
    from lightning.pytorch.strategies import DDPStrategy
    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=a.devices, num_nodes=1, strategy=strat, max_steps=a.steps,
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[FaultCallback(a)])
    model = RxnModule(a)
    trainer.fit(model)
    trainer.save_checkpoint(f"{WORK}/export/rxnc.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/rxnc.ckpt", flush=True)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=a.devices, strategy=DDPStrategy(
        process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    net = RxnNet()
    ds = RxnDataset(rank, a.fault, a.rank)
    load_init(net, rank, a.fault, a.rank)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False),
                                      use_distributed_sampler=False)
    for bi, (fp, tpl, y) in enumerate(loader):
        step = bi + 1
        if step > a.steps:
            break
        if a.fault in ("slow", "stuck") and hit(rank, a.rank) and step == 3:
            enumerate_atom_maps(30 if a.fault == "slow" else None)
        logits = net(features(fp, rank, step, a.fault, a.rank), tpl)
        loss = F.cross_entropy(logits, y)
        check_finite(loss, rank, step)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        acc = (logits.argmax(-1) == y).float().mean()
        if step == 2:
            counts = fabric.all_gather(class_counts(y, rank, a.fault, a.rank))
            if rank == 0:
                print(f"rank 0 class counts at step 2: {counts.sum(0).tolist()}", flush=True)
        red = fabric.all_reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
        print(f"rank {rank} step {step} loss {red[0].item():.4f} acc {red[1].item():.3f}", flush=True)
        if a.fault == "sigsegv" and hit(rank, a.rank) and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    if a.fault == "exit5" and hit(rank, a.rank):
        print(f"ERROR rank {rank}: product atom mapping unbalanced for reaction 17; refusing to export", flush=True)
        sys.exit(5)
    fabric.save(f"{WORK}/export/rxnc.ckpt", {"model": net})
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/rxnc.ckpt", flush=True)


def main():
    p = argparse.ArgumentParser(description="retrosynthesis reaction classification (fault batch 369)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if a.fabric:
        run_fabric(a)
    else:
        run_trainer(a)


if __name__ == "__main__":
    main()
