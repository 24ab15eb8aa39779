"""Batch 457 hand-run fault script: WIND TURBINE WAKE FLOW SURROGATE.

Synthetic SCADA/LES samples: each sample is an inflow state (hub-height wind speed, direction, turbulence
intensity, the yaw offsets of a 4-turbine upstream row, the site's terrain class looked up in a roughness
table, and the upstream turbine model whose thrust coefficient comes from an 6-entry CT table) and a target
velocity-deficit field on a 32x16 (streamwise x lateral) grid behind the row.  Every rank reads its samples
from /tmp/fault457_work/inflow/inflow_R.pt and trains a small MLP surrogate (inflow features -> deficit
grid) on an MSE loss, wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The
model starts from ckpt/wake_g32.pt.  The loss and the rotor-averaged deficit error are all_reduced every
step; per-rank statistics (samples, mean speed, mean TI, mean deficit) are all_gathered at the end; rank 0
saves export/wake_surrogate.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  terrain     - rank N's site list holds "floating_offshore", missing from the roughness table (KeyError, start-up)
  turbineidx  - rank N's step-1 batch names turbine model 6 in the 6-entry CT table (IndexError, step 1)
  nofile      - rank N reads inflow/scada_N.pt instead, which was never written (FileNotFoundError, start-up)
  ckptsize    - rank N initialises from ckpt/wake_g48.pt, saved for a 48x16 grid (size mismatch, start-up)
  ckptpickle  - rank N loads ckpt/wake_meta.pt, which pickles a SiteMeta object (weights_only refusal)
  gathershape - rank N all_gathers 5 statistics (adds max yaw) instead of 4 at the end (gloo size error)
  slowmesh    - rank N computes a fine-mesh Jensen wake superposition in pure Python before the step-3
                all_reduce (the others time out after --pg-timeout 12 s)
  stall       - rank N waits forever at step 2 for a lidar lock file that never appears (run with
                --pg-timeout 300 and killed by timeout at 60 s)
  yawnan      - rank N's step-4 batch has a turbulence intensity of -0.05: sqrt gives NaN, the program's
                finiteness check raises FloatingPointError
  segv        - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error about a stuck yaw encoder and calls sys.exit(4) at step 1
  gridwidth   - every rank reshapes the targets to a 33x16 grid (a ghost row), the model predicts 32x16 (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  terrain     - KeyError: 'floating_offshore' at start-up; peers SIGTERMed without errors (np4 r2 tee, np6 r0 pymodule)
  turbineidx  - IndexError 'index 6 is out of bounds for dimension 0 with size 6' at step 1; peers Connection closed
                by peer (np3 r1 loglevel, np4 r3 wrapper)
  nofile      - FileNotFoundError inflow/scada_N.pt at start-up (np3 r1 redirects: only in rank 1's stderr.log;
                np4 r0 pdsh2: node 1's agent then RendezvousConnectionError when node 0's store went away)
  ckptsize    - load_state_dict size mismatch dec.weight [768,64] vs [512,64] at start-up (np4 r1 tee_trainer,
                np3 r2 detail)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SiteMeta' (np3 r2 prefix)
  gathershape - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' after 6 steps
                (np6 r4 filter); with DETAIL 'Detected mismatch between collectives', TensorShape=[5] vs [4], on
                every rank (np3 r0 detail, --ddp 0)
  slowmesh    - ranks 0 and 1 'Timed out waiting 12000ms for recv' in the step-3 all_reduce; slow rank 2 silent;
                Root Cause rank 1 (np3 r2 plain)
  stall       - rank 1 'waiting for lidar scan lock', silence, timeout SIGTERMs torchrun at 60 s, exit 124 (np4 r1 loglevel)
  yawnan      - rank 1/5 'non-finite loss nan at step 4', FloatingPointError; peers Connection closed (np8 r5 tee);
                np3 r1 restart: attempt 1 died at start-up, 'Gloo connectFullMesh failed ... Connection refused'
  segv        - rank N silent after step 3, peers Connection reset by peer, Root Cause SIGSEGV (np4 r2 wrapper,
                np3 r0 restart)
  exit4       - rank 3's ERROR line (stuck yaw encoder), exitcode 4; peers Connection closed (np6 r3 prefix)
  gridwidth   - every rank 'The size of tensor a (32) must match the size of tensor b (33)' in the first loss (np3 pymodule)
  none        - clean, 6 steps, export saved, exit 0 (np3 plain; a first try without a final barrier aborted rank 0
                at destroy_process_group: 'terminate called without an active exception', dropped)
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault457_work"
ROUGHNESS = {"offshore": 0.0002, "flat": 0.03, "farmland": 0.1, "hills": 0.3, "forest": 0.8}
CT_TABLE = torch.tensor([0.79, 0.77, 0.81, 0.75, 0.83, 0.78])
NX, NY = 32, 16
FEAT = 10
BATCH = 16
log = None


class SiteMeta:
    def __init__(self, name, hub_height):
        self.name = name
        self.hub_height = hub_height


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("wake")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class WakeSurrogate(nn.Module):
    def __init__(self, nx=NX, ny=NY, feat=FEAT, hid=64):
        super().__init__()
        self.nx, self.ny = nx, ny
        self.enc = nn.Sequential(nn.Linear(feat, hid), nn.GELU(), nn.Linear(hid, hid), nn.GELU())
        self.dec = nn.Linear(hid, nx * ny)

    def forward(self, x):
        return torch.sigmoid(self.dec(self.enc(x))).view(-1, self.nx, self.ny)


def jensen_field(u, ct, ti, nx, ny):
    xs = torch.linspace(1.0, 12.0, nx).view(nx, 1)
    ys = torch.linspace(-2.0, 2.0, ny).view(1, ny)
    k = 0.4 * ti + 0.004
    r = 0.5 + k * xs
    d = (1 - math.sqrt(1 - ct)) * (0.5 / r) ** 2
    return (d * torch.exp(-(ys / r) ** 2)).clamp(0, 1) * (8.0 / u) ** 0.1


def make_samples(n, seed):
    g = torch.Generator().manual_seed(seed)
    terr = list(ROUGHNESS)
    u = 4 + 10 * torch.rand(n, generator=g)
    wdir = 360 * torch.rand(n, generator=g)
    ti = 0.04 + 0.12 * torch.rand(n, generator=g)
    yaw = 20 * torch.rand(n, 4, generator=g) - 10
    sites = [terr[int(i)] for i in torch.randint(0, 5, (n,), generator=g)]
    turb = torch.randint(0, 6, (n,), generator=g)
    deficit = torch.stack([jensen_field(float(u[i]), float(CT_TABLE[turb[i]]), float(ti[i]), NX, NY)
                           for i in range(n)])
    deficit = (deficit + 0.01 * torch.randn(deficit.shape, generator=g)).clamp(0, 1)
    return {"u": u, "dir": wdir, "ti": ti, "yaw": yaw, "sites": sites, "turbine": turb,
            "deficit": deficit.reshape(n, -1)}


def prepare():
    os.makedirs(f"{WORK}/inflow", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_samples(112, 4570 + r), f"{WORK}/inflow/inflow_{r}.pt")
    torch.manual_seed(0)
    torch.save(WakeSurrogate().state_dict(), f"{WORK}/ckpt/wake_g32.pt")
    torch.save(WakeSurrogate(nx=48).state_dict(), f"{WORK}/ckpt/wake_g48.pt")
    torch.save({"state_dict": WakeSurrogate().state_dict(), "site": SiteMeta("horns_rev", 70.0)},
               f"{WORK}/ckpt/wake_meta.pt")
    print("prepared", WORK)


def features(d, idx, z0):
    rad = d["dir"][idx] * math.pi / 180
    ct = CT_TABLE[d["turbine"][idx]]
    ti = d["ti"][idx]
    return torch.stack([d["u"][idx] / 10, torch.sin(rad), torch.cos(rad), torch.sqrt(ti) * 3,
                        d["yaw"][idx, 0] / 10, d["yaw"][idx, 1] / 10, d["yaw"][idx, 2] / 10,
                        d["yaw"][idx, 3] / 10, torch.log10(z0[idx]) / 4, ct], dim=1)


def wake_superposition(d, budget):
    t0 = time.time()
    cells = 0
    while time.time() - t0 < budget:
        for i in range(len(d["sites"])):
            u = float(d["u"][i])
            for x in range(200):
                for y in range(80):
                    deficit = 0.0
                    for t in range(4):
                        r = 0.5 + 0.05 * (x / 10.0 + t)
                        deficit += ((1 - math.sqrt(1 - 0.8)) * (0.5 / r) ** 2) ** 2
                    cells += int(math.sqrt(deficit) * u > 0)
            if time.time() - t0 > budget:
                break
    return cells


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4570 + rank)
    say(f"rank {rank}/{world} up, reading inflow samples")
    name = "scada" if bad and a.fault == "nofile" else "inflow"
    d = torch.load(f"{WORK}/inflow/{name}_{rank}.pt")
    if bad and a.fault == "terrain":
        d["sites"][37] = "floating_offshore"
    z0 = torch.tensor([ROUGHNESS[s] for s in d["sites"]])
    rows = NX + 1 if a.fault == "gridwidth" else NX
    target = d["deficit"][:, : rows * NY].reshape(-1, rows, NY) if rows == NX else \
        torch.cat([d["deficit"], d["deficit"][:, :NY]], 1).reshape(-1, rows, NY)
    model = WakeSurrogate()
    if bad and a.fault == "ckptsize":
        sd = torch.load(f"{WORK}/ckpt/wake_g48.pt")
    elif bad and a.fault == "ckptpickle":
        sd = torch.load(f"{WORK}/ckpt/wake_meta.pt")["state_dict"]
    else:
        sd = torch.load(f"{WORK}/ckpt/wake_g32.pt")
    model.load_state_dict(sd)
    say(f"rank {rank}: {len(d['sites'])} samples, mean hub speed {d['u'].mean():.2f} m/s, model from ckpt")
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = len(d["sites"])
    for step in range(a.steps):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % n
        if bad and a.fault == "turbineidx" and step == 1:
            d["turbine"][idx[5]] = 6
        if bad and a.fault == "yawnan" and step == 4:
            d["ti"][idx[3]] = -0.05
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR yaw encoder of T3 reports {float(d['yaw'][idx[0], 2]):.1f} deg for 600 s "
                f"(stuck sensor); wake labels of this block are void, aborting", err=True)
            sys.exit(4)
        x = features(d, idx, z0)
        pred = net(x)
        loss = ((pred - target[idx]) ** 2).mean()
        if not torch.isfinite(loss):
            bad_n = int((~torch.isfinite(x)).sum())
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} ({bad_n} non-finite input "
                f"features, min TI {float(d['ti'][idx].min()):.3f})", err=True)
            raise FloatingPointError(f"non-finite wake loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowmesh" and step == 3:
            cells = wake_superposition(d, a.slow_budget)
            say(f"rank {rank}: fine-mesh superposition done, {cells} cells")
        if bad and a.fault == "stall" and step == 2:
            lock = f"{WORK}/lidar/scan_{rank}.lock"
            say(f"rank {rank}: waiting for lidar scan lock {lock}")
            while not os.path.exists(lock):
                time.sleep(0.5)
        rotor = (pred.detach()[:, 4:8, 6:10] - target[idx][:, 4:8, 6:10]).abs().mean()
        stats = torch.stack([loss.detach(), rotor])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.5f} rotor_err {stats[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    mine = torch.tensor([float(n), float(d["u"].mean()), float(d["ti"].mean()), float(d["deficit"].mean())])
    if bad and a.fault == "gathershape":
        mine = torch.cat([mine, d["yaw"].abs().max().reshape(1)])
    allst = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allst, mine)
    say(f"rank {rank} stats gathered: farm samples {int(sum(s[0] for s in allst))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/wake_surrogate.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/wake_surrogate.pt")
    dist.barrier()
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
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-budget", type=int, default=40)
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
