"""A three-hundred-and-sixty-fourth hand-run batch: VEHICLE TRAJECTORY PREDICTION.

Synthetic road-user tracks: each track has 8 observed (x, y) positions, 12 future positions to predict, a
per-track sampling interval dt (0.1 s), an agent type (looked up in a 5-entry table: car, truck, bus, cyclist,
pedestrian) and the id of the lane it drives on (16 lanes in the map).  Every rank reads its tracks from
/tmp/fault364_work/scenes/train/tracks_R.pt, turns the observed positions into (dx, dy, vx, vy) features and
trains a GRU encoder with agent-type and lane embeddings and a linear decoder (12 x 2 offsets) on an MSE
loss, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised
from ckpt/trajnet_h12.pt.  Per-rank agent counts are all_gathered at start-up, loss and ADE are all_reduced
every step, per-agent-type ADE is all_gathered at the end, and rank 0 saves export/trajnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  agenttype   - rank N's tracks contain an "e-scooter", missing from the agent-type table (KeyError, start-up)
  lanegap     - rank N's step-1 batch has lane id 16 from a newer map: nn.Embedding index out of range (IndexError)
  notracks    - rank N reads its tracks from scenes/val/, which does not exist (FileNotFoundError, start-up)
  ckpthorizon - rank N initialises from ckpt/trajnet_h16.pt, saved with a 16-step horizon (size mismatch)
  ckptpickle  - rank N initialises from ckpt/trajnet_full.pt, which pickles a TrajConfig object (weights_only)
  adegather   - rank N all_gathers its per-type ADE with an extra "unknown" bucket at the end (6 vs 5)
  smoothing   - rank N Kalman-smooths every track in pure Python before the step-2 all_reduce (--smooth-budget s)
  dtzero      - rank N's step-3 batch has a duplicated GPS timestamp (dt 0): infinite velocity, program's check
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own ERROR line about non-monotonic timestamps and calls sys.exit(4) at step 1
  featbug     - every rank: features get a heading column (5 wide), the GRU expects 4 (shape error, first step)
  none        - control, clean run

What happened (filled in after the runs):
  agenttype   - KeyError: 'e-scooter' at start-up; peers Connection closed by peer in the first all_gather (np4 r2 tee, np6 r0 loglevel)
  lanegap     - 'IndexError: index out of range in self' in the step-1 forward; peers closed (np3 r1 tee_trainer, np8 r5 filter)
  notracks    - FileNotFoundError for scenes/val/tracks_3.pt, seen only in rank 3's stderr.log; console Root Cause rank 3 (np4 r3 redirects)
  ckpthorizon - load_state_dict size mismatch for head.weight [32, 48] vs [24, 48]; peers closed (np3 r2 pymodule, np4 r1 pdsh2)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.TrajConfig' (np4 r0 wrapper)
  adegather   - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[6] (np3 r1 detail);
                'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (5))' on rank 4 (np6 r4 prefix)
  smoothing   - 12 s PG timeout: ranks 0, 1 'Timed out waiting 12000ms for recv', slow rank 2 SIGTERMed silent (np3 r2 plain);
                300 s: silent after step 1, killed by timeout at 60 s, exit 124 (np4 r1 tee)
  dtzero      - '14 non-finite values (max |v| inf)' and FloatingPointError; under DETAIL peers report monitoredBarrier errors
                from rank 0 (np3 r0 detail); with --max-restarts 1 the restart failed in Gloo connectFullMesh instead (np4 r3 restart)
  sigsegv     - no traceback after step 3; Root Cause exitcode -11 (SIGSEGV) (np4 r2 prefix, np3 r1 loglevel)
  exit4       - rank N's ERROR line and exit 4; Root Cause exitcode 4 (np3 r2 filter, np6 r3 wrapper)
  featbug     - every rank 'input.size(-1) must be equal to input_size. Expected 4, got 5'; Root Cause rank 2 (np3 pymodule)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/trajnet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault364_work"
AGENTS = {"car": 0, "truck": 1, "bus": 2, "cyclist": 3, "pedestrian": 4}
NLANE = 16
OBS = 8
HORIZON = 12
FEAT = 4
HID = 32
BATCH = 32
log = None


class TrajConfig:
    def __init__(self, horizon, hid):
        self.horizon = horizon
        self.hid = hid


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
    log = logging.getLogger("trajnet")
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


class TrajNet(nn.Module):
    def __init__(self, horizon=HORIZON, feat=FEAT, hid=HID):
        super().__init__()
        self.agent = nn.Embedding(len(AGENTS), 8)
        self.lane = nn.Embedding(NLANE, 8)
        self.enc = nn.GRU(feat, hid, batch_first=True)
        self.head = nn.Linear(hid + 16, horizon * 2)
        self.horizon = horizon

    def forward(self, feats, agent, lane):
        _, h = self.enc(feats)
        z = torch.cat([h[-1], self.agent(agent), self.lane(lane)], 1)
        return self.head(z).view(-1, self.horizon, 2)


def make_tracks(n, seed):
    g = torch.Generator().manual_seed(seed)
    types = list(AGENTS)
    speed = torch.tensor([12.0, 9.0, 8.0, 4.0, 1.4])
    kind = torch.randint(0, 5, (n,), generator=g)
    heading = torch.rand(n, generator=g) * 2 * math.pi
    v = speed[kind] * (0.8 + 0.4 * torch.rand(n, generator=g))
    t = torch.arange(OBS + HORIZON).float() * 0.1
    turn = 0.05 * torch.randn(n, generator=g)
    ang = heading[:, None] + turn[:, None] * t[None] * 10
    pos = torch.stack([torch.cos(ang), torch.sin(ang)], 2) * v[:, None, None] * 0.1
    pos = pos.cumsum(1) + 0.05 * torch.randn(n, OBS + HORIZON, 2, generator=g)
    pos = pos - pos[:, OBS - 1:OBS]
    return {"past": pos[:, :OBS].clone(), "future": pos[:, OBS:].clone(), "dt": torch.full((n,), 0.1),
            "agent": [types[int(k)] for k in kind], "lane": torch.randint(0, NLANE, (n,), generator=g)}


def prepare():
    for d in ("scenes/train", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_tracks(192, 300 + r), f"{WORK}/scenes/train/tracks_{r}.pt")
    torch.manual_seed(0)
    sd = TrajNet().state_dict()
    torch.save(sd, f"{WORK}/ckpt/trajnet_h12.pt")
    torch.save(TrajNet(horizon=16).state_dict(), f"{WORK}/ckpt/trajnet_h16.pt")
    torch.save({"model": sd, "cfg": TrajConfig(HORIZON, HID), "epoch": 40}, f"{WORK}/ckpt/trajnet_full.pt")
    print("prepared", WORK)


def featurise(past, dt, a):
    d = past[:, 1:] - past[:, :-1]
    v = d / dt[:, None, None]
    cols = [d, v]
    if a.fault == "featbug":
        cols.append(torch.atan2(d[..., 1:], d[..., :1]))
    return torch.cat(cols, 2)


def kalman_smooth(track, q=0.01, r=0.05):
    out = []
    for dim in range(2):
        x, p = float(track[0][dim]), 1.0
        for k in range(len(track)):
            p += q
            gain = p / (p + r)
            x += gain * (float(track[k][dim]) - x)
            p *= 1 - gain
            out.append(x)
    return out


def check_finite(name, t, rank):
    bad = ~torch.isfinite(t)
    if bad.any():
        say(f"rank {rank}: {name} has {int(bad.sum())} non-finite values (max |v| {t.abs().max().item()})", err=True)
        raise FloatingPointError(f"non-finite {name} on rank {rank}")


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading tracks")
    split = "val" if bad and a.fault == "notracks" else "train"
    tr = torch.load(f"{WORK}/scenes/{split}/tracks_{rank}.pt")
    if bad and a.fault == "agenttype":
        tr["agent"][41] = "e-scooter"
    agent = torch.tensor([AGENTS[s] for s in tr["agent"]])
    counts = torch.bincount(agent, minlength=len(AGENTS)).float()
    allc = [torch.zeros(len(AGENTS)) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} tracks {len(agent)} global agents {[int(x) for x in sum(allc).tolist()]}")
    model = TrajNet()
    ck = {"ckpthorizon": "trajnet_h16.pt", "ckptpickle": "trajnet_full.pt"}.get(a.fault) if bad else None
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck or 'trajnet_h12.pt'}"))
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = len(agent)
    for step in range(a.steps):
        b0 = (step * BATCH) % n
        idx = torch.arange(b0, b0 + BATCH)
        past, fut, dt, lane = tr["past"][idx], tr["future"][idx], tr["dt"][idx].clone(), tr["lane"][idx].clone()
        if bad and a.fault == "dtzero" and step == 3:
            dt[5] = 0.0
        if bad and a.fault == "lanegap" and step == 1:
            lane[9] = NLANE
        feats = featurise(past, dt, a)
        check_finite("velocity features", feats, rank)
        pred = net(feats, agent[idx], lane)
        loss = ((pred - fut) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "smoothing" and step == 2:
            t0, nt = time.time(), 0
            while time.time() - t0 < a.smooth_budget:
                for k in range(n):
                    kalman_smooth(tr["past"][k].tolist() + tr["future"][k].tolist())
                    nt += 1
            say(f"rank {rank} smoothed {nt} tracks")
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR track 117 has non-monotonic GPS timestamps (t[4]=0.38 < t[3]=0.41), "
                f"aborting this shard", err=True)
            sys.exit(4)
        ade = (pred.detach() - fut).norm(dim=2).mean()
        stats = torch.stack([loss.detach(), ade])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} ade {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        err = (net(featurise(tr["past"], tr["dt"], a), agent, tr["lane"]) - tr["future"]).norm(dim=2).mean(1)
    nb = len(AGENTS) + (1 if bad and a.fault == "adegather" else 0)
    per_type = torch.zeros(nb).index_add_(0, agent, err) / counts.clamp(min=1).sum() * len(AGENTS)
    allt = [torch.zeros(len(AGENTS)) for _ in range(world)]
    dist.all_gather(allt, per_type)
    say(f"rank {rank} per-type ade {[round(x, 3) for x in (sum(allt) / world).tolist()]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/trajnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/trajnet.pt")
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
    p.add_argument("--smooth-budget", type=int, default=30)
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
