"""A four-hundred-and-fifty-ninth hand-run batch: SEISMIC PHASE PICKING ON WAVEFORM WINDOWS.

Synthetic three-component (Z, N, E) waveform windows of 400 samples at 100 Hz: noise, a P arrival and a
later, stronger S arrival.  Every rank reads its windows from /tmp/fault459_work/waves/waves_R.pt (traces,
station codes, P and S pick samples), looks each window's station up in stations.pt (an 8-station table),
labels every sample noise / P / S (a +-3 sample band around each pick) and trains a small PhaseNet-like
1-D conv picker (two conv layers, a station embedding, a 1x1 head) with a per-sample cross entropy, wrapped
in DDP (gloo), or with gradients all_reduced by hand under --ddp 0.  The picker is initialised from
ckpt/picker_c3.pt.  Per-rank window counts are all_gathered at the start, the loss and the P-pick accuracy
are all_reduced every step, an 8-bin SNR histogram is all_gathered at the end, and rank 0 saves
export/picker.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults:
  station     - rank N's step-1 batch holds a window from station "KZX9", missing from the table (KeyError)
  pickidx     - rank N's step-3 batch has a P pick at sample 400 of a 400-sample window (IndexError)
  nowaves     - rank N reads its windows from waves/rotated/ which does not exist (FileNotFoundError)
  ckptchan    - rank N initialises from ckpt/picker_c4.pt, saved with 4 input channels (size mismatch)
  ckptmeta    - rank N initialises from ckpt/picker_meta.pt, which pickles a PickerConfig object
                (torch.load weights_only refusal)
  snrhist     - rank N all_gathers a 9-bin SNR histogram at the end (others 8 bins)
  slowfilter  - rank N band-pass filters every trace in pure Python before the step-2 all_reduce
  stall       - rank N waits for picks/catalog.lock to go away before step 4; it never does
  gapnan      - rank N's step-3 batch has a telemetry gap filled with NaN: the loss check raises
                FloatingPointError
  segv        - rank N sends itself SIGSEGV after step 2
  exit2       - rank N prints its own clock-drift error line at step 1 and calls sys.exit(2)
  chanwidth   - every rank stacks a fourth (pressure) channel; the first conv expects 3 (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  station     - KeyError: 'KZX9' in batch_for at step 1; peers Connection closed by peer; Root Cause the faulty rank (np4 r2 plain, np6 r0 tee)
  pickidx     - IndexError 'index 400 is out of bounds for dimension 1 with size 400' at step 3; Root Cause the faulty rank (np3 r1 tee_trainer, np8 r5 filter)
  nowaves     - FileNotFoundError waves/rotated/waves_N.pt at start-up; console of redirects shows only the agent summary (np3 r1 redirects, np4 r3 pdsh2)
  ckptchan    - load_state_dict size mismatch c1.weight [16,4,7] vs [16,3,7] at start-up; DETAIL adds a monitoredBarrier line on rank 0 (np4 r1 pymodule, np3 r2 detail)
  ckptmeta    - _pickle.UnpicklingError 'Weights only load failed' (Unsupported global __main__.PickerConfig) at start-up (np3 r0 loglevel)
  snrhist     - DETAIL: 'Detected mismatch between collectives' on every rank, Root Cause rank 0 (np3 r2 detail); plain gloo: 'allgather: invalid tensor size at index 0 (expected (9), got (8))' on rank 4 (np6 r4 prefix)
  slowfilter  - rank 1 silent; ranks 0 and 2 'Timed out waiting 12000ms' in the step-2 all_reduce; Root Cause rank 0 (np3 r1 plain)
  stall       - steps 0-3, rank 2 'waiting for ... catalog.lock', output stops; killed by timeout at 60 s, exit 124 (np4 r2 loglevel)
  gapnan      - 'non-finite loss nan (1200 non-finite samples)' and FloatingPointError at step 3, twice under --max-restarts 1 (np3 r0 restart); np4 r2 wrapper: Root Cause rank 1 SIGABRT, rank 2 listed SIGTERM
  segv        - no traceback from rank N after step 2; np4 r3 prefix: Root Cause rank 0 SIGABRT (terminate called), rank 3 -11 in Failures; np3 r1 pymodule: Root Cause rank 1 SIGSEGV
  exit2       - rank N's clock-drift ERROR line; np8 r6 tee: Root Cause rank 6 exitcode 2; np3 r2 wrapper: the exit ended in 'terminate called', Root Cause rank 2 SIGABRT -6
  chanwidth   - every rank 'expected input[16, 4, 400] to have 3 channels, but got 4 channels instead' in the first forward; Root Cause rank 0 (np4 tee_trainer)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/picker.pt, exit 0 (np3 plain)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault459_work"
NS = 400
BATCH = 16
STATIONS = ["ANMO", "COLA", "HRV", "KONO", "MAJO", "PAB", "SSPA", "TATO"]
log = None


class PickerConfig:
    def __init__(self, fs=100.0, band=(1.0, 20.0)):
        self.fs = fs
        self.band = band


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
    log = logging.getLogger("picker")
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


class Picker(nn.Module):
    def __init__(self, cin=3, dim=16, nsta=len(STATIONS)):
        super().__init__()
        self.c1 = nn.Conv1d(cin, dim, 7, padding=3)
        self.c2 = nn.Conv1d(dim, dim, 7, padding=3)
        self.sta = nn.Embedding(nsta, dim)
        self.head = nn.Conv1d(dim, 3, 1)

    def forward(self, x, sta):
        h = torch.relu(self.c1(x))
        h = torch.relu(self.c2(h) + self.sta(sta).unsqueeze(2))
        return self.head(h)


def make_windows(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(NS).float()
    x = 0.1 * torch.randn(n, 3, NS, generator=g)
    p = torch.randint(50, 200, (n,), generator=g)
    s = p + torch.randint(40, 150, (n,), generator=g)
    for i in range(n):
        pi, si = int(p[i]), int(s[i])
        x[i, 0, pi:] += torch.sin(2 * math.pi * 8 * t[: NS - pi] / 100) * torch.exp(-t[: NS - pi] / 40)
        x[i, 1:, si:] += 2 * torch.sin(2 * math.pi * 4 * t[: NS - si] / 100) * torch.exp(-t[: NS - si] / 60)
    sta = [STATIONS[int(k)] for k in torch.randint(0, len(STATIONS), (n,), generator=g)]
    return {"x": x, "station": sta, "p": p, "s": s}


def prepare():
    for d in ("waves", "ckpt", "picks"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_windows(96, 500 + r), f"{WORK}/waves/waves_{r}.pt")
    torch.save({c: i for i, c in enumerate(STATIONS)}, f"{WORK}/stations.pt")
    torch.manual_seed(0)
    torch.save(Picker(3).state_dict(), f"{WORK}/ckpt/picker_c3.pt")
    torch.save(Picker(4).state_dict(), f"{WORK}/ckpt/picker_c4.pt")
    torch.save({"model": Picker(3).state_dict(), "config": PickerConfig()}, f"{WORK}/ckpt/picker_meta.pt")
    open(f"{WORK}/picks/catalog.lock", "w").write("held by catalog-sync pid 4711\n")
    print("prepared", WORK)


def bandpass_python(trace, fs=100.0, lo=1.0, hi=20.0):
    # a first-order high-pass then low-pass, sample by sample, the slow way
    a_hp = 1.0 / (1.0 + 2 * math.pi * lo / fs)
    a_lp = (2 * math.pi * hi / fs) / (1.0 + 2 * math.pi * hi / fs)
    out, prev_x, prev_hp, prev_lp = [], 0.0, 0.0, 0.0
    for v in trace:
        hp = a_hp * (prev_hp + v - prev_x)
        lp = prev_lp + a_lp * (hp - prev_lp)
        out.append(lp)
        prev_x, prev_hp, prev_lp = v, hp, lp
    return out


def batch_for(data, table, step, a, bad, rank):
    n = data["x"].shape[0]
    idx = torch.arange(step * BATCH, step * BATCH + BATCH) % n
    x = data["x"][idx].clone()
    codes = [data["station"][int(i)] for i in idx]
    p = data["p"][idx].clone()
    s = data["s"][idx].clone()
    if bad and a.fault == "station" and step == 1:
        codes[11] = "KZX9"
    if bad and a.fault == "pickidx" and step == 3:
        p[6] = NS
    if bad and a.fault == "gapnan" and step == 3:
        x[4, :, 120:180] = float("nan")
    if a.fault == "chanwidth":
        x = torch.cat([x, 0.05 * torch.randn(BATCH, 1, NS)], dim=1)
    sta = torch.tensor([table[c] for c in codes])
    y = torch.zeros(BATCH, NS, dtype=torch.long)
    ar = torch.arange(BATCH)
    y[ar, p] = 1
    y[ar, s] = 2
    for off in (-3, -2, -1, 1, 2, 3):
        y[ar, (p + off).clamp(0, NS - 1)] = 1
        y[ar, (s + off).clamp(0, NS - 1)] = 2
    x = x / (x.abs().amax(dim=2, keepdim=True) + 1e-6)
    return x, sta, y, p


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading waveform windows")
    sub = "rotated/" if bad and a.fault == "nowaves" else ""
    data = torch.load(f"{WORK}/waves/{sub}waves_{rank}.pt")
    table = torch.load(f"{WORK}/stations.pt")
    nwin = torch.tensor([float(data["x"].shape[0])])
    alln = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(alln, nwin)
    say(f"rank {rank} windows {int(nwin.item())} global {int(sum(t.item() for t in alln))}")
    model = Picker()
    if bad and a.fault == "ckptchan":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/picker_c4.pt"))
    elif bad and a.fault == "ckptmeta":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/picker_meta.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/picker_c3.pt"))
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        if bad and a.fault == "exit2" and step == 1:
            say(f"rank {rank}: ERROR station {STATIONS[rank % 8]} clock drift 2.4 s exceeds 0.1 s tolerance "
                f"(GPS lock lost); picks from this node are unreliable, aborting", err=True)
            sys.exit(2)
        if bad and a.fault == "stall" and step == 4:
            say(f"rank {rank}: waiting for {WORK}/picks/catalog.lock before writing picks")
            while os.path.exists(f"{WORK}/picks/catalog.lock"):
                time.sleep(1)
        x, sta, y, p = batch_for(data, table, step, a, bad, rank)
        logits = net(x, sta)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({nbad} non-finite samples in batch)",
                err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if bad and a.fault == "slowfilter" and step == 2:
            t0, n = time.time(), 0
            while time.time() - t0 < a.filter_budget:
                for tr in data["x"][:, 0]:
                    bandpass_python(tr.tolist())
                    n += 1
            say(f"rank {rank} band-passed {n} traces")
        pick = logits.detach()[:, 1].argmax(1)
        acc = ((pick - p).abs() <= 10).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} p_acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    amp = data["x"].abs().amax(dim=(1, 2))
    noise = data["x"][:, :, :40].std(dim=(1, 2)) + 1e-6
    snr = 20 * torch.log10(amp / noise)
    nbins = 9 if bad and a.fault == "snrhist" else 8
    hist = torch.histc(snr, bins=nbins, min=0, max=40)
    allh = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} snr histogram gathered: {[int(v) for v in sum(allh).tolist()]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/picker.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/picker.pt")
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
    p.add_argument("--filter-budget", type=int, default=40)
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
