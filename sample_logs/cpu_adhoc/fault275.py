"""A two-hundred-and-seventy-fifth hand-run batch: IMAGE TOKENIZER WITH A VQ-VAE.

Synthetic 32x32 RGB images (per-rank shards /tmp/job_work/shards/imgs_RR.pt written by --prep 1, normalised
with a per-dataset mean/std table), a conv encoder (3 -> 32 -> 16 channels, two stride-2 convs, 8x8 latents),
a vector-quantised codebook (64 codes of dim 16, nearest code by squared distance, straight-through estimator,
codebook loss + 0.25 x commitment loss), a conv decoder (transposed convs back to 32x32), DDP (gloo) or a
hand-written gradient all_reduce (--ddp 0), the per-rank code histogram all_gathered for the usage log and the
summed histogram all_reduced for the global codebook perplexity, an optional resume of the codebook from
/tmp/job_work/ckpt/vq_k64.pt (--resume 1), then barrier and destroy_process_group.

Faults:
- codeidx: from step 2 rank N appends a "null code" column to the distances, so argmin returns 64 (IndexError).
- perpnan: rank N counts codes only after a warmup of 99 steps; its histogram is all zero, perplexity nan (check).
- histgather: rank N builds its usage histogram with an old codebook size of 48 and all_gathers it (size mismatch).
- noshard: rank N reads its image shard from shards_32px/, which does not exist (FileNotFoundError at startup).
- badnorm: rank N's dataset name is "synth32_v2", not in the normalisation table (KeyError at startup).
- codedim: every rank builds the codebook with dim 32 for 16-channel encoder latents (matmul shape error).
- optmod: rank N imports the optional fused VQ kernel module vq_fused_kernels, not installed (ModuleNotFoundError).
- kmeans: rank N re-initialises dead codes with a Python k-means for --stall seconds at step 2 (others wait).
- sigbus: rank N sends itself SIGBUS after step 2's optimizer step.
- collapse: rank N uses a min-used-codes threshold of 64; logs a "codebook collapsed" warning, raises RuntimeError.
- ckptk: with --resume 1 rank N loads ckpt/vq_k128.pt (128 codes) into the 64-code codebook (size mismatch).
- none: control.

What happened (filled in after the runs):
- codeidx: IndexError: index 64 is out of bounds for dimension 0 with size 64 on rank N at step 2 (vqv_codeidx_np4_r1_plain, _np3_r2_tee_trainer).
- perpnan: FloatingPointError 'rank N: codebook perplexity is nan at step 0 (code histogram sums to 0)' (vqv_perpnan_np4_r2_loglevel, _np3_r1_detail).
- histgather: rank N SIGABRT: gloo::EnforceNotMet 'op.preamble.length <= op.nbytes. 128 vs 96' (vqv_histgather_np3_r1_tee, _np4_r3_pymodule).
- noshard: FileNotFoundError for /tmp/job_work/shards_32px/imgs_0N.pt on rank N at startup (vqv_noshard_np3_r2_redirects, _np4_r0_prefix).
- badnorm: KeyError: 'synth32_v2' on rank N at startup (vqv_badnorm_np4_r3_filter, vqv_badnorm_np3_r1_wrapper).
- codedim: every rank: 'mat1 and mat2 shapes cannot be multiplied (1024x16 and 32x64)' (vqv_codedim_np3_rall_plain, _np4_rall_restart).
- optmod: ModuleNotFoundError: No module named 'vq_fused_kernels' on rank N (vqv_optmod_np3_r0_pymodule, _np4_r2_pdsh2).
- kmeans: PG 12 s: peers 'Timed out waiting 12000ms' (vqv_kmeans_np3_r1_tee); PG 300 s: killed at 60 s, exit 124 (_np3_r2_plain).
- sigbus: rank N SIGBUS after step 2, no traceback; Root Cause -7 (vqv_sigbus_np4_r1_tee, vqv_sigbus_np3_r0_prefix).
- collapse: 'codebook collapsed: 5x of 64 codes used' warning, then RuntimeError on rank N (vqv_collapse_np3_r2_loglevel, _np4_r1_filter).
- ckptk: size mismatch for codebook.weight [128, 16] vs [64, 16] on rank N (vqv_ckptk_np4_r1_tee_trainer).
- none: exit 0, 'rank 0 done: 5 steps, codebook perplexity 36.62' (vqv_none_np3_rnone_plain).
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
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault275_work"
K, D = 64, 16
NORM = {"synth32": ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), "cifar10": ((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))}

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--stall", type=float, default=40.0)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--prep", type=int, default=0)
a = p.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("vqvae")


class VQ(nn.Module):
    def __init__(self, k, d):
        super().__init__()
        self.codebook = nn.Embedding(k, d)
        self.codebook.weight.data.uniform_(-1.0 / k, 1.0 / k)

    def forward(self, z, null_code=False):
        b, c, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, c)
        e = self.codebook.weight
        dist_ = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ e.t() + e.pow(2).sum(1)
        if null_code:
            dist_ = torch.cat([dist_, torch.full((dist_.shape[0], 1), -1.0)], 1)
        idx = dist_.argmin(1)
        q = e[idx].view(b, h, w, c).permute(0, 3, 1, 2)
        loss = F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach())
        return z + (q - z).detach(), loss, idx


class VQVAE(nn.Module):
    def __init__(self, k=K, d=D):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(), nn.Conv2d(32, D, 4, 2, 1))
        self.vq = VQ(k, d)
        self.dec = nn.Sequential(nn.ConvTranspose2d(D, 32, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(32, 3, 4, 2, 1))

    def forward(self, x, null_code=False):
        q, vq_loss, idx = self.vq(self.enc(x), null_code)
        return self.dec(q), vq_loss, idx


def prep():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for r in range(8):
        torch.save(torch.rand(64, 3, 32, 32, generator=g), f"{WORK}/shards/imgs_{r:02d}.pt")
    torch.save(VQ(64, D).state_dict(), f"{WORK}/ckpt/vq_k64.pt")
    torch.save(VQ(128, D).state_dict(), f"{WORK}/ckpt/vq_k128.pt")
    print("prep done")


def kmeans_restart(codebook, z, seconds):
    pts = z.permute(0, 2, 3, 1).reshape(-1, D).tolist()
    cents = [list(pts[i]) for i in range(K)]
    t0 = time.time()
    while time.time() - t0 < seconds:
        for pt in pts:
            best = min(range(K), key=lambda j: sum((u - v) ** 2 for u, v in zip(pt, cents[j])))
            cents[best] = [0.9 * u + 0.1 * v for u, v in zip(cents[best], pt)]
    codebook.weight.data.copy_(torch.tensor(cents))


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    hit = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(1234 + rank)
    if a.fault == "optmod" and hit:
        import vq_fused_kernels  # noqa: F401
    name = "synth32_v2" if (a.fault == "badnorm" and hit) else "synth32"
    mean, std = NORM[name]
    shard_dir = "shards_32px" if (a.fault == "noshard" and hit) else "shards"
    imgs = torch.load(f"{WORK}/{shard_dir}/imgs_{rank:02d}.pt")
    imgs = (imgs - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    print(f"rank {rank}/{ws}: {imgs.shape[0]} images from {shard_dir}/imgs_{rank:02d}.pt, dataset {name}", flush=True)
    model = VQVAE(K, 32 if a.fault == "codedim" and hit else D)
    if a.resume:
        ck = "vq_k128.pt" if (a.fault == "ckptk" and hit) else "vq_k64.pt"
        model.vq.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
        print(f"rank {rank}: resumed codebook from ckpt/{ck}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    warmup = 99 if (a.fault == "perpnan" and hit) else 0
    kc = 48 if (a.fault == "histgather" and hit) else K
    min_used = 64 if (a.fault == "collapse" and hit) else 2
    for step in range(a.steps):
        x = imgs[(step * 16) % 64:(step * 16) % 64 + 16]
        rec, vq_loss, idx = net(x, null_code=(a.fault == "codeidx" and hit and step >= 2))
        if a.fault == "kmeans" and hit and step == 2:
            log.info("rank %d: re-initialising dead codes with k-means", rank)
            kmeans_restart(model.vq.codebook, model.enc(x).detach(), a.stall)
        loss = F.mse_loss(rec, x) + vq_loss
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= ws
        opt.step()
        if a.fault == "sigbus" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
        counted = idx if step >= warmup else idx[:0]
        hist = torch.bincount(counted.clamp(max=kc - 1), minlength=kc).float()
        probs = hist / hist.sum()
        perp = torch.exp(-(probs * torch.log(probs + 1e-10)).sum())
        if not torch.isfinite(perp):
            raise FloatingPointError(f"rank {rank}: codebook perplexity is {perp.item()} at step {step} "
                                     f"(code histogram sums to {hist.sum().item():.0f})")
        used = int((hist > 0).sum())
        if used < min_used:
            log.warning("rank %d: codebook collapsed: %d of %d codes used at step %d", rank, used, kc, step)
            raise RuntimeError(f"codebook collapse on rank {rank}: {used} codes in use < min_used_codes={min_used}")
        gathered = [torch.zeros_like(hist) for _ in range(ws)]
        dist.all_gather(gathered, hist)
        tot = torch.stack(gathered).sum(0)
        dist.all_reduce(loss.detach())
        pg = tot / tot.sum()
        gperp = torch.exp(-(pg * torch.log(pg + 1e-10)).sum()).item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} perplexity {perp.item():.2f} global {gperp:.2f} "
              f"used {used}/{kc}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, codebook perplexity {gperp:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if a.prep:
        prep()
        sys.exit(0)
    main()
