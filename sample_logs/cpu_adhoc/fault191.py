"""A hundred-and-ninety-first hand-run batch: SELF-DISTILLATION WITH NO LABELS (DINO-STYLE).

Every rank builds a student (a small conv backbone, adaptive pooling, a projection head) and a teacher of the
same architecture loaded from the student's state_dict, then trained as an EMA of the student (momentum from
a cosine schedule).  Each step makes multi-crop views (2 global 8x8 crops, 4 local 4x4 crops) of synthetic
12x12 images, the teacher sees the global crops, the student all crops; the DINO loss is the cross-entropy
between the centered, sharpened teacher softmax (teacher temperature warm-up) and the student softmax.  The
student is wrapped in DDP on gloo (or --ddp 0: a hand-written gradient all_reduce); the center vector is
broadcast from rank 0 at start and all_reduced every step; a collapse check watches the teacher entropy.

Faults:
  centerdim - rank N allocates its center with one extra output dimension before the start broadcast
  temp0     - rank N's teacher temperature warm-up starts at 0.0 (NaN loss, the program's finite check)
  cropstack - every rank stacks global and local crops (different sizes) into one batch tensor
  teacharch - every rank builds the teacher with the wider 64-unit head, then loads the student's weights
  momstr    - every rank reads the teacher momentum from the config as the string "0.996"
  cropcfg   - rank N reads the multi-crop config for global size 224 (the file is not there)
  stall     - rank N waits --stall seconds for a teacher snapshot lock before the step-2 center all_reduce
  collapse  - rank N's teacher temperature is 100x too small: the collapse check raises RuntimeError
  sigabrt   - rank N sends itself SIGABRT at step 3
  exit5     - rank N prints its own 'EMA teacher diverged' error line after training and exits with code 5
  none      - control, clean run

What happened (filled in after the runs):
  centerdim - rank N: broadcast of the 17-entry center raised nothing; RuntimeError size of tensor a (16) vs b (17)
  temp0     - rank N: FloatingPointError non-finite DINO loss nan at step 0 (teacher temp 0.0); DETAIL: monitoredBarrier
  cropstack - every rank: RuntimeError stack expects each tensor to be equal size ([8,3,8,8] vs [8,3,4,4])
  teacharch - every rank: RuntimeError loading state_dict for DinoNet: size mismatch for proj.weight [32,32] vs [64,32]
  momstr    - every rank: TypeError unsupported operand type(s) for -: 'int' and 'str' in the momentum schedule
  cropcfg   - rank N: FileNotFoundError /tmp/job_work/cfg/multicrop_g224.json before DDP; peers SIGTERMed
  stall     - wait 40 s: peers gloo timeout 12000ms in the step-2 center all_reduce; 1000 s / PG 300 s: hung, exit 124
  collapse  - rank N: RuntimeError teacher output collapsed at step 0: entropy 0.0000 < 0.1386; peers Connection closed
  sigabrt   - rank N: exitcode -6 (SIGABRT) at step 3; with --max-restarts 1 the restart died in Gloo connectFullMesh
  exit5     - rank N: prints its ERROR EMA teacher diverged line after training, exitcode 5
  none      - clean, exit 0, rank 0 saved ckpt/teacher_last.pt
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault191_work"
OUT_DIM = 16


class DinoNet(nn.Module):
    def __init__(self, hidden=32, out_dim=OUT_DIM):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.proj = nn.Linear(32, hidden)
        self.head = nn.Linear(hidden, out_dim)

    def forward(self, x):
        h = self.pool(F.gelu(self.conv(x))).flatten(1)
        return self.head(F.gelu(self.proj(h)))


def multicrop(imgs, gsize, lsize, g):
    n = imgs.shape[-1]
    crops = []
    for size, count in ((gsize, 2), (lsize, 4)):
        for _ in range(count):
            i, j = torch.randint(0, n - size + 1, (2,), generator=g).tolist()
            crops.append(imgs[:, :, i:i + size, j:j + size])
    return crops


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--work", default=WORK)
    a = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank == -1 or a.rank == rank
    torch.manual_seed(0)

    gsize = 224 if (a.fault == "cropcfg" and bad) else 8
    with open(os.path.join(a.work, "cfg", f"multicrop_g{gsize}.json")) as f:
        cfg = json.load(f)
    if a.fault == "momstr" and bad:
        cfg["teacher_momentum"] = str(cfg["teacher_momentum"])
    print(f"rank {rank}: multicrop global={cfg['global_size']} local={cfg['local_size']} "
          f"momentum={cfg['teacher_momentum']} world={world}", flush=True)

    student = DinoNet()
    teacher = DinoNet(hidden=64 if (a.fault == "teacharch" and bad) else 32)
    teacher.load_state_dict(student.state_dict())
    for q in teacher.parameters():
        q.requires_grad_(False)
    if a.ddp:
        model = DDP(student)
    else:
        model = student
        for q in student.parameters():
            dist.broadcast(q.data, 0)
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)

    center = torch.zeros(1, OUT_DIM + (1 if (a.fault == "centerdim" and bad) else 0))
    dist.broadcast(center, 0)
    t0, t1 = cfg["teacher_temp_start"], cfg["teacher_temp"]
    if a.fault == "temp0" and bad:
        t0 = 0.0
    temps = [t0 + (t1 - t0) * min(1.0, s / cfg["warmup_steps"]) for s in range(a.steps)]
    if a.fault == "collapse" and bad:
        temps = [t / 100.0 for t in temps]
    m0 = cfg["teacher_momentum"]
    g = torch.Generator().manual_seed(1000 + rank)

    for step in range(a.steps):
        imgs = torch.rand(a.batch, 3, 12, 12, generator=g)
        crops = multicrop(imgs, cfg["global_size"], cfg["local_size"], g)
        if a.fault == "cropstack":
            views = torch.stack(crops)
        s_out = [model(c) / cfg["student_temp"] for c in crops]
        with torch.no_grad():
            t_raw = [teacher(c) for c in crops[:2]]
            t_prob = [F.softmax((t - center) / temps[step], dim=-1) for t in t_raw]
        ent = -(t_prob[0] * torch.log(t_prob[0] + 1e-12)).sum(-1).mean().item()
        if ent < 0.05 * math.log(OUT_DIM):
            raise RuntimeError(f"rank {rank}: teacher output collapsed at step {step}: entropy {ent:.4f} "
                               f"< {0.05 * math.log(OUT_DIM):.4f} (teacher temp {temps[step]:.5f})")
        loss, n = 0.0, 0
        for ti, tp in enumerate(t_prob):
            for si, so in enumerate(s_out):
                if si == ti:
                    continue
                loss = loss + (-tp * F.log_softmax(so, dim=-1)).sum(-1).mean()
                n += 1
        loss = loss / n
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite DINO loss {loss.item()} at step {step} "
                                     f"(teacher temp {temps[step]})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for q in student.parameters():
                dist.all_reduce(q.grad)
                q.grad /= world
        opt.step()
        if a.fault == "sigabrt" and bad and step == 3:
            os.kill(os.getpid(), signal.SIGABRT)
        mom = 1 - (1 - m0) * (math.cos(math.pi * step / a.steps) + 1) / 2
        with torch.no_grad():
            for qt, qs in zip(teacher.parameters(), student.parameters()):
                qt.mul_(mom).add_(qs.detach(), alpha=1 - mom)
            batch_center = torch.cat(t_raw).mean(0, keepdim=True)
        if a.fault == "stall" and bad and step == 2:
            print(f"rank {rank}: waiting for teacher snapshot lock {a.work}/snap/.lock", flush=True)
            time.sleep(a.stall)
        dist.all_reduce(batch_center)
        center = center * cfg["center_momentum"] + batch_center / world * (1 - cfg["center_momentum"])
        print(f"rank {rank} step {step} loss {loss.item():.4f} teacher_temp {temps[step]:.4f} "
              f"momentum {mom:.5f} entropy {ent:.3f}", flush=True)

    dist_ts = sum((qt - qs).pow(2).sum() for qt, qs in zip(teacher.parameters(), student.parameters()))
    if a.fault == "exit5" and bad:
        print(f"ERROR rank {rank}: EMA teacher diverged from student (param distance "
              f"{dist_ts.sqrt().item() * 1e4:.1f} > 10.0); refusing to save teacher", flush=True)
        sys.exit(5)
    if rank == 0:
        os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
        path = os.path.join(a.work, "ckpt", "teacher_last.pt")
        torch.save({"teacher": teacher.state_dict(), "center": center}, path)
        print(f"rank 0: saved teacher and center to {path}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
