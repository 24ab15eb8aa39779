"""A two-hundred-and-eighty-fifth hand-run batch: HUMAN POSE ESTIMATION FROM 2-D TO 3-D LIFTING.

Synthetic 17-joint skeletons (Human3.6M joint order) with random bone lengths and a random walk of joint
angles over time, projected to 2-D through per-camera intrinsics (a table keyed by the H36M camera ids) and
normalised to the image width; a temporal convolutional lifting network (dilated conv1d blocks, receptive
field 3 ** blocks frames) predicts the centre-frame 3-D pose from a window of 2-D keypoints; the loss is the
MPJPE plus a bone-length term normalised by the hip-spine reference bone; DDP (gloo) or, with --ddp 0, a
hand-written gradient all_reduce; the MPJPE all_reduced every step, a per-rank MPJPE histogram all_gathered
at step 3, destroy_process_group. --prep 1 writes the keypoint archive and lifter checkpoints.

Faults:
- jointidx: from step 1 rank N's bone table lists joint 17 (the skeleton has joints 0-16) (IndexError).
- zerobone: rank N's skeleton sampler gives the hip-spine reference bone length 0; the bone term is inf (check).
- histgather: rank N all_gathers its MPJPE histogram with 21 bins instead of 20 at step 3 (size mismatch).
- noarchive: rank N looks for its keypoints in keypoints_v2/, which does not exist (FileNotFoundError).
- camera: rank N's shard names camera "60457275", missing from the intrinsics table (KeyError).
- receptive: every rank builds 5 blocks (243-frame receptive field) for 81-frame sequences (conv1d error).
- ckptblocks: with --resume 1 rank N loads ckpt/lifter_b4.pt into the 3-block lifter (unexpected keys).
- triang: at step 2 rank N triangulates the validation set frame by frame in Python for --stall seconds.
- segv: rank N sends itself SIGSEGV after step 2's optimizer step.
- exit3: at step 1 rank N prints "rank N: ...; aborting" to stderr and calls os._exit(3).
- none: control.

What happened (filled in after the runs):
- jointidx: IndexError: index 17 is out of bounds for dimension 0 with size 17 on rank N at step 1 (hpe_jointidx_np4_r2_plain, _np3_r1_pymodule).
- zerobone: FloatingPointError 'rank N: bone-length term is inf at step 0' (hpe_zerobone_np3_r2_tee, _np4_r1_detail with --ddp 0).
- histgather: the receiving rank (N+1) aborts on gloo::EnforceNotMet '42 vs 40. Received data size doesn't match' (hpe_histgather_np3_r1_tee_trainer, _np4_r2_loglevel).
- noarchive: FileNotFoundError for /tmp/job_work/keypoints_v2/h36m_2d.pt on rank N at startup (hpe_noarchive_np4_r3_redirects, _np3_r2_wrapper).
- camera: KeyError: '60457275' on rank N at startup (hpe_camera_np4_r2_pdsh2, _np3_r0_prefix).
- receptive: every rank: 'Calculated padded input size per channel: (1). Kernel size: (163)' in step 0 (hpe_receptive_np3_rall_plain, _np4_rall_tee).
- ckptblocks: Unexpected key(s) "blocks.3.weight", "blocks.3.bias" for Lifter on rank N (hpe_ckptblocks_np3_r1_restart, _np4_r2_filter).
- triang: PG 12 s: peers 'Timed out waiting 12000ms' (hpe_triang_np3_r1_tee); PG 300 s: killed at 60 s, exit 124 (_np3_r2_plain).
- segv: rank N exits -11 (SIGSEGV) after step 2, no traceback; peers Connection reset (hpe_segv_np4_r1_pymodule, _np3_r2_prefix).
- exit3: 'rank N: sequence 3 has 17 keypoints outside the image ...; aborting', exit 3 (hpe_exit3_np3_r1_wrapper, _np4_r3_tee_trainer).
- none: exit 0, 'rank 0 done: 5 steps, MPJPE 453.2mm' (hpe_none_np3_rnone_tee).
"""
import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

NJ = 17
# (parent, child) pairs of the H36M 17-joint skeleton; bone 0 (hip -> spine) is the reference bone
BONES = [(0, 7), (0, 1), (1, 2), (2, 3), (0, 4), (4, 5), (5, 6), (7, 8), (8, 9), (9, 10),
         (8, 11), (11, 12), (12, 13), (8, 14), (14, 15), (15, 16)]
INTRINSICS = {"54138969": (1145.0, 512.5, 515.5), "55011271": (1149.7, 508.8, 508.1),
              "58860488": (1149.1, 519.8, 501.4), "60457274": (1145.5, 514.9, 501.9)}
