"""Batch 379 hand-run fault script: ANOMALY DETECTION ON SERVER METRICS.

Every rank reads a CSV of per-host server metrics (cpu, mem, disk_r, disk_w, net_in, net_out, load1,
iowait; one row per host per minute) from /tmp/fault379_work/metrics/shard_R.csv, maps host names to ids
through hosts.json, cuts 32-minute windows, scales each metric by the fleet-wide scale in scales.json and
trains a small autoencoder (host embedding + MLP encoder/decoder) on the reconstruction error, wrapped in
DDP over gloo (or with gradients all_reduced by hand, --ddp 0).  The model starts from ckpt/ae_w32.pt.
Per-rank metric means are all_gathered at the start, the loss and the anomaly rate (windows whose error is
above 3x the batch median) are all_reduced every step, the anomaly threshold is all_reduced at the end and
rank 0 saves export/detector.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  hostkey     - rank N's step-1 batch holds windows of host "db-17", missing from hosts.json (KeyError)
  badvalue    - rank N's CSV row 137 has iowait "n/a" (ValueError while parsing, at start-up)
  nometrics   - rank N reads metrics/2026-12-05/shard_R.csv, a dated folder that does not exist
  ckptwidth   - rank N initialises from ckpt/ae_w48.pt, saved for 48-minute windows (size mismatch)
  ckptpickle  - rank N initialises from ckpt/ae_full.pt, a whole pickled module (weights_only refusal)
  gatherwidth - rank N all_gathers its metric means with a 9th entry (gpu_util): 9 vs 8 elements
  scorer      - rank N computes robust z-scores for every window in pure Python after step 3 (20 s)
  stuck       - rank N waits at step 2 for baseline.ready, a file nobody writes (use --pg-timeout 300)
  nanloss     - rank N's net_out counter is read as bytes*1e39 at step 3: inf, the program's finite check
  sigsegv     - rank N sends itself SIGSEGV after step 2
  exit4       - rank N finds no normal windows in threshold calibration at the end, logs ERROR, sys.exit(4)
  featwidth   - every rank adds two derived metrics (10 channels), the encoder expects 8 (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  hostkey     - KeyError: 'db-17' in the step-1 host lookup; peers Connection closed by peer (np4 r2 ranklabel), spawn ProcessRaisedException (np3 r0 spawn)
  badvalue    - ValueError: could not convert string to float: 'n/a' at start-up; 5 peers closed in all_gather (np6 r4 srunlabel)
  nometrics   - FileNotFoundError for metrics/2026-12-05/shard_R.csv at start-up; peers closed in all_gather (np3 r2 files, np4 r1 mpitag)
  ckptwidth   - load_state_dict size mismatch enc.0.weight [64,384] vs [64,256]; Root Cause rank N (np4 r1 pdsh2, np3 r2 legacy)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.Detector'; Root Cause rank 3 (np4 r3 tee)
  gatherwidth - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' on rank N (np3 r1 logfmt, np6 r5 bashloop --ddp 0)
  scorer      - ranks 0,1 'Timed out waiting 12000ms for recv operation' in the step-3 all_reduce, then rank 2 closed (np3 r2 ranklabel)
  stuck       - rank 1 'waiting for .../baseline.ready' at step 2, silent, killed at 60 s, exit 124 (np3 r1 srunlabel)
  nanloss     - 'non-finite reconstruction loss nan at step 3 (max input inf)', FloatingPointError; Root Cause rank N (np8 r6 tee, np3 r0 logfmt)
  sigsegv     - bash 'Segmentation fault' exit 139 (np4 r3 mpitag); ProcessExitedException 'process 1 terminated with signal SIGSEGV' (np3 r1 spawn)
  exit4       - rank N's calibration ERROR line after 6 steps and exit 4; peers closed in the threshold all_reduce; Root Cause exitcode 4 (np3 r2 legacy --ddp 0, np4 r0 pdsh2)
  featwidth   - the shape bug surfaced earlier than planned: every rank 'allgather: invalid tensor size ... (expected (10), got (8))' at start-up (np3 files)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/detector.pt, exit 0 (np3 bashloop)
"""
import argparse
import json
import logging
import os
import signal
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault379_work"
METRICS = ["cpu", "mem", "disk_r", "disk_w", "net_in", "net_out", "load1", "iowait"]
WIN = 32
STRIDE = 8
BATCH = 16
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
    log = logging.getLogger("srvm")
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


class Detector(nn.Module):
    def __init__(self, nhost=32, nmet=len(METRICS), win=WIN, hid=64, code=16):
        super().__init__()
        self.host = nn.Embedding(nhost, 4)
        self.enc = nn.Sequential(nn.Linear(nmet * win, hid), nn.ReLU(), nn.Linear(hid, code))
        self.dec = nn.Sequential(nn.Linear(code + 4, hid), nn.ReLU(), nn.Linear(hid, nmet * win))

    def forward(self, x, hid):
        z = self.enc(x.flatten(1))
        return self.dec(torch.cat([z, self.host(hid)], 1)).view_as(x)


