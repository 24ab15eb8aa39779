"""Batch 373 hand-run fault script: TABULAR CUSTOMER CHURN PREDICTION with Lightning (lightning.pytorch).

Every rank reads its own customer table /tmp/fault373_work/data/customers_R.csv (tenure, monthly and total
charges, plan, region, contract, churned), maps the plan name through a 4-entry plan table and the region code
into a 10-row embedding, and trains a small MLP (plan and region embeddings + 3 numeric features -> 32 -> 1)
with BCE-with-logits.  The network is initialised from ckpt/churn_h32.pt.  The Trainer runs DDP over gloo
(DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout)); every step the loss and accuracy are
reduced through the strategy and printed as `rank R step S loss L acc A`; at step 2 each rank all_gathers its
per-contract customer counts through LightningModule.all_gather; at the end rank 0 writes
export/churn.ckpt through trainer.save_checkpoint.  --fabric 1 runs the same model with lightning.fabric.Fabric
and a hand-written loop (fabric.all_reduce / fabric.all_gather / fabric.save).
Options: --devices W (Lightning's own launcher when started plainly; under torchrun or with LOCAL_RANK set it
is environment-launched), --fault NAME --rank R (-1 every rank), --steps, --pg-timeout, --prepare, --fabric.

Faults:
  plankey    - rank N reads data/customers_newplans.csv where a customer has plan "enterprise", missing from
               the plan table (KeyError in setup, start-up)
  regionidx  - rank N reads data/customers_badregion.csv whose row 70 has region code 12 for a 10-row region
               embedding (IndexError in the forward of step 3)
  nodata     - rank N reads data/holdout/customers_N.csv, which does not exist (FileNotFoundError in setup)
  ckptsize   - rank N initialises from ckpt/churn_h64.pt, saved with a 64-wide hidden layer (size mismatch)
  gathershape- rank N all_gathers its contract counts with an extra "unknown contract" bucket (4 entries, the
               others 3) at step 2, through LightningModule.all_gather / fabric.all_gather
  slow       - rank N computes a customer-lifetime-value table in pure Python (about 50 s) before step 2's reduce
  stuck      - rank N waits forever on an Event before step 3's reduce (run with --pg-timeout 300)
  nanloss    - rank N's monthly charges are multiplied by inf at step 4: the program's finite-loss check raises
               FloatingPointError
  sigkill    - rank N sends itself SIGKILL after printing step 2
  exit4      - rank N prints its own ERROR line about an unbalanced churn label file in on_train_end and
               calls sys.exit(4)
  featwidth  - every rank: 5 numeric features (two extra flags); the first layer expects 3 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  plankey    - KeyError: 'enterprise' in setup() before any step; peers Connection closed by peer in a barrier (np4 r2 torchrun, np5 r0 bashloop)
  regionidx  - IndexError 'index out of range in self' in the step-3 forward; peers Connection closed (np3 r1 tee, np4 r3 fabric)
  nodata     - FileNotFoundError for data/holdout/customers_N.csv before any step; peers Connection closed (np4 r1 loglevel, np3 r2 fabric)
  ckptsize   - load_state_dict size mismatch l1.weight [64, 11] vs [32, 11] in setup(); peers closed in a barrier (np3 r0 own launcher, np5 r3 torchrun)
  gathershape- a peer (not rank N) dies with gloo::EnforceNotMet 'Received data size doesn't match expected size' (SIGABRT) at the
               step-2 all_gather; Root Cause names that peer (np3 r2 torchrun, np4 r1 fabric); a first fabric run with a 3x1 tensor
               (same byte count) ran clean and was dropped
  slow       - peers 'Timed out waiting 12000ms' in the step-2 all_gather; bash loop: ranks never exited, exit 124 (np3 r2);
               tee: Root Cause rank 3, exit 1 (np4 r0)
  stuck      - silent after step 2, timeout at 60 s; torchrun SIGTERMs workers, Lightning catches it, SIGKILL: exit 137 (np4 r1 loglevel)
  nanloss    - FloatingPointError 'churn loss is nan (non-finite)' at step 4; peers Connection closed in the backward or a barrier (np5 r2 fabric, np3 r1 own launcher)
  sigkill    - nothing from rank N after step 2; torchrun Root Cause exitcode -9 SIGKILL (np4 r2 tee); own launcher: no signal named (np3 r1)
  exit4      - rank N's ERROR line after step 6 and exit 4; peers closed in save_checkpoint's barrier; Root Cause exitcode 4 (np6 r4 loglevel)
  featwidth  - every rank 'mat1 and mat2 shapes cannot be multiplied (32x13 and 11x32)' in the first forward, exit 1 (np3 bashloop; the
               first run, whose model was built for 5 features, ran clean and was dropped)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/churn.ckpt, exit 0 (np3 own launcher)
"""
import argparse
import csv
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault373_work"
PLANS = {"basic": 0, "standard": 1, "premium": 2, "family": 3}
CONTRACTS = {"monthly": 0, "yearly": 1, "two_year": 2}
NREGION = 10
HIDDEN = 32
torch.set_num_threads(1)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fabric", type=int, default=0)
    return p.parse_args()


