"""A two-hundred-and-seventieth hand-run batch: TIME-SERIES ANOMALY DETECTION WITH A TCN AUTOENCODER. Rank 0 writes
one synthetic multivariate sensor CSV per machine (512 rows x 6 channels, sine trends plus noise with injected
spikes and a label column), a machine table (machines.json) and a pretrained 1x1 decoder (ckpt/decoder_c6.pt, plus
an older 8-channel decoder_c8.pt). Each rank looks its machine up, reads its CSV, selects the sensor channels of its
config, cuts 32-step windows, builds a dilated causal conv encoder (kernel 3, dilations 1-2-4) with the pretrained
decoder, trains the reconstruction MSE for 6 steps under DDP, calibrates a threshold (mean + 3 std of normal window
scores), all_gathers per-rank anomaly counts in 8 time bins and all_reduces TP/FP/FN for precision and recall.

Faults:
- channel: --rank's config selects sensor channel 6 of a 6-wide input (off by one): IndexError at channel select.
- zerostd: --rank calibrates on 1 window, std 0, z-scores NaN/inf: the program's check raises FloatingPointError.
- counts: --rank bins its anomaly counts into 9 bins instead of 8; the all_gather of counts has another length.
- csv: --rank reads its CSV from sensors/v2/, never written: FileNotFoundError.
- machine: --rank looks its machine up as M-0NN-b (a renamed host), missing from machines.json: KeyError.
- dilation: the config (every rank with -1) uses valid convs with dilations 1-2-4-8-16: window shrinks, RuntimeError.
- ckpt: --rank's config points at the old 8-channel decoder checkpoint: size mismatch in load_state_dict.
- slowscore: --rank scores every window point by point in Python (--stall s) before the counts all_gather.
- kill: --rank sends itself SIGKILL after step 3.
- exit5: --rank prints an ERROR line about clock drift at step 4 and calls sys.exit(5).
- none: control.

What happened (filled in after the runs):
- channel: rank N IndexError 'index 6 is out of bounds for dimension 0 with size 6'; peers Connection closed in DDP init (np4 r2, np3 r1).
- zerostd: rank N FloatingPointError '1 NaN and 30 inf anomaly scores (calibration std 0 over 1 windows)' (np3 r1, np5 r3).
- counts: a peer aborts on gloo EnforceNotMet '18 vs 16 ... size mismatch' in the all_gather (exit 134); others reset/closed.
- csv: rank N FileNotFoundError '/tmp/job_work/sensors/v2/machine_0N.csv not found.' (spawn np3 r2, files np4 r1).
- machine: rank N KeyError 'M-00N-b' at the machine lookup; peers Connection closed or SIGTERMed (np4 r3, np3 r1).
- dilation: every rank RuntimeError 'Calculated padded input size per channel: (2). Kernel size: (33)' at step 0.
- ckpt: rank N RuntimeError loading state_dict for Conv1d: size mismatch for weight [8, 16, 1] vs [6, 16, 1].
- slowscore: PG 12 s: peers 'Timed out waiting 12000ms' in the counts all_gather; PG 300 s under timeout 60: exit 124.
- kill: rank N killed by SIGKILL after step 3 (exitcode -9 / bash 'Killed', exit 137); peers Connection reset/closed.
- exit5: rank N prints 'ERROR rank N: sensor clock drift 4.20 s ...; refusing to score' and exits 5; peers closed.
- none: exit 0; rank 0 prints 'anomaly detection done: precision 1.000 recall 0.379, 11 windows flagged on 3 machines'.
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault270_work"
WIN, NCH, ROWS = 32, 6, 512
LOG = None


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a, _ = p.parse_known_args()
    return a


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def out(msg, err=False):
    if LOG is not None:
        (LOG.error if err else LOG.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class CausalConv(nn.Module):
    def __init__(self, cin, cout, k, d, pad):
        super().__init__()
        self.left = (k - 1) * d if pad == "causal" else 0
        self.conv = nn.Conv1d(cin, cout, k, dilation=d)

    def forward(self, x):
        return self.conv(F.pad(x, (self.left, 0)))


class TCNAE(nn.Module):
    def __init__(self, c, hidden, dilations, pad):
        super().__init__()
        layers, cin = [], c
        for d in dilations:
            layers += [CausalConv(cin, hidden, 3, d, pad), nn.ReLU()]
            cin = hidden
        self.encoder = nn.Sequential(*layers)
        self.decoder = nn.Conv1d(hidden, c, 1)

    def forward(self, x):
        return self.decoder(self.encoder(x))


def export(W):
    os.makedirs(f"{WORK}/sensors", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    rng = np.random.default_rng(7)
    table = {}
    for i in range(W):
        t = np.arange(ROWS)[:, None]
        x = np.sin(2 * np.pi * t / (40 + 7 * np.arange(NCH))) + 0.1 * rng.standard_normal((ROWS, NCH))
        lab = np.zeros(ROWS)
        for s in rng.choice(np.arange(WIN * 4, ROWS), 6, replace=False):
            x[s, rng.integers(NCH)] += 4.0
            lab[s] = 1
        np.savetxt(f"{WORK}/sensors/machine_{i:02d}.csv", np.hstack([x, lab[:, None]]), delimiter=",",
                   header=",".join([f"s{j}" for j in range(NCH)] + ["label"]), comments="", fmt="%.5f")
        table[f"M-{i:03d}"] = {"site": "plant-%d" % (i % 2), "sample_hz": 10, "csv": f"machine_{i:02d}.csv"}
    with open(f"{WORK}/machines.json", "w") as f:
        json.dump(table, f)
    torch.manual_seed(1)
    torch.save(nn.Conv1d(16, 6, 1).state_dict(), f"{WORK}/ckpt/decoder_c6.pt")
    torch.save(nn.Conv1d(16, 8, 1).state_dict(), f"{WORK}/ckpt/decoder_c8.pt")


def config(a, r):
    hit = a.rank in (-1, r)
    cfg = {"channels": [0, 1, 2, 3, 4, 5], "hidden": 16, "dilations": [1, 2, 4], "pad": "causal", "cal_windows": 64,
           "bins": 8, "decoder": "decoder_c6.pt", "csv_dir": "sensors", "host_suffix": ""}
    if a.fault == "channel" and hit:
        cfg["channels"] = [1, 2, 3, 4, 5, 6]
    if a.fault == "zerostd" and hit:
        cfg["cal_windows"] = 1
    if a.fault == "counts" and hit:
        cfg["bins"] = 9
    if a.fault == "csv" and hit:
        cfg["csv_dir"] = "sensors/v2"
    if a.fault == "machine" and hit:
        cfg["host_suffix"] = "-b"
    if a.fault == "dilation" and hit:
        cfg["dilations"], cfg["pad"] = [1, 2, 4, 8, 16], "valid"
    if a.fault == "ckpt" and hit:
        cfg["decoder"] = "decoder_c8.pt"
    return cfg


def main(a):
    global LOG
    r, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.logfmt:
        LOG = logging.getLogger("tcnae")
        h = logging.StreamHandler(sys.stdout)
        h.addFilter(RankFilter(r))
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        LOG.addHandler(h)
        LOG.setLevel(logging.INFO)
        LOG.propagate = False
    hit = a.rank in (-1, r)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    if r == 0:
        export(W)
    dist.barrier()
    cfg = config(a, r)
    with open(f"{WORK}/machines.json") as f:
        table = json.load(f)
    mid = f"M-{r:03d}{cfg['host_suffix']}"
    info = table[mid]
    raw = np.loadtxt(f"{WORK}/{cfg['csv_dir']}/{info['csv']}", delimiter=",", skiprows=1, dtype=np.float32)
    data = torch.from_numpy(raw)
    x_all, lab = data[:, :NCH], data[:, NCH]
    x = x_all[:, torch.tensor(cfg["channels"])]
    x = (x - x.mean(0)) / x.std(0)
    wins = x.unfold(0, WIN, WIN // 2)  # (n, C, WIN)
    wlab = lab.unfold(0, WIN, WIN // 2).amax(1)
    out(f"rank {r}/{W} machine {mid} ({info['site']}): {wins.shape[0]} windows of {WIN} x {wins.shape[1]}, "
        f"{int(wlab.sum())} with spikes")
    torch.manual_seed(0)
    model = TCNAE(len(cfg["channels"]), cfg["hidden"], cfg["dilations"], cfg["pad"])
    model.decoder.load_state_dict(torch.load(f"{WORK}/ckpt/{cfg['decoder']}"))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    normal = wins[wlab == 0]
    for step in range(a.steps):
        batch = normal[torch.randint(0, normal.shape[0], (16,), generator=torch.Generator().manual_seed(step + r))]
        loss = F.mse_loss(ddp(batch), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out(f"rank {r} step {step} loss {loss.item():.4f}")
        if a.fault == "kill" and hit and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault == "exit5" and hit and step == 4:
            out(f"ERROR rank {r}: sensor clock drift 4.20 s on machine {mid} exceeds 2.00 s; refusing to score", True)
            sys.exit(5)
    with torch.no_grad():
        scores = (model(wins) - wins).pow(2).mean((1, 2))
        cal = scores[wlab == 0][:cfg["cal_windows"]]
        mu, sd = cal.mean(), cal.std(unbiased=False)
        if a.fault == "slowscore" and hit:
            out(f"rank {r}: scoring {wins.shape[0] * WIN} window points one by one (exact mode)")
            t_end = time.time() + a.stall
            while time.time() < t_end:
                for w in wins:
                    float((w * w).sum())
                time.sleep(0.05)
        z = (scores - mu) / sd
        if not torch.isfinite(z).all():
            raise FloatingPointError(f"rank {r}: {int(torch.isnan(z).sum())} NaN and {int(torch.isinf(z).sum())} inf "
                                     f"anomaly scores (calibration std {sd.item():.3g} over {cal.numel()} windows)")
        pred = (z > 3.0).float()
    counts = torch.bincount((torch.arange(len(pred)) * cfg["bins"]) // len(pred), weights=pred, minlength=cfg["bins"])
    got = [torch.empty_like(counts) for _ in range(W)]
    dist.all_gather(got, counts)
    conf = torch.tensor([(pred * wlab).sum(), (pred * (1 - wlab)).sum(), ((1 - pred) * wlab).sum()])
    dist.all_reduce(conf)
    tp, fp, fn = conf.tolist()
    if r == 0:
        out(f"anomaly detection done: precision {tp / max(tp + fp, 1):.3f} recall {tp / max(tp + fn, 1):.3f}, "
            f"{int(sum(g.sum() for g in got))} windows flagged on {W} machines")
    dist.destroy_process_group()


def spawned(i, n, a):
    os.environ.update(RANK=str(i), WORLD_SIZE=str(n), LOCAL_RANK=str(i))
    main(a)


if __name__ == "__main__":
    args = parse()
    if args.spawn:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        mp.spawn(spawned, args=(args.spawn, args), nprocs=args.spawn)
    else:
        main(args)
