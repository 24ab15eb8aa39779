"""A three-hundred-and-twelfth hand-run batch: REPLICA-EXCHANGE STYLE ENSEMBLE TRAINING OF SMALL REGRESSORS.

Every rank holds one replica of an ensemble of 4 small two-layer regressors (batched weights, one bmm per
layer) and trains it on its own synthetic shard /tmp/fault312_work/data/shard_R.pt with an MSE loss.  The
gradients are averaged by DDP over gloo (or by hand with --ddp 0); on top of the step every replica adds
Langevin noise scaled by its temperature, taken from a ladder (a named schedule, geometric by default).
Every second step the ranks all_gather their per-member energies and swap temperatures between neighbouring
rungs with the Metropolis rule (replica exchange, decided by a generator seeded the same on every rank).
The ensemble starts from ckpt/ens_h16.pt; per-rank shard sizes are all_gathered at start, the loss is
all_reduced every step, and rank 0 saves export/ensemble.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  tempkey      - rank N asks the schedule table for "exponential", which it does not have (KeyError, start-up)
  nodata       - rank N reads its shard from data/holdout/, which does not exist (FileNotFoundError)
  ckptsize     - rank N initialises from ckpt/ens_h32.pt, saved with 32 hidden units (size mismatch)
  ckptpickle   - rank N initialises from ckpt/ens_full.pt, a pickled module (weights_only refusal)
  energygather - rank N all_gathers its energies with the ensemble mean appended (5 vs 4 entries, step 1)
  slowswap     - rank N re-equilibrates its chain in pure Python before the step-3 all_reduce (slow rank)
  nanenergy    - rank N's temperature underflows to 0 at step 2: beta = inf, the program's energy check
  sigsegv      - rank N sends itself SIGSEGV after step 3
  exit5        - rank N finds its swap acceptance too low after the last step, prints an error, sys.exit(5)
  featdim      - every rank appends a bias column to the features: 9 wide, the first layer expects 8
  ladderidx    - rank N's swap bookkeeping moves it one rung past the top of the ladder at step 3 (IndexError)
  none         - control, clean run

What happened (filled in after the runs):
  tempkey      - KeyError: 'exponential' at the schedule lookup before any collective; peers Connection closed in the first all_gather (np4 r2 ranklabel, np3 r0 spawn)
  nodata       - FileNotFoundError for data/holdout/shard_N.pt at start-up; peers closed (np5 r3 srunlabel, np3 r1 logfmt, Root Cause rank 1)
  ckptsize     - load_state_dict size mismatch for w1/b1/w2 ([4, 8, 32] vs [4, 8, 16]) (np4 r1 pdsh2, worker-0 RendezvousConnectionError; np3 r2 legacy)
  ckptpickle   - UnpicklingError 'Weights only load failed ... GLOBAL __main__.Ensemble'; peers closed in DDP's param check (np4 r0 mpitag)
  energygather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' after step 1 (np3 r1 tee, np5 r4 bashloop)
  slowswap     - 12 s: 'Timed out waiting 12000ms for recv' on the peers (np3 r2 ranklabel); 300 s: silent after step 2, killed at 60 s, exit 124 (np4 r1 srunlabel)
  nanenergy    - 'non-finite replica energy at step 2: beta inf' then FloatingPointError (np4 r2 files, np3 r0 logfmt)
  sigsegv      - no traceback after step 3; loop exit 139 (np4 r3 mpitag); ProcessExitedException 'process 1 terminated with signal SIGSEGV' (np3 r1 spawn)
  exit5        - rank N's 'ERROR swap acceptance 0.00 ...' line and exit 5 after the last step (np5 r2 tee, Root Cause exitcode 5; np3 r1 files, exit 5)
  featdim      - every rank: 'Expected size for first two dimensions of batch2 tensor to be: [4, 9] but got: [4, 8].' (np3 legacy)
  ladderidx    - IndexError 'index W is out of bounds for dimension 0 with size W' at step 3; peers closed (np4 r0 bashloop --ddp 0, np3 r2 srunlabel)
  none         - clean: 6 steps on 3 ranks, rank 0 saved export/ensemble.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import math
import os
import random
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault312_work"
MEMBERS = 4
FEAT = 8
HIDDEN = 16
SCHEDULES = {
    "geometric": lambda n: [0.01 * (2.0 ** k) for k in range(n)],
    "linear": lambda n: [0.01 + 0.02 * k for k in range(n)],
}
log = None


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("replex")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base.addHandler(h)
    base.setLevel(logging.INFO)
    log = RankAdapter(base, {"rank": rank})


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class Ensemble(nn.Module):
    """MEMBERS independent 2-layer regressors evaluated with one bmm per layer."""

    def __init__(self, members=MEMBERS, feat=FEAT, hidden=HIDDEN):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(members, feat, hidden) / math.sqrt(feat))
        self.b1 = nn.Parameter(torch.zeros(members, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(members, hidden, 1) / math.sqrt(hidden))
        self.b2 = nn.Parameter(torch.zeros(members, 1, 1))

    def forward(self, x):
        xb = x.unsqueeze(0).expand(self.w1.shape[0], -1, -1)
        h = torch.tanh(torch.bmm(xb, self.w1) + self.b1)
        return (torch.bmm(h, self.w2) + self.b2).squeeze(-1)  # [members, batch]


def target_fn(x):
    return torch.sin(x[:, 0] * 2.0) + 0.5 * x[:, 1] * x[:, 2] - 0.3 * x[:, 3] ** 2 + 0.1 * x[:, 4:].sum(1)


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(500 + r)
        x = torch.randn(384, FEAT, generator=g)
        y = target_fn(x) + 0.05 * torch.randn(384, generator=g)
        torch.save({"x": x, "y": y, "rank": r}, f"{WORK}/data/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(Ensemble().state_dict(), f"{WORK}/ckpt/ens_h16.pt")
    torch.save(Ensemble(hidden=32).state_dict(), f"{WORK}/ckpt/ens_h32.pt")
    torch.save(Ensemble(), f"{WORK}/ckpt/ens_full.pt")
    print("prepared", WORK)


def equilibrate(energies, temp, budget):
    """Pure-Python Metropolis walk over member energies (the slow re-equilibration)."""
    rng = random.Random(7)
    e = [float(v) for v in energies]
    t0, moves, acc = time.time(), 0, 0
    while time.time() - t0 < budget:
        i = rng.randrange(len(e))
        prop = e[i] + rng.gauss(0.0, 0.01)
        if prop < e[i] or rng.random() < math.exp(-(prop - e[i]) / max(temp, 1e-6)):
            e[i] = prop
            acc += 1
        moves += 1
    return moves, acc


def exchange(all_e, slots, ladder, step, world):
    """Metropolis swaps of temperature slots between neighbouring rungs; same decision on every rank."""
    g = torch.Generator().manual_seed(9000 + step)
    order = sorted(range(world), key=lambda r: slots[r])
    swaps = 0
    for k in range(step % 2, world - 1, 2):
        a, b = order[k], order[k + 1]
        ea, eb = float(all_e[a].mean()), float(all_e[b].mean())
        ta, tb = float(ladder[slots[a]]), float(ladder[slots[b]])
        delta = (ea - eb) * (1.0 / ta - 1.0 / tb)
        if float(torch.rand(1, generator=g)) < min(1.0, math.exp(min(delta, 50.0))):
            slots[a], slots[b] = slots[b], slots[a]
            swaps += 1
    return swaps


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, schedule {a.schedule}, {MEMBERS} members")
    sched = "exponential" if bad and a.fault == "tempkey" else a.schedule
    ladder = torch.tensor(SCHEDULES[sched](world))
    split = "holdout/" if bad and a.fault == "nodata" else ""
    shard = torch.load(f"{WORK}/data/{split}shard_{rank}.pt")
    x, y = shard["x"], shard["y"]
    if a.fault == "featdim":
        x = torch.cat([x, torch.ones(x.shape[0], 1)], 1)
    n = torch.tensor([x.shape[0]], dtype=torch.long)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, n)
    say(f"rank {rank} shard {int(n)} samples, global {int(sum(int(s) for s in sizes))}")
    model = Ensemble()
    ck = {"ckptsize": "ens_h32.pt", "ckptpickle": "ens_full.pt"}.get(a.fault, "ens_h16.pt") if bad else "ens_h16.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=a.lr)
    slots = list(range(world))
    accepted = 0
    for step in range(a.steps):
        i0 = (step * a.batch) % x.shape[0]
        xb, yb = x[i0:i0 + a.batch], y[i0:i0 + a.batch]
        pred = net(xb)
        energies = ((pred - yb.unsqueeze(0)) ** 2).mean(1)
        loss = energies.mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "ladderidx" and step == 3:
            slots[rank] = world  # off-by-one: promoted past the top rung
        temp = ladder[slots[rank]]
        if bad and a.fault == "nanenergy" and step == 2:
            temp = temp * 1e-300 * 1e-300  # float32 underflow to 0.0
        beta = 1.0 / temp
        if not torch.isfinite(beta * energies).all():
            say(f"rank {rank}: non-finite replica energy at step {step}: beta {float(beta)} "
                f"energies {[round(float(e), 4) for e in energies]}", err=True)
            raise FloatingPointError(f"replica energy is not finite on rank {rank} at step {step} (T={float(temp)})")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * math.sqrt(2.0 * a.lr * float(temp)) * 0.1)
        if bad and a.fault == "slowswap" and step == 3:
            moves, acc = equilibrate(energies.detach(), float(temp), a.slow_budget)
            say(f"rank {rank} re-equilibrated: {moves} moves, {acc} accepted")
        stat = loss.detach().reshape(1).clone()
        dist.all_reduce(stat)
        say(f"rank {rank} step {step} loss {stat.item() / world:.4f} T {float(temp):.3f}")
        if step % 2 == 1:
            e = energies.detach()
            if bad and a.fault == "energygather":
                e = torch.cat([e, e.mean().reshape(1)])
            all_e = [torch.zeros(MEMBERS) for _ in range(world)]
            dist.all_gather(all_e, e)
            sw = exchange(all_e, slots, ladder, step, world)
            accepted += sw
            if rank == 0:
                say(f"rank 0 exchange at step {step}: {sw} swaps, slots {slots}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        rate = 0.0
        say(f"rank {rank}: ERROR swap acceptance {rate:.2f} after {a.steps} steps is below 0.05; "
            f"the temperature ladder does not mix, refusing to export", err=True)
        sys.exit(5)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save({"model": model.state_dict(), "slots": slots}, f"{WORK}/export/ensemble.pt")
        say(f"rank 0 done: {a.steps} steps, {accepted} swaps, saved export/ensemble.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--schedule", default="geometric")
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-budget", type=int, default=45)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()
