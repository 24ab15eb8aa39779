"""A two-hundred-and-eighty-sixth hand-run batch: DISCRETE VAE FOR TOKENISED MOTION.

A discrete VAE that turns synthetic motion-capture clips into motion tokens.  Every rank reads its clip archive
/tmp/fault286_work/clips/clips_RR.pt (written by --prep 1: 24 clips of 64 frames, 17 joints x 3 coordinates,
a skeleton name mapped to its joint count through JOINT_MAP), a 1-D conv encoder (stride 4 overall) gives code
logits over a 16-entry codebook, a Gumbel-softmax bottleneck with an annealed temperature picks soft codes, a
1x1 codebook projection and a transposed-conv decoder reconstruct the clip.  Loss = MSE + beta * KL(q || uniform).
The decoder starts from ckpt/decoder_init.pt; the model is wrapped in DDP (gloo), or with --ddp 0 the gradients
are all_reduced by hand.  Code usage is all_reduced every step (perplexity in the progress line), per-rank code
histograms are all_gathered at step 2, and rank 0 writes the token stats to export/codes.pt at the end.

Faults:
  codeid    - rank N adds the vocabulary offset (16) to its code ids: ids 16+ beyond the 16-entry codebook (IndexError)
  tempzero  - rank N anneals the Gumbel temperature to 0 by step 2: NaN loss, the program's check raises
  histlen   - rank N all_gathers its code histogram with an extra "unused" bin (gloo size mismatch)
  noarchive - rank N reads its clips from clips_v2/, which was never written (FileNotFoundError)
  skeleton  - rank N's archive names skeleton "CMU31" that is missing from JOINT_MAP (KeyError)
  stride    - every rank: clip_len 62 is not divisible by the encoder's stride 4 (decoder output 60 vs 62)
  wonly     - rank N loads ckpt/decoder_v0.pt (pickled DecoderConfig) with weights_only=True (UnpicklingError)
  usage     - rank N recomputes code usage with nested Python loops for --stall s before the all_reduce
  pairdist  - rank N allocates a frame-pair distance buffer times --pair-factor (CPU allocator failure)
  sigterm   - rank N sends itself SIGTERM after step 2
  none      - control, clean run

What happened (filled in after the runs):
  codeid    - rank N: IndexError index 18/30 is out of bounds for dimension 0 with size 16 at step 1; peers closed
  tempzero  - rank N: FloatingPointError rank N: loss is nan at step 2 (tau 0); peers Connection closed by peer
  histlen   - gloo EnforceNotMet 34 vs 32 on the receiver (SIGABRT); with DETAIL every rank: 16vs 17, Rank 2 named
  noarchive - rank N: FileNotFoundError .../clips_v2/clips_0N.pt at startup; the agent SIGTERMed the rest
  skeleton  - rank N: KeyError 'CMU31' at JOINT_MAP[skeleton] at startup; the agent SIGTERMed the rest
  stride    - every rank: RuntimeError size of tensor a (60) must match b (62); restart: connectFullMesh refused
  wonly     - rank N: _pickle.UnpicklingError Weights only load failed, Unsupported global __main__.DecoderConfig
  usage     - rank N looped: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout 60 (exit 124)
  pairdist  - rank N: RuntimeError DefaultCPUAllocator: can't allocate memory (17592186044416 bytes); peers closed
  sigterm   - rank N: exitcode -15 (SIGTERM) after step 2, no traceback; peers closed/reset in backward
  none      - clean, exit 0, rank 0 done: 5 steps, code perplexity 4.99
"""
import argparse
import dataclasses
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

JOINT_MAP = {"cmu31": 17, "h36m": 17, "mixamo": 17}
CODEBOOK = 16


@dataclasses.dataclass
class DecoderConfig:
    hidden: int = 32
    channels: int = 51
    stride: int = 4


class DVAE(nn.Module):
    def __init__(self, channels, hidden=32, codes=CODEBOOK):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv1d(channels, hidden, 4, stride=2, padding=1), nn.GELU(),
            nn.Conv1d(hidden, hidden, 4, stride=2, padding=1), nn.GELU(),
            nn.Conv1d(hidden, codes, 1))
        self.codebook = nn.Conv1d(codes, hidden, 1, bias=False)
        self.dec = nn.Sequential(
            nn.ConvTranspose1d(hidden, hidden, 4, stride=2, padding=1), nn.GELU(),
            nn.ConvTranspose1d(hidden, channels, 4, stride=2, padding=1))

    def forward(self, x, tau):
        logits = self.enc(x)
        z = F.gumbel_softmax(logits, tau=tau, hard=False, dim=1)
        return self.dec(self.codebook(z)), logits


