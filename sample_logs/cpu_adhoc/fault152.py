"""A hundred-and-fifty-second hand-run batch: PRUNING AND SPARSITY (torch.nn.utils.prune UNDER DDP).

An MLP Linear(16,32)-ReLU-Linear(32,32)-ReLU-Linear(32,4) trained on a synthetic 4-class problem, wrapped in DDP
(`--ddp 0`: gradients all_reduced by hand as one flat tensor). Rank 0 writes a pruning schedule (prune_schedule.json:
layers, steps, amount) before a barrier; every rank reads it. At each scheduled step every rank applies
l1_unstructured to the listed layers, all_reduces a per-layer [zeros, numel] tensor and prints the global sparsity;
after the last prune the masks are made permanent with prune.remove and the model is fine-tuned. The logits are
standardized per class over the batch before the loss (a calibration trick), and the program checks the loss is
finite. Prints `rank R step S loss L`. Rank 0 saves a sparse checkpoint at the end; `--init 1` loads it first.
Faults:
- amount: the schedule's amount is 1.5 (a percent-vs-fraction typo) on every rank: prune raises ValueError.
- layername: the schedule names 'fc_2' for 'fc2' on every rank: getattr on the model raises AttributeError.
- removeonly: rank N calls prune.remove on fc3, a layer it never pruned: ValueError from prune.remove.
- extralayer: rank N also prunes fc3 (a stale local override): its sparsity all_reduce has 3 rows, the others 2.
- ckpt: the final checkpoint is saved before prune.remove (weight_orig/weight_mask); --init 1 loads it unpruned.
- nan: rank N's amount for fc1 is 1.0 (off-by-one in the per-rank ramp): fc1 is all zeros, the loss check fires.
- wait: rank N waits for a re-prune ready file that is never written before the second prune; the others wait.
- schedfile: rank N reads the schedule from a node-local cache dir that does not exist: FileNotFoundError.
- unreachable: rank N prints that its sparsity target is unreachable and exits with code 3.
- segv: rank N is killed by SIGSEGV while pruning at the second scheduled step.
What happened (filled in after the runs):
- amount: every rank ValueError 'amount=1.5 should either be a float in the range [0, 1]...' at step 2.
- layername: every rank AttributeError "'MLP' object has no attribute 'fc_2'" (line 119).
- removeonly: rank N ValueError 'has to be pruned before pruning can be removed' (line 160).
- extralayer: DETAIL: 'Detected mismatch between collectives' [3, 2] vs [2, 2]; plain: 12 s timeouts.
- ckpt: every rank load_state_dict Missing fc1.weight, Unexpected fc1.weight_orig/mask (line 134).
- nan: rank N FloatingPointError 'loss is nan (fc1 sparsity 1.00)' at step 2 (line 169).
- wait: PG 12 s: peers 'Timed out waiting 12000ms' (line 102); PG 300 s: timeout 60, exit 124.
- schedfile: rank N FileNotFoundError '/tmp/job_work/nodeN_cache/prune_schedule.json' (line 92).
- unreachable: rank N prints 'sparsity target 0.51 unreachable', exitcode 3; peers reset/closed.
- segv: rank N exitcode -11 (SIGSEGV) at step 4; with --max-restarts 1 the retry dies in connectFullMesh.
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
import torch.nn.utils.prune as prune
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--steps", type=int, default=7)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--init", type=int, default=0)
p.add_argument("--out", default="/tmp/fault152_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)


def hit(name):
    return a.fault == name and (a.rank == -1 or a.rank == RANK)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def write_schedule(path):
    sched = {"layers": ["fc1", "fc2"], "steps": [2, 4], "amount": 0.3, "target": 0.51}
    if a.fault == "amount":
        sched["amount"] = 1.5
    if a.fault == "layername":
        sched["layers"] = ["fc1", "fc_2"]
    with open(path, "w") as f:
        json.dump(sched, f)


def read_schedule():
    path = os.path.join(a.out, "prune_schedule.json")
    if hit("schedfile"):
        path = os.path.join(a.out, f"node{RANK}_cache", "prune_schedule.json")
    with open(path) as f:
        return json.load(f)


def sparsity_report(model, names, step):
    rows = []
    for n in names:
        w = getattr(model, n).weight
        rows.append([float((w == 0).sum()), float(w.numel())])
    t = torch.tensor(rows)
    dist.all_reduce(t)
    parts = " ".join(f"{n} {t[i, 0] / t[i, 1]:.2f}" for i, n in enumerate(names))
    total = float(t[:, 0].sum() / t[:, 1].sum())
    print(f"rank {RANK} step {step} sparsity {parts} global {total:.3f}", flush=True)
    return total


def apply_pruning(model, sched, step, round_idx):
    layers = list(sched["layers"])
    if hit("extralayer"):
        layers.append("fc3")
    for n in layers:
        amount = sched["amount"]
        if hit("nan") and n == "fc1":
            amount = min(1.0, amount * 4 * RANK)
        if hit("segv") and round_idx == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        prune.l1_unstructured(getattr(model, n), name="weight", amount=amount)
    return layers


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    os.makedirs(a.out, exist_ok=True)
    if RANK == 0:
        write_schedule(os.path.join(a.out, "prune_schedule.json"))
    dist.barrier()
    sched = read_schedule()
    torch.manual_seed(0)
    model = MLP()
    ckpt_path = os.path.join(a.out, "sparse_ckpt.pt")
    if a.init:
        model.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
        print(f"rank {RANK} loaded {ckpt_path}", flush=True)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + RANK)
    proj = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    pruned = []
    for step in range(a.steps):
        if step in sched["steps"]:
            r = sched["steps"].index(step)
            if hit("wait") and r == 1:
                ready = os.path.join(a.out, f"reprune_ready_{step}")
                t0 = time.time()
                while not os.path.exists(ready) and time.time() - t0 < 3 * a.pg_timeout:
                    time.sleep(0.5)
            pruned = apply_pruning(model, sched, step, r)
            total = sparsity_report(model, pruned, step)
            if hit("unreachable") and r == 1:
                print(f"rank {RANK}: sparsity target {sched['target']} unreachable "
                      f"(global {total:.3f} after {r + 1} rounds), giving up", flush=True)
                sys.stdout.flush()
                os._exit(3)
            if r == len(sched["steps"]) - 1 and a.fault != "ckpt":
                if hit("removeonly"):
                    pruned = pruned + ["fc3"]
                for n in pruned:
                    prune.remove(getattr(model, n), "weight")
                print(f"rank {RANK} step {step} masks made permanent for {','.join(pruned)}", flush=True)
        x = torch.randn(32, 16, generator=g)
        y = (x @ proj).argmax(1)
        out = net(x)
        z = (out - out.mean(0)) / out.std(0)
        loss = F.cross_entropy(z, y)
        if not torch.isfinite(loss):
            sp = float((model.fc1.weight == 0).float().mean())
            raise FloatingPointError(f"rank {RANK} step {step}: loss is {loss.item()} (fc1 sparsity {sp:.2f})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            grads = [p_.grad for p_ in model.parameters()]
            flat = torch.cat([gr.reshape(-1) for gr in grads])
            dist.all_reduce(flat)
            flat /= WORLD
            off = 0
            for gr in grads:
                gr.copy_(flat[off:off + gr.numel()].view_as(gr))
                off += gr.numel()
        opt.step()
        print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
    if RANK == 0:
        torch.save(model.state_dict(), ckpt_path)
        if a.fault == "ckpt":
            for n in pruned:
                prune.remove(getattr(model, n), "weight")
        print(f"rank 0 saved {ckpt_path} ({len(model.state_dict())} tensors)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