class ChurnNet(nn.Module):
    def __init__(self, nnum=3, hidden=HIDDEN):
        super().__init__()
        self.plan = nn.Embedding(len(PLANS), 4)
        self.region = nn.Embedding(NREGION, 4)
        self.l1 = nn.Linear(nnum + 8, hidden)
        self.l2 = nn.Linear(hidden, 1)

    def forward(self, num, plan, region):
        h = torch.cat([num, self.plan(plan), self.region(region)], dim=1)
        return self.l2(torch.relu(self.l1(h))).squeeze(1)


def write_table(path, n, seed, plan_override=None, region_override=None):
    g = torch.Generator().manual_seed(seed)
    plans, contracts = list(PLANS), list(CONTRACTS)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["customer_id", "tenure", "monthly_charges", "total_charges", "plan", "region", "contract",
                    "churned"])
        for i in range(n):
            tenure = int(torch.randint(1, 72, (1,), generator=g))
            monthly = round(20 + 80 * float(torch.rand(1, generator=g)), 2)
            plan = plans[int(torch.randint(0, 4, (1,), generator=g))]
            region = int(torch.randint(0, NREGION, (1,), generator=g))
            contract = contracts[int(torch.randint(0, 3, (1,), generator=g))]
            if plan_override and i == plan_override[0]:
                plan = plan_override[1]
            if region_override and i == region_override[0]:
                region = region_override[1]
            churn = int(tenure < 12 and contract == "monthly" or float(torch.rand(1, generator=g)) < 0.1)
            w.writerow([f"C{seed:03d}{i:04d}", tenure, monthly, round(monthly * tenure, 2), plan, region,
                        contract, churn])


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        write_table(f"{WORK}/data/customers_{r}.csv", 256, 300 + r)
    write_table(f"{WORK}/data/customers_newplans.csv", 256, 390, plan_override=(41, "enterprise"))
    write_table(f"{WORK}/data/customers_badregion.csv", 256, 391, region_override=(70, 12))
    torch.manual_seed(0)
    torch.save({"state_dict": ChurnNet().state_dict(), "hidden": HIDDEN}, f"{WORK}/ckpt/churn_h32.pt")
    torch.save({"state_dict": ChurnNet(hidden=64).state_dict(), "hidden": 64}, f"{WORK}/ckpt/churn_h64.pt")
    print("prepared", WORK)


def faulty(a, rank):
    return a.fault != "none" and (a.rank == -1 or a.rank == rank)