def prepare():
    os.makedirs(f"{WORK}/metrics", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    hosts = {f"{kind}-{i:02d}": n for n, (kind, i) in
             enumerate((k, i) for k in ("web", "api", "db", "cache") for i in range(8))}
    json.dump(hosts, open(f"{WORK}/hosts.json", "w"), indent=1)
    json.dump({"cpu": 100.0, "mem": 100.0, "disk_r": 500.0, "disk_w": 500.0, "net_in": 1e3,
               "net_out": 1e3, "load1": 16.0, "iowait": 100.0}, open(f"{WORK}/scales.json", "w"))
    g = torch.Generator().manual_seed(379)
    names = list(hosts)
    for r in range(8):
        with open(f"{WORK}/metrics/shard_{r}.csv", "w") as f:
            f.write("host,minute," + ",".join(METRICS) + "\n")
            for h in names[r * 4:(r + 1) * 4]:
                base = torch.rand(8, generator=g) * torch.tensor([60, 70, 200, 150, 400, 300, 4, 10.0])
                for t in range(160):
                    v = base * (1 + 0.1 * torch.randn(8, generator=g)).abs()
                    if t % 53 == 7:
                        v = v * 3
                    f.write(f"{h},{t}," + ",".join(f"{x:.3f}" for x in v.tolist()) + "\n")
    torch.manual_seed(0)
    torch.save(Detector().state_dict(), f"{WORK}/ckpt/ae_w32.pt")
    torch.save(Detector(win=48).state_dict(), f"{WORK}/ckpt/ae_w48.pt")
    torch.save(Detector(), f"{WORK}/ckpt/ae_full.pt")
    print("prepared", WORK)


def read_shard(path, bad, a):
    rows = []
    with open(path) as f:
        next(f)
        for i, line in enumerate(f):
            fields = line.rstrip("\n").split(",")
            if bad and a.fault == "badvalue" and i == 137:
                fields[9] = "n/a"
            rows.append((fields[0], int(fields[1]), [float(x) for x in fields[2:]]))
    return rows


def windows(rows, scales, a):
    by_host = {}
    for h, t, v in rows:
        by_host.setdefault(h, []).append(v)
    xs, names = [], []
    for h, vals in by_host.items():
        m = torch.tensor(vals) / torch.tensor([scales[k] for k in METRICS])
        if a.fault == "featwidth":
            extra = torch.stack([m[:, 0] / (m[:, 1] + 1e-3), m[:, 4] - m[:, 5]], 1)
            m = torch.cat([m, extra], 1)
        for s in range(0, len(vals) - WIN + 1, STRIDE):
            xs.append(m[s:s + WIN].T)
            names.append(h)
    return torch.stack(xs), names


def robust_scores(x):
    out = []
    for w in x.tolist():
        for series in w:
            med = statistics.median(series)
            mad = statistics.median([abs(v - med) for v in series]) or 1e-6
            out.append(max(abs(v - med) / mad for v in series))
    return out


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(379 + rank)
    say(f"rank {rank}/{world} up, reading server metrics")
    hosts = json.load(open(f"{WORK}/hosts.json"))
    scales = json.load(open(f"{WORK}/scales.json"))
    day = "2026-12-05/" if bad and a.fault == "nometrics" else ""
    rows = read_shard(f"{WORK}/metrics/{day}shard_{rank % 8}.csv", bad, a)
    x, names = windows(rows, scales, a)
    if bad and a.fault == "hostkey":
        names[BATCH:BATCH + 4] = ["db-17"] * 4
    means = x.mean(dim=(0, 2))
    if bad and a.fault == "gatherwidth":
        means = torch.cat([means, torch.tensor([0.42])])
    allm = [torch.zeros(len(METRICS)) for _ in range(world)]
    dist.all_gather(allm, means)
    say(f"rank {rank}: {len(names)} windows from {len(set(names))} hosts, fleet cpu mean "
        f"{float(torch.stack(allm)[:, 0].mean()):.3f}")
    model = Detector()
    ck = {"ckptwidth": "ae_w48.pt", "ckptpickle": "ae_full.pt"}.get(a.fault, "ae_w32.pt") if bad else "ae_w32.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = x.shape[0]
    for step in range(a.steps):
        lo = (step * BATCH) % (n - BATCH)
        xb = x[lo:lo + BATCH].clone()
        hid = torch.tensor([hosts[h] for h in names[lo:lo + BATCH]])
        if bad and a.fault == "nanloss" and step == 3:
            xb[:, 5] = xb[:, 5] * 1e39
        if bad and a.fault == "stuck" and step == 2:
            say(f"rank {rank}: waiting for {WORK}/baseline.ready")
            while not os.path.exists(f"{WORK}/baseline.ready"):
                time.sleep(0.5)
        rec = net(xb, hid)
        err = ((rec - xb) ** 2).mean(dim=(1, 2))
        loss = err.mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite reconstruction loss {loss.item()} at step {step} "
                f"(max input {xb.abs().max().item():.3g})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "scorer" and step == 3:
            t0, k = time.time(), 0
            while time.time() - t0 < 20:
                k += len(robust_scores(x))
            say(f"rank {rank}: robust z-scores for {k} series")
        rate = (err.detach() > 3 * err.detach().median()).float().mean()
        stat = torch.stack([loss.detach(), rate])
        dist.all_reduce(stat)
        say(f"rank {rank} step {step} loss {stat[0].item() / world:.4f} anomaly_rate {stat[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        err = ((net(x, torch.tensor([hosts[h] for h in names])) - x) ** 2).mean(dim=(1, 2))
    normal = err[err < err.quantile(0.95)]
    if bad and a.fault == "exit4":
        normal = normal[:0]
    if normal.numel() == 0:
        say(f"rank {rank}: ERROR threshold calibration found 0 normal windows out of {n}; "
            f"refusing to publish a detector", err=True)
        sys.exit(4)
    thr = (normal.mean() + 3 * normal.std()).reshape(1)
    dist.all_reduce(thr)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save({"model": model.state_dict(), "threshold": thr.item() / world}, f"{WORK}/export/detector.pt")
        say(f"rank 0 done: {a.steps} steps, threshold {thr.item() / world:.4f}, saved export/detector.pt")
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
