"""A three-hundred-and-thirty-first hand-run batch: KEYWORD SPOTTING ON MFCC FEATURES.

Synthetic one-second clips of twelve keywords ("yes", "no", "up", ... "go") are turned into 13 MFCC
coefficients over 40 frames plus a per-clip log-energy by --prepare, and stored per rank in
/tmp/fault331_work/feats/mfcc_R.pt.  Every rank normalises its features, looks each word up in the keyword
table, and trains a small 1-D conv net (two Conv1d layers over time, mean pooling, a linear head) with a
class-weighted cross entropy, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.
The model starts from ckpt/kws_mfcc13.pt.  Per-rank keyword counts are all_gathered at the start, the
accuracy is all_reduced every step, every rank reloads the front-end calibration at the end for a final
accuracy all_reduce, and rank 0 saves export/kws.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badkw      - rank N's shard has the word "marvin" in its first batch, missing from the keyword table (KeyError)
  labelidx   - rank N maps "_silence_" to label 12 at step 3: a target beyond the 12 classes (IndexError)
  nofeats    - rank N reads feats/test/mfcc_R.pt which does not exist (FileNotFoundError)
  ckptmel    - rank N initialises from ckpt/kws_mfcc40.pt, trained on 40 coefficients (size mismatch)
  ckptpickle - rank N reloads the front-end calibration from ckpt/frontend_full.pt, a pickled object (weights_only)
  statgather - rank N all_gathers its keyword counts plus an "_unknown_" count (13 vs 12 entries)
  dtw        - rank N aligns its clips to templates with a pure-Python DTW before the step-2 all_reduce
  nanlog     - rank N's batch at step 2 holds silent clips: log-energy -inf, the program's finiteness check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line about a keyword with no clips and calls sys.exit(5)
  deltawidth - every rank: deltas and delta-deltas appended (39 channels), the first conv expects 13 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  badkw      - KeyError: 'marvin' in the step-0 label lookup; peers Connection closed by peer, one aborts (np4 r1 ranklabel, np6 r0 tee)
  labelidx   - IndexError 'Target 12 is out of bounds.' at step 3; peers closed, one 12 s recv timeout (np3 r2 srunlabel --ddp 0, np6 r5 mpitag)
  nofeats    - FileNotFoundError for feats/test/mfcc_N.pt at start-up; peers closed in all_gather (np4 r3 mpitag, np3 r0 spawn)
  ckptmel    - load_state_dict size mismatch conv1.weight [32,40,3] vs [32,13,3] (np4 r2 legacy, np4 r1 pdsh2)
  ckptpickle - at the end: UnpicklingError 'Weights only load failed' (__main__.FrontendConfig) (np3 r1 logfmt, np5 r4 files)
  statgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (13), got (12))' (np6 r3 bashloop)
  dtw        - 12 s: peers 'Timed out waiting 12000ms' at step 2 (np3 r1 srunlabel); 300 s: silent after step 1, exit 124 (np4 r2 ranklabel)
  nanlog     - 'log-energy has 3 non-finite values' at step 2, FloatingPointError (np4 r0 logfmt, np3 r2 spawn)
  sigsegv    - silent death after step 3; bash 'Segmentation fault' exit 139 (np5 r2 bashloop); Root Cause -11 SIGSEGV (np3 r1 tee)
  exit5      - rank N's ERROR line (keyword 'off' has 0 clips), exit 5 (np4 r1 files loop exit 5, np3 r2 legacy Root Cause)
  deltawidth - every rank: 'expected input[32, 39, 40] to have 13 channels, but got 39 channels instead' (np4 pdsh2)
  none       - clean: 6 steps on 3 ranks, final accuracy, rank 0 saved export/kws.pt, exit 0 (np3 bashloop)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault331_work"
KEYWORDS = {w: i for i, w in enumerate(
    ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go", "_silence_", "_unknown_"])}
NCLASS = 12
NMFCC = 13
FRAMES = 40
BATCH = 32
log = None


class FrontendConfig:
    def __init__(self, n_mfcc, hop_ms):
        self.n_mfcc = n_mfcc
        self.hop_ms = hop_ms
        self.cmvn = torch.zeros(2, n_mfcc)


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
    log = logging.getLogger("kws")
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


class KWSNet(nn.Module):
    def __init__(self, n_in=NMFCC, ch=32):
        super().__init__()
        self.conv1 = nn.Conv1d(n_in, ch, 3, padding=1)
        self.conv2 = nn.Conv1d(ch, ch, 3, padding=1)
        self.energy = nn.Linear(1, ch)
        self.head = nn.Linear(ch, NCLASS)

    def forward(self, x, e):
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h)).mean(2)
        return self.head(h + self.energy(e.unsqueeze(1)))


def mfcc_of(wave, sr=16000, n_fft=400, hop=400):
    spec = torch.stft(wave, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True).abs() ** 2
    nbin = spec.shape[0]
    mel = torch.linspace(0, 1, 26).unsqueeze(1) - torch.linspace(0, 1, nbin).unsqueeze(0)
    fb = torch.clamp(1 - mel.abs() * 25, min=0)
    logmel = torch.log(fb @ spec + 1e-6)
    k = torch.arange(26).float()
    dct = torch.cos(torch.pi / 26 * (k + 0.5).unsqueeze(0) * torch.arange(NMFCC).float().unsqueeze(1))
    return (dct @ logmel)[:, :FRAMES]


def make_shard(n, seed):
    g = torch.Generator().manual_seed(seed)
    words = list(KEYWORDS)
    ws, feats, energy = [], [], []
    t = torch.arange(16000) / 16000.0
    for _ in range(n):
        w = words[int(torch.randint(0, NCLASS, (1,), generator=g))]
        f0 = 200 + 80 * KEYWORDS[w]
        wave = torch.sin(2 * torch.pi * f0 * t) * 0.3 + 0.05 * torch.randn(16000, generator=g)
        feats.append(mfcc_of(wave))
        energy.append(float(wave.pow(2).mean()))
        ws.append(w)
    return {"words": ws, "mfcc": torch.stack(feats), "energy": torch.tensor(energy)}


def prepare():
    os.makedirs(f"{WORK}/feats", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(256, 500 + r), f"{WORK}/feats/mfcc_{r}.pt")
    torch.manual_seed(0)
    torch.save(KWSNet(NMFCC).state_dict(), f"{WORK}/ckpt/kws_mfcc13.pt")
    torch.save(KWSNet(40).state_dict(), f"{WORK}/ckpt/kws_mfcc40.pt")
    torch.save({"cmvn": torch.zeros(2, NMFCC), "hop_ms": 25}, f"{WORK}/ckpt/frontend.pt")
    torch.save({"config": FrontendConfig(NMFCC, 25), "hop_ms": 25}, f"{WORK}/ckpt/frontend_full.pt")
    print("prepared", WORK)


def dtw_cost(a, b):
    n, m = len(a), len(b)
    inf = float("inf")
    d = [[inf] * (m + 1) for _ in range(n + 1)]
    d[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            c = sum((x - y) ** 2 for x, y in zip(a[i - 1], b[j - 1]))
            d[i][j] = c + min(d[i - 1][j], d[i][j - 1], d[i - 1][j - 1])
    return d[n][m]


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading MFCC shard")
    split = "test/" if bad and a.fault == "nofeats" else ""
    shard = torch.load(f"{WORK}/feats/{split}mfcc_{rank}.pt")
    words = shard["words"]
    x = shard["mfcc"]
    x = (x - x.mean((0, 2), keepdim=True)) / x.std((0, 2), keepdim=True)
    if a.fault == "deltawidth":
        d1 = x[:, :, 1:] - x[:, :, :-1]
        d1 = torch.cat([d1, d1[:, :, -1:]], 2)
        d2 = torch.cat([d1[:, :, 1:] - d1[:, :, :-1], torch.zeros_like(d1[:, :, :1])], 2)
        x = torch.cat([x, d1, d2], 1)
    energy = shard["energy"].clone()
    if bad and a.fault == "badkw":
        words[7] = "marvin"
    if bad and a.fault == "nanlog":
        energy[2 * BATCH + 3: 2 * BATCH + 6] = 0.0
    counts = torch.zeros(NCLASS)
    for w in words:
        if w in KEYWORDS:
            counts[KEYWORDS[w]] += 1
    if bad and a.fault == "statgather":
        counts = torch.cat([counts, torch.tensor([float(sum(w not in KEYWORDS for w in words))])])
    allc = [torch.zeros(NCLASS) for _ in range(world)]
    dist.all_gather(allc, counts)
    total = sum(allc)
    say(f"rank {rank} clips {len(words)} global {int(total.sum())} min/class {int(total.min())}")
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR keyword 'off' has 0 clips after speaker filtering in shard {rank}, "
            f"cannot balance classes", err=True)
        sys.exit(5)
    class_w = (total.sum() / (NCLASS * total.clamp(min=1)))
    model = KWSNet()
    ck = "kws_mfcc40.pt" if bad and a.fault == "ckptmel" else "kws_mfcc13.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    logE = None
    for step in range(a.steps):
        sl = slice(step * BATCH, (step + 1) * BATCH)
        labels = torch.tensor([KEYWORDS[w] for w in words[sl]])
        if bad and a.fault == "labelidx" and step == 3:
            labels[labels == KEYWORDS["_silence_"]] = NCLASS
            labels[0] = NCLASS
        logE = torch.log(energy[sl])
        if not torch.isfinite(logE).all():
            say(f"rank {rank}: step {step}: log-energy has {int((~torch.isfinite(logE)).sum())} non-finite "
                f"values (min energy {energy[sl].min():.3g})", err=True)
            raise FloatingPointError(f"non-finite log-energy on rank {rank} at step {step}")
        logits = net(x[sl], logE)
        loss = (F.cross_entropy(logits, labels, reduction="none") * class_w[labels]).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "dtw" and step == 2:
            t0 = time.time()
            n = 0
            tmpl = x[0].t().tolist()
            while time.time() - t0 < a.dtw_budget:
                dtw_cost(x[n % len(words)].t().tolist(), tmpl)
                n += 1
            say(f"rank {rank} DTW alignment: {n} clips")
        acc = (logits.argmax(1) == labels).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    fe = "frontend_full.pt" if bad and a.fault == "ckptpickle" else "frontend.pt"
    cal = torch.load(f"{WORK}/ckpt/{fe}")
    with torch.no_grad():
        final = (model(x[:BATCH], torch.log(energy[:BATCH])).argmax(1) ==
                 torch.tensor([KEYWORDS[w] for w in words[:BATCH]])).float().mean().reshape(1)
    dist.all_reduce(final)
    say(f"rank {rank} final acc {final.item() / world:.3f} (hop {cal['hop_ms']} ms)")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/kws.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/kws.pt")
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
    p.add_argument("--dtw-budget", type=int, default=45)
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
