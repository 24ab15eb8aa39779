"""A three-hundred-and-fourteenth hand-run batch: TRAFFIC SIMULATION SURROGATE WITH A GRAPH RECURRENT NETWORK.

A road network of 32 detector stations (loop sensors on motorway segments) joined by a directed adjacency of
road links.  A microscopic traffic simulator was run offline; each rank reads its simulated scenarios from
/tmp/fault314_work/sim/scen_R.pt: per 5-minute interval, per sensor, speed (km/h), flow (veh/h) and occupancy.
Sensor names are looked up in a station table, link lengths turn speeds into travel times.  The surrogate is a
graph recurrent network (a GRU cell whose gates see a one-hop graph convolution of the sensor state, DCRNN-like)
that reads 12 intervals and predicts the next interval's speed at every sensor.  DDP over gloo; the model is
initialised from ckpt/gru_h16.pt.  The MAE (km/h) is all_reduced every step, per-rank travel-time statistics
are all_gathered at the end, and rank 0 saves export/surrogate.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  station    - rank N's scenario names a sensor "I405N-17" missing from the station table (KeyError, start-up)
  badlink    - rank N's link list has a link to sensor 40 of 32 (IndexError in the first forward)
  nosim      - rank N reads its scenarios from sim/holdout/ which does not exist (FileNotFoundError, start-up)
  ckpthidden - rank N initialises from ckpt/gru_h24.pt, saved with hidden size 24 (size mismatch)
  ckptconfig - rank N loads ckpt/gru_cfg.pt, which pickles a SimConfig object (weights_only refusal)
  ttgather   - rank N all_gathers its travel-time statistics plus a queue length (5 vs 4 entries, the end)
  replay     - rank N replays its scenario through a Python car-following loop before the step-2 all_reduce
  gridlock   - rank N's speeds drop to 0 at step 3: travel times inf, the program's check (FloatingPointError)
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line about a stale detector feed and calls sys.exit(5) at step 1
  timefeat   - every rank: a time-of-day feature makes the input 4 wide, the gate convolution expects 3
  none       - control, clean run

What happened (filled in after the runs):
  station    - KeyError: 'I405N-17' in build_inputs at start-up; peers Connection closed in DDP init (np4 r2 ranklabel, np3 r0 spawn ProcessRaisedException)
  badlink    - RuntimeError 'index 40 is out of bounds for dimension 0 with size 32' in the first forward; peers closed (np5 r3 srunlabel, a peer aborts, exit 134; np3 r1 logfmt)
  nosim      - FileNotFoundError for sim/holdout/scen_N.pt at start-up; peers closed (np4 r1 mpitag, np3 r2 legacy Root Cause rank 2)
  ckpthidden - load_state_dict size mismatch [48, 27] vs [32, 19] ...; worker-0's agent RendezvousConnectionError as a cascade (np4 r3 pdsh2)
  ckptconfig - UnpicklingError 'Weights only load failed ... GLOBAL __main__.SimConfig' (np3 r1 tee, np5 r0 files)
  ttgather   - after 6 steps 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' (np3 r1 srunlabel, np4 r2 legacy --ddp 0)
  replay     - 12 s: ranks waiting in the step-2 all_reduce 'Timed out waiting 12000ms' (np3 r2 bashloop); 300 s: silent, killed at 60 s, exit 124 (np4 r1 ranklabel)
  gridlock   - the program's check '5 links with non-finite travel time' at step 3, FloatingPointError (np4 r1 mpitag, np3 r2 logfmt)
  sigsegv    - rank N silent after step 3; files: loop exit 139 (np4 r2); spawn: 'process 1 terminated with signal SIGSEGV' (np3 r1)
  exit5      - rank 4's stale detector feed ERROR line after step 1, exit 5; Root Cause rank 4 exitcode 5 (np5 r4 tee)
  timefeat   - every rank 'mat1 and mat2 shapes cannot be multiplied (32x20 and 19x32)' in the first forward (np3 srunlabel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/surrogate.pt, exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
import logging
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

WORK = "/tmp/fault314_work"
NS = 32
FEAT = 3
HID = 16
WIN = 12
STATIONS = {f"I5N-{i:02d}": i for i in range(NS)}
log = None


@dataclasses.dataclass
class SimConfig:
    network: str = "I5N corridor"
    dt_s: float = 0.5
    hidden: int = HID


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
    log = logging.getLogger("tsim")
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


class GraphGRUCell(nn.Module):
    """GRU cell whose gates see a one-hop graph convolution of [x, h]."""

    def __init__(self, feat, hid):
        super().__init__()
        self.gates = nn.Linear(feat + hid, 2 * hid)
        self.cand = nn.Linear(feat + hid, hid)

    def forward(self, x, h, src, dst, w):
        def conv(z):
            agg = torch.zeros_like(z).index_add_(0, dst, z[src] * w.unsqueeze(1))
            return z + agg

        xh = conv(torch.cat([x, h], dim=1))
        r, u = torch.sigmoid(self.gates(xh)).chunk(2, dim=1)
        c = torch.tanh(self.cand(conv(torch.cat([x, r * h], dim=1))))
        return u * h + (1 - u) * c


class Surrogate(nn.Module):
    def __init__(self, feat=FEAT, hid=HID):
        super().__init__()
        self.cell = GraphGRUCell(feat, hid)
        self.head = nn.Linear(hid, 1)

    def forward(self, seq, src, dst, w):
        h = torch.zeros(seq.shape[1], self.head.in_features)
        for t in range(seq.shape[0]):
            h = self.cell(seq[t], h, src, dst, w)
        return self.head(h).squeeze(1)


def make_scenario(seed):
    g = torch.Generator().manual_seed(seed)
    T = 96
    base = 100 - 40 * torch.sin(torch.linspace(0, 3.14, T)).unsqueeze(1) * torch.rand(1, NS, generator=g)
    speed = (base + 5 * torch.randn(T, NS, generator=g)).clamp(5, 130)
    flow = (2000 - 12 * speed + 50 * torch.randn(T, NS, generator=g)).clamp(0)
    occ = (flow / (speed * 2.0)).clamp(0, 100)
    links = [(i, i + 1) for i in range(NS - 1)] + [(i + 3, i) for i in range(0, NS - 3, 4)]
    length_km = (0.4 + torch.rand(len(links), generator=g)).tolist()
    return {"sensors": list(STATIONS), "speed": speed, "flow": flow, "occ": occ,
            "links": links, "length_km": length_km}


def prepare():
    os.makedirs(f"{WORK}/sim", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_scenario(300 + r), f"{WORK}/sim/scen_{r}.pt")
    torch.manual_seed(0)
    torch.save(Surrogate().state_dict(), f"{WORK}/ckpt/gru_h16.pt")
    torch.save(Surrogate(hid=24).state_dict(), f"{WORK}/ckpt/gru_h24.pt")
    torch.save({"config": SimConfig(), "model": Surrogate().state_dict()}, f"{WORK}/ckpt/gru_cfg.pt")
    print("prepared", WORK)


def build_inputs(sc, a, bad):
    idx = torch.tensor([STATIONS[s] for s in sc["sensors"]])
    links = list(sc["links"])
    if bad and a.fault == "badlink":
        links[7] = (links[7][0], 40)
    src = torch.tensor([i for i, _ in links])
    dst = torch.tensor([j for _, j in links])
    w = 1.0 / torch.tensor(sc["length_km"])
    x = torch.stack([sc["speed"] / 100, sc["flow"] / 2000, sc["occ"] / 100], dim=2)[:, idx]
    if a.fault == "timefeat":
        tod = torch.linspace(0, 1, x.shape[0]).view(-1, 1, 1).expand(-1, NS, 1)
        x = torch.cat([x, tod], dim=2)
    return x, src, dst, w


def car_following_replay(sc, budget_s):
    """Intelligent-driver model replay of one scenario, vehicle by vehicle, in pure Python."""
    n, t_start = 0, time.time()
    pos = [float(i) * 30.0 for i in range(400)]
    vel = [25.0] * 400
    while True:
        for k in range(399, 0, -1):
            gap = max(pos[k - 1] - pos[k] - 5.0, 0.1)
            acc = 1.5 * (1 - (vel[k] / 33.0) ** 4 - ((2.0 + vel[k] * 1.5) / gap) ** 2)
            vel[k] = max(vel[k] + 0.5 * acc, 0.0)
            pos[k] += 0.5 * vel[k]
        n += 1
        if time.time() - t_start > budget_s:
            return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(2024 + rank)
    say(f"rank {rank}/{world} up, loading simulated scenarios")
    split = "holdout/" if bad and a.fault == "nosim" else ""
    sc = torch.load(f"{WORK}/sim/{split}scen_{rank}.pt")
    if bad and a.fault == "station":
        sc["sensors"][11] = "I405N-17"
    x, src, dst, w = build_inputs(sc, a, bad)
    say(f"rank {rank} scenario: {x.shape[0]} intervals x {x.shape[1]} sensors, {len(src)} links")
    model = Surrogate()
    if bad and a.fault == "ckptconfig":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/gru_cfg.pt")["model"])
    else:
        ck = "gru_h24.pt" if bad and a.fault == "ckpthidden" else "gru_h16.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    ddp = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(ddp.parameters(), lr=2e-3)
    lengths = torch.tensor(sc["length_km"])
    for step in range(a.steps):
        t0 = 4 * step
        seq, target = x[t0:t0 + WIN], x[t0 + WIN, :, 0]
        pred = ddp(seq, src, dst, w)
        loss = ((pred - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        speed = sc["speed"][t0 + WIN].clone()
        if bad and a.fault == "gridlock" and step == 3:
            speed[5:9] = 0.0
        tt_min = 60.0 * lengths / speed[src]
        if not torch.isfinite(tt_min).all():
            say(f"rank {rank}: step {step}: {int((~torch.isfinite(tt_min)).sum())} links with non-finite travel "
                f"time (min speed {speed.min():.1f} km/h)", err=True)
            raise FloatingPointError(f"non-finite travel times on rank {rank} at step {step}")
        if bad and a.fault == "replay" and step == 2:
            say(f"rank {rank} replaying scenario through the car-following model")
            n = car_following_replay(sc, a.replay_s)
            say(f"rank {rank} replay done: {n} sweeps")
        mae = ((pred.detach() - target).abs().mean() * 100).reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae_kmh {mae.item() / world:.2f}")
        if bad and a.fault == "exit5" and step == 1:
            say(f"rank {rank}: ERROR detector feed for sensor I5N-23 stale for 45 min in scenario, "
                f"aborting this rank", err=True)
            sys.exit(5)
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    stats = torch.stack([tt_min.mean(), tt_min.max(), speed.mean(), speed.min()])
    if bad and a.fault == "ttgather":
        stats = torch.cat([stats, torch.tensor([float(sc["occ"].max())])])
    allst = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allst, stats)
    say(f"rank {rank} mean travel time {stats[0]:.2f} min, global {sum(s[0] for s in allst) / world:.2f} min")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/surrogate.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/surrogate.pt")
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
    p.add_argument("--replay-s", type=int, default=25)
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
