"""A four-hundred-and-eighteenth hand-run batch: POSTAGE STAMP CONDITION GRADING (Lightning).

Synthetic stamp lots: every stamp carries 24 measured features (centering offsets, perforation counts, a
colour-fade score, hinge and crease flags, ...), a gum code (looked up in the GUM table: MNH, MH, NG, USED)
and a condition grade (Poor, Fair, Good, Fine, Superb = 5 classes).  Every rank reads its own lot from
/tmp/fault418_work/data/lots/stamps_R.pt in the LightningModule's setup() hook, initialises the grader (an
MLP on the features plus a gum embedding) from ckpt/grader_init.ckpt through Lightning's own loader, and
trains under lightning.pytorch.Trainer with DDPStrategy (gloo, timeout --pg-timeout, default 12 s).  The loss
and accuracy are reduced through the strategy every step and printed; rank 0 writes export/grader.ckpt with
trainer.save_checkpoint at the end.  --fabric 1 runs the same model with lightning.fabric.Fabric and a
hand-written loop (fabric.load, fabric.all_reduce, fabric.save).  --prepare writes the data once.

Faults (--fault NAME --rank R, R = -1 for every rank):
  gumcode    - rank N's lot holds a regummed stamp, gum code "RG", missing from the GUM table (KeyError, setup)
  gradeidx   - rank N's lot grades one stamp "Superb+" as class 5 of 5 (IndexError in cross_entropy, step 0)
  noscans    - rank N reads its lot from data/lots_2025/ which does not exist (FileNotFoundError, setup)
  ckptsize   - rank N initialises from ckpt/grader_7grade.ckpt, a 7-grade head (size mismatch, setup)
  ckptpickle - rank N initialises from ckpt/grader_panel.ckpt, which pickles a GradingPanel object
               (weights_only refusal, setup)
  perfgather - at step 3 rank N all_gathers a 12-bin perforation histogram, the others 11 bins
  catalog    - rank N re-sorts the whole catalogue in Python before step 2 (4 x pg-timeout seconds, at most 600)
  nanfade    - from step 3 rank N normalises the fade score by a mint sheet's max fade (0): NaN loss, the
               program's own check raises FloatingPointError
  sigsegv    - rank N sends itself SIGSEGV after step 2 (in on_train_batch_end)
  exit5      - rank N prints its own error line about a grading-panel disagreement in on_train_end and
               calls sys.exit(5)
  featwidth  - every rank: two extra flags (watermark, gum break) make the features 26 wide; the first
               layer expects 24 (shape error in the first forward)
  none       - control, clean run

What happened (filled in after the runs):
  gumcode    - KeyError: 'RG' in setup(); peers 'Connection closed by peer' in the post_setup barrier (np4 r2 bashloop, np3 r0 own)
  gradeidx   - IndexError 'Target 5 is out of bounds.' at step 0; peers closed, Root Cause rank N (np5 r3 tee, np3 r1 fabric)
  noscans    - FileNotFoundError for data/lots_2025/stamps_N.pt at start-up; peers closed (np4 r1 loglevel, np3 r2 fabric)
  ckptsize   - load_state_dict size mismatch for head.weight [7,32] vs [5,32] and head.bias (np3 r1 own, np5 r0 torchrun)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.GradingPanel' (np4 r3 bashloop)
  perfgather - not the rank with 12 bins but its ring neighbour aborts: gloo::EnforceNotMet 'Received data size doesn't
               match expected size' (SIGABRT, the Root Cause torchrun names); the others closed/reset (np6 r4 torchrun,
               np3 r1 fabric)
  catalog    - 12 s: the peers 'Timed out waiting 12000ms for send/recv' in the step-2 reduce, the slow rank later
               'Connection closed by peer' (np3 r1 bashloop); 300 s: silent after step 1, killed at 60 s; Lightning's
               SIGTERM handler logs 'Received SIGTERM' and does not exit, so torchrun was SIGKILLed, exit 137, and the
               4 orphaned workers were killed by PID afterwards (np4 r2 tee)
  nanfade    - the program's check: FloatingPointError 'non-finite loss nan at step 3'; peers closed (np4 r3 loglevel,
               np3 r0 fabric)
  sigsegv    - Lightning's own launcher: no line from rank 2, peers reset/closed, exit 1 (np5 r2 own); torchrun: Root
               Cause rank 1 exitcode -11 SIGSEGV (np4 r1 torchrun)
  exit5      - rank N's ERROR line about the grading panel after 6 steps and exit 5; Root Cause exitcode 5 (np3 r2 tee,
               np4 r1 loglevel)
  featwidth  - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x26 and 24x32)' in the first step (np3 bashloop)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/grader.ckpt, exit 0 (np3 torchrun)
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
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

WORK = "/tmp/fault418_work"
GUM = {"MNH": 0, "MH": 1, "NG": 2, "USED": 3}
GRADES = ["Poor", "Fair", "Good", "Fine", "Superb"]
NFEAT = 24
FADE = 5
PER_RANK = 128
BATCH = 16


class GradingPanel:
    """Who graded the reference sheets; pickled into grader_panel.ckpt by --prepare."""

    def __init__(self, names):
        self.names = names


class Grader(nn.Module):
    def __init__(self, nfeat=NFEAT, ngrades=len(GRADES)):
        super().__init__()
        self.gum = nn.Embedding(len(GUM), 4)
        self.l1 = nn.Linear(nfeat, 32)
        self.l2 = nn.Linear(32 + 4, 32)
        self.head = nn.Linear(32, ngrades)

    def forward(self, x, gum):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(torch.cat([h, self.gum(gum)], dim=1)))
        return self.head(h)


def prepare(max_rank=8):
    os.makedirs(f"{WORK}/data/lots", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(418)
    codes = list(GUM)
    for r in range(max_rank):
        x = torch.randn(PER_RANK, NFEAT, generator=g)
        x[:, FADE] = torch.rand(PER_RANK, generator=g)
        y = (x[:, :3].sum(1) * 1.2 + 2).round().clamp(0, 4).long()
        gum = [codes[int(i)] for i in torch.randint(0, 4, (PER_RANK,), generator=g)]
        torch.save({"features": x, "gum": gum, "grade": [GRADES[int(i)] for i in y]},
                   f"{WORK}/data/lots/stamps_{r}.pt")
    torch.manual_seed(0)
    torch.save({"state_dict": Grader().state_dict(), "epoch": 0}, f"{WORK}/ckpt/grader_init.ckpt")
    torch.save({"state_dict": Grader(ngrades=7).state_dict(), "epoch": 0}, f"{WORK}/ckpt/grader_7grade.ckpt")
    torch.save({"state_dict": Grader().state_dict(), "panel": GradingPanel(["APS", "PF", "BPA"])},
               f"{WORK}/ckpt/grader_panel.ckpt")
    print(f"prepared {max_rank} lots and 3 checkpoints under {WORK}")


def faulty(args, rank):
    return args.rank == -1 or args.rank == rank


def load_lot(args, rank):
    lots = "lots_2025" if (args.fault == "noscans" and faulty(args, rank)) else "lots"
    raw = torch.load(f"{WORK}/data/{lots}/stamps_{rank}.pt")
    x, gums, grades = raw["features"], list(raw["gum"]), list(raw["grade"])
    if args.fault == "gumcode" and faulty(args, rank):
        gums[37] = "RG"  # a regummed stamp from a dealer lot
    gum = torch.tensor([GUM[c] for c in gums])
    table = {name: i for i, name in enumerate(GRADES)}
    if args.fault == "gradeidx" and faulty(args, rank):
        grades[3] = "Superb+"
        table["Superb+"] = 5
    y = torch.tensor([table[c] for c in grades])
    if args.fault == "featwidth" and faulty(args, rank):
        flags = torch.stack([(x[:, 0] > 1).float(), (x[:, 1] < -1).float()], dim=1)
        x = torch.cat([x, flags], dim=1)  # watermark, gum break
    return TensorDataset(x, gum, y)


def init_path(args, rank):
    if args.fault == "ckptsize" and faulty(args, rank):
        return f"{WORK}/ckpt/grader_7grade.ckpt"
    if args.fault == "ckptpickle" and faulty(args, rank):
        return f"{WORK}/ckpt/grader_panel.ckpt"
    return f"{WORK}/ckpt/grader_init.ckpt"


def catalogue_resort(seconds):
    cat = [((i * 7919) % 104729, f"SG{i}") for i in range(200000)]
    end = time.time() + seconds
    n = 0
    while time.time() < end:
        cat = sorted(cat, key=lambda t: (t[0] * 31 + n) % 9973)
        n += 1
    return n


def before_step(args, rank, step, x):
    if args.fault == "catalog" and faulty(args, rank) and step == 2:
        secs = min(4 * args.pg_timeout, 600)
        print(f"rank {rank}: re-sorting the catalogue before step {step}", flush=True)
        catalogue_resort(secs)
    if args.fault == "nanfade" and faulty(args, rank) and step >= 3:
        sheet_max = torch.zeros(())  # a mint sheet: no fade at all
        x = x.clone()
        x[:, FADE] = x[:, FADE] / sheet_max * 0.0
    return x


def check_loss(rank, step, loss, x):
    if not torch.isfinite(loss):
        bad = int((~torch.isfinite(x)).sum())
        raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                 f"({bad} non-finite feature values in the batch)")


def perf_gather(args, rank, step, world):
    if step != 3:
        return
    bins = 12 if (args.fault == "perfgather" and faulty(args, rank)) else 11
    hist = torch.histc(torch.rand(64) * 4 + 10, bins=bins, min=10, max=14)
    out = [torch.zeros_like(hist) for _ in range(world)]
    dist.all_gather(out, hist)


def after_step(args, rank, step):
    if args.fault == "sigsegv" and faulty(args, rank) and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)


def at_end(args, rank):
    if args.fault == "exit5" and faulty(args, rank):
        print(f"rank {rank}: ERROR grading panel disagreement on 14 reference stamps (kappa 0.41 < 0.60), "
              f"refusing to publish the grader", flush=True)
        sys.exit(5)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import _load as pl_load
    from lightning.pytorch.strategies import DDPStrategy

    class GradeModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Grader()
            self.ds = None

        def setup(self, stage):
            r = self.global_rank
            self.ds = load_lot(args, r)
            ck = pl_load(init_path(args, r), map_location="cpu", weights_only=True)
            self.model.load_state_dict(ck["state_dict"])

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=BATCH, shuffle=False)

        def training_step(self, batch, idx):
            r, s = self.global_rank, self.global_step
            x, gum, y = batch
            x = before_step(args, r, s, x)
            logits = self.model(x, gum)
            loss = F.cross_entropy(logits, y)
            check_loss(r, s, loss, x)
            acc = (logits.argmax(1) == y).float().mean()
            red = self.trainer.strategy.reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
            perf_gather(args, r, s, self.trainer.world_size)
            print(f"rank {r} step {s} loss {red[0].item():.4f} acc {red[1].item():.3f}", flush=True)
            return loss

        def on_train_batch_end(self, outputs, batch, idx):
            after_step(args, self.global_rank, self.global_step - 1)

        def on_train_end(self):
            at_end(args, self.global_rank)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    module = GradeModule()
    trainer.fit(module)
    trainer.save_checkpoint(f"{WORK}/export/grader.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/grader.ckpt after {trainer.global_step} steps", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    r, world = fabric.global_rank, fabric.world_size
    ds = load_lot(args, r)
    model = Grader()
    ck = fabric.load(init_path(args, r))
    model.load_state_dict(ck["state_dict"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False),
                                      use_distributed_sampler=False)
    step = 0
    for x, gum, y in loader:
        if step >= args.steps:
            break
        x = before_step(args, r, step, x)
        logits = model(x, gum)
        loss = F.cross_entropy(logits, y)
        check_loss(r, step, loss, x)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        red = fabric.all_reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
        perf_gather(args, r, step, world)
        print(f"rank {r} step {step} loss {red[0].item():.4f} acc {red[1].item():.3f}", flush=True)
        step += 1
        after_step(args, r, step - 1)
    at_end(args, r)
    fabric.save(f"{WORK}/export/grader_fabric.ckpt", {"model": model, "step": step})
    if r == 0:
        print(f"rank 0 saved {WORK}/export/grader_fabric.ckpt after {step} steps", flush=True)


def main():
    p = argparse.ArgumentParser(description="postage stamp condition grading (Lightning, gloo)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1, help="the faulty rank, -1 for every rank")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(418)
    torch.set_num_threads(1)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
