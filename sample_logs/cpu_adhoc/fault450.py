"""Batch 450 of hand-run faults: FERRY PASSENGER DEMAND FORECASTING.

Synthetic ferry sailings: each rank reads its routes from /tmp/fault450_work/sailings/sailings_R.pt, a list of
sailings with a departure port (looked up in a 6-entry port table), an hour slot (0-23), a weekday, a sea state
and vessel capacity, and 24 hours of past passenger counts.  A small forecaster (port, hour and weekday
embeddings plus a GRU over the 24-hour history, a linear head) predicts next-sailing load as a fraction of
capacity, trained on an MSE loss and wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.
The model starts from ckpt/ferry_p6.pt.  Per-rank demand statistics are all_gathered at the start, the MAPE is
all_reduced every step, and rank 0 saves export/ferry.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badport    - rank N's sailings include a departure from "Stornoway", missing from the port table (KeyError)
  hourslot   - rank N encodes midnight sailings as hour slot 24: out of range for the 24-row hour embedding (IndexError)
  nowinter   - rank N reads sailings/winter/sailings_N.pt which does not exist (FileNotFoundError)
  ckptports  - rank N initialises from ckpt/ferry_p8.pt, saved with 8 ports (size mismatch in load_state_dict)
  ckptpickle - rank N loads ckpt/ferry_meta.pt which pickles a Timetable object (weights_only refusal)
  statgather - rank N all_gathers 5 demand statistics (an extra holiday count) instead of 4
  timetable  - rank N rebuilds its timetable in pure Python before the step-3 all_reduce (peers time out, 12 s)
  berthlock  - rank N waits forever for a berth lock file after step 2 (run with --pg-timeout 300, killed at 60 s)
  capacity0  - rank N has a vessel with capacity 0 from step 4: load factor inf, the program's check raises
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error about an unreconciled ticket ledger after the last step and exits 5
  horizon    - every rank: histories are cut to 48 hours, the head expects 24*H features (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  badport    - KeyError: 'Stornoway' building the port tensor; peers Connection closed in the start-up all_gather (np4 r2 bashloop, np6 r0 tee)
  hourslot   - IndexError 'index out of range in self' in the first forward (np3 r1 spawn); the np8 r5 ranklabel run was
               dropped: on the overloaded machine ranks 4 and 7 timed out (12 s) and the loop was killed at 100 s
  nowinter   - FileNotFoundError for sailings/winter/sailings_3.pt; peers Connection closed (np4 r3 srunlabel)
  ckptports  - load_state_dict size mismatch for port.weight [8,16] vs [6,16]; each pdsh2 agent names its own Root Cause (np4 r1 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.Timetable' (np3 r2 legacy)
  statgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank 1 (np3 r1 logfmt)
  timetable  - peers 'Timed out waiting 12000ms' (send/recv) in the step-3 all_reduce; rank 1 later Connection closed (np3 r1 bashloop)
  berthlock  - output stops after step 1 on every rank; killed by timeout at 60 s, exit 124 (np4 r2 ranklabel)
  capacity0  - the program's check: 1 non-finite load factor at step 4, FloatingPointError (np3 r0 logfmt, --ddp 0)
  sigsegv    - Root Cause rank 3 exitcode -11 (SIGSEGV); peers Connection reset by peer (np4 r3 legacy)
  exit5      - rank 1's ledger ERROR line and exit 5 after the last step; peers Connection closed in the final barrier (np3 r1 mpitag)
  horizon    - every rank 'mat1 and mat2 shapes cannot be multiplied (96x48 and 24x16)'; spawn reports process 0 (np3 spawn, --ddp 0)
  none       - clean, 6 steps, export/ferry.pt saved, exit 0 (np3 files)
"""
import argparse
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

WORK = "/tmp/fault450_work"
PORTS = {"Dover": 0, "Calais": 1, "Holyhead": 2, "Dublin": 3, "Oban": 4, "Mull": 5}
HIST = 24
DIM = 16
log = None


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
    log = logging.getLogger("ferry")
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


class Timetable:
    def __init__(self, sailings):
        self.sailings = sailings


class Forecaster(nn.Module):
    def __init__(self, nports=len(PORTS), dim=DIM):
        super().__init__()
        self.port = nn.Embedding(nports, dim)
        self.hour = nn.Embedding(24, dim)
        self.wday = nn.Embedding(7, dim)
        self.gru = nn.GRU(1, dim, batch_first=True)
        self.mix = nn.Linear(HIST, dim)
        self.head = nn.Linear(4 * dim + 1, 1)

    def forward(self, port, hour, wday, sea, hist):
        _, h = self.gru(hist.unsqueeze(-1))
        z = torch.cat([self.port(port), self.hour(hour), self.wday(wday), torch.relu(self.mix(hist)),
                       sea.unsqueeze(1)], 1)
        z = z + 0 * h[0].sum()
        return torch.sigmoid(self.head(z)).squeeze(1)


