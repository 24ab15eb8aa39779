"""A hundred-and-forty-first hand-run batch: SEVERAL TRIALS IN ONE JOB (A HYPERPARAMETER SWEEP INSIDE TORCHRUN).

A small learning-rate/width sweep run inside one torchrun job. For each trial of the sweep list (lr, width, wd)
every rank builds Linear(8,W)-ReLU-Linear(W,1), wraps it in DDP (`--ddp 0`: rank 0's weights broadcast and the
gradients all-reduced by hand), optionally warm-starts from the previous trial's checkpoint when the width
matches (`--warm 1`), trains `--steps` steps printing `rank R step S loss L`, all_reduces a validation metric
vector (a per-trial subgroup from `dist.new_group` with `--subgroup 1`), and rank 0 logs `trial K lr X: val Y`
and saves trial_K.pt. `--reinit 1` destroys and re-creates the default process group between trials. At the
end every rank writes its results, rank 0 reads the summary, barrier, destroy_process_group().

Faults:
- width: rank N parses the width list rotated by one (32 for 16): DDP's parameter shape check fails in trial 1.
- nanlr: trial 3's lr is 1e2 (a lost minus sign in 1e-2): the loss check finds NaN/inf on every rank.
- skip: rank N early-stops after trial 1 (its local loss) and goes to the final barrier; the others wait.
- reinit: with --reinit 1, rank N skips destroy_process_group() before re-initialising (double init).
- json: every rank writes the results to one shared path; rank 0 parses it while another rank rewrites it.
- keyerr: trial 2's sweep entry names its weight decay "weight_decay" instead of "wd": KeyError on every rank.
- segv: rank N gets SIGSEGV in trial 2 (a native extension crash).
- oom: rank N's trial-3 activation cache is sized from a wrong count: one huge allocation fails at once.
- ckpt: with --warm 1, rank N skips the width check: trial 2 loads trial_1.pt (width 16) into width 32.
- shape: (--ddp 0) rank N's validation metric vector has an extra entry in trial 2's all_reduce.
- data: rank N's trial-2 data has 9 features (stale feature count): a matmul shape error.
What happened (filled in after the runs):
- width: RuntimeError 'params[0] ... sizes [32, 8] appears not to match' (DDP ctor, line 108) on rank N, trial 1.
- nanlr: every rank FloatingPointError 'trial 3 step 3: loss is inf (lr 100.0)' (line 122).
- skip: rank N waits in the final barrier; PG 12 s: gloo 12000ms timeouts on all; PG 300 s: killed by timeout 60.
- reinit: ValueError 'trying to initialize the default process group twice!' (line 93 via 173) on rank N.
- json: rank 0 JSONDecodeError 'Expecting property name ... (char 64)' (line 159); others SIGTERMed.
- keyerr: every rank KeyError 'wd' at the optimizer (line 113) in trial 2.
- segv: rank N exitcode -11 (SIGSEGV) at trial 2's start; with --max-restarts 1 the retry dies in connectFullMesh.
- oom: rank N RuntimeError DefaultCPUAllocator can't allocate 17592186044416 bytes in trial 3; peers Connection closed.
- ckpt: RuntimeError size mismatch for 0.weight [16, 8] vs [32, 8] (load_state_dict, line 105) on rank N, trial 2.
- shape: DETAIL: every rank 'Detected mismatch between collectives', ALLREDUCE TensorShape=[5] on rank N vs [4].
- data: rank N RuntimeError 'mat1 and mat2 shapes cannot be multiplied (16x9 and 8x32)' in trial 2's forward.
"""
import argparse
import json
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--warm", type=int, default=0)
p.add_argument("--reinit", type=int, default=0)
p.add_argument("--subgroup", type=int, default=0)
p.add_argument("--widths", default="16,32,32")
p.add_argument("--out", default="/tmp/fault141_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


def sweep_config():
    widths = [int(w) for w in a.widths.split(",")]
    if a.fault == "width" and hit():
        widths = widths[1:] + widths[:1]
    lrs = [0.05, 0.02, 0.01]
    if a.fault == "nanlr":
        lrs[2] = float("1e2")
    trials = [{"lr": lr, "width": w, "wd": 1e-4} for lr, w in zip(lrs, widths)]
    if a.fault == "keyerr":
        trials[1]["weight_decay"] = trials[1].pop("wd")
    return trials


def make_data(k):
    nfeat = 9 if (a.fault == "data" and hit() and k == 2) else 8
    g = torch.Generator().manual_seed(100 * k + RANK)
    x = torch.randn(64, nfeat, generator=g)
    y = x[:, :8].sum(dim=1, keepdim=True) * 0.3 + 0.1
    return x, y


def init_pg():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))


