"""A four-hundred-and-twenty-first hand-run batch: AUDIO-VISUAL SPEAKER DIARISATION.

Synthetic meeting clips: every clip has 40-bin log-mel audio frames, up to four face tracks (64-wide face
embeddings per frame, looked up in a per-rank bank of 32 face crops by track index) and a reference RTTM-like
list of speaker turns (start frame, end frame, speaker name).  Names are mapped to track slots through the
speaker table spk_table.json; frames with no turn are "silence" (class 0).  Every rank reads its clips from
/tmp/fault421_work/clips/clips_R.pt and its face bank from video/faces_R.pt, and trains an audio-visual
active-speaker model (an audio encoder, a face encoder, audio-face agreement scores per track plus a silence
logit, a 5-way frame classifier) with cross entropy, wrapped in DDP (gloo) or with hand all_reduced gradients
(--ddp 0).  The model starts from ckpt/avsd_k4.pt.  Per-rank frame counts are all_gathered at the start, the
loss and the diarisation error rate (DER, frame error here) are all_reduced every step, the per-rank
speaker-turn histograms are all_gathered at the end, and rank 0 saves export/avsd.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  speakerid     - rank N's reference turns name "spk_guest_07", missing from the speaker table (KeyError, start-up)
  facetrack     - rank N's clip points a face track at crop 32 of a 32-crop bank (IndexError, first step)
  novideo       - rank N reads its face bank from video_hd/, which does not exist (FileNotFoundError, start-up)
  ckptspk       - rank N initialises from ckpt/avsd_k6.pt, saved for six tracks (size mismatch, start-up)
  ckptpickle    - rank N initialises from ckpt/avsd_cfg.pt, which pickles a DiarConfig object (weights_only refusal)
  overlapgather - rank N's end-of-run turn histogram has an extra "overlap" bin (6 vs 5 entries in all_gather)
  vadslow       - rank N re-smooths its voice-activity track in pure Python before the step-3 all_reduce
  nanfusion     - rank N's clip at step 3 has a zero-energy stretch: log(0) = -inf, NaN loss, the program's check
  sigsegv       - rank N sends itself SIGSEGV after step 3
  exit4         - rank N prints its own error about an audio/video offset and calls sys.exit(4) at step 1
  fusedim       - every rank: face features are 72 wide (8 landmark values appended), the encoder expects 64
  none          - control, clean run

What happened (filled in after the runs):
  speakerid     - rank N: KeyError: 'spk_guest_07' in frame_labels at start-up; peers Connection closed by peer in all_gather (np4 r2 bashloop; np3 r0 tee, Root Cause rank 0)
  facetrack     - rank N: 'IndexError: index 32 is out of bounds for dimension 0 with size 32' at step 0 (np3 r1 spawn, ProcessRaisedException; np4 r3 ranklabel --ddp 0)
  novideo       - rank N: FileNotFoundError for video_hd/faces_N.pt at start-up; peers closed in all_gather (np4 r1 mpitag; np3 r2 files)
  ckptspk       - rank N: size mismatch for spk_head.weight [7, 7] vs [5, 5] (np4 r1 pdsh2, worker-1's agent loses the store; np3 r0 legacy)
  ckptpickle    - rank N: UnpicklingError 'Weights only load failed' (__main__.DiarConfig not allowed) (np5 r3 srunlabel; np3 r1 logfmt)
  overlapgather - rank N: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (5))' after step 5 (np6 r4 bashloop --ddp 0: ranks 0-2 never exited, timeout exit 124; np3 r0 mpitag, exit 1)
  vadslow       - 12 s: rank 1 'Timed out waiting 12000ms for recv', rank 0 then closed, slow rank 2 closed last; ranks slow to exit, timeout exit 124 (np3 r2 ranklabel); 300 s: silent after step 2, killed at 60 s, exit 124 (np4 r1 srunlabel)
  nanfusion     - rank N's check: 'non-finite loss nan (56 of 192 frames ...)', FloatingPointError at step 3 (np4 r1 logfmt; np8 r6 bashloop); an np8 r5 files run was killed at 100 s before step 0 finished (machine loaded) and dropped
  sigsegv       - rank N dies after step 3: ProcessExitedException 'process 2 terminated with signal SIGSEGV' (np4 r2 spawn); Root Cause rank 1 exitcode -11, rank 2 SIGABRT (np3 r1 legacy)
  exit4         - rank 1's ERROR line about a 2.40 s audio/video offset, exit 4; Root Cause rank 1 exitcode 4 (np5 r1 tee)
  fusedim       - every rank: 'mat1 and mat2 shapes cannot be multiplied (768x72 and 64x32)' in the first forward; Root Cause rank 0 (np6 legacy)
  none          - clean: 6 steps on 3 ranks, rank 0 saved export/avsd.pt, exit 0 (np3 logfmt)
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault421_work"
NMEL = 40
FACE = 64
TRACKS = 4
NCLS = TRACKS + 1
FRAMES = 48
NCROP = 32
log = None


@dataclass
class DiarConfig:
    tracks: int = 4
    frame_ms: int = 40
    collar: float = 0.25


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("avsd")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base.addHandler(h)
    base.setLevel(logging.INFO)
    log = RankAdapter(base, {"rank": rank})


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class AVDiariser(nn.Module):
    def __init__(self, tracks=TRACKS, face=FACE, dim=32):
        super().__init__()
        self.audio = nn.Sequential(nn.Conv1d(NMEL, dim, 3, padding=1), nn.ReLU(), nn.Conv1d(dim, dim, 3, padding=1))
        self.face = nn.Sequential(nn.Linear(face, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.silence = nn.Linear(dim, 1)
        self.spk_head = nn.Linear(tracks + 1, tracks + 1)

    def forward(self, mel, faces):
        a = self.audio(mel.transpose(1, 2)).transpose(1, 2)            # B T D
        v = self.face(faces)                                           # B T K D
        agree = (a.unsqueeze(2) * v).sum(-1) / a.shape[-1] ** 0.5       # B T K
        logits = torch.cat([self.silence(a), agree], dim=-1)          # B T K+1
        return self.spk_head(logits)


def make_clips(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = [f"spk_{i:02d}" for i in range(8)]
    clips = []
    for _ in range(n):
        people = [names[int(i)] for i in torch.randperm(8, generator=g)[:TRACKS]]
        crops = torch.randint(0, NCROP, (TRACKS,), generator=g).tolist()
        turns, t = [], 0
        while t < FRAMES - 4:
            d = int(torch.randint(3, 10, (1,), generator=g))
            who = int(torch.randint(0, TRACKS + 1, (1,), generator=g))
            if who < TRACKS:
                turns.append((t, min(t + d, FRAMES), people[who]))
            t += d
        energy = torch.rand(FRAMES, NMEL, generator=g) + 0.05
        for s, e, _ in turns:
            energy[s:e] += 1.0
        clips.append({"people": people, "crops": crops, "turns": turns, "energy": energy, "offset": 0.04})
    return clips


def prepare():
    for d in ("clips", "video", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_clips(16, 300 + r), f"{WORK}/clips/clips_{r}.pt")
        torch.save(torch.randn(NCROP, FACE, generator=torch.Generator().manual_seed(900 + r)),
                   f"{WORK}/video/faces_{r}.pt")
    with open(f"{WORK}/spk_table.json", "w") as f:
        json.dump({f"spk_{i:02d}": i for i in range(8)}, f)
    torch.manual_seed(0)
    sd = AVDiariser().state_dict()
    torch.save(sd, f"{WORK}/ckpt/avsd_k4.pt")
    torch.save(AVDiariser(tracks=6).state_dict(), f"{WORK}/ckpt/avsd_k6.pt")
    torch.save({"model": sd, "config": DiarConfig()}, f"{WORK}/ckpt/avsd_cfg.pt")
    print("prepared", WORK)


def frame_labels(clip, table):
    slot = {name: k for k, name in enumerate(clip["people"])}
    y = torch.zeros(FRAMES, dtype=torch.long)
    for s, e, name in clip["turns"]:
        table[name]                      # every reference speaker must be enrolled
        y[s:e] = slot[name] + 1
    return y


def vad_smooth(y, rounds):
    act = [int(v > 0) for v in y.tolist()]
    for _ in range(rounds):
        act = [1 if sum(act[max(0, i - 2):i + 3]) >= 3 else 0 for i in range(len(act))]
    return act


def build_batch(clips, idx, bank, a, bad, step):
    mels, faces = [], []
    for c in (clips[i % len(clips)] for i in idx):
        crops = list(c["crops"])
        if bad and a.fault == "facetrack" and step == 0:
            crops[2] = NCROP
        energy = c["energy"].clone()
        if bad and a.fault == "nanfusion" and step == 3:
            energy[10:20] = 0.0
        mels.append(torch.log(energy))
        f = bank[torch.tensor(crops)].unsqueeze(0).expand(FRAMES, -1, -1)
        f = f + 0.1 * torch.randn_like(f)
        if a.fault == "fusedim":
            f = torch.cat([f, torch.rand(FRAMES, TRACKS, 8)], dim=-1)
        faces.append(f)
    return torch.stack(mels), torch.stack(faces)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading clips and face bank")
    clips = torch.load(f"{WORK}/clips/clips_{rank}.pt")
    vdir = "video_hd" if bad and a.fault == "novideo" else "video"
    bank = torch.load(f"{WORK}/{vdir}/faces_{rank}.pt")
    with open(f"{WORK}/spk_table.json") as f:
        table = json.load(f)
    if bad and a.fault == "speakerid":
        s, e, _ = clips[4]["turns"][1]
        clips[4]["turns"][1] = (s, e, "spk_guest_07")
    labels = [frame_labels(c, table) for c in clips]
    nframes = torch.tensor([float(len(clips) * FRAMES)])
    allf = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allf, nframes)
    say(f"rank {rank} clips {len(clips)} frames {int(nframes)} global {int(sum(t.item() for t in allf))}")
    model = AVDiariser()
    if bad and a.fault == "ckptspk":
        ck = "avsd_k6.pt"
    elif bad and a.fault == "ckptpickle":
        ck = "avsd_cfg.pt"
    else:
        ck = "avsd_k4.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state["model"] if "model" in state else state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        idx = [(step * 4 + j) for j in range(4)]
        mel, faces = build_batch(clips, idx, bank, a, bad, step)
        y = torch.stack([labels[i % len(clips)] for i in idx])
        logits = net(mel, faces)
        loss = F.cross_entropy(logits.reshape(-1, NCLS), y.reshape(-1))
        if not torch.isfinite(loss):
            bad_frames = int((~torch.isfinite(logits)).any(-1).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({bad_frames} of {y.numel()} frames "
                f"with non-finite logits)", err=True)
            raise FloatingPointError(f"non-finite diarisation loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR clip {idx[2]} audio/video offset 2.40 s exceeds the 0.50 s tolerance, "
                f"refusing to diarise unsynchronised clips", err=True)
            sys.exit(4)
        if bad and a.fault == "vadslow" and step == 3:
            t0, rounds = time.time(), 0
            while time.time() - t0 < a.vad_budget:
                vad_smooth(y.reshape(-1), 50)
                rounds += 50
            say(f"rank {rank} VAD re-smoothing: {rounds} rounds")
        der = (logits.detach().argmax(-1) != y).float().mean()
        stats = torch.stack([loss.detach(), der])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} der {stats[1].item():.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    hist = torch.bincount(torch.cat(labels), minlength=NCLS).float()
    if bad and a.fault == "overlapgather":
        hist = torch.cat([hist, torch.tensor([float(len(clips) * 3)])])
    allh = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} turn histogram {hist.tolist()} global silence {int(sum(h[0] for h in allh))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/avsd.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/avsd.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"diarisation training failed: {type(e).__name__}: {e}", err=True)
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
    p.add_argument("--vad-budget", type=int, default=45)
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