WORK = os.environ.get("HPE_WORK", "/tmp/fault285_work")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=81)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", dest="pg_timeout", type=float, default=12.0)
    p.add_argument("--resume", type=int, default=0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prep", type=int, default=0)
    return p.parse_args()


class Lifter(nn.Module):
    def __init__(self, blocks=3, width=64):
        super().__init__()
        self.inp = nn.Conv1d(NJ * 2, width, 1)
        self.blocks = nn.ModuleList([nn.Conv1d(width, width, 3, dilation=3 ** i) for i in range(blocks)])
        self.out = nn.Conv1d(width, NJ * 3, 1)

    def forward(self, x):  # x: (B, 2*NJ, T) -> (B, 3*NJ, T - receptive + 1)
        h = torch.relu(self.inp(x))
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.out(h)


def skeletons(g, n, seq, zero_ref=False):
    lengths = 0.1 + 0.35 * torch.rand(n, len(BONES), generator=g)
    if zero_ref:
        lengths[1, 0] = 0.0
    angles = torch.cumsum(0.05 * torch.randn(n, seq, len(BONES), 2, generator=g), 1)
    angles = angles + torch.rand(n, 1, len(BONES), 2, generator=g) * math.pi
    pos = torch.zeros(n, seq, NJ, 3)
    for k, (p, c) in enumerate(BONES):
        th, ph = angles[:, :, k, 0], angles[:, :, k, 1]
        d = torch.stack([torch.sin(th) * torch.cos(ph), torch.sin(th) * torch.sin(ph), torch.cos(th)], -1)
        pos[:, :, c] = pos[:, :, p] + lengths[:, None, k, None] * d
    return pos  # (n, seq, NJ, 3), root-relative, metres


def project(pos, cam):
    f, cx, cy = INTRINSICS[cam]
    z = pos[..., 2] + 5.0
    u = f * pos[..., 0] / z + cx
    v = f * pos[..., 1] / z + cy
    return torch.stack([u / 1000.0 * 2 - 1, v / 1000.0 * 2 - 1], -1)


def bone_lengths(pos, bones):
    par = torch.tensor([p for p, _ in bones])
    chi = torch.tensor([c for _, c in bones])
    return (pos[:, chi] - pos[:, par]).norm(dim=-1)


def prep():
    os.makedirs(f"{WORK}/keypoints_v1", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    torch.manual_seed(0)
    torch.save({"cameras": sorted(INTRINSICS), "seed": 2850, "fps": 50}, f"{WORK}/keypoints_v1/h36m_2d.pt")
    torch.save(Lifter(3).state_dict(), f"{WORK}/ckpt/lifter_b3.pt")
    torch.save(Lifter(4).state_dict(), f"{WORK}/ckpt/lifter_b4.pt")
    print("prepared", WORK)


def train(rank, world, a):
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.pg_timeout))
    print(f"rank {rank}/{world}: process group up (gloo, timeout {a.pg_timeout:.0f}s)", flush=True)
    sub = "keypoints_v2" if (bad and a.fault == "noarchive") else "keypoints_v1"
    meta = torch.load(f"{WORK}/{sub}/h36m_2d.pt")
    cams = list(meta["cameras"])
    if bad and a.fault == "camera":
        cams[rank % len(cams)] = "60457275"
    cam = cams[rank % len(cams)]
    g = torch.Generator().manual_seed(meta["seed"] + rank)
    pos = skeletons(g, a.batch * 2, a.seq, zero_ref=(bad and a.fault == "zerobone"))
    kp2d = project(pos, cam)
    blocks = 5 if (bad and a.fault == "receptive") else a.blocks
    rf = 3 ** blocks
    print(f"rank {rank}: camera {cam}, {pos.shape[0]} sequences of {a.seq} frames, receptive field {rf}", flush=True)
    torch.manual_seed(0)
    model = Lifter(blocks)
    if a.resume:
        path = "ckpt/lifter_b4.pt" if (bad and a.fault == "ckptblocks") else "ckpt/lifter_b3.pt"
        print(f"rank {rank}: resuming lifter from {path}", flush=True)
        model.load_state_dict(torch.load(f"{WORK}/{path}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    bones = list(BONES)
    for step in range(a.steps):
        idx = torch.arange(a.batch) + (step % 2) * a.batch
        x = kp2d[idx].reshape(a.batch, a.seq, NJ * 2).transpose(1, 2).contiguous()
        if bad and a.fault == "jointidx" and step >= 1:
            bones[-1] = (15, 17)
        if bad and a.fault == "triang" and step == 2:
            print(f"rank {rank}: triangulating {a.batch * 2 * a.seq} validation frames for the 3-D reference", flush=True)
            t0 = time.time()
            while time.time() - t0 < a.stall:
                time.sleep(0.5)
        pred = net(x)
        tout = pred.shape[-1]
        pred = pred.transpose(1, 2).reshape(a.batch, tout, NJ, 3)
        off = (a.seq - tout) // 2
        tgt = pos[idx, off:off + tout]
        mpjpe = (pred - tgt).norm(dim=-1).mean()
        pb = bone_lengths(pred.reshape(-1, NJ, 3), bones)
        tb = bone_lengths(tgt.reshape(-1, NJ, 3), bones)
        ref = tb[:, :1]
        bone_term = ((pb - tb).abs() / ref).mean()
        loss = mpjpe + 0.1 * bone_term
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: bone-length term is {bone_term.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and a.fault == "exit3" and step == 1:
            print(f"rank {rank}: sequence 3 has 17 keypoints outside the image after projection; aborting", file=sys.stderr, flush=True)
            os._exit(3)
        m = mpjpe.detach().clone()
        dist.all_reduce(m)
        m /= world
        print(f"rank {rank} step {step} loss {loss.item():.4f} mpjpe {m.item() * 1000:.1f}mm", flush=True)
        if step == 3:
            nb = 21 if (bad and a.fault == "histgather") else 20
            per = (pred - tgt).norm(dim=-1).mean((1, 2)).detach()
            hist = torch.histc(per, bins=nb, min=0.0, max=1.0)
            out = [torch.zeros(nb) for _ in range(world)]
            out[rank].copy_(hist)
            dist.all_gather(out, hist)
            if rank == 0:
                print(f"rank 0: MPJPE histogram gathered from {world} ranks, {int(sum(o.sum() for o in out))} sequences", flush=True)
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, MPJPE {m.item() * 1000:.1f}mm", flush=True)
    dist.destroy_process_group()


def main():
    a = parse()
    if a.prep:
        prep()
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()
