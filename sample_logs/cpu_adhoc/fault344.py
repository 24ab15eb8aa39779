"""A three-hundred-and-forty-fourth hand-run batch: HUMAN POSE ESTIMATION FROM 2D KEYPOINTS LIFTED TO 3D.

Synthetic poses: a 17-joint skeleton (names in skeleton.json, a joint table below), each sample has 2D
keypoints in pixels, root-relative 3D joints in millimetres, a camera id (4 cameras, intrinsics in a table)
and a root depth.  Every rank reads its poses from /tmp/fault344_work/poses/poses_R.pt, normalises the 2D
keypoints by its camera's focal length and the 3D joints by the root depth, and trains a Martinez-style
lifter (linear 34 -> H, two residual blocks, linear H -> 51) on an MPJPE-like loss, wrapped in DDP (gloo).
The model starts from ckpt/lifter_h64.pt.  Per-rank sample counts are all_gathered at the start, the
loss and MPJPE are all_reduced every step, per-joint errors are all_gathered at the end and rank 0 saves
export/lifter.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging),
--ddp 0 (gradients all_reduced by hand).

Faults:
  joint      - rank N's skeleton.json names 'neck_top', missing from the joint table (KeyError at start-up)
  camidx     - rank N's batch at step 1 refers to camera 4 of the 4 cameras (IndexError)
  nocams     - rank N reads its poses from poses/val/ which does not exist (FileNotFoundError)
  ckptwide   - rank N starts from ckpt/lifter_h96.pt, saved with hidden width 96 (size mismatch)
  ckptpickle - rank N loads ckpt/lifter_rig.pt which pickles a RigMeta object (weights_only refusal)
  gather     - rank N all_gathers its per-joint errors without the pelvis root (16 vs 17 entries, at the end)
  bones      - rank N recomputes bone-length statistics in Python before the step-2 all_reduce (slow)
  stuck      - rank N waits forever for a camera-sync event before step 2 (a hang)
  depthnan   - rank N's samples of step 3 have root depth 0: the 3D targets become inf, the program's check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line about a rig mismatch after step 1 and calls sys.exit(5)
  rootdim    - every rank feeds the 2D confidence channel too: 51 inputs, the lifter expects 34 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  joint      - KeyError: 'neck_top' in bone_table at start-up; peers Connection closed by peer in the first all_gather (np4 r2 bashloop, np6 r0 logfmt)
  camidx     - IndexError 'index 4 is out of bounds for dimension 0 with size 4' in step 1; peers closed (np3 r1 ranklabel, np4 r3 pdsh2)
  nocams     - FileNotFoundError for poses/val/poses_N.pt at start-up; peers closed (np5 r4 srunlabel), spawn SIGTERMs them (np3 r1 spawn)
  ckptwide   - load_state_dict size mismatch [96, 34] vs [64, 34] at start-up (np4 r1 mpitag, np3 r2 legacy Root Cause rank 2)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.RigMeta'; Root Cause rank 3 (np6 r3 tee)
  gather     - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (16), got (17))' after step 5; peers closed (np3 r0 files, np8 r5 ranklabel)
  bones      - peers 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r2 bashloop; np4 r1 logfmt, Root Cause rank 3)
  stuck      - rank N's 'waiting for camera sync' line, then silence; timeout at 60 s, exit 124 (np4 r2 srunlabel)
  depthnan   - the program's check: 'non-finite loss nan ... min root depth 0.0 mm', FloatingPointError at step 3 (np3 r1 mpitag, np6 r4 legacy)
  sigsegv    - no traceback from rank N after step 3; ProcessExitedException 'process 2 terminated with signal SIGSEGV' (np4 r2 spawn)
  exit5      - rank N's rig-mismatch ERROR line after step 1; Root Cause rank 1 exitcode 5, torchrun exit 1 (np3 r1 tee)
  rootdim    - every rank: 'mat1 and mat2 shapes cannot be multiplied (32x51 and 34x64)' in the first forward (np8 files)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/lifter.pt, exit 0 (np3 bashloop)
"""
import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault344_work"
JOINTS = ["pelvis", "r_hip", "r_knee", "r_ankle", "l_hip", "l_knee", "l_ankle", "spine", "thorax",
          "neck", "head", "l_shoulder", "l_elbow", "l_wrist", "r_shoulder", "r_elbow", "r_wrist"]
JOINT_IDX = {n: i for i, n in enumerate(JOINTS)}
NJ = 17
NCAM = 4
BATCH = 32
log = None


class RigMeta:
    def __init__(self, name, cams):
        self.name = name
        self.cams = cams


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
    log = logging.getLogger("lifter")
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


class ResBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.l1 = nn.Linear(h, h)
        self.l2 = nn.Linear(h, h)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        y = self.drop(torch.relu(self.l1(x)))
        return x + self.drop(torch.relu(self.l2(y)))


class Lifter(nn.Module):
    def __init__(self, hidden=64, nin=NJ * 2):
        super().__init__()
        self.inp = nn.Linear(nin, hidden)
        self.blocks = nn.Sequential(ResBlock(hidden), ResBlock(hidden))
        self.out = nn.Linear(hidden, NJ * 3)

    def forward(self, kp2d):
        h = torch.relu(self.inp(kp2d.flatten(1)))
        return self.out(self.blocks(h)).view(-1, NJ, 3)


