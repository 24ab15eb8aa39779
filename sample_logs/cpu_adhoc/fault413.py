"""A four-hundred-and-thirteenth hand-run batch: DRUG RESPONSE REGRESSION FROM CELL-LINE PROFILES.

Synthetic pharmacogenomics: every rank reads its own screen from /tmp/fault413_work/data/screen_R.pt (cell-line
ids, a tissue for each, 48 gene-expression values and the drug screened on it, with a measured IC50 in uM).
Drugs are looked up by name in data/drugs.pt (a 32-bit fingerprint for each of 12 compounds).  The model
(DrugNet: a gene encoder and a drug encoder, concatenated, an MLP head) regresses log(IC50) with an MSE loss,
trained with Lightning (Trainer + DDPStrategy over gloo, or Fabric with your own loop with --fabric 1).  The
model starts from ckpt/drugnet_init.pt; per-tissue cell counts are all_gathered at the start, the loss and the
RMSE are reduced every step, and rank 0 saves export/drugnet.ckpt at the end (trainer.save_checkpoint or
fabric.save).
Options: --fault NAME --rank R (-1: every rank), --steps, --pg-timeout (seconds, default 12), --prepare,
--devices W (the world size Lightning is told), --fabric 1.

Faults:
  unkdrug    - rank N's screen names a drug "PD0325901-rev" at batch 3, missing from the drug table (KeyError
               inside the DataLoader's fetch)
  nofile     - rank N reads its screen from data/holdout/screen_N.pt, which does not exist (FileNotFoundError
               in the LightningModule's setup hook)
  ckptsize   - rank N initialises from ckpt/drugnet_g64.pt, saved with 64 genes (size mismatch)
  ckptwo     - rank N loads ckpt/expr_scaler.pt, a pickled ExprScaler object, with torch.load's default
               weights_only=True (UnpicklingError)
  gathershape- rank N all_gathers per-tissue counts with a 9th "unknown" tissue (9 vs 8 entries)
  slowrank   - rank N computes all pairwise Tanimoto similarities in Python for 40 s before the step-2 reduce
  stuck      - rank N waits at step 3 for a feature-cache flag file that never appears (hang)
  nanic50    - rank N's IC50 column has zeros at batch 4: log(0) = -inf, the program's own check raises
               FloatingPointError
  segv       - rank N sends itself SIGSEGV after step 2 (a callback's on_train_batch_end)
  exit4      - rank N prints its own ERROR line about held-out cell lines missing from the response matrix at
               the end of training and calls sys.exit(4)
  shapebug   - every rank: the head is built for 48+16 inputs, but the raw 32-bit fingerprint is concatenated
               instead of the drug encoding (mat1 and mat2 shapes error in the first forward); the first run's
               version built the drug encoder 32 wide instead, and failed earlier, at the checkpoint load
  none       - control, clean run

What happened (filled in after the runs):
  unkdrug    - steps 1-3 run, then KeyError: 'PD0325901-rev' in Screen.__getitem__ (DataLoader fetch); peers
               Connection closed by peer (np3 r1 plown, np4 r0 plfabric)
  nofile     - FileNotFoundError for data/holdout/screen_N.pt in setup; peers fail in the post_setup barrier
               (np4 r2 pltorchrun, Root Cause rank 2; np3 r1 plown)
  ckptsize   - size mismatch for genes.0.weight [64,64] vs [64,48]; peers closed in DDP's param check (np3 r0 plfabric)
  ckptwo     - _pickle.UnpicklingError: Weights only load failed (np6 r4 plfabric, np3 r1 plown)
  gathershape- 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' on rank N;
               peers closed (np5 r3 pltee, np4 r0 plfabric)
  slowrank   - peers 'Timed out waiting 12000ms for recv/send operation'; the slow rank SIGTERMed by torchrun
               (np3 r2 plloglevel, Root Cause rank 0; np4 r0 plfabric, Root Cause rank 1)
  stuck      - output stops after step 2; killed at 60 s, agent's death-signal lines, exit 137; orphaned workers
               killed by PID (np3 r1 pltorchrun, np4 r2 pltee)
  nanic50    - FloatingPointError 'loss is inf at step 5 (3 non-finite log(IC50) targets in the batch)'; peers
               closed (np3 r2 plbashloop, np6 r5 pltee)
  segv       - no traceback after step 2; Root Cause exitcode -11 (SIGSEGV) (np5 r1 pltorchrun); bash
               'Segmentation fault', loop exit 139 (np3 r2 plbashloop)
  exit4      - the ERROR line after step 6 and exit 4; peers closed in a barrier (np3 r0 plloglevel, Root Cause
               exitcode 4; np3 r2 plbashloop, loop exit 4)
  shapebug   - first version: every rank's load_state_dict size mismatch for drug.0.weight [16,32] vs [32,32]
               (np3 pltee, relabelled checkpoint); fixed version: 'mat1 and mat2 shapes cannot be multiplied
               (16x80 and 64x32)' on every rank (np4 plloglevel)
  none       - clean: 6 steps, rank 0 saved export/drugnet.ckpt, exit 0 (np3 plbashloop, np4 plown)
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault413_work"
NGENES = 48
FPBITS = 32
TISSUES = ["lung", "breast", "skin", "blood", "colon", "brain", "kidney", "liver"]
DRUGS = ["erlotinib", "lapatinib", "nutlin-3a", "PLX4720", "sorafenib", "paclitaxel", "AZD6244",
         "PD0325901", "nilotinib", "17-AAG", "irinotecan", "topotecan"]
PER_RANK = 160
BATCH = 16


class ExprScaler:
    """Per-gene mean and std from the training screen (pickled as an object, not as tensors)."""

    def __init__(self, mean, std):
        self.mean = mean
        self.std = std


def prepare():
    g = torch.Generator().manual_seed(413)
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    fps = {d: (torch.rand(FPBITS, generator=g) < 0.3).float() for d in DRUGS}
    torch.save(fps, f"{WORK}/data/drugs.pt")
    w = torch.randn(NGENES, generator=g)
    for r in range(8):
        expr = torch.randn(PER_RANK, NGENES, generator=g)
        didx = torch.randint(0, len(DRUGS), (PER_RANK,), generator=g)
        drugs = [DRUGS[i] for i in didx.tolist()]
        tissue = torch.randint(0, len(TISSUES), (PER_RANK,), generator=g)
        fpsum = torch.stack([fps[d] for d in drugs]).sum(1)
        logic50 = 0.3 * (expr @ w) / NGENES ** 0.5 - 0.1 * fpsum + 0.2 * torch.randn(PER_RANK, generator=g)
        torch.save({"cells": [f"ACH-{r:01d}{i:05d}" for i in range(PER_RANK)], "tissue": tissue,
                    "expr": expr, "drugs": drugs, "ic50": logic50.exp()}, f"{WORK}/data/screen_{r}.pt")
    torch.save({"state_dict": DrugNet(NGENES).state_dict(), "genes": NGENES}, f"{WORK}/ckpt/drugnet_init.pt")
    torch.save({"state_dict": DrugNet(64).state_dict(), "genes": 64}, f"{WORK}/ckpt/drugnet_g64.pt")
    torch.save(ExprScaler(torch.zeros(NGENES), torch.ones(NGENES)), f"{WORK}/ckpt/expr_scaler.pt")
    print(f"prepared {WORK}: 8 screens of {PER_RANK} cell-line/drug pairs, drug table, 3 checkpoints")


class DrugNet(nn.Module):
    def __init__(self, ngenes=NGENES, drug_out=16):
        super().__init__()
        self.genes = nn.Sequential(nn.Linear(ngenes, 64), nn.ReLU(), nn.Linear(64, 48))
        self.drug = nn.Sequential(nn.Linear(FPBITS, drug_out), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(48 + 16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, expr, fp):
        d = fp if getattr(self, "raw_fp", False) else self.drug(fp)
        return self.head(torch.cat([self.genes(expr), d], dim=1)).squeeze(1)


class Screen(Dataset):
    def __init__(self, path, drug_table, rank, fault, frank):
        s = torch.load(path)
        self.expr, self.drugs, self.ic50, self.tissue = s["expr"], list(s["drugs"]), s["ic50"].clone(), s["tissue"]
        self.table = drug_table
        if fault == "unkdrug" and hit(rank, frank):
            self.drugs[3 * BATCH + 5] = "PD0325901-rev"
        if fault == "nanic50" and hit(rank, frank):
            self.ic50[4 * BATCH + 2: 4 * BATCH + 5] = 0.0

    def __len__(self):
        return len(self.drugs)

    def __getitem__(self, i):
        fp = self.table[self.drugs[i]]
        return self.expr[i], fp, torch.log(self.ic50[i])


def hit(rank, frank):
    return frank == -1 or rank == frank


class Faults:
    """The fault hooks, shared by the Trainer and the Fabric paths."""

    def __init__(self, args, rank, world):
        self.a, self.rank, self.world = args, rank, world
        self.on = lambda name: args.fault == name and hit(rank, args.rank)

    def screen_path(self):
        if self.on("nofile"):
            return f"{WORK}/data/holdout/screen_{self.rank}.pt"
        return f"{WORK}/data/screen_{self.rank}.pt"

    def init_weights(self, model):
        if self.on("ckptwo"):
            scaler = torch.load(f"{WORK}/ckpt/expr_scaler.pt")
            print(f"rank {self.rank}: expression scaler for {len(scaler.mean)} genes", flush=True)
        path = f"{WORK}/ckpt/drugnet_g64.pt" if self.on("ckptsize") else f"{WORK}/ckpt/drugnet_init.pt"
        sd = torch.load(path, map_location="cpu")
        model.load_state_dict(sd["state_dict"])
        print(f"rank {self.rank}: initialised DrugNet from {path}", flush=True)

    def tissue_counts(self, tissue):
        counts = torch.bincount(tissue, minlength=len(TISSUES)).float()
        if self.on("gathershape"):
            counts = torch.cat([counts, torch.tensor([3.0])])  # cells with no tissue annotation
        out = [torch.zeros(len(TISSUES)) for _ in range(self.world)]
        dist.all_gather(out, counts)
        return torch.stack(out).sum(0)

    def before_reduce(self, step):
        if step == 2 and self.on("slowrank"):
            fps = list(torch.load(f"{WORK}/data/drugs.pt").values())
            bits = [set(i for i, b in enumerate(f.tolist()) if b) for f in fps]
            t0, n = time.time(), 0
            while time.time() - t0 < 40:
                for x in bits:
                    for y in bits:
                        n += len(x & y) / max(1, len(x | y)) > 0.5
            print(f"rank {self.rank}: {n} similar drug pairs", flush=True)
        if step == 3 and self.on("stuck"):
            flag = f"{WORK}/cache/expr_features_{self.rank}.ready"
            while not os.path.exists(flag):
                time.sleep(0.5)

    def check(self, loss, y, step):
        if not torch.isfinite(loss):
            bad = int((~torch.isfinite(y)).sum())
            raise FloatingPointError(f"rank {self.rank}: loss is {loss.item()} at step {step} "
                                     f"({bad} non-finite log(IC50) targets in the batch)")

    def after_step(self, step):
        if step == 2 and self.on("segv"):
            os.kill(os.getpid(), signal.SIGSEGV)

    def at_end(self):
        if self.on("exit4"):
            print(f"ERROR rank {self.rank}: 3 held-out cell lines (ACH-000417, ACH-000981, ACH-001113) are "
                  f"missing from the response matrix; refusing to export predictions", flush=True)
            sys.exit(4)


def make_model(args):
    net = DrugNet(NGENES)
    net.raw_fp = args.fault == "shapebug"  # the raw 32-bit fingerprint goes to the head, not the 16-wide encoding
    return net


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(args)

        def setup(self, stage):
            self.f = Faults(args, self.global_rank, self.trainer.world_size)
            self.screen = Screen(self.f.screen_path(), torch.load(f"{WORK}/data/drugs.pt"),
                                 self.global_rank, args.fault, args.rank)
            self.f.init_weights(self.net)

        def train_dataloader(self):
            return DataLoader(self.screen, batch_size=BATCH, shuffle=False, num_workers=0)

        def on_train_start(self):
            c = self.f.tissue_counts(self.screen.tissue)
            if self.global_rank == 0:
                print("cells per tissue: " + " ".join(f"{t}={int(v)}" for t, v in zip(TISSUES, c)), flush=True)

        def training_step(self, batch, i):
            expr, fp, y = batch
            loss = nn.functional.mse_loss(self.net(expr, fp), y)
            step = self.global_step + 1
            self.f.check(loss, y, step)
            self.f.before_reduce(step)
            m = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
            print(f"rank {self.global_rank} step {step} loss {m.item():.4f} rmse {m.sqrt().item():.4f}", flush=True)
            return loss

        def on_train_batch_end(self, outputs, batch, i):
            self.f.after_step(self.global_step)

        def on_train_end(self):
            self.f.at_end()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, max_steps=args.steps,
                         strategy=DDPStrategy(process_group_backend="gloo",
                                              timeout=timedelta(seconds=args.pg_timeout)),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(Module())
    trainer.save_checkpoint(f"{WORK}/export/drugnet.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/drugnet.ckpt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    f = Faults(args, rank, fabric.world_size)
    screen = Screen(f.screen_path(), torch.load(f"{WORK}/data/drugs.pt"), rank, args.fault, args.rank)
    net = make_model(args)
    f.init_weights(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(screen, batch_size=BATCH, shuffle=False),
                                      use_distributed_sampler=False)
    c = f.tissue_counts(screen.tissue)
    if rank == 0:
        print("cells per tissue: " + " ".join(f"{t}={int(v)}" for t, v in zip(TISSUES, c)), flush=True)
    it = iter(loader)
    for step in range(1, args.steps + 1):
        expr, fp, y = next(it)
        loss = nn.functional.mse_loss(net(expr, fp), y)
        f.check(loss, y, step)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        f.before_reduce(step)
        m = fabric.all_reduce(loss.detach(), reduce_op="mean")
        print(f"rank {rank} step {step} loss {m.item():.4f} rmse {m.sqrt().item():.4f}", flush=True)
        f.after_step(step)
    f.at_end()
    fabric.save(f"{WORK}/export/drugnet_fabric.ckpt", {"model": net, "steps": args.steps})
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/drugnet_fabric.ckpt", flush=True)


def main():
    p = argparse.ArgumentParser(description="drug response regression from cell-line profiles")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
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