def make_sailings(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(PORTS)
    out = []
    for _ in range(n):
        hour = int(torch.randint(5, 23, (1,), generator=g))
        cap = int(torch.randint(200, 900, (1,), generator=g))
        base = 0.3 + 0.4 * torch.rand(1, generator=g).item()
        hist = (base + 0.1 * torch.randn(HIST, generator=g)).clamp(0, 1) * cap
        out.append({"port": names[int(torch.randint(0, 6, (1,), generator=g))], "hour": hour,
                    "wday": int(torch.randint(0, 7, (1,), generator=g)), "sea": float(torch.rand(1, generator=g)),
                    "cap": cap, "hist": hist.round().tolist(), "pax": round(base * cap)})
    return out


def prepare():
    os.makedirs(f"{WORK}/sailings", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_sailings(96, 450 + r), f"{WORK}/sailings/sailings_{r}.pt")
    torch.manual_seed(0)
    torch.save(Forecaster().state_dict(), f"{WORK}/ckpt/ferry_p6.pt")
    torch.save(Forecaster(8).state_dict(), f"{WORK}/ckpt/ferry_p8.pt")
    torch.save({"model": Forecaster().state_dict(), "timetable": Timetable(make_sailings(4, 1))},
               f"{WORK}/ckpt/ferry_meta.pt")
    print("prepared", WORK)


def tensorise(sail, a, bad, hist_len):
    port = torch.tensor([PORTS[s["port"]] for s in sail])
    hour = torch.tensor([24 if (bad and a.fault == "hourslot" and s["hour"] >= 22) else s["hour"] for s in sail])
    wday = torch.tensor([s["wday"] for s in sail])
    sea = torch.tensor([s["sea"] for s in sail])
    cap = torch.tensor([float(s["cap"]) for s in sail])
    hist = torch.tensor([(s["hist"] * 2)[:hist_len] for s in sail]) / cap.unsqueeze(1)
    y = torch.tensor([float(s["pax"]) for s in sail])
    return port, hour, wday, sea, cap, hist, y


def rebuild_timetable(sail):
    legs = 0
    for s in sail:
        for a in range(24):
            for b in range(24):
                for c in range(24):
                    legs += (a * s["hour"] + b * c) % 7 == s["wday"]
    return legs


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(450 + rank)
    say(f"rank {rank}/{world} up, loading sailings")
    season = "winter/" if bad and a.fault == "nowinter" else ""
    sail = torch.load(f"{WORK}/sailings/{season}sailings_{rank}.pt")
    if bad and a.fault == "badport":
        sail[37]["port"] = "Stornoway"
    hist_len = 2 * HIST if a.fault == "horizon" else HIST
    port, hour, wday, sea, cap, hist, y = tensorise(sail, a, bad, hist_len)
    stats = torch.tensor([float(len(sail)), y.sum().item(), cap.sum().item(), y.max().item()])
    if bad and a.fault == "statgather":
        stats = torch.cat([stats, torch.tensor([float(sum(s["wday"] >= 5 for s in sail))])])
    allst = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allst, stats)
    say(f"rank {rank} sailings {len(sail)} passengers {int(stats[1])} global {int(sum(s[1] for s in allst))}")
    model = Forecaster()
    if bad and a.fault == "ckptpickle":
        sd = torch.load(f"{WORK}/ckpt/ferry_meta.pt")["model"]
    else:
        ck = "ferry_p8.pt" if bad and a.fault == "ckptports" else "ferry_p6.pt"
        sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for step in range(a.steps):
        if bad and a.fault == "capacity0" and step == 4:
            cap[11] = 0.0
        load = y / cap
        if not torch.isfinite(load).all():
            say(f"rank {rank}: load factor has {int((~torch.isfinite(load)).sum())} non-finite values at step {step} "
                f"(min capacity {cap.min():.0f})", err=True)
            raise FloatingPointError(f"non-finite load factor on rank {rank} at step {step}")
        pred = net(port, hour, wday, sea, hist)
        loss = ((pred - load) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "timetable" and step == 3:
            t0 = time.time()
            legs = 0
            while time.time() - t0 < 40:
                legs += rebuild_timetable(sail)
            say(f"rank {rank} timetable rebuilt: {legs} legs")
        if bad and a.fault == "berthlock" and step == 2:
            while not os.path.exists(f"{WORK}/berth_{rank}.lock"):
                time.sleep(0.5)
        mape = ((pred.detach() - load).abs() / load).mean().reshape(1)
        dist.all_reduce(mape)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mape {mape.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR ticket ledger for Holyhead-Dublin 06:40 does not reconcile "
            f"(412 boarded vs 398 sold); refusing to publish forecasts", err=True)
        sys.exit(5)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/ferry.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/ferry.pt")
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