def run_trial(k, cfg, group):
    torch.manual_seed(k)
    net = nn.Sequential(nn.Linear(8, cfg["width"]), nn.ReLU(), nn.Linear(cfg["width"], 1))
    if a.warm and k > 1 and not dist.barrier():
        src = k - 2 if (a.fault == "ckpt" and hit() and k > 2) else k - 1
        ck = os.path.join(a.out, f"trial_{src}.pt")
        if src >= 1 and os.path.exists(ck):
            sd = torch.load(ck, map_location="cpu")
            if a.fault == "ckpt" and hit() or sd["width"] == cfg["width"]:
                net.load_state_dict(sd["model"])
                print(f"rank {RANK} trial {k}: warm start from {ck}", flush=True)
    if a.ddp:
        model = DDP(net)
    else:
        for prm in net.parameters():
            dist.broadcast(prm.data, src=0)
        model = net
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"])
    x, y = make_data(k)
    if a.fault == "segv" and hit() and k == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    loss = None
    for step in range(a.steps):
        opt.zero_grad()
        loss = ((model(x[step * 16:(step + 1) * 16]) - y[step * 16:(step + 1) * 16]) ** 2).mean()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"trial {k} step {step}: loss is {loss.item()} (lr {cfg['lr']})")
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
    if a.fault == "oom" and hit() and k == 3:
        cache = torch.empty(1 << 42, dtype=torch.float32)
        print(f"rank {RANK} cache {cache.numel()}", flush=True)
    with torch.no_grad():
        n = 5 if (a.fault == "shape" and hit() and k == 2) else 4
        vx, vy = x[48:], y[48:]
        err = (net(vx) - vy) ** 2
        metric = torch.tensor([err.sum().item(), float(len(vy)), err.max().item(), loss.item()] + [0.0] * (n - 4))
    dist.all_reduce(metric, group=group)
    val = metric[0].item() / metric[1].item()
    if RANK == 0:
        print(f"trial {k} lr {cfg['lr']} width {cfg['width']}: val {val:.4f}", flush=True)
        torch.save({"model": net.state_dict(), "width": cfg["width"]}, os.path.join(a.out, f"trial_{k}.pt"))
    return {"trial": k, "lr": cfg["lr"], "width": cfg["width"], "val": val, "local_loss": loss.item()}


def write_results(results):
    path = os.path.join(a.out, "sweep_results.json")
    if a.fault == "json" or RANK == 0:
        text = json.dumps({"rank": RANK, "results": results}, indent=1) if RANK == 0 or not time.sleep(1.0) else ""
        with open(path, "w") as f:
            for i in range(0, len(text), 16):
                f.write(text[i:i + 16])
                f.flush()
                if RANK != 0:
                    time.sleep(0.3)
    if RANK == 0:
        time.sleep(2.0)
        with open(path) as f:
            summary = json.load(f)
        best = min(summary["results"], key=lambda r: r["val"])
        print(f"best trial {best['trial']}: lr {best['lr']} width {best['width']} val {best['val']:.4f}", flush=True)


def main():
    os.makedirs(a.out, exist_ok=True)
    init_pg()
    print(f"rank {RANK}/{WORLD} sweep starting", flush=True)
    results = []
    for k, cfg in enumerate(sweep_config(), start=1):
        if k > 1 and a.reinit:
            if not (a.fault == "reinit" and hit()):
                dist.destroy_process_group()
            init_pg()
        group = dist.new_group(list(range(WORLD))) if a.subgroup else None
        results.append(run_trial(k, cfg, group))
        if group is not None:
            dist.destroy_process_group(group)
        if a.fault == "skip" and hit() and results[-1]["local_loss"] < 10.0:
            print(f"rank {RANK} early stop after trial {k}: loss {results[-1]['local_loss']:.4f}", flush=True)
            break
    write_results(results)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()
