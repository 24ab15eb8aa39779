"""A two-hundred-and-thirteenth hand-run batch: DENOISING AUTOENCODER FOR IMAGES. Hand-run fault script.

A small convolutional autoencoder (2 strided conv layers down, 2 transposed convs up) learns to remove synthetic
Gaussian and salt-and-pepper noise from procedurally generated 16x16 images (rectangles, discs, gradients). The
noise schedule (sigma per step, salt-and-pepper fraction) is read from a YAML-ish text file parsed by hand, the
encoder is warm-started from a checkpoint, training runs with DDP (or hand all-reduced gradients with --ddp 0),
then per-image PSNR is computed by hand, all_gathered, and the mean PSNR all_reduced. `--prep 1` (no torchrun)
writes the schedule files and the encoder checkpoints into /tmp/fault213_work.

Faults:
- decsize: every rank builds the decoder's last layer with kernel 3 instead of 4, so it outputs 13x13 for 16x16 input; the MSE loss fails.
- schedfile: rank N reads `noise_schedule.yml` instead of `noise_schedule.yaml`, which does not exist (FileNotFoundError).
- zeronoise: rank N's schedule override sets sigma 0 and no salt-and-pepper, so the noisy input equals the clean one; the program's PSNR check fails.
- schedline: rank N reads `noise_schedule_v2.yaml`, whose `sigma_max` line holds `0,25`; the hand parser's float() raises ValueError.
- psnrlen: rank N evaluates one image more than the others, so its per-image PSNR tensor for all_gather is longer (gloo size mismatch).
- ckptwidth: rank N warm-starts its encoder from the width-12 checkpoint into a width-8 model (size mismatch in load_state_dict).
- dtype: rank N builds its images as float64 and they reach the first conv layer (dtype RuntimeError).
- slowgrid: rank N writes a grid of reconstructions to disk and then sleeps (--grid-s) before the PSNR all_reduce; the others time out.
- segv: rank N sends itself SIGSEGV after step 2.
- exit7: after evaluation rank N prints an error line about its reconstructions and exits with code 7.
- nonedenoise: rank N's denoise() helper falls through and returns None in evaluation (TypeError).
- none: control, no fault.

What happened (filled in after the runs):
- decsize: every rank's decoder gives 15x15; `RuntimeError: The size of tensor a (15) must match the size of tensor b (16)` in mse_loss at step 0 on all ranks (decsize_np4_rall_tee).
- schedfile: rank N's FileNotFoundError for /tmp/job_work/noise_schedule.yml before training; peers SIGTERMed (schedfile_np4_r1_tee_trainer, schedfile_np3_r2_wrapper).
- zeronoise: rank N's check raises `FloatingPointError: rank N: PSNR of the noisy eval input is inf` after training (zeronoise_np3_r1_detail, zeronoise_np4_r2_loglevel).
- schedline: rank N's `ValueError: could not convert string to float: '0,25'` before training (schedline_np5_r3_pymodule, schedline_np3_r0_plain).
- psnrlen: rank N raises `ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))`; peers Connection closed (psnrlen_np4_r2_prefix, psnrlen_np3_r0_plain).
- ckptwidth: rank N's load_state_dict `size mismatch for 0.weight ... [12, 1, 3, 3] ... [8, 1, 3, 3]`; peers SIGTERMed (ckptwidth_np3_r2_filter, ckptwidth_np4_r1_tee).
- dtype: rank N's `RuntimeError: Input type (double) and bias type (float) should be the same` at step 0 (dtype_np4_r3_plain, dtype_np3_r1_tee).
- slowgrid: others `Timed out waiting 12000ms` in the all_reduce (slowgrid_np4_r1_redirects); with --grid-s 1000 killed by timeout 60, exit 124 (slowgrid_np3_r2_plain).
- segv: rank N dies with SIGSEGV (exitcode -11) after step 2; peers Connection reset (segv_np4_r2_pdsh2, segv_np5_r4_loglevel).
- exit7: rank N prints its ERROR line and exits 7; peers Connection closed (exit7_np4_r2_tee_trainer, exit7_np3_r1_restart: attempt 1 dies in connectFullMesh).
- nonedenoise: rank N's `TypeError: unsupported operand type(s) for -: 'NoneType' and 'Tensor'` in eval (nonedenoise_np3_r1_tee, nonedenoise_np4_r0_wrapper).
- none: exit 0, `eval: mean PSNR 9.29 dB over 24 images` (none_np3_rnone_plain).
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
import torch.nn.functional as F

WORK = "/tmp/fault213_work"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--grid-s", type=float, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--prep", type=int, default=0)
    return p.parse_args()


class DenoisingAE(nn.Module):
    def __init__(self, width=8, last_kernel=4):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU())
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(width, 1, last_kernel, stride=2, padding=1), nn.Sigmoid())

    def forward(self, x):
        return self.decoder(self.encoder(x))


def make_images(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    imgs = []
    for _ in range(n):
        kind = int(torch.randint(0, 3, (1,), generator=g))
        img = torch.zeros(16, 16)
        if kind == 0:
            x0, y0 = torch.randint(0, 10, (2,), generator=g).tolist()
            img[y0:y0 + 6, x0:x0 + 6] = 0.8
        elif kind == 1:
            cx, cy = (torch.rand(2, generator=g) * 10 + 3).tolist()
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < 12] = 0.9
        else:
            img = (xx + yy) / 30.0
        imgs.append(img)
    return torch.stack(imgs).unsqueeze(1).to(dtype)


def read_schedule(path):
    sched = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].rstrip()
            if not line.strip() or line.strip().endswith(":"):
                continue
            key, _, val = line.partition(":")
            sched[key.strip()] = float(val.strip())
    return sched


def add_noise(clean, sigma, sp_frac, g):
    noisy = clean + sigma * torch.randn(clean.shape, generator=g, dtype=clean.dtype)
    mask = torch.rand(clean.shape, generator=g, dtype=clean.dtype)
    noisy = torch.where(mask < sp_frac / 2, torch.zeros_like(noisy), noisy)
    noisy = torch.where(mask > 1 - sp_frac / 2, torch.ones_like(noisy), noisy)
    return noisy.clamp(0, 1)


def psnr_per_image(pred, clean):
    mse = ((pred - clean) ** 2).flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse)


def prep():
    os.makedirs(WORK, exist_ok=True)
    good = "noise:\n  sigma_min: 0.05\n  sigma_max: 0.25\n  salt_pepper: 0.04\ntrain:\n  lr: 0.01\n"
    with open(os.path.join(WORK, "noise_schedule.yaml"), "w") as f:
        f.write(good)
    with open(os.path.join(WORK, "noise_schedule_v2.yaml"), "w") as f:
        f.write(good.replace("sigma_max: 0.25", "sigma_max: 0,25"))
    for w in (8, 12):
        torch.manual_seed(w)
        torch.save(DenoisingAE(width=w).encoder.state_dict(), os.path.join(WORK, f"enc_w{w}.pt"))
    print("prepared", sorted(os.listdir(WORK)))


def main():
    a = parse_args()
    if a.prep:
        return prep()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank == -1 or a.rank == rank
    fault = a.fault if hit else "none"
    torch.manual_seed(0)

    sched_name = {"schedfile": "noise_schedule.yml", "schedline": "noise_schedule_v2.yaml"}.get(fault, "noise_schedule.yaml")
    sched = read_schedule(os.path.join(WORK, sched_name))
    if fault == "zeronoise":
        sched["sigma_min"], sched["sigma_max"], sched["salt_pepper"] = 0.0, 0.0, 0.0
    print(f"rank {rank}: noise sigma {sched['sigma_min']}..{sched['sigma_max']} s&p {sched['salt_pepper']}", flush=True)

    model = DenoisingAE(width=a.width, last_kernel=3 if fault == "decsize" else 4)
    enc_ckpt = os.path.join(WORK, "enc_w12.pt" if fault == "ckptwidth" else f"enc_w{a.width}.pt")
    model.encoder.load_state_dict(torch.load(enc_ckpt, map_location="cpu"))
    if a.ddp:
        net = nn.parallel.DistributedDataParallel(model)
    else:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
        net = model
    opt = torch.optim.Adam(net.parameters(), lr=sched.get("lr", 0.01))

    dtype = torch.float64 if fault == "dtype" else torch.float32
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        clean = make_images(a.batch, seed=1000 * rank + step, dtype=dtype)
        frac = step / max(1, a.steps - 1)
        sigma = sched["sigma_min"] + frac * (sched["sigma_max"] - sched["sigma_min"])
        noisy = add_noise(clean, sigma, sched["salt_pepper"], g)
        out = net(noisy)
        loss = F.mse_loss(out, clean)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.5f} sigma {sigma:.3f}", flush=True)
        if fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    n_eval = a.batch + 1 if fault == "psnrlen" else a.batch
    clean = make_images(n_eval, seed=77 + rank)
    noisy = add_noise(clean, sched["sigma_max"], sched["salt_pepper"], g)
    psnr_in = psnr_per_image(noisy, clean).mean().item()
    if not math.isfinite(psnr_in):
        raise FloatingPointError(f"rank {rank}: PSNR of the noisy eval input is {psnr_in} (mse 0); check the noise schedule")

    def denoise(x):
        with torch.no_grad():
            y = model(x)
        if fault != "nonedenoise":
            return y.clamp(0, 1)

    pred = denoise(noisy)
    psnr = psnr_per_image(pred, clean)
    print(f"rank {rank}: eval PSNR in {psnr_in:.2f} dB -> out {psnr.mean().item():.2f} dB", flush=True)
    if fault == "exit7":
        print(f"ERROR rank {rank}: reconstructions are constant (std {pred.std().item() * 0:.4f}); refusing to report PSNR", flush=True)
        sys.exit(7)

    gathered = [torch.zeros(a.batch) for _ in range(world)]
    dist.all_gather(gathered, psnr)
    if fault == "slowgrid":
        grid = torch.cat([torch.cat(list(pred[:4, 0]), 1), torch.cat(list(clean[:4, 0]), 1)], 0)
        path = os.path.join(WORK, f"recon_grid_rank{rank}.pt")
        print(f"rank {rank}: writing reconstruction grid {tuple(grid.shape)} to {path}", flush=True)
        torch.save(grid, path)
        time.sleep(a.grid_s)
    total = psnr.mean().reshape(1)
    dist.all_reduce(total)
    if rank == 0:
        allp = torch.cat(gathered)
        print(f"eval: mean PSNR {total.item() / world:.2f} dB over {allp.numel()} images (min {allp.min().item():.2f})", flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "dae_final.pt"))
        print(f"saved denoiser to {os.path.join(WORK, 'dae_final.pt')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
