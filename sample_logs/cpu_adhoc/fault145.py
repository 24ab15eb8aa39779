"""A hundred-and-forty-fifth hand-run batch: 3D VOLUMES AND PATCH-BASED TRAINING (MEDICAL-IMAGING STYLE).

Each rank writes and reads back its synthetic cases (1x16x16x16 volumes with a sphere mask, case_R_K.pt),
clips and normalises intensities, samples random 8^3 patches, trains a tiny 3D conv net
(Conv3d(1,4,3)-ReLU-Conv3d(4,1,1), warm-started from rank 0's pretrained.pt) under DDP (`--ddp 0`: rank 0's
weights broadcast, gradients all-reduced by hand) with a hand-written soft Dice loss, printing
`rank R step S loss L`; then a sliding-window inference (patch 8, overlap 0.5) stitched back into the volume,
a per-case hard Dice, all_gather of the per-case scores, rank 0 logs the mean Dice, barrier, destroy.

Faults:
- patch: rank N's patch size is 6: the sliding-window check raises ValueError (the windows do not tile 16).
- chan: rank N's cases are stacked with a second modality (2 channels): conv3d RuntimeError at step 0.
- dice: rank N's second case is unlabelled (empty mask and empty body): hard Dice 0/0, FloatingPointError.
- cases: rank N validates 3 cases instead of 2: the all_gather of per-case Dice scores mismatches.
- step0: rank N's overlap is 0.9: the window step is int(0.8) = 0 and its sliding window never ends.
- missing: rank N's case list starts at the held-out case (cases 2..3): FileNotFoundError for case_N_3.pt.
- ckpt2d: rank N warm-starts from pretrained_2d.pt (Conv2d weights): size mismatch in load_state_dict.
- std0: every rank's clip window is (2.0, 2.0): the std is 0, the normalised patches are NaN, loss NaN.
- kill: rank N is SIGKILLed at step 2.
- config: every rank parses the patch size "8,8" into 2 dims: ValueError from the config check.
What happened (filled in after the runs):
- patch: ValueError 'patch 6 with step 3 does not tile a volume of 16 voxels' (line 121) on rank N at eval; peers closed.
- chan: RuntimeError 'expected input[2, 2, 8, 8, 8] to have 1 channels' (line 79) at step 0; np3: a peer SIGABRT.
- dice: FloatingPointError 'rank N case 1: dice is nan (empty prediction and mask)' (line 196); peers closed.
- cases: plain: rank N 'ProcessGroupGloo::allgather: invalid tensor size'; DETAIL: every rank 'Detected mismatch'.
- step0: PG 12 s: the others 'Timed out waiting 12000ms' in the all_gather; PG 300 s: killed by timeout 60.
- missing: FileNotFoundError .../case_N_3.pt from torch.load (line 100) on rank N; the others SIGTERMed.
- ckpt2d: 'size mismatch for conv1.weight: ... torch.Size([4, 1, 3, 3])' (line 159) on rank N; others SIGTERMed.
- std0: every rank FloatingPointError 'rank R step 0: dice loss is nan' (line 179).
- kill: rank N exitcode -9 (SIGKILL) at step 2; peers Connection reset/closed; the restart died in connectFullMesh.
- config: every rank ValueError 'patch_size must have 3 dims (z,y,x), got 2' (line 68).
"""
import argparse
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--tag", default="run")
p.add_argument("--out", default="/tmp/fault145_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
D = 16
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


def parse_patch(text):
    dims = [int(t) for t in text.split(",")]
    if len(dims) != 3:
        raise ValueError(f"patch_size must have 3 dims (z,y,x), got {len(dims)}: {text!r}")
    return dims


class Seg3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(1, 4, 3, padding=1)
        self.head = nn.Conv3d(4, 1, 1)

    def forward(self, x):
        return self.head(torch.relu(self.conv1(x)))


def make_case(k):
    g = torch.Generator().manual_seed(100 * RANK + k)
    zz, yy, xx = torch.meshgrid(*[torch.arange(D, dtype=torch.float32)] * 3, indexing="ij")
    c = 5 + torch.rand(3, generator=g) * 6
    r = 3 + torch.rand(1, generator=g).item() * 2
    mask = ((zz - c[0]) ** 2 + (yy - c[1]) ** 2 + (xx - c[2]) ** 2 <= r * r).float()
    vol = 40.0 + 60.0 * mask + 8.0 * torch.randn(D, D, D, generator=g)
    body = torch.ones(D, D, D)
    if a.fault == "dice" and hit() and k == 1:
        mask = torch.zeros(D, D, D)
        body = torch.zeros(D, D, D)
    return {"vol": vol.unsqueeze(0), "mask": mask.unsqueeze(0), "body": body.unsqueeze(0)}


def load_cases(n):
    first = 2 if (a.fault == "missing" and hit()) else 0
    cases = []
    for k in range(first, first + n):
        case = torch.load(os.path.join(a.out, f"{a.tag}_case_{RANK}_{k}.pt"))
        if a.fault == "chan" and hit():
            case["vol"] = torch.cat([case["vol"], case["vol"] * 0.5], dim=0)
        cases.append(case)
    return cases


def normalise(v, lo, hi):
    v = v.clamp(lo, hi)
    return (v - v.mean()) / v.std()


def dice_loss(logits, t, smooth=1e-5):
    pr = torch.sigmoid(logits)
    inter = (pr * t).sum()
    return 1 - (2 * inter + smooth) / (pr.sum() + t.sum() + smooth)


def sliding_window(net, vol, P, overlap):
    step = int(P * (1 - overlap))
    if step > 0 and (D - P) % step != 0:
        raise ValueError(f"patch {P} with step {step} does not tile a volume of {D} voxels")
    out = torch.zeros(1, D, D, D)
    cnt = torch.zeros(1, D, D, D)
    z = 0
    while z + P <= D:
        for y in range(0, D - P + 1, max(step, 1)):
            for x in range(0, D - P + 1, max(step, 1)):
                with torch.no_grad():
                    o = net(vol[None, :, z:z + P, y:y + P, x:x + P])[0]
                out[:, z:z + P, y:y + P, x:x + P] += o
                cnt[:, z:z + P, y:y + P, x:x + P] += 1
        z += step
    return out / cnt


def main():
    print(f"rank {RANK} world {WORLD} pid {os.getpid()}", flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    patch_text = "8,8" if a.fault == "config" else "8,8,8"
    P = parse_patch(patch_text)[0]
    if a.fault == "patch" and hit():
        P = 6
    overlap = 0.9 if (a.fault == "step0" and hit()) else 0.5
    clip = (2.0, 2.0) if a.fault == "std0" else (0.0, 150.0)
    n_val = 3 if (a.fault == "cases" and hit()) else 2
    for k in range(3):
        torch.save(make_case(k), os.path.join(a.out, f"{a.tag}_case_{RANK}_{k}.pt"))
    torch.manual_seed(0)
    net = Seg3d()
    if RANK == 0:
        torch.save(net.state_dict(), os.path.join(a.out, f"{a.tag}_pretrained.pt"))
        c2 = {"conv1.weight": torch.zeros(4, 1, 3, 3), "conv1.bias": torch.zeros(4),
              "head.weight": torch.zeros(1, 4, 1, 1), "head.bias": torch.zeros(1)}
        torch.save(c2, os.path.join(a.out, f"{a.tag}_pretrained_2d.pt"))
    dist.barrier()
    cases = load_cases(2)
    print(f"rank {RANK} loaded {len(cases)} cases, patch {P}, overlap {overlap}", flush=True)
    name = "pretrained_2d.pt" if (a.fault == "ckpt2d" and hit()) else "pretrained.pt"
    net.load_state_dict(torch.load(os.path.join(a.out, f"{a.tag}_{name}"), map_location="cpu"))
    if a.ddp:
        model = DDP(net)
    else:
        model = net
        for prm in net.parameters():
            dist.broadcast(prm.data, src=0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7 + RANK)
    for s in range(a.steps):
        xs, ts = [], []
        for case in cases:
            o = torch.randint(0, D - P + 1, (3,), generator=g).tolist()
            v = case["vol"][:, o[0]:o[0] + P, o[1]:o[1] + P, o[2]:o[2] + P]
            xs.append(normalise(v, *clip))
            ts.append(case["mask"][:, o[0]:o[0] + P, o[1]:o[1] + P, o[2]:o[2] + P])
        if a.fault == "kill" and hit() and s == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = dice_loss(model(torch.stack(xs)), torch.stack(ts))
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {RANK} step {s}: dice loss is {loss.item()}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        print(f"rank {RANK} step {s} loss {loss.item():.4f}", flush=True)
        time.sleep(0.2)
    val = cases + [torch.load(os.path.join(a.out, f"{a.tag}_case_{RANK}_2.pt"))]
    scores = []
    for k, case in enumerate(val[:n_val]):
        prob = torch.sigmoid(sliding_window(net, normalise(case["vol"], *clip), P, overlap)) * case["body"]
        pred = (prob > 0.5).float()
        d = (2 * (pred * case["mask"]).sum() / (pred.sum() + case["mask"].sum())).item()
        if not math.isfinite(d):
            raise FloatingPointError(f"rank {RANK} case {k}: dice is {d} (empty prediction and mask)")
        scores.append(d)
    mine = torch.tensor(scores)
    allsc = [torch.zeros(2) for _ in range(WORLD)]
    dist.all_gather(allsc, mine)
    if RANK == 0:
        flat = torch.cat(allsc)
        print(f"val cases {flat.numel()} mean dice {flat.mean().item():.4f}", flush=True)
    dist.barrier()
    print(f"rank {RANK} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
