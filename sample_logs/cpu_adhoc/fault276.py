"""A two-hundred-and-seventy-sixth hand-run batch: DEPTH-FROM-STEREO WITH A SMALL DISPARITY NETWORK.

Synthetic rectified stereo pairs (1x24x48 grey textures; the left image is the right one shifted by a random
per-column-block disparity map of 0..7 pixels), a siamese conv feature extractor (1 -> 16 -> 16 channels, warm-started
from ckpt/extractor_c16.pt), a correlation cost volume over MAX_DISP = 8 disparities, a soft-argmin, a smooth L1 loss
on disparity plus a small depth term (depth = focal * baseline / disparity, focal and baseline per camera from
/tmp/job_work/calib/<cam>.json), DDP (gloo) over the extractor (or hand all_reduced gradients with --ddp 0), the
3-pixel error all_reduced and per-rank error histograms all_gathered each step, then barrier and
destroy_process_group. --prep 1 writes the calibration files and the checkpoints.

Faults:
- dispidx: from step 2 rank N looks up the probability at the ground-truth disparity rounded up plus one (IndexError).
- zerobase: rank N's camera has baseline 0.0; the depth term is 0/0 and the program's loss check raises.
- histgather: rank N all_gathers a 17-bin error histogram (the others 16 bins) at step 1.
- nocalib: rank N reads its calibration from calib_v2/, which does not exist (FileNotFoundError at startup).
- camid: rank N's camera id is "cam_07", which is not in the calibration table (KeyError at startup).
- maxdisp: every rank uses --max-disp 12 for the soft-argmin over an 8-disparity cost volume (shape error).
- extckpt: rank N loads ckpt/extractor_c32.pt (32 channels) into the 16-channel extractor (size mismatch).
- slowrefine: rank N refines step 2's disparities pixel by pixel in Python for --stall seconds (others wait).
- cudadev: rank N moves the extractor to torch.device("cuda", rank) on this CPU-only build.
- exit5: rank N calls os._exit(5) after step 1's optimizer step, with no message.
- segv: rank N gets SIGSEGV after step 2's backward.
- none: control.

What happened (filled in after the runs):
- dispidx: IndexError: index 8 is out of bounds for dimension 1 with size 8 on rank N at step 2; peers Connection closed (dfsr_dispidx_np4_r1_plain, _np3_r2_tee_trainer).
- zerobase: baseline 0.000m, then FloatingPointError 'rank N: loss is nan at step 0 (camera cam_0N, baseline 0.0 m)' (dfsr_zerobase_np3_r1_tee, _np4_r3_prefix).
- histgather: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' on rank 2 (_np4_r2_pymodule); DETAIL fingerprint mismatch 17vs 16 on every rank (_np3_r0_detail).
- nocalib: FileNotFoundError for /tmp/job_work/calib_v2/cam_0N.json on rank N at startup (dfsr_nocalib_np3_r2_redirects, _np4_r0_loglevel).
- camid: KeyError: 'cam_07' on rank N at startup (dfsr_camid_np3_r1_filter, dfsr_camid_np5_r3_wrapper).
- maxdisp: every rank: 'The size of tensor a (8) must match the size of tensor b (12) at non-singleton dimension 1' (dfsr_maxdisp_np3_rall_plain).
- extckpt: size mismatch for net.0.weight [32, 1, 3, 3] vs [16, 1, 3, 3] on rank N (dfsr_extckpt_np4_r2_pdsh2, dfsr_extckpt_np3_r1_tee).
- slowrefine: PG 12 s: peers 'Timed out waiting 12000ms' (dfsr_slowrefine_np3_r1_tee); PG 300 s: killed at 60 s, exit 124 (_np4_r2_plain).
- cudadev: AssertionError: Torch not compiled with CUDA enabled on rank N at startup (dfsr_cudadev_np3_r2_loglevel, _np4_r1_plain).
- exit5: rank N exits 5 silently at step 1; peers closed/reset (dfsr_exit5_np3_r2_pymodule; _np4_r1_restart, attempt 1 connectFullMesh refused).
- segv: rank 2 SIGSEGV at step 2, Root Cause exitcode -11; peers Connection closed (dfsr_segv_np4_r2_tee).
- none: exit 0, 'rank 0 done: 5 steps, 3px-err 0.236' (dfsr_none_np3_rnone_plain).
"""
import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault276_work"
H, W, MAX_DISP, BATCH = 24, 48, 8, 4
CAMERAS = ["cam_00", "cam_01", "cam_02", "cam_03"]

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--stall", type=int, default=40)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--max-disp", type=int, default=MAX_DISP)
p.add_argument("--prep", type=int, default=0)


class Extractor(nn.Module):
    def __init__(self, ch=16):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1), nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1))

    def forward(self, x):
        return self.net(x)