def load_table(a, rank):
    path = f"{WORK}/data/customers_{rank}.csv"
    if faulty(a, rank) and a.fault == "plankey":
        path = f"{WORK}/data/customers_newplans.csv"
    elif faulty(a, rank) and a.fault == "regionidx":
        path = f"{WORK}/data/customers_badregion.csv"
    elif faulty(a, rank) and a.fault == "nodata":
        path = f"{WORK}/data/holdout/customers_{rank}.csv"
    num, plan, region, contract, y = [], [], [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            tenure, monthly, total = float(row["tenure"]), float(row["monthly_charges"]), float(row["total_charges"])
            feats = [tenure / 72.0, monthly / 100.0, total / 7200.0]
            if a.fault == "featwidth":
                feats += [float(row["contract"] == "monthly"), float(tenure < 12)]
            num.append(feats)
            plan.append(PLANS[row["plan"]])
            region.append(int(row["region"]))
            contract.append(CONTRACTS[row["contract"]])
            y.append(float(row["churned"]))
    return TensorDataset(torch.tensor(num), torch.tensor(plan), torch.tensor(region), torch.tensor(contract),
                         torch.tensor(y))


def init_net(a, rank):
    net = ChurnNet()
    path = f"{WORK}/ckpt/churn_h32.pt"
    if faulty(a, rank) and a.fault == "ckptsize":
        path = f"{WORK}/ckpt/churn_h64.pt"
    ck = torch.load(path, map_location="cpu")
    net.load_state_dict(ck["state_dict"])
    return net


def before_step(a, rank, step, num):
    """Faults that strike inside the step loop; returns the (maybe corrupted) numeric features."""
    if not faulty(a, rank):
        return num
    if a.fault == "slow" and step == 2:
        t0 = time.time()
        clv = {}
        while time.time() - t0 < 50:
            for m in range(1, 73):
                clv[m] = sum(0.97 ** k * 55.0 for k in range(m))
    if a.fault == "stuck" and step == 3:
        threading.Event().wait()
    if a.fault == "nanloss" and step == 4:
        num = num.clone()
        num[:, 1] = num[:, 1] * float("inf")
    return num


def check_loss(loss, rank, step):
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: churn loss is {loss.item()} (non-finite)")


def contract_counts(a, rank, contract):
    counts = torch.bincount(contract, minlength=3).float()
    if faulty(a, rank) and a.fault == "gathershape":
        counts = torch.cat([counts, torch.zeros(1)])  # an extra "unknown contract" bucket: 4 entries, not 3
    return counts


class ChurnModule(pl.LightningModule):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.net = ChurnNet()
        self.lossf = nn.BCEWithLogitsLoss()

    def setup(self, stage):
        self.ds = load_table(self.a, self.global_rank)
        self.net.load_state_dict(init_net(self.a, self.global_rank).state_dict())

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=32, shuffle=False)

    def training_step(self, batch, idx):
        num, plan, region, contract, y = batch
        step, rank = self.global_step + 1, self.global_rank
        num = before_step(self.a, rank, step, num)
        logit = self.net(num, plan, region)
        loss = self.lossf(logit, y)
        check_loss(loss, rank, step)
        acc = ((logit > 0).float() == y).float().mean()
        if step == 2:
            allc = self.all_gather(contract_counts(self.a, rank, contract))
            if rank == 0:
                print(f"contract counts across ranks: {allc.sum(0).tolist()}", flush=True)
        ml = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        ma = self.trainer.strategy.reduce(acc, reduce_op="mean")
        print(f"rank {rank} step {step} loss {ml.item():.4f} acc {ma.item():.3f}", flush=True)
        if self.a.fault == "sigkill" and faulty(self.a, rank) and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    def on_train_end(self):
        if faulty(self.a, self.global_rank) and self.a.fault == "exit4":
            print(f"ERROR rank {self.global_rank}: churn labels unbalanced in customers_{self.global_rank}.csv "
                  f"(positives 0.93 > 0.80 limit), refusing to export", flush=True)
            sys.exit(4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def run_trainer(a):
    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=a.devices, num_nodes=1, strategy=strat, max_steps=a.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    module = ChurnModule(a)
    trainer.fit(module)
    trainer.save_checkpoint(f"{WORK}/export/churn.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/churn.ckpt", flush=True)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FDDP
    fabric = Fabric(accelerator="cpu", devices=a.devices, num_nodes=1,
                    strategy=FDDP(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    ds = load_table(a, rank)
    net = ChurnNet()
    net.load_state_dict(init_net(a, rank).state_dict())
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=32, shuffle=False), use_distributed_sampler=False)
    lossf = nn.BCEWithLogitsLoss()
    step = 0
    for num, plan, region, contract, y in loader:
        step += 1
        if step > a.steps:
            break
        num = before_step(a, rank, step, num)
        logit = net(num, plan, region)
        loss = lossf(logit, y)
        check_loss(loss, rank, step)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        acc = ((logit > 0).float() == y).float().mean()
        if step == 2:
            allc = fabric.all_gather(contract_counts(a, rank, contract))
            if rank == 0:
                print(f"contract counts across ranks: {allc.sum(0).tolist()}", flush=True)
        ml = fabric.all_reduce(loss.detach(), reduce_op="mean")
        ma = fabric.all_reduce(acc, reduce_op="mean")
        print(f"rank {rank} step {step} loss {ml.item():.4f} acc {ma.item():.3f}", flush=True)
        if a.fault == "sigkill" and faulty(a, rank) and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    if faulty(a, rank) and a.fault == "exit4":
        print(f"ERROR rank {rank}: churn labels unbalanced in customers_{rank}.csv "
              f"(positives 0.93 > 0.80 limit), refusing to export", flush=True)
        sys.exit(4)
    fabric.save(f"{WORK}/export/churn_fabric.ckpt", {"model": net})
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/churn_fabric.ckpt", flush=True)


def main():
    a = parse()
    if a.prepare:
        prepare()
        return
    if a.fabric:
        run_fabric(a)
    else:
        run_trainer(a)


if __name__ == "__main__":
    main()