def prep(work):
    torch.manual_seed(0)
    os.makedirs(os.path.join(work, "clips"), exist_ok=True)
    os.makedirs(os.path.join(work, "ckpt"), exist_ok=True)
    for r in range(8):
        t = torch.linspace(0, 2 * math.pi, 64)
        phase = torch.rand(24, 51, 1) * 6.28
        clips = torch.sin(t.view(1, 1, -1) * (1 + torch.rand(24, 51, 1)) + phase) + 0.05 * torch.randn(24, 51, 64)
        torch.save({"skeleton": "cmu31", "fps": 30, "clips": clips}, os.path.join(work, "clips", f"clips_{r:02d}.pt"))
    m = DVAE(51)
    torch.save(m.dec.state_dict(), os.path.join(work, "ckpt", "decoder_init.pt"))
    torch.save({"config": DecoderConfig(), "state_dict": m.dec.state_dict()}, os.path.join(work, "ckpt", "decoder_v0.pt"))
    print("prepared clips and decoder checkpoints under", work)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pair-factor", type=int, default=4096)
    p.add_argument("--work", default="/tmp/fault286_work")
    p.add_argument("--prep", type=int, default=0)
    a = p.parse_args()
    if a.prep:
        return prep(a.work)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    fault = a.fault if bad else "none"
    torch.manual_seed(1234 + rank)

    clip_dir = "clips_v2" if fault == "noarchive" else "clips"
    archive = torch.load(os.path.join(a.work, clip_dir, f"clips_{rank:02d}.pt"), weights_only=True)
    skeleton = archive["skeleton"].upper() if fault == "skeleton" else archive["skeleton"]
    joints = JOINT_MAP[skeleton]
    clip_len = 62 if fault == "stride" else 64
    clips = archive["clips"][:, : joints * 3, :clip_len].contiguous()
    print(f"rank {rank}: {clips.shape[0]} clips of {clip_len} frames, skeleton {skeleton} ({joints} joints)", flush=True)

    model = DVAE(joints * 3)
    dec_path = "decoder_v0.pt" if fault == "wonly" else "decoder_init.pt"
    model.dec.load_state_dict(torch.load(os.path.join(a.work, "ckpt", dec_path), weights_only=True))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    tau0, tau_min, anneal = 1.0, (0.0 if fault == "tempzero" else 0.3), (2 if fault == "tempzero" else 50)
    code_ids = torch.arange(CODEBOOK, dtype=torch.float32)

    for step in range(a.steps):
        tau = max(tau_min, tau0 * (1 - step / anneal))
        x = clips[torch.randint(0, clips.shape[0], (8,))]
        recon, logits = net(x, tau)
        q = logits.softmax(1)
        kl = (q * (q.clamp_min(1e-9).log() + math.log(CODEBOOK))).sum(1).mean()
        rec = F.mse_loss(recon, x)
        loss = rec + 0.01 * kl
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (tau {tau:.3g})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()

        idx = logits.argmax(1)
        if fault == "codeid" and step == 1:
            idx = idx + CODEBOOK
        mean_code = code_ids[idx].mean()
        if fault == "usage" and step == 1:
            print(f"rank {rank}: recomputing code usage per clip", flush=True)
            t0, usage = time.time(), torch.zeros(CODEBOOK)
            while time.time() - t0 < a.stall:
                for c in range(idx.shape[0]):
                    for f in range(idx.shape[1]):
                        usage[idx[c, f]] += 1
                time.sleep(0.05)
        usage = torch.bincount(idx.flatten(), minlength=CODEBOOK).float()
        dist.all_reduce(usage)
        pr = usage / usage.sum()
        ppl = torch.exp(-(pr * pr.clamp_min(1e-9).log()).sum()).item()
        if fault == "pairdist" and step == 1:
            frames = x.permute(0, 2, 1).reshape(-1, x.shape[1])
            n = frames.shape[0] * a.pair_factor
            pair = frames.new_empty(n, n)
            pair[: frames.shape[0], : frames.shape[0]] = torch.cdist(frames, frames)
        if step == 2:
            hist = torch.bincount(idx.flatten(), minlength=CODEBOOK + (1 if fault == "histlen" else 0)).float()
            hists = [torch.zeros_like(hist) for _ in range(world)]
            dist.all_gather(hists, hist)
            if fault == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
        print(f"rank {rank} step {step} loss {loss.item():.4f} recon {rec.item():.4f} kl {kl.item():.3f} "
              f"tau {tau:.2f} ppl {ppl:.2f} mean_code {mean_code.item():.2f}", flush=True)

    dist.barrier()
    if rank == 0:
        os.makedirs(os.path.join(a.work, "export"), exist_ok=True)
        torch.save({"usage": usage, "ppl": ppl}, os.path.join(a.work, "export", "codes.pt"))
        print(f"rank 0 done: {a.steps} steps, code perplexity {ppl:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
