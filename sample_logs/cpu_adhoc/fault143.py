"""A hundred-and-forty-third hand-run batch: ELASTIC JOBS AND MEMBERSHIP CHANGES.

A small elastic DDP regression job (Linear(8,32)-ReLU-Linear(32,1); `--ddp 0`: rank 0's weights broadcast and
the gradients all-reduced by hand) launched by torchrun, often with `--nnodes 1:2`, c10d rendezvous and
`--max-restarts`. Each rank prints its WORLD_SIZE and TORCHELASTIC_RESTART_COUNT at start, builds its shard,
optionally resumes from a step snapshot (`--resume S`), trains `--steps` steps printing `rank R step S loss L`,
all_gathers the per-rank sample counts, all_reduces a validation vector, rank 0 saves snap_stepS.pt, destroy.

Faults:
- repeat: rank N's warmup config is 0 steps; the lr schedule raises ValueError in every attempt.
- once: rank N reads the token cache before rank 0 has built it (attempt 0 only): FileNotFoundError.
- kill: rank N is SIGKILLed at step 2 (as the kernel's OOM killer would).
- exit3: rank N finds its shard checksum wrong at step 1, prints it and calls os._exit(3).
- late: no fault in the program; a second agent is started past the rendezvous join window.
- hang: rank N waits at step 2 for a lock file that is never released; the others wait in the all_reduce.
- nan: rank N's shard holds an inf; the program's loss check raises FloatingPointError.
- ckpt: with --resume S, rank N looks for snap_step(S+1).pt (an off-by-one): FileNotFoundError.
- shape: rank N gathers its sample count as a 2-entry tensor against 1 in the all_gather.
- env: rank N (the logging rank) reads TORCHELASTIC_RUN_ID_ (a typo) from the environment: KeyError.
- sched: every rank adds the restart count as a string to the warmup steps: TypeError.
What happened (filled in after the runs):
- repeat: ValueError 'warmup_steps must be positive, got 0' (line 80) on rank N; the restart died in connectFullMesh.
- once: FileNotFoundError .../once1_tokens.pt (attempt 0); attempt 1 connectFullMesh refused, then timeout 100.
- kill: rank N exitcode -9 (SIGKILL) after step 1; peers Connection closed/reset by peer.
- exit3: rank N prints its checksum line and exits 3 at step 1; peers Connection closed/reset by peer.
- late: node 0 ran alone (world 2); node 1's arrival restarted it; re-rendezvous DistStoreError 60000ms.
- hang: PG 12 s: the others time out (12000ms) in the step-2 all_reduce; PG 300 s: killed by timeout 60.
- nan: FloatingPointError 'rank N step 2: loss is nan' (line 154); peers Connection closed by peer.
- ckpt: FileNotFoundError .../snap_step7.pt from torch.load (line 125) on rank N; the others resumed.
- shape: DETAIL: every rank 'Detected mismatch', ALLGATHER TensorShape=[2] on rank N vs [1].
- env: KeyError 'TORCHELASTIC_RUN_ID_' (line 88) on rank N before step 0; the others SIGTERMed.
- sched: every rank TypeError unsupported operand type(s) for +: 'int' and 'str' (line 117).
"""
import argparse
import math
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
p.add_argument("--steps", type=int, default=6)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--tag", default="run")
p.add_argument("--out", default="/tmp/fault143_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RESTART = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def lr_at(step, base, warmup):
    if warmup <= 0:
        raise ValueError(f"warmup_steps must be positive, got {warmup}")
    return base * min(1.0, (step + 1) / warmup)


def run_name():
    key = "TORCHELASTIC_RUN_ID"
    if a.fault == "env" and hit():
        key = "TORCHELASTIC_RUN_ID_"
    return os.environ[key]


def make_shard():
    g = torch.Generator().manual_seed(1000 + RANK)
    x = torch.randn(96, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.3 + 0.1
    if a.fault == "nan" and hit():
        x[37, 4] = float("inf")
    return x, y


def main():
    print(f"rank {RANK} world {WORLD} restart {RESTART} pid {os.getpid()}", flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    cache = os.path.join(a.out, f"{a.tag}_tokens.pt")
    if RANK == 0 and not os.path.exists(cache):
        time.sleep(1.0)
        torch.save({"vocab": 512}, cache)
    if a.fault == "once" and hit():
        vocab = torch.load(cache)["vocab"]
    else:
        vocab = 512
    if RANK == 0 or (a.fault == "env" and hit()):
        print(f"rank {RANK} run {run_name()} vocab {vocab}", flush=True)
    warmup = 3
    if a.fault == "repeat" and hit():
        warmup = 0
    if a.fault == "sched":
        warmup = warmup + RESTART
    x_all, y_all = make_shard()
    torch.manual_seed(0)
    net = Net()
    if a.resume:
        step0 = a.resume
        if a.fault == "ckpt" and hit():
            step0 = a.resume + 1
        sd = torch.load(os.path.join(a.out, f"snap_step{step0}.pt"), map_location="cpu")
        net.load_state_dict(sd["model"])
        print(f"rank {RANK} resumed from step {sd['step']}", flush=True)
    if a.ddp:
        model = DDP(net)
    else:
        model = net
        for prm in net.parameters():
            dist.broadcast(prm.data, src=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    dist.barrier()
    bs = 16
    for s in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s, 0.05, warmup)
        lo = (s * bs) % x_all.shape[0]
        x, y = x_all[lo:lo + bs], y_all[lo:lo + bs]
        if a.fault == "kill" and hit() and s == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault == "exit3" and hit() and s == 1:
            print(f"rank {RANK}: shard {RANK} checksum mismatch (expected 0x5e1f, got 0x0000), giving up", flush=True)
            os._exit(3)
        if a.fault == "hang" and hit() and s == 2:
            lock = os.path.join(a.out, f"{a.tag}_shard{RANK}.lock")
            open(lock, "w").write("busy\n")
            while os.path.exists(lock):
                time.sleep(1.0)
        loss = F.mse_loss(model(x), y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {RANK} step {s}: loss is {loss.item()}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        print(f"rank {RANK} step {s} loss {loss.item():.4f}", flush=True)
        time.sleep(0.3)
    count = torch.tensor([float(x_all.shape[0])])
    if a.fault == "shape" and hit():
        count = torch.tensor([float(x_all.shape[0]), 0.0])
    counts = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_gather(counts, count)
    with torch.no_grad():
        pred = net(x_all[:32])
        err = pred - y_all[:32]
        vec = torch.stack([err.pow(2).sum(), err.abs().sum(), torch.tensor(32.0)])
    dist.all_reduce(vec)
    if RANK == 0:
        total = sum(c.item() for c in counts)
        print(f"samples {total:.0f} val mse {vec[0].item() / vec[2].item():.4f}", flush=True)
        torch.save({"model": net.state_dict(), "step": a.steps}, os.path.join(a.out, f"snap_step{a.steps}.pt"))
    dist.barrier()
    print(f"rank {RANK} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
