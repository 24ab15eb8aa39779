"""A two-hundred-and-ninety-sixth hand-run batch: DEPTH COMPLETION FROM SPARSE LIDAR POINTS AND AN RGB IMAGE.

Synthetic driving frames: every rank reads its RGB crops and dense ground-truth depth from
/tmp/fault296_work/scenes/scene_R.pt, its lidar sweep (points x, y, depth, beam ring) from lidar/velo_R.pt and a
calibration table (camera and lidar names -> matrices) from the scene file.  The sweep is projected into a
sparse depth map plus a validity mask, each beam's return scaled by a 64-entry beam gain table, and a small
two-branch CNN (RGB branch, sparse-depth branch, fused, depth head) regresses dense depth on an L1 loss over
the pixels that have ground truth, wrapped in DDP (gloo) or, with --ddp 0, gradients all_reduced by hand.
The model is initialised from ckpt/dcnet.pt.  A histogram of each rank's lidar depths is all_gathered at the
start, the RMSE is all_reduced every step, per-rank final RMSEs are all_gathered at the end and rank 0 saves
export/dcnet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging lines).

Faults:
  calib      - rank N looks up its lidar extrinsics as "velo_vlp32", missing from the calibration table (KeyError)
  noscan     - rank N reads lidar/velo_N_sweep2.pt, which does not exist (FileNotFoundError)
  ckptwide   - rank N initialises from ckpt/dcnet_w16.pt, saved with 16-channel branches (size mismatch)
  ckptpickle - rank N loads ckpt/dcnet_full.pt, which pickles a CamCfg object (weights_only refusal)
  gatherpts  - rank N all_gathers a 5-bin depth histogram while the others send 4 bins
  densify    - rank N densifies its sparse map by a pure-Python nearest-neighbour fill before the step-2 all_reduce
  invdepth   - rank N switches to inverse depth at step 3; empty pixels give 1/0 = inf, the program's check raises
  beamidx    - rank N's sweep has 128-beam ring ids; the 64-entry beam gain table is indexed with ring 64+ (IndexError)
  segv       - rank N raises SIGSEGV in itself after step 3
  exit4      - rank N prints its own error line about lidar/camera timestamp skew at the end and calls sys.exit(4)
  chanbug    - every rank: the depth branch gets a third (confidence) channel, its conv expects 2 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  calib      - KeyError: 'velo_vlp32' at start-up; peers Connection closed by peer in the histogram all_gather (np4 r2 tee, np3 r0 pymodule)
  noscan     - FileNotFoundError for lidar/velo_N_sweep2.pt at start-up; peers Connection closed (np5 r3 loglevel, np3 r1 filter)
  ckptwide   - load_state_dict size mismatch [16,3,3,3] vs [8,3,3,3]; peers SIGTERMed (np4 r1 tee_trainer; np4 r3 pdsh2, worker-0 RendezvousConnectionError)
  ckptpickle - UnpicklingError 'Weights only load failed' (Unsupported global __main__.CamCfg); Root Cause rank 2 (np3 r2 wrapper)
  gatherpts  - DETAIL: 'Detected mismatch between collectives' TensorShape [5] vs [4] on every rank (np4 r0); no DETAIL: rank 0 aborts, gloo EnforceNotMet size 10 vs 8 (np3 r2 prefix)
  densify    - 12 s: ranks 0 and 2 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r1 plain); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 tee)
  invdepth   - 'non-finite loss nan (4608 non-finite depth pixels)', FloatingPointError at step 3 (np4 r1 redirects; np5 r4 restart, 2nd attempt Gloo connectFullMesh refused)
  beamidx    - IndexError 'index 64 is out of bounds for dimension 0 with size 64' before step 0; peers closed in backward (np4 r3 tee_trainer)
  segv       - no traceback after step 3, Root Cause exitcode -11 (SIGSEGV); peers Connection reset (np3 r2 prefix, np4 r1 loglevel)
  exit4      - rank N's timestamp-skew ERROR line, exitcode 4 before the final all_gather (np5 r2 wrapper; np3 r1 restart, 2nd attempt connectFullMesh refused)
  chanbug    - every rank: 'expected input[8, 3, 24, 24] to have 2 channels, but got 3 channels instead'; Root Cause rank 1 (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/dcnet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault296_work"
H = W = 24
NBEAM = 64
log = None


class CamCfg:
    def __init__(self, name, fx, fy):
        self.name, self.fx, self.fy = name, fx, fy


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
    log = logging.getLogger("dcmp")
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


class DCNet(nn.Module):
    def __init__(self, c=8, din=2):
        super().__init__()
        self.rgb = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.dep = nn.Sequential(nn.Conv2d(din, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.fuse = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.head = nn.Conv2d(2 * c, 1, 1)

    def forward(self, rgb, sparse):
        f = torch.cat([self.rgb(rgb), self.dep(sparse)], 1)
        return F.softplus(self.head(torch.relu(self.fuse(f)))) + sparse[:, :1]


def make_scene(n, seed):
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(2.0, 40.0, H).view(1, 1, H, 1).expand(n, 1, H, W)
    gt = ramp + torch.rand(n, 1, H, W, generator=g) * 3.0
    rgb = torch.rand(n, 3, H, W, generator=g) * 0.2 + (gt / 40.0)
    calib = {"cam_02": torch.tensor([[300.0, 0, 12], [0, 300.0, 12], [0, 0, 1]]),
             "velo_hdl64": torch.eye(4), "imu": torch.eye(4)}
    return {"rgb": rgb, "gt": gt, "calib": calib}


def make_sweep(n, seed, beams=NBEAM):
    g = torch.Generator().manual_seed(seed)
    pts = []
    for i in range(n):
        k = 40
        ys = torch.randint(0, H, (k,), generator=g)
        xs = torch.randint(0, W, (k,), generator=g)
        ring = (ys * beams // H).clamp(max=beams - 1)
        d = 2.0 + ys.float() * 38.0 / (H - 1) + torch.rand(k, generator=g)
        pts.append(torch.stack([xs.float(), ys.float(), d, ring.float()], 1))
    return pts


def prepare():
    for d in ("scenes", "lidar", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_scene(8, 200 + r), f"{WORK}/scenes/scene_{r}.pt")
        torch.save(make_sweep(8, 300 + r), f"{WORK}/lidar/velo_{r}.pt")
        torch.save(make_sweep(8, 300 + r, beams=128), f"{WORK}/lidar/velo_{r}_hdl128.pt")
    torch.manual_seed(0)
    sd = DCNet().state_dict()
    torch.save(sd, f"{WORK}/ckpt/dcnet.pt")
    torch.save(DCNet(c=16).state_dict(), f"{WORK}/ckpt/dcnet_w16.pt")
    torch.save({"state": sd, "cam": CamCfg("cam_02", 300.0, 300.0)}, f"{WORK}/ckpt/dcnet_full.pt")
    print("prepared", WORK)


def project(pts, gain, fault_conf):
    n = len(pts)
    sparse = torch.zeros(n, 3 if fault_conf else 2, H, W)
    for i, p in enumerate(pts):
        x, y, ring = p[:, 0].long(), p[:, 1].long(), p[:, 3].long()
        sparse[i, 0, y, x] = p[:, 2] * gain[ring]
        sparse[i, 1, y, x] = 1.0
        if fault_conf:
            sparse[i, 2, y, x] = 0.9
    return sparse


def densify(sparse, budget):
    t0, passes = time.time(), 0
    d = sparse[:, 0].tolist()
    while time.time() - t0 < budget:
        for img in d:
            for yy in range(H):
                for xx in range(W):
                    if img[yy][xx] == 0.0:
                        best = min(((abs(yy - j) + abs(xx - i), img[j][i]) for j in range(H) for i in range(W)
                                    if img[j][i] > 0.0), default=(0, 0.0))
                        _ = best[1]
        passes += 1
    return passes


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading scene {rank}")
    scene = torch.load(f"{WORK}/scenes/scene_{rank}.pt")
    sensor = "velo_vlp32" if bad and a.fault == "calib" else "velo_hdl64"
    T = scene["calib"][sensor]
    sweep = f"velo_{rank}_sweep2.pt" if bad and a.fault == "noscan" else f"velo_{rank}.pt"
    if bad and a.fault == "beamidx":
        sweep = f"velo_{rank}_hdl128.pt"
    pts = torch.load(f"{WORK}/lidar/{sweep}")
    say(f"rank {rank} calib {sensor} det {float(torch.det(T)):.1f}, {sum(len(p) for p in pts)} lidar points")
    allpts = torch.cat(pts)
    nb = 5 if bad and a.fault == "gatherpts" else 4
    hist = torch.histc(allpts[:, 2], bins=nb, min=0.0, max=45.0)
    hists = [torch.zeros_like(hist) for _ in range(world)]
    dist.all_gather(hists, hist)
    say(f"rank {rank} depth histogram {hist.tolist()} global points {int(sum(h.sum() for h in hists))}")
    model = DCNet(din=2)
    if bad and a.fault == "ckptwide":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/dcnet_w16.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/dcnet_full.pt")["state"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/dcnet.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    gain = torch.ones(NBEAM)
    rgb, gt = scene["rgb"], scene["gt"]
    sparse = None
    rmse = torch.zeros(1)
    for step in range(a.steps):
        if sparse is None or step == 3:
            sparse = project(pts, gain, a.fault == "chanbug")
            if bad and a.fault == "invdepth" and step == 3:
                say(f"rank {rank}: switching lidar channel to inverse depth (1/d) from step 3")
                sparse[:, 0] = 1.0 / sparse[:, 0]
        pred = net(rgb, sparse)
        loss = (pred - gt).abs().mean()
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(pred)).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({nbad} non-finite depth pixels)", err=True)
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "densify" and step == 2:
            n = densify(sparse, a.densify_budget)
            say(f"rank {rank} nearest-neighbour densify: {n} passes")
        rmse = ((pred.detach() - gt) ** 2).mean().sqrt().reshape(1)
        tot = rmse.clone()
        dist.all_reduce(tot)
        say(f"rank {rank} step {step} loss {loss.item():.4f} rmse {tot.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR lidar/camera timestamp skew 212 ms exceeds 50 ms on 8 frames, refusing to export",
            err=True)
        sys.exit(4)
    finals = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(finals, rmse)
    say(f"rank {rank} final rmse per rank {[round(float(f), 3) for f in finals]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/dcnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/dcnet.pt")
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
    p.add_argument("--densify-budget", type=int, default=40)
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
