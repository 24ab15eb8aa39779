"""A three-hundred-and-fifty-sixth hand-run batch: SPEECH QUALITY (MOS) PREDICTION.

Synthetic utterances as log-mel spectrograms (120 frames x 40 mel bins) with a mean opinion score (MOS,
1-5 ACR scale) and a degradation condition (clean, mp3_32k, amr_nb, noise_10db, reverb, packet_loss) looked
up in a condition table.  Every rank reads its utterances from /tmp/fault356_work/feats/feats_R.pt and
trains a MOSNet-style predictor (conv front end, GRU, frame scores, mean pooling, a condition embedding)
on the utterance MSE plus a last-frame term, wrapped in DDP (gloo), or with gradients all_reduced by hand
(--ddp 0).  The model is initialised from ckpt/mosnet_mel40.pt.  Per-rank MOS histograms are all_gathered at
the start, loss and MAE are all_reduced every step, rank 0 saves export/mosnet.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  mosrange   - rank N's label file holds a MOS of 7.5 (a 1-10 panel slipped in): the program's range check (ValueError)
  condition  - rank N's utterances name condition "opus_6k", missing from the condition table (KeyError)
  frameidx   - rank N from step 3 picks the last frame at index len instead of len-1 (IndexError)
  nofeats    - rank N reads its features from feats_16k/ which does not exist (FileNotFoundError)
  ckptmel    - rank N initialises from ckpt/mosnet_mel80.pt, saved for 80 mel bins (size mismatch)
  ckptpickle - rank N initialises from ckpt/mosnet_full.pt, a pickled whole model (weights_only refusal)
  gatherlen  - rank N all_gathers a 9-bin half-point MOS histogram instead of 5 bins
  slowpesq   - rank N computes a pure-Python reference quality score before the step-2 all_reduce
  nanloss    - rank N's step-3 batch holds a silent clip: log(0) = -inf frames, NaN loss, the program's check
  segv       - rank N sends itself SIGSEGV after step 4
  exit5      - rank N, before the export, prints its own error line about a thin listener panel and sys.exit(5)
  poolshape  - every rank: the head reads mean+max pooled features (64 wide) but was built for 32 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  mosrange   - ValueError 'MOS label 7.50 for utterance 7 is outside the 1-5 ACR scale' at start-up; peers closed in all_gather (np4 r2 ranklabel, np6 r0 logfmt)
  condition  - KeyError: 'opus_6k' at start-up; peers Connection closed by peer (np3 r1 srunlabel, np5 r3 tee)
  frameidx   - IndexError 'index 120 is out of bounds for dimension 1 with size 120' (np4 r1 mpitag --ddp 0, step 3; np5 r4 spawn); np3 r2 spawn never hit a 120-frame utterance, ran clean, dropped
  nofeats    - FileNotFoundError for feats_16k/feats_4.pt before the first all_gather; five peers closed (np6 r4 bashloop)
  ckptmel    - load_state_dict size mismatch for conv.weight [32,80,3] vs [32,40,3]; Root Cause rank 1 under worker-1 (np4 r1 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed' (Unsupported global __main__.MOSNet) (np3 r0 legacy, np4 r3 files)
  gatherlen  - rank 5: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (5))'; peers closed (np6 r5 srunlabel)
  slowpesq   - 12 s PG timeout: ranks 0,1 'Timed out waiting 12000ms' (np3 r2 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r0 ranklabel)
  nanloss    - program's check: 'non-finite loss nan at step 3 (input min -inf ...)', FloatingPointError (np4 r3 logfmt, np3 r1 spawn)
  segv       - no traceback after step 4; Root Cause rank 2 exitcode -11 SIGSEGV (np4 r2 tee); bash 'Segmentation fault', exit 139 (np3 r0 mpitag)
  exit5      - rank 1's listener-panel ERROR line after step 5 and exit 5; peers closed in the final barrier (np3 r1 files)
  poolshape  - every rank: 'mat1 and mat2 shapes cannot be multiplied (8x64 and 32x1)' in the first forward; Root Cause rank 0 (np3 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/mosnet.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault356_work"
COND = {"clean": 0, "mp3_32k": 1, "amr_nb": 2, "noise_10db": 3, "reverb": 4, "packet_loss": 5}
NMEL = 40
T = 120
HID = 32
BATCH = 8
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
    log = logging.getLogger("mosnet")
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


class MOSNet(nn.Module):
    def __init__(self, nmel=NMEL, hid=HID, pool2=False):
        super().__init__()
        self.conv = nn.Conv1d(nmel, hid, 3, padding=1)
        self.gru = nn.GRU(hid, hid, batch_first=True)
        self.cond = nn.Embedding(len(COND), hid)
        self.frame = nn.Linear(hid, 1)
        self.head = nn.Linear(hid, 1)
        self.pool2 = pool2

    def forward(self, mel, cond):
        h = torch.relu(self.conv(mel.transpose(1, 2))).transpose(1, 2)
        h, _ = self.gru(h)
        h = h + self.cond(cond).unsqueeze(1)
        fs = self.frame(h).squeeze(2) + 3.0
        if self.pool2:
            g = torch.cat([h.mean(1), h.max(1).values], 1)
        else:
            g = h.mean(1)
        return self.head(g).squeeze(1) + fs.mean(1), fs


def make_feats(n, seed):
    g = torch.Generator().manual_seed(seed)
    conds = list(COND)
    cond = [conds[int(i)] for i in torch.randint(0, len(COND), (n,), generator=g)]
    mos = torch.empty(n)
    mel = torch.randn(n, T, NMEL, generator=g) * 0.5 - 4.0
    for i, c in enumerate(cond):
        base = 4.3 - 0.45 * COND[c]
        mos[i] = float(min(5.0, max(1.0, base + 0.3 * float(torch.randn(1, generator=g)))))
        mel[i, :, 20:] -= (5.0 - mos[i]) * 0.4
    lens = torch.randint(90, T + 1, (n,), generator=g)
    lens[0] = T
    return {"mel": mel, "mos": mos, "cond": cond, "len": lens}


def prepare():
    for d in ("feats", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_feats(48, 300 + r), f"{WORK}/feats/feats_{r}.pt")
    torch.manual_seed(0)
    torch.save(MOSNet().state_dict(), f"{WORK}/ckpt/mosnet_mel40.pt")
    torch.save(MOSNet(nmel=80).state_dict(), f"{WORK}/ckpt/mosnet_mel80.pt")
    torch.save(MOSNet(), f"{WORK}/ckpt/mosnet_full.pt")
    print("prepared", WORK)


def reference_quality(mel, budget):
    t0 = time.time()
    score, n = 0.0, 0
    while time.time() - t0 < budget:
        for u in mel.tolist():
            for frame in u:
                e = sum(v * v for v in frame) / len(frame)
                score += 1.0 / (1.0 + abs(e - 16.0))
                n += 1
    return score / max(n, 1)


def load_data(a, rank, bad):
    sub = "feats_16k" if bad and a.fault == "nofeats" else "feats"
    d = torch.load(f"{WORK}/{sub}/feats_{rank}.pt")
    if bad and a.fault == "mosrange":
        d["mos"][7] = 7.5
    if bad and a.fault == "condition":
        d["cond"][11] = "opus_6k"
    if bad and a.fault == "nanloss":
        d["mel"][3 * BATCH + 2] = torch.log(torch.zeros(T, NMEL))
    out_of_scale = ((d["mos"] < 1.0) | (d["mos"] > 5.0)).nonzero().flatten().tolist()
    if out_of_scale:
        i = out_of_scale[0]
        raise ValueError(f"MOS label {d['mos'][i].item():.2f} for utterance {i} is outside the 1-5 ACR scale")
    cond = torch.tensor([COND[c] for c in d["cond"]])
    return d["mel"], d["mos"], cond, d["len"]


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading utterances")
    mel, mos, cond, lens = load_data(a, rank, bad)
    if bad and a.fault == "gatherlen":
        hist = torch.histc(mos, bins=9, min=1.0, max=5.0)
    else:
        hist = torch.histc(mos, bins=5, min=1.0, max=5.0)
    allh = [torch.zeros(5) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} utterances {mel.shape[0]} global MOS histogram {[int(v) for v in sum(allh).tolist()]}")
    model = MOSNet(pool2=a.fault == "poolshape")
    ck = {"ckptmel": "mosnet_mel80.pt", "ckptpickle": "mosnet_full.pt"}.get(a.fault) if bad else None
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck or 'mosnet_mel40.pt'}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = mel.shape[0]
    for step in range(a.steps):
        j = (step * BATCH) % n
        xb, yb, cb, lb = mel[j:j + BATCH], mos[j:j + BATCH], cond[j:j + BATCH], lens[j:j + BATCH]
        pred, fs = net(xb, cb)
        last = lb - 1
        if bad and a.fault == "frameidx" and step >= 3:
            last = lb
        fl = fs[torch.arange(xb.shape[0]), last]
        loss = ((pred - yb) ** 2).mean() + 0.1 * ((fl - yb) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(input min {xb.min().item()}, {int((~torch.isfinite(pred)).sum())} NaN predictions)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowpesq" and step == 2:
            q = reference_quality(xb, a.pesq_budget)
            say(f"rank {rank} reference quality {q:.4f}")
        stats = torch.stack([loss.detach(), (pred.detach() - yb).abs().mean()])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} mae {stats[1].item():.4f}")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR listener panel for condition amr_nb has 2 raters (< 3 required), "
            f"refusing to export MOS predictions", err=True)
        sys.exit(5)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/mosnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/mosnet.pt")
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
    p.add_argument("--pesq-budget", type=int, default=45)
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
