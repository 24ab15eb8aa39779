"""A hundred-and-seventy-second hand-run batch: AUDIO SOURCE SEPARATION WITH STFT MASKS.

Each rank synthesises mixtures of two sine-like sources (a low tone and a chirp), saves them as
mixtures/mix_RR.npy and reads them back; a tiny mask network (per frame: |X| -> 64 -> two sigmoid masks)
estimates one mask per source on the magnitude spectrogram (torch.stft, Hann window), the masks are applied
to the complex STFT and torch.istft brings both estimates back to waveforms. The loss is the negative SI-SDR,
computed per rank and all_reduced for logging; the model is trained with DDP on gloo (or --ddp 0: gradients
all_reduced by hand). Frame counts are all_gathered once per run for a consistency line. Rank 0 saves
/tmp/job_work/<save-name> at the end.

Faults:
- shortseg: rank N crops its segment to seg_len // 16 samples (an off-by-factor in the crop), so torch.stft's
  reflect padding of n_fft // 2 is too large: RuntimeError from stft on rank N.
- winlen: the window is built with win_length = n_fft // 2 but stft is called with win_length = n_fft on every rank.
- istftlen: rank N calls istft with length = seg_len - 1; the SI-SDR loss then fails on a shape mismatch.
- zerotgt: rank N's batch at step 2 has a silent (all-zero) source; SI-SDR divides by its zero energy: NaN,
  caught by the program's finite check (FloatingPointError).
- mixmissing: rank N reads mixtures/mix_RRR.npy (three digits) while files are written as mix_RR.npy:
  FileNotFoundError on rank N.
- framegather: rank N all_gathers its frame counts as a length-3 tensor instead of 2 (a collective mismatch).
- wavblock: rank N at step 3 writes its separated audio into a named pipe nobody reads and blocks; the other
  ranks wait in the next all_reduce until the process-group timeout.
- ckptbins: every rank resumes from a checkpoint made with n_fft 512 (257 bins) into a 129-bin model:
  size mismatch in load_state_dict.
- hopstr: the config's hop_length is the string "64" on every rank: TypeError from torch.stft.
- srmismatch: rank N prints an ERROR line "sample rate mismatch" and exits with code 4 (no traceback).
- sigbus: rank N is killed by SIGBUS at step 2.
- none: control.

What happened (filled in after the runs):
- shortseg: RuntimeError 'Padding size should be less than the corresponding input dimension ... padding (128, 128)' on rank N (stft_shortseg_np3_r1_tee, _np4_r2_pymodule).
- winlen: every rank: RuntimeError 'expected a 1D window tensor of size equal to win_length=256, but got window with size [128]' (tee_trainer, redirects).
- istftlen: rank N: RuntimeError 'The size of tensor a (2047) must match the size of tensor b (2048)' in si_sdr (np4_r3_loglevel, np3_r0_detail).
- zerotgt: rank N: FloatingPointError 'non-finite SI-SDR at step 2 on rank N (items [[1, 1]]): loss=nan' (np3_r1_plain, np4_r2_prefix).
- mixmissing: rank N: FileNotFoundError '.../mixtures/mix_00N.npy' (np3_r2_restart: restart died in connectFullMesh; np4_r1_filter).
- framegather: gloo::EnforceNotMet '12 vs 8. Received data size doesn't match' aborts a receiving rank (SIGABRT) (np3_r1_plain, np4_r2_pdsh2).
- wavblock: PG 12 s: peers 'Timed out waiting 12000ms' (np3_r1_plain); PG 300 s: killed by timeout 60, exit 124 (np4_r2_tee).
- ckptbins: every rank: 'size mismatch for fc1.weight: ... [64, 257] from checkpoint ... [64, 129]' (np3_rall_tee, np4_rall_pymodule).
- hopstr: every rank: TypeError 'stft() received an invalid combination of arguments' (np4_rall_wrapper, np3_rall_plain).
- srmismatch: rank N prints 'ERROR rank N: sample rate mismatch ...' and exits 4; Root Cause exitcode 4 (np4_r1_plain, np3_r2_tee).
- sigbus: rank N killed at step 2: Root Cause 'exitcode -7 (SIGBUS)' (np4_r1_tee_trainer, np3_r2_loglevel).
- none: exit 0, rank 0 saves sep.pt (stft_none_np3_rnone_plain).
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--n-fft", type=int, default=256)
p.add_argument("--seg-len", type=int, default=2048)
p.add_argument("--sr", type=int, default=8000)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--save-name", default="sep.pt")
p.add_argument("--resume", default="")
p.add_argument("--work", default=os.environ.get("SEP_WORK", "/tmp/fault172_work"))
a = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
hit = a.fault != "none" and (a.rank == -1 or a.rank == rank)
torch.manual_seed(1234)
rng = np.random.default_rng(100 + rank)

cfg = {"n_fft": a.n_fft, "hop_length": a.n_fft // 4, "win_length": a.n_fft, "sample_rate": a.sr}
if a.fault == "hopstr" and hit:
    cfg = json.loads(json.dumps(cfg).replace('"hop_length": %d' % cfg["hop_length"], '"hop_length": "%d"' % cfg["hop_length"]))
window = torch.hann_window(cfg["n_fft"] // 2 if (a.fault == "winlen" and hit) else cfg["win_length"])
n_bins = cfg["n_fft"] // 2 + 1

# ---- data: synthesise, save, read back ----
mix_dir = os.path.join(a.work, "mixtures")
os.makedirs(mix_dir, exist_ok=True)
n_items = a.steps * a.batch
t = np.arange(a.seg_len) / a.sr
f1 = rng.uniform(200, 600, size=(n_items, 1))
f2 = rng.uniform(900, 1800, size=(n_items, 1))
s1 = 0.6 * np.sin(2 * np.pi * f1 * t)
s2 = 0.4 * np.sin(2 * np.pi * (f2 * t + 300 * t * t))
np.save(os.path.join(mix_dir, "mix_%02d.npy" % rank), np.stack([s1, s2], 1).astype(np.float32))
name = "mix_%03d.npy" % rank if (a.fault == "mixmissing" and hit) else "mix_%02d.npy" % rank
if a.fault == "srmismatch" and hit:
    print("ERROR rank %d: sample rate mismatch: %s recorded at 16000 Hz, model expects %d Hz" % (rank, os.path.join("mixtures", name), a.sr), file=sys.stderr, flush=True)
    sys.exit(4)
sources = torch.from_numpy(np.load(os.path.join(mix_dir, name)))
print("rank %d loaded %d mixtures of %d samples from %s" % (rank, sources.shape[0], sources.shape[2], name), flush=True)


class MaskNet(nn.Module):
    def __init__(self, bins, hidden=64):
        super().__init__()
        self.fc1 = nn.Linear(bins, hidden)
        self.fc2 = nn.Linear(hidden, 2 * bins)

    def forward(self, mag):  # mag: (B, F, T)
        h = torch.relu(self.fc1(torch.log1p(mag).transpose(1, 2)))
        m = torch.sigmoid(self.fc2(h)).transpose(1, 2)  # (B, 2F, T)
        return m.view(mag.shape[0], 2, -1, mag.shape[2])


def si_sdr(est, ref):
    ref_e = (ref * ref).sum(-1, keepdim=True)
    alpha = (est * ref).sum(-1, keepdim=True) / ref_e
    proj = alpha * ref
    noise = est - proj
    return 10 * torch.log10((proj * proj).sum(-1) / (noise * noise).sum(-1).clamp_min(1e-8))


model = MaskNet(n_bins)
if a.fault == "ckptbins" and hit:
    a.resume = os.path.join(a.work, "sep_nfft512.pt")
if a.resume:
    state = torch.load(a.resume, map_location="cpu")
    model.load_state_dict(state["model"])
    print("rank %d resumed from %s" % (rank, a.resume), flush=True)
net = DDP(model) if a.ddp else model
if not a.ddp:
    for prm in model.parameters():
        dist.broadcast(prm.data, 0)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)

for step in range(a.steps):
    ref = sources[step * a.batch:(step + 1) * a.batch].clone()
    if a.fault == "shortseg" and hit and step == 1:
        ref = ref[..., : a.seg_len // 16]
    if a.fault == "zerotgt" and hit and step == 2:
        ref[1, 1].zero_()
    if a.fault == "sigbus" and hit and step == 2:
        os.kill(os.getpid(), signal.SIGBUS)
    mix = ref.sum(1)
    spec = torch.stft(mix, n_fft=cfg["n_fft"], hop_length=cfg["hop_length"], win_length=cfg["win_length"],
                      window=window, center=True, return_complex=True)
    if step == 0:
        frames = torch.tensor([spec.shape[1], spec.shape[2]], dtype=torch.int64)
        if a.fault == "framegather" and hit:
            frames = torch.tensor([spec.shape[1], spec.shape[2], a.seg_len], dtype=torch.int64)
        got = [torch.zeros_like(frames) for _ in range(world)]
        dist.all_gather(got, frames)
        if rank == 0:
            print("frame counts per rank: %s" % [g.tolist() for g in got], flush=True)
    masks = net(spec.abs())
    est_spec = masks * spec.unsqueeze(1)
    length = a.seg_len - 1 if (a.fault == "istftlen" and hit) else ref.shape[-1]
    est = torch.istft(est_spec.reshape(-1, n_bins, spec.shape[-1]), n_fft=cfg["n_fft"], hop_length=cfg["hop_length"],
                      win_length=cfg["win_length"], window=window, center=True, length=length)
    est = est.view(ref.shape[0], 2, -1)
    sdr = si_sdr(est, ref)
    loss = -sdr.mean()
    if not torch.isfinite(loss):
        bad = (~torch.isfinite(sdr)).nonzero().tolist()
        raise FloatingPointError("non-finite SI-SDR at step %d on rank %d (items %s): loss=%s" % (step, rank, bad, loss.item()))
    opt.zero_grad()
    loss.backward()
    if not a.ddp:
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
    opt.step()
    if a.fault == "wavblock" and hit and step == 3:
        fifo = os.path.join(a.work, "sep_out_r%d.wav" % rank)
        if not os.path.exists(fifo):
            os.mkfifo(fifo)
        with open(fifo, "wb") as fh:  # blocks: nothing reads the pipe
            fh.write((est.detach().numpy() * 32767).astype(np.int16).tobytes())
    log = loss.detach().clone()
    dist.all_reduce(log)
    print("rank %d step %d loss %.4f (mean SI-SDR %.2f dB)" % (rank, step, loss.item(), -log.item() / world), flush=True)

if rank == 0:
    torch.save({"model": model.state_dict(), "cfg": cfg}, os.path.join(a.work, a.save_name))
    print("saved %s" % os.path.join(a.work, a.save_name), flush=True)
dist.barrier()
dist.destroy_process_group()
