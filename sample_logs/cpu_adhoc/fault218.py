"""A two-hundred-and-eighteenth hand-run batch: HYPERNETWORK FOR CONTINUAL TASKS. A hypernetwork maps a learned
task embedding to the flat weights of a small target MLP (3 -> 16 -> 1), trained with DDP over a sequence of
synthetic regression tasks read from a task list file; a regulariser keeps the weights generated for earlier tasks
close to snapshots taken when those tasks ended; per-task losses are all_reduced and the evaluation losses over all
tasks seen so far are all_gathered. Launch with torchrun / a bash loop (env://) or --spawn N (mp.spawn).

Faults:
- wsize: the target hidden width in the config is 20 on every rank, so the generated weights do not split (every rank).
- tasklist: --rank reads the task list from a node-local path that does not exist (FileNotFoundError).
- taskid: --rank appends one task id equal to the number of task embeddings (IndexError in the embedding).
- snapshot: --rank stores the regulariser snapshots under string keys and looks them up by int (KeyError).
- losslen: --rank also reports the current task's loss twice, so its all_gathered eval losses are longer.
- wnorm: --rank reads a weight gain of 1e39; its generated weight norm overflows and the program's check raises.
- ckptemb: --rank builds the hypernetwork with task embedding size 12 and warm-starts from the size-8 checkpoint.
- lrstr: the learning rate in the config is the string "1e-3" on every rank (TypeError in the optimizer).
- slowreg: --rank re-evaluates every earlier task for --slow-s seconds before the task-loss all_reduce.
- segv: --rank sends itself SIGSEGV after step 2 of task 0.
- exit5: --rank prints an error about its task data and exits with code 5.
- none: control.

What happened (filled in after the runs):
- wsize: every rank RuntimeError 'split_with_sizes expects split_sizes to sum exactly to 81 ... [60, 20, 20, 1]' at step 0 (np3, np4).
- tasklist: rank N FileNotFoundError on /tmp/job_work/nodeN/tasks.json after the first barrier; peers Connection closed / SIGTERMed.
- taskid: rank N IndexError 'index out of range in self' at task id 4, after the peers finished and rank 0 saved (np3 r2, np5 r3).
- snapshot: rank N KeyError: 0 in the regulariser at task 1; peers Connection closed (np4 r3: rank 0 then aborts, exit 134).
- losslen: a peer aborts with gloo EnforceNotMet '4 vs 2 ... Received data size doesn't match expected size' (SIGABRT).
- wnorm: rank N FloatingPointError 'generated weight norm is inf for task 0 at step 0'; peers Connection closed by peer.
- ckptemb: rank N RuntimeError loading state_dict: size mismatch for task_emb.weight [4, 8] vs [4, 12]; peers closed/SIGTERMed.
- lrstr: every rank TypeError "'<=' not supported between instances of 'float' and 'str'" in Adam's __init__ (np3).
- slowreg: PG 12 s: peers gloo 'Timed out waiting 12000ms' in the all_reduce; PG 300 s: killed by timeout 60, exit 124.
- segv: rank N exitcode -11 (SIGSEGV) after step 2; legacy Root Cause rank 3, spawn ProcessExitedException process 1.
- exit5: rank N prints 'ERROR rank N: task 1 has 0 samples left ...' then exits 5 (np4 files) or aborts -6 (np3 tee).
- none: exit 0; rank 0 logs 'saved hypernetwork to /tmp/job_work/hnet_final.pt after 12 steps over 3 tasks'.
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault218_work"
LOG = None


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tasks", type=int, default=3)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    return p.parse_args()


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(a, rank):
    global LOG
    if a.logfmt:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        LOG = logging.getLogger("hnet")
        LOG.addFilter(RankFilter(rank))
        LOG.addHandler(h)
        LOG.setLevel(logging.INFO)


def info(msg):
    if LOG is not None:
        LOG.info(msg)
    else:
        print(msg, flush=True)


def error(msg):
    if LOG is not None:
        LOG.error(msg)
    else:
        print(msg, file=sys.stderr, flush=True)


class HyperNet(nn.Module):
    def __init__(self, n_tasks, emb_dim, n_out):
        super().__init__()
        self.task_emb = nn.Embedding(n_tasks, emb_dim)
        self.body = nn.Sequential(nn.Linear(emb_dim, 32), nn.ReLU(), nn.Linear(32, n_out))

    def forward(self, task_id):
        return self.body(self.task_emb(task_id))


def target_forward(flat, x, cfg):
    i, h = cfg["in"], cfg["hidden"]
    w1, b1, w2, b2 = torch.split(flat, [h * i, h, h, 1])
    hid = torch.tanh(F.linear(x, w1.view(h, i), b1))
    return F.linear(hid, w2.view(1, h), b2)


def task_data(task, rank, n=32):
    g = torch.Generator().manual_seed(1000 * task + rank)
    x = torch.randn(n, 3, generator=g)
    coef = torch.tensor([1.0 + task, -0.5 * task, 0.3])
    return x, torch.sin(x @ coef).unsqueeze(1)


def worker(rank, world, a):
    fault_here = a.fault != "none" and a.rank in (-1, rank)
    setup_log(a, rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    cfg = {"in": 3, "hidden": 16, "emb_dim": 8, "n_tasks": 4, "lr": 1e-3, "beta": 0.1, "gain": 1.0,
           "task_list": f"{WORK}/tasks.json"}
    if a.fault == "wsize" and fault_here:
        cfg["hidden"] = 20
    if a.fault == "lrstr" and fault_here:
        cfg["lr"] = "1e-3"
    if a.fault == "wnorm" and fault_here:
        cfg["gain"] = 1e39
    if a.fault == "ckptemb" and fault_here:
        cfg["emb_dim"] = 12
    if a.fault == "tasklist" and fault_here:
        cfg["task_list"] = f"/tmp/fault218_work/node{rank}/tasks.json"
    n_out = 3 * 16 + 16 + 16 + 1
    if rank == 0:
        with open(f"{WORK}/tasks.json", "w") as f:
            json.dump({"tasks": list(range(a.tasks)), "samples": 32}, f)
        torch.save(HyperNet(cfg["n_tasks"], 8, n_out).state_dict(), f"{WORK}/hnet_init.pt")
    dist.barrier()
    with open(cfg["task_list"]) as f:
        tasks = json.load(f)["tasks"]
    if a.fault == "taskid" and fault_here:
        tasks = tasks + [cfg["n_tasks"]]
    info(f"rank {rank} world {world} tasks {tasks} target {cfg['in']}x{cfg['hidden']}x1 ({n_out} weights)")
    model = HyperNet(cfg["n_tasks"], cfg["emb_dim"], n_out)
    model.load_state_dict(torch.load(f"{WORK}/hnet_init.pt"))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
    snapshots = {}
    step = 0
    for t in tasks:
        x, y = task_data(t, rank)
        tid = torch.tensor([t])
        for s in range(a.steps):
            flat = ddp(tid)[0] * cfg["gain"]
            wn = flat.norm()
            if not torch.isfinite(wn):
                raise FloatingPointError(f"generated weight norm is {wn.item()} for task {t} at step {step}")
            loss = F.mse_loss(target_forward(flat, x, cfg), y)
            for prev in tasks[: tasks.index(t)]:
                old = model.body(model.task_emb(torch.tensor([prev])))[0]
                loss = loss + cfg["beta"] * (old - snapshots[prev]).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            info(f"rank {rank} task {t} step {step} loss {loss.item():.4f} wnorm {wn.item():.3f}")
            if a.fault == "segv" and fault_here and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            step += 1
        if a.fault == "exit5" and fault_here and t == 1:
            error(f"ERROR rank {rank}: task {t} has 0 samples left after outlier filtering (32 read); cannot fit")
            sys.exit(5)
        if a.fault == "slowreg" and fault_here:
            info(f"rank {rank} re-evaluating all earlier tasks before reducing task {t} loss")
            time.sleep(a.slow_s)
        tl = torch.tensor([loss.item()])
        dist.all_reduce(tl)
        with torch.no_grad():
            key = str(t) if (a.fault == "snapshot" and fault_here) else t
            snapshots[key] = model.body(model.task_emb(tid))[0].clone()
            evals = []
            for prev in tasks[: tasks.index(t) + 1]:
                xp, yp = task_data(prev, rank)
                evals.append(F.mse_loss(target_forward(model(torch.tensor([prev]))[0], xp, cfg), yp).item())
            if a.fault == "losslen" and fault_here:
                evals.append(evals[-1])
        ev = torch.tensor(evals)
        gathered = [torch.zeros_like(ev) for _ in range(world)]
        dist.all_gather(gathered, ev)
        if rank == 0:
            mean_ev = torch.stack(gathered).mean(0).tolist()
            info(f"task {t} done: mean loss {tl.item() / world:.4f} eval {[round(v, 4) for v in mean_ev]}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/hnet_final.pt")
        info(f"saved hypernetwork to {WORK}/hnet_final.pt after {step} steps over {len(tasks)} tasks")
    dist.destroy_process_group()


def main():
    a = parse()
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        mp.spawn(worker, args=(a.spawn, a), nprocs=a.spawn)
    else:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()
