"""A three-hundred-and-sixth hand-run batch: HDR IMAGE RECONSTRUCTION FROM BRACKETED EXPOSURES.

Synthetic scenes: every sample is a linear HDR radiance patch (3x16x16, log-normal) photographed as a
bracket of 3 LDR exposures (exposure times t = 1/4, 1, 4 s), each through its camera's response curve (a
gamma looked up by camera model in a CRF table) and clipped to [0, 1].  Every rank reads its brackets from
/tmp/fault306_work/brackets/brk_R.pt, linearises each exposure (ldr^gamma / t), and trains a small
merge CNN (9 log-radiance channels in, 3 log-HDR channels out) with an L1 loss on mu-law tonemapped
values, wrapped in DDP (gloo), or with gradients all_reduced by hand under --ddp 0.  The network starts
from ckpt/mergenet_e3.pt.  Per-rank luminance histograms (16 bins) are all_gathered at the start, the loss
and PSNR are all_reduced every step, and rank 0 saves export/mergenet.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  crfkey     - rank N's brackets were shot on a "Sony-A7S3", missing from the CRF table (KeyError, start-up)
  nobrackets - rank N reads its brackets from brackets/raw/ which does not exist (FileNotFoundError)
  ckptbands  - rank N initialises from ckpt/mergenet_e4.pt, saved for 4 exposures (12 channels): size mismatch
  ckptpickle - rank N loads ckpt/mergenet_full.pt, pickled with a CRFCalib object: weights_only refuses it
  histgather - rank N all_gathers a 17-bin luminance histogram (an extra overflow bin) against 16
  deghost    - rank N runs a per-pixel Python deghosting pass before the step-2 all_reduce (slow)
  zeroexp    - rank N's step-3 batch has one exposure time 0: radiance inf/NaN, the program's own check
  segv       - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error about clipped highlights at step 1 and calls sys.exit(5)
  evidx      - rank N's step-4 batch names reference exposure 3 of 0..2 (IndexError)
  tonemapbug - every rank: the end-of-run preview applies the 3x3 colour matrix to flattened pixels (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  crfkey     - KeyError: 'Sony-A7S3' at start-up; peers Connection closed by peer in all_gather (np3 r1 tee, np5 r0 pymodule)
  nobrackets - FileNotFoundError for brackets/raw/brk_N.pt at start-up; peers Connection closed (np4 r2 wrapper, np3 r0 loglevel)
  ckptbands  - load_state_dict size mismatch inp.weight [16,12,3,3] vs [16,9,3,3] (np3 r1 redirects: console only Root Cause
               rank 1, the error in its stderr.log; np4 r0 pdsh2: rank 0 under worker-1:, worker-0's Root Cause rank 2)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.CRFCalib' (np5 r3 plain)
  histgather - DETAIL: 'Detected mismatch between collectives' on every rank, rank 3 TensorShape=[17] (np4 r3 detail);
               'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' (np3 r2 prefix)
  deghost    - 12 s: ranks 0/2 'Timed out waiting 12000ms' for recv/send at step 2, Root Cause rank 2 (np3 r1 plain);
               300 s: output stops after step 1, timeout kills it at 60 s, SignalException 15, exit 124 (np4 r2 tee_trainer)
  zeroexp    - the program's check: '768 non-finite radiance values', FloatingPointError at step 3 (np4 r1 prefix;
               np5 r4 detail, where rank 0 reports 'Ranks 4 failed to pass monitoredBarrier in 12000 ms')
  segv       - no traceback after step 3, Root Cause SIGSEGV exitcode -11 (np5 r1 filter); np3 r2 restart: attempt 0
               SIGSEGV, attempt 1 did not segfault but rank 0 timed out (12 s send) in the start-up all_gather
  exit5      - rank N's ERROR line about clipped highlights and exit 5; Root Cause exitcode 5 (np4 r0 tee_trainer, np3 r2 loglevel)
  evidx      - IndexError 'index 3 is out of bounds for dimension 1 with size 3' at step 4 (np5 r2 pymodule: peer rank 1
               SIGABRT 'terminate called without an active exception' named as Root Cause; np4 r3 filter)
  tonemapbug - every rank after step 5: 'mat1 and mat2 shapes cannot be multiplied (8x768 and 3x3)'; Root Cause rank 0 (np3 wrapper)
  none       - clean: 6 steps on 4 ranks, rank 0 saved export/mergenet.pt, exit 0 (np4 tee)
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

WORK = "/tmp/fault306_work"
CRF = {"Canon-5D4": 2.2, "Nikon-D850": 2.4, "Fuji-XT4": 2.0, "Sony-A7R4": 2.3}
TIMES = [0.25, 1.0, 4.0]
NEXP = 3
PATCH = 16
BATCH = 8
MU = 5000.0
log = None


class CRFCalib:
    """A camera calibration record (pickled into mergenet_full.pt)."""

    def __init__(self, camera, gamma):
        self.camera = camera
        self.gamma = gamma


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
    log = logging.getLogger("hdrr")
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


class MergeNet(nn.Module):
    def __init__(self, nexp=NEXP, width=16):
        super().__init__()
        self.inp = nn.Conv2d(3 * nexp, width, 3, padding=1)
        self.mid = nn.Conv2d(width, width, 3, padding=1)
        self.out = nn.Conv2d(width, 3, 1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.mid(h)) + h
        return self.out(h)


def make_brackets(n, seed):
    g = torch.Generator().manual_seed(seed)
    cams = list(CRF)
    hdr = torch.exp(torch.randn(n, 3, PATCH, PATCH, generator=g) * 1.2 - 0.5)
    cam = [cams[int(i)] for i in torch.randint(0, len(cams), (n,), generator=g)]
    ldr = torch.empty(n, NEXP, 3, PATCH, PATCH)
    for i in range(n):
        gam = CRF[cam[i]]
        for e, t in enumerate(TIMES):
            v = (hdr[i] * t).clamp(0, 1) ** (1.0 / gam)
            ldr[i, e] = torch.round(v * 255) / 255
    return {"ldr": ldr, "hdr": hdr, "camera": cam, "times": [list(TIMES) for _ in range(n)],
            "ref": [1] * n}


def prepare():
    os.makedirs(f"{WORK}/brackets", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_brackets(48, 600 + r), f"{WORK}/brackets/brk_{r}.pt")
    torch.manual_seed(0)
    torch.save(MergeNet(3).state_dict(), f"{WORK}/ckpt/mergenet_e3.pt")
    torch.save(MergeNet(4).state_dict(), f"{WORK}/ckpt/mergenet_e4.pt")
    torch.save({"model": MergeNet(3).state_dict(), "calib": CRFCalib("Canon-5D4", 2.2)},
               f"{WORK}/ckpt/mergenet_full.pt")
    print("prepared", WORK)


def linearise(ldr, gammas, times):
    # ldr [B, E, 3, H, W] -> log radiance [B, 3E, H, W]
    g = torch.tensor(gammas).view(-1, 1, 1, 1, 1)
    t = torch.tensor(times).view(ldr.shape[0], ldr.shape[1], 1, 1, 1)
    lin = ldr.clamp(1e-4, 1) ** g / t
    return torch.log(lin).flatten(1, 2)


def tonemap(x):
    return torch.log1p(MU * x.clamp(min=0)) / torch.log1p(torch.tensor(MU))


def deghost(ldr, budget):
    t0 = time.time()
    moved = 0
    while time.time() - t0 < budget:
        for i in range(ldr.shape[0]):
            for y in range(PATCH):
                for x in range(PATCH):
                    vals = [float(ldr[i, e, 1, y, x]) for e in range(NEXP)]
                    if max(vals) - min(vals) > 0.6:
                        moved += 1
    return moved


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, loading exposure brackets")
    sub = "raw/" if bad and a.fault == "nobrackets" else ""
    data = torch.load(f"{WORK}/brackets/{sub}brk_{rank}.pt")
    if bad and a.fault == "crfkey":
        data["camera"][7] = "Sony-A7S3"
    if bad and a.fault == "zeroexp":
        data["times"][3 * BATCH + 2][0] = 0.0
    if bad and a.fault == "evidx":
        data["ref"][4 * BATCH + 5] = 3
    gammas = [CRF[c] for c in data["camera"]]
    n = data["ldr"].shape[0]
    lum = data["hdr"].mean(1).flatten()
    nb = 17 if bad and a.fault == "histgather" else 16
    hist = torch.histc(torch.log2(lum), bins=nb, min=-6, max=6)
    hists = [torch.zeros(16) for _ in range(world)]
    dist.all_gather(hists, hist)
    say(f"rank {rank} brackets {n} cameras {len(set(data['camera']))} "
        f"global pixels {int(sum(h.sum() for h in hists))}")
    model = MergeNet()
    ck = {"ckptbands": "mergenet_e4.pt", "ckptpickle": "mergenet_full.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'mergenet_e3.pt'}", weights_only=True)
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        sl = slice((step * BATCH) % n, (step * BATCH) % n + BATCH)
        if bad and a.fault == "exit5" and step == 1:
            say(f"rank {rank}: ERROR bracket set {sl.start + 3}: 97.4% of pixels clipped in the shortest "
                f"exposure (t=0.25 s), highlights unrecoverable; aborting this shard", err=True)
            sys.exit(5)
        x = linearise(data["ldr"][sl], gammas[sl], data["times"][sl])
        if not torch.isfinite(x).all():
            say(f"rank {rank}: step {step}: {int((~torch.isfinite(x)).sum())} non-finite radiance values "
                f"after linearisation (min exposure time {min(min(t) for t in data['times'][sl])})", err=True)
            raise FloatingPointError(f"non-finite radiance in batch {step} on rank {rank}")
        refs = torch.tensor(data["ref"][sl])
        ref_ldr = data["ldr"][sl][torch.arange(BATCH), refs]
        target = data["hdr"][sl]
        pred = torch.exp(net(x))
        wgt = 1.0 - (2 * ref_ldr - 1).abs() ** 4
        loss = ((tonemap(pred) - tonemap(target)).abs() * (0.5 + wgt)).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "deghost" and step == 2:
            say(f"rank {rank} deghosting bracket {step}: {deghost(data['ldr'][sl], a.deghost_budget)} moved px")
        mse = ((tonemap(pred.detach()) - tonemap(target)) ** 2).mean()
        stats = torch.stack([loss.detach(), mse])
        dist.all_reduce(stats)
        psnr = -10 * torch.log10(stats[1] / world)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} psnr {psnr.item():.2f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    ccm = torch.tensor([[1.6, -0.4, -0.2], [-0.3, 1.5, -0.2], [0.0, -0.5, 1.5]])
    with torch.no_grad():
        pv = tonemap(torch.exp(net(x)))
        if a.fault == "tonemapbug":
            pv = pv.flatten(1) @ ccm
        else:
            pv = (pv.permute(0, 2, 3, 1) @ ccm.T).clamp(0, 1)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save({"model": model.state_dict(), "preview": pv}, f"{WORK}/export/mergenet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/mergenet.pt")
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
    p.add_argument("--deghost-budget", type=int, default=90)
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