def make_poses(n, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(NJ, 3, generator=g) * 250.0
    base[0] = 0.0
    kp3d = base + torch.randn(n, NJ, 3, generator=g) * 40.0
    kp3d[:, 0] = 0.0
    depth = 3000.0 + torch.rand(n, generator=g) * 2000.0
    cam = torch.randint(0, NCAM, (n,), generator=g)
    kp2d = kp3d[:, :, :2] / (depth[:, None, None] + kp3d[:, :, 2:]) * 1150.0 + 500.0
    conf = torch.rand(n, NJ, 1, generator=g)
    return {"kp2d": kp2d, "conf": conf, "kp3d": kp3d, "cam": cam, "depth": depth}


def prepare():
    for d in ("poses", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_poses(192, 300 + r), f"{WORK}/poses/poses_{r}.pt")
    with open(f"{WORK}/skeleton.json", "w") as f:
        json.dump({"joints": JOINTS, "bones": [[JOINTS[i], JOINTS[p]] for i, p in
                                               zip(range(1, NJ), [0, 1, 2, 0, 4, 5, 0, 7, 8, 9, 8, 11, 12, 8, 14, 15])]}, f)
    torch.manual_seed(0)
    torch.save(Lifter(64).state_dict(), f"{WORK}/ckpt/lifter_h64.pt")
    torch.save(Lifter(96).state_dict(), f"{WORK}/ckpt/lifter_h96.pt")
    torch.save({"model": Lifter(64).state_dict(), "rig": RigMeta("studio_b", NCAM)}, f"{WORK}/ckpt/lifter_rig.pt")
    torch.save(torch.tensor([[1145.0, 1149.7], [1149.6, 1147.6], [1149.1, 1148.8], [1145.5, 1144.8]]),
               f"{WORK}/ckpt/intrinsics.pt")
    print("prepared", WORK)


def bone_table(bad, a):
    with open(f"{WORK}/skeleton.json") as f:
        sk = json.load(f)
    bones = sk["bones"]
    if bad and a.fault == "joint":
        bones[8] = ["neck_top", "thorax"]
    return torch.tensor([[JOINT_IDX[c], JOINT_IDX[p]] for c, p in bones])


def bone_stats(kp3d, bones, budget):
    t0 = time.time()
    rounds = 0
    while time.time() - t0 < budget:
        lens = {}
        for s in range(kp3d.shape[0]):
            for c, p in bones.tolist():
                d = sum((float(kp3d[s, c, k]) - float(kp3d[s, p, k])) ** 2 for k in range(3)) ** 0.5
                lens.setdefault((c, p), []).append(d)
        rounds += 1
    return rounds, {k: sum(v) / len(v) for k, v in lens.items()}


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading poses")
    bones = bone_table(bad, a)
    split = "val/" if bad and a.fault == "nocams" else ""
    data = torch.load(f"{WORK}/poses/{split}poses_{rank}.pt")
    intr = torch.load(f"{WORK}/ckpt/intrinsics.pt")
    if bad and a.fault == "camidx":
        data["cam"][BATCH + 7] = NCAM
    if bad and a.fault == "depthnan":
        data["depth"][3 * BATCH:3 * BATCH + 5] = 0.0
    n = torch.tensor([data["kp2d"].shape[0]])
    alln = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(alln, n)
    say(f"rank {rank} samples {int(n)} global {int(sum(x.item() for x in alln))} bones {len(bones)}")
    hidden = 64
    model = Lifter(hidden, nin=NJ * 2)
    if bad and a.fault == "ckptwide":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/lifter_h96.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/lifter_rig.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/lifter_h64.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    joint_err = torch.zeros(NJ)
    for step in range(a.steps):
        sl = slice(step * BATCH, (step + 1) * BATCH)
        cam = data["cam"][sl]
        focal = intr[cam].mean(1)
        kp2d = (data["kp2d"][sl] - 500.0) / focal[:, None, None]
        if a.fault == "rootdim":
            kp2d = torch.cat([kp2d, data["conf"][sl]], dim=2)
        target = data["kp3d"][sl] / data["depth"][sl][:, None, None]
        pred = net(kp2d)
        err = (pred - target).norm(dim=2)
        loss = err.mean()
        if not torch.isfinite(loss):
            bad_n = int((~torch.isfinite(target)).any(2).any(1).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({bad_n} samples with non-finite "
                f"3D targets, min root depth {data['depth'][sl].min().item():.1f} mm)", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "bones" and step == 2:
            rounds, stats = bone_stats(data["kp3d"], bones, a.bone_budget)
            say(f"rank {rank} bone stats: {rounds} rounds, {len(stats)} bones")
        if bad and a.fault == "stuck" and step == 2:
            say(f"rank {rank} waiting for camera sync before step {step}")
            threading.Event().wait()
        stats = torch.tensor([loss.item(), err.detach().mean().item() * 4000.0])
        dist.all_reduce(stats)
        joint_err += err.detach().mean(0) * 4000.0
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} mpjpe {stats[1].item() / world:.1f}mm")
        if bad and a.fault == "exit5" and step == 1:
            say(f"rank {rank}: ERROR camera rig mismatch: poses_{rank}.pt was captured with rig studio_a "
                f"(4 cams), intrinsics are for studio_b, refusing to continue", err=True)
            sys.exit(5)
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    je = joint_err / a.steps
    if bad and a.fault == "gather":
        je = je[1:]
    allje = [torch.zeros(NJ) for _ in range(world)]
    dist.all_gather(allje, je)
    worst = int(torch.stack(allje).mean(0).argmax())
    say(f"rank {rank} per-joint mpjpe gathered, worst joint {JOINTS[worst]}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export/lifter.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/lifter.pt")
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
    p.add_argument("--bone-budget", type=int, default=40)
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
