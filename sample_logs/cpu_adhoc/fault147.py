"""A hundred-and-forty-seventh hand-run batch: CONTINUAL LEARNING WITH GROWING HEADS.

A class-incremental classifier (body Linear(8,16)-ReLU, head Linear(16,C)) trained over `--tasks` tasks in
sequence, `--cpt` new classes per task. At each new task the head grows: a new nn.Linear with the old rows
copied in; the DDP wrapper and the Adam optimizer are rebuilt around the grown model. Each task runs
`--steps` steps printing `rank R task T step S loss L`; from task 1 a distillation loss on the old logits
(temperature `--temp`) is added, and a rehearsal phase replays each rank's exemplar buffer (kept on disk
per rank) with an all_reduce of the replay loss. After each task: barrier, evaluation on all seen tasks,
an all_reduce of the accuracy matrix, rank 0 saves ckpt_task<T>.pt. At the end every rank reloads the last
checkpoint into a fresh grown model, barrier, destroy_process_group(). `--ddp 0` broadcasts the weights and
all-reduces the gradients by hand instead of DDP.
Faults:
- headgrow: rank N grows its head by cpt+1 classes at task 1 (DDP's parameter shape check on re-wrap).
- optstate: rank N carries the old Adam state into the rebuilt optimizer at task 1 (stale moment shapes).
- labeloff: rank N offsets the new task's labels twice at task 1 (targets beyond the head).
- replay: rank N's exemplar quota is memory // (classes * WORLD * 8) = 0: empty buffer, skips rehearsal.
- accwidth: rank N builds its accuracy matrix with tasks+1 columns (all_reduce of another size).
- oldckpt: the final reload picks ckpt_task0.pt (2-class head) into the grown model on every rank.
- distnan: rank N reads a distillation temperature of 0 from its config: the program's finiteness check.
- sigkill: rank N is killed by SIGKILL at the switch to task 1.
- typeerr: every rank reads classes-per-task as a string when growing the head.
- replaymiss: rank N looks for its exemplar file in a stale directory at task 1 (file not there).
What happened (filled in after the runs):
- headgrow: rank N RuntimeError '[N]: params[2] in this process with sizes [5, 16] appears not to match' (DDP, line 140).
- optstate: rank N RuntimeError 'The size of tensor a (2) must match the size of tensor b (4)' in Adam step (line 168).
- labeloff: rank N IndexError 'Target 5 is out of bounds.' in cross_entropy (line 156); peers Connection closed.
- replay: PG 12 s: peers time out 12000ms in rehearsal (line 180), rank N in barrier; PG 300 s: killed by timeout 60.
- accwidth: DETAIL --ddp 0: 'Detected mismatch between collectives' [3, 4] vs [3, 3]; plain: gloo EnforceNotMet 8 vs 4, SIGABRT.
- oldckpt: every rank RuntimeError loading state_dict: size mismatch for head.weight [2, 16] vs [6, 16] (line 217).
- distnan: rank N FloatingPointError 'non-finite distillation loss nan at task 1 step 0 (T=0.0)' (line 163).
- sigkill: rank N exitcode -9 (SIGKILL) at task 1; peers Connection closed by peer in the DDP re-wrap (line 140).
- typeerr: every rank TypeError 'unsupported operand type(s) for +: 'int' and 'str'' in grow_head (line 139).
- replaymiss: rank N FileNotFoundError '/tmp/job_work/prev_run/replay_rankN_task0.pt' (line 175); peers closed.
"""
import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--tasks", type=int, default=3)
p.add_argument("--cpt", default="2")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--memory", type=int, default=40)
p.add_argument("--temp", default="2.0")
p.add_argument("--out", default="/tmp/fault147_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def hit():
    return a.fault != "none" and (a.rank == -1 or a.rank == RANK)


class Net(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


def grow_head(model, n_new):
    old = model.head
    new = nn.Linear(old.in_features, old.out_features + n_new)
    with torch.no_grad():
        new.weight[: old.out_features].copy_(old.weight)
        new.bias[: old.out_features].copy_(old.bias)
    model.head = new
    return model


def task_data(t, cpt, n=48):
    g = torch.Generator().manual_seed(1000 * t + RANK)
    y = torch.randint(0, cpt, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + (y.float() + 2 * t).unsqueeze(1) * 0.5
    return x, y


def wrap(model):
    if a.ddp:
        return DDP(model)
    for prm in model.parameters():
        dist.broadcast(prm.data, src=0)
    return model


def sync_grads(model):
    if a.ddp:
        return
    for prm in model.parameters():
        if prm.grad is not None:
            dist.all_reduce(prm.grad)
            prm.grad /= WORLD


def replay_path(t):
    return os.path.join(a.out, f"replay_rank{RANK}_task{t}.pt")


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    cpt = int(a.cpt)
    temp = float(a.temp)
    model = Net(cpt)
    net = wrap(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    old_model = None
    seen = 0
    for t in range(a.tasks):
        if t > 0:
            if a.fault == "sigkill" and hit():
                os.kill(os.getpid(), signal.SIGKILL)
            n_new = cpt
            if a.fault == "typeerr" and hit():
                n_new = a.cpt
            if a.fault == "headgrow" and hit() and t == 1:
                n_new = cpt + 1
            old_model = Net(seen)
            old_model.load_state_dict(model.state_dict())
            old_model.eval()
            model = grow_head(model, n_new)
            net = wrap(model)
            old_opt = opt
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            if a.fault == "optstate" and hit() and t == 1:
                opt.load_state_dict(old_opt.state_dict())
            print(f"rank {RANK} task {t} head grown to {model.head.out_features} classes", flush=True)
        x, y = task_data(t, cpt)
        offset = seen
        if a.fault == "labeloff" and hit() and t == 1:
            offset = seen + t * cpt
        y = y + offset
        if a.fault == "distnan" and hit():
            temp = float("0")
        for s in range(a.steps):
            idx = torch.arange(s * 16, (s + 1) * 16)
            logits = net(x[idx])
            loss = F.cross_entropy(logits, y[idx])
            if old_model is not None:
                with torch.no_grad():
                    old_logits = old_model(x[idx])
                kd = F.kl_div(F.log_softmax(logits[:, :seen] / temp, dim=1),
                              F.softmax(old_logits / temp, dim=1), reduction="batchmean") * temp * temp
                if not torch.isfinite(kd):
                    raise FloatingPointError(f"rank {RANK}: non-finite distillation loss {kd.item()} at task {t} step {s} (T={temp})")
                loss = loss + kd
            opt.zero_grad()
            loss.backward()
            sync_grads(model)
            opt.step()
            print(f"rank {RANK} task {t} step {s} loss {loss.item():.4f}", flush=True)
            time.sleep(0.2)
        if t > 0:
            src = replay_path(t - 1)
            if a.fault == "replaymiss" and hit() and t == 1:
                src = os.path.join(a.out, "prev_run", f"replay_rank{RANK}_task{t - 1}.pt")
            buf_x, buf_y = torch.load(src)
            if len(buf_y) > 0:
                for r in range(2):
                    rl = F.cross_entropy(net(buf_x[r * 4:(r + 1) * 4]), buf_y[r * 4:(r + 1) * 4])
                    opt.zero_grad()
                    rl.backward()
                    sync_grads(model)
                    opt.step()
                    stat = rl.detach().reshape(1).clone()
                    dist.all_reduce(stat)
                    print(f"rank {RANK} task {t} replay {r} loss {stat.item() / WORLD:.4f}", flush=True)
            else:
                print(f"rank {RANK} task {t} replay buffer empty, skipping rehearsal", flush=True)
        seen += model.head.out_features - seen
        quota = a.memory // (seen * 2)
        if a.fault == "replay" and hit():
            quota = a.memory // (seen * WORLD * 8)
        keep = torch.cat([torch.nonzero(y == c).flatten()[:quota] for c in range(seen - cpt, seen)])
        if t > 0:
            prev_x, prev_y = torch.load(replay_path(t - 1)) if os.path.exists(replay_path(t - 1)) else (x[:0], y[:0])
            buf = (torch.cat([prev_x, x[keep]]), torch.cat([prev_y, y[keep]]))
        else:
            buf = (x[keep], y[keep])
        torch.save(buf, replay_path(t))
        dist.barrier()
        cols = a.tasks + 1 if a.fault == "accwidth" and hit() else a.tasks
        acc = torch.zeros(a.tasks, cols)
        with torch.no_grad():
            for k in range(t + 1):
                ex, ey = task_data(k, cpt)
                pred = model(ex).argmax(1)
                acc[t, k] = (pred == ey + k * cpt).float().mean()
        dist.all_reduce(acc)
        acc /= WORLD
        if RANK == 0:
            print(f"rank 0 task {t} accuracy row {[round(v, 3) for v in acc[t, : t + 1].tolist()]}", flush=True)
            torch.save(model.state_dict(), os.path.join(a.out, f"ckpt_task{t}.pt"))
    dist.barrier()
    last = a.tasks - 1
    if a.fault == "oldckpt":
        last = 0
    fresh = Net(seen)
    fresh.load_state_dict(torch.load(os.path.join(a.out, f"ckpt_task{last}.pt")))
    print(f"rank {RANK} reloaded ckpt_task{last}.pt with {seen} classes", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