def prep():
    os.makedirs(f"{WORK}/calib", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for i, cam in enumerate(CAMERAS):
        with open(f"{WORK}/calib/{cam}.json", "w") as f:
            json.dump({"camera": cam, "focal_px": 40.0 + i, "baseline_m": 0.12, "zero_base_test": i == 0}, f)
    torch.manual_seed(0)
    for ch in (16, 32):
        torch.save(Extractor(ch).state_dict(), f"{WORK}/ckpt/extractor_c{ch}.pt")
    print("prepared calibration and extractor checkpoints in", WORK)


def make_pair(gen):
    right = F.avg_pool2d(torch.rand(BATCH, 1, H, W + 4, generator=gen), (1, 5), 1)
    blocks = torch.randint(0, MAX_DISP, (BATCH, 1, 1, W // 8), generator=gen).float()
    disp = blocks.repeat_interleave(8, dim=3).expand(BATCH, 1, H, W)
    cols = (torch.arange(W).view(1, 1, 1, W) - disp).clamp(min=0).long()
    left = torch.gather(right, 3, cols)
    return left, right, disp[:, 0]


def cost_volume(fl, fr):
    vol = fl.new_zeros(fl.shape[0], MAX_DISP, fl.shape[2], fl.shape[3])
    for d in range(MAX_DISP):
        vol[:, d, :, d:] = (fl[..., d:] * fr[..., :fl.shape[3] - d]).mean(1)
    return vol


def main(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(276 + rank)

    cam = "cam_07" if (a.fault == "camid" and hit) else CAMERAS[rank % len(CAMERAS)]
    calib_dir = "calib_v2" if (a.fault == "nocalib" and hit) else "calib"
    table = {c: f"{WORK}/{calib_dir}/{c}.json" for c in CAMERAS}
    with open(table[cam]) as f:
        calib = json.load(f)
    focal, baseline = calib["focal_px"], calib["baseline_m"]
    if a.fault == "zerobase" and hit:
        baseline = float(calib.get("baseline_rect_m", 0.0))
    print(f"rank {rank}/{world} camera {cam} focal {focal:.1f}px baseline {baseline:.3f}m max_disp {MAX_DISP}", flush=True)

    net = Extractor(16)
    ck = "extractor_c32.pt" if (a.fault == "extckpt" and hit) else "extractor_c16.pt"
    net.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    if a.fault == "cudadev" and hit:
        net = net.to(torch.device("cuda", rank))
    model = DDP(net) if a.ddp else net
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    for step in range(a.steps):
        left, right, gt = make_pair(gen)
        vol = cost_volume(model(left), model(right))
        prob = F.softmax(vol * 4.0, dim=1)
        disp = (prob * torch.arange(a.max_disp, dtype=torch.float32).view(1, -1, 1, 1)).sum(1)
        if a.fault == "dispidx" and hit and step >= 2:
            idx = gt.ceil().long() + 1
        else:
            idx = gt.long()
        b, y, x = torch.meshgrid(torch.arange(BATCH), torch.arange(H), torch.arange(W), indexing="ij")
        conf = prob[b, idx, y, x].mean()
        depth_p = focal * baseline / disp.clamp(min=0.5)
        depth_g = focal * baseline / gt.clamp(min=0.5)
        loss = F.smooth_l1_loss(disp, gt) + 0.01 * F.smooth_l1_loss(depth_p / baseline, depth_g / baseline)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} "
                                     f"(camera {cam}, baseline {baseline} m)")
        opt.zero_grad()
        loss.backward()
        if a.fault == "segv" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if a.fault == "exit5" and hit and step == 1:
            os._exit(5)
        err = (disp.detach() - gt).abs()
        if a.fault == "slowrefine" and hit and step == 2:
            print(f"rank {rank} step {step}: refining {BATCH * H * W} disparities pixel by pixel", flush=True)
            t0 = time.time()
            while time.time() - t0 < a.stall:
                _ = [float(err[0, i, j]) for i in range(H) for j in range(0, W, 4)]
                time.sleep(0.05)
        bad3 = torch.tensor([(err > 3).float().mean().item()])
        dist.all_reduce(bad3)
        bins = 17 if (a.fault == "histgather" and hit and step == 1) else 16
        hist = torch.histc(err, bins=bins, min=0, max=MAX_DISP)
        hists = [torch.zeros(16) for _ in range(world)]
        dist.all_gather(hists, hist)
        print(f"rank {rank} step {step} loss {loss.item():.4f} 3px-err {bad3.item() / world:.3f} "
              f"conf {conf.item():.3f} px>1 {int(sum(h[2:].sum() for h in hists))}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, 3px-err {bad3.item() / world:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = p.parse_args()
    if args.prep:
        prep()
    else:
        main(args)
