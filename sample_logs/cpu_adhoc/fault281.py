"""A two-hundred-and-eighty-first hand-run batch: CHORD RECOGNITION WITH A CRNN.

Synthetic songs: per-frame chord labels (24 major/minor chords plus "no chord" = 25 classes) drawn from a
key-dependent progression, 12 chroma bins plus an 84-bin CQT-like spectrum per frame (chord templates plus
noise), standardised per bin; a conv1d front end, a bidirectional GRU, a frame-wise linear softmax over the
chord classes, DDP (gloo), the frame accuracy all_reduced every step, the per-rank class histograms
all_gathered at step 3, destroy_process_group. --prep 1 writes the feature archive and GRU checkpoints.

Faults:
- chordidx: from step 1 rank N maps "no chord" to class 25 instead of 24 (IndexError in the loss).
- zerovar: rank N's song has a silent (constant) chroma bin; standardising divides by a zero std (NaN check).
- histgather: rank N all_gathers its class histogram without the "no chord" bin (another length) at step 3.
- noarchive: rank N looks for its features in features_v2/, which does not exist (FileNotFoundError).
- keysig: rank N's song metadata names the key "H" (German B), not in the transposition table (KeyError).
- cqtbins: every rank extracts 72 CQT bins while the conv front end expects 84 (shape error in step 0).
- gruckpt: with --resume 1 rank N loads ckpt/gru_2layers.pt into the one-layer GRU (unexpected keys).
- viterbi: rank N Viterbi-decodes every training song in Python at step 2 for --stall seconds (others wait).
- sigabrt: rank N sends itself SIGABRT after step 2's optimizer step.
- hopsize: rank N reads a hop size of 500 from its shard config; the framing raises ValueError at startup.
- none: control.

What happened (filled in after the runs):
- chordidx: IndexError: Target 25 is out of bounds. on rank N at step 1; peers Connection closed by peer (chrt_chordidx_np3_r1_bashloop, _np4_r2_mpitag).
- zerovar: FloatingPointError 'non-finite standardised features on rank N (songs [1])' at startup (chrt_zerovar_np3_r2_ranklabel, _np4_r1_logfmt).
- histgather: rank N aborts on gloo::EnforceNotMet '50 vs 48. Received data size doesn't match expected size' at step 3, exit 134 (chrt_histgather_np3_r1_srunlabel, _np4_r2_mpitag).
- noarchive: FileNotFoundError for /tmp/job_work/features_v2/chroma_cqt.pt on rank N at startup (chrt_noarchive_np3_r1_files, _np4_r3_spawn).
- keysig: KeyError: 'H' on rank N at startup (chrt_keysig_np4_r2_pdsh2: worker-1 Root Cause rank 2; chrt_keysig_np3_r0_spawn).
- cqtbins: every rank: 'weight of size [32, 96, 3], expected input[4, 84, 64] to have 96 channels, but got 84' in step 0 (chrt_cqtbins_np3_rall_tee, _np4_rall_files).
- gruckpt: Unexpected key(s) "weight_ih_l1", ... in loading state_dict for GRU on rank N (chrt_gruckpt_np3_r2_logfmt, _np4_r1_tee).
- viterbi: PG 12 s: peers 'Timed out waiting 12000ms' (chrt_viterbi_np3_r1_mpitag); PG 300 s: killed at 60 s, exit 124 (_np3_r2_bashloop).
- sigabrt: rank N dies by SIGABRT after step 2, no traceback; peers Connection reset/closed (chrt_sigabrt_np3_r0_legacy: Root Cause -6; _np3_r2_ranklabel: exit 134).
- hopsize: ValueError: hop_length 500 must be a positive divisor of the window length 2048 on rank N (chrt_hopsize_np3_r1_spawn, _np4_r3_legacy).
- none: exit 0, 'rank 0 done: 5 steps, frame accuracy 0.328' (chrt_none_np3_rnone_srunlabel).
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

KEYS = {"C": 0, "C#": 1, "D": 2, "Eb": 3, "E": 4, "F": 5, "F#": 6, "G": 7, "Ab": 8, "A": 9, "Bb": 10, "B": 11}
SONG_KEYS = ["C", "G", "D", "A", "E", "F", "Bb", "Eb"]
NCLS = 25
NOCHORD = 24
CQT = 84
WORK = os.environ.get("CHORD_WORK", "/tmp/fault281_work")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hop", type=int, default=512)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", dest="pg_timeout", type=float, default=12.0)
    p.add_argument("--resume", type=int, default=0)
    p.add_argument("--prep", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    return p.parse_args()


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def make_log(a, rank):
    if not a.logfmt:
        return None
    lg = logging.getLogger("chords")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    return lg


class CRNN(nn.Module):
    def __init__(self, layers=1):
        super().__init__()
        self.front = nn.Sequential(nn.Conv1d(12 + CQT, 32, 3, padding=1), nn.ReLU(), nn.Conv1d(32, 32, 3, padding=1))
        self.gru = nn.GRU(32, 24, num_layers=layers, bidirectional=True, batch_first=True)
        self.head = nn.Linear(48, NCLS)

    def forward(self, x):  # x: (B, 12+CQT, T)
        h = F.relu(self.front(x)).transpose(1, 2)
        h, _ = self.gru(h)
        return self.head(h)  # (B, T, NCLS)


def frames_for(hop, samples=32768, win=2048):
    if hop <= 0 or win % hop != 0:
        raise ValueError(f"hop_length {hop} must be a positive divisor of the window length {win}")
    return (samples - win) // hop + 1


def song(g, key, frames, cqt_bins, quiet_bin=None):
    root = KEYS[key]
    prog = [root, (root + 5) % 12, (root + 7) % 12, 12 + (root + 9) % 12]
    labels = torch.tensor([prog[(t // 16) % 4] if (t % 16) < 14 else NOCHORD for t in range(frames)])
    chroma = torch.rand(frames, 12, generator=g) * 0.3
    for t, c in enumerate(labels.tolist()):
        if c != NOCHORD:
            r = c % 12
            third = 3 if c >= 12 else 4
            for iv in (0, third, 7):
                chroma[t, (r + iv) % 12] += 1.0
    cqt = chroma.repeat(1, cqt_bins // 12 + 1)[:, :cqt_bins] + 0.2 * torch.randn(frames, cqt_bins, generator=g)
    if quiet_bin is not None:
        chroma[:, quiet_bin] = 0.0
    return torch.cat([chroma, cqt], 1), labels


def standardise(x):
    mu = x.mean(0, keepdim=True)
    sd = x.std(0, keepdim=True)
    return (x - mu) / sd


def prep():
    os.makedirs(f"{WORK}/features_v1", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    torch.manual_seed(0)
    torch.save({"keys": SONG_KEYS, "seed": 1234}, f"{WORK}/features_v1/chroma_cqt.pt")
    torch.save(CRNN(1).gru.state_dict(), f"{WORK}/ckpt/gru_1layer.pt")
    torch.save(CRNN(2).gru.state_dict(), f"{WORK}/ckpt/gru_2layers.pt")
    print("prepared", WORK)


def train(rank, world, a):
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    lg = make_log(a, rank)

    def say(msg):
        if lg:
            lg.info(msg)
        else:
            print(msg, flush=True)

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.pg_timeout))
    say(f"rank {rank}/{world}: process group up (gloo, timeout {a.pg_timeout:.0f}s)")
    hop = 500 if (bad and a.fault == "hopsize") else a.hop
    n_frames = frames_for(hop)
    say(f"rank {rank}: hop {hop}, {n_frames} frames per excerpt, training on {a.frames}-frame windows")
    sub = "features_v2" if (bad and a.fault == "noarchive") else "features_v1"
    meta = torch.load(f"{WORK}/{sub}/chroma_cqt.pt")
    keys = list(meta["keys"])
    if bad and a.fault == "keysig":
        keys[rank % len(keys)] = "H"
    cqt_bins = 72 if (bad and a.fault == "cqtbins") else CQT
    g = torch.Generator().manual_seed(meta["seed"] + rank)
    xs, ys = [], []
    for i in range(a.batch * 2):
        qb = 5 if (bad and a.fault == "zerovar" and i == 1) else None
        x, y = song(g, keys[(rank + i) % len(keys)], a.frames, cqt_bins, qb)
        xs.append(standardise(x))
        ys.append(y)
    x_all, y_all = torch.stack(xs), torch.stack(ys)
    if not torch.isfinite(x_all).all():
        bad_songs = [i for i in range(len(xs)) if not torch.isfinite(xs[i]).all()]
        raise FloatingPointError(f"non-finite standardised features on rank {rank} (songs {bad_songs})")
    torch.manual_seed(0)
    model = CRNN(1)
    if a.resume:
        path = "ckpt/gru_2layers.pt" if (bad and a.fault == "gruckpt") else "ckpt/gru_1layer.pt"
        say(f"rank {rank}: resuming GRU from {path}")
        model.gru.load_state_dict(torch.load(f"{WORK}/{path}"))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    for step in range(a.steps):
        idx = torch.arange(a.batch) + (step % 2) * a.batch
        x, y = x_all[idx].transpose(1, 2).contiguous(), y_all[idx].clone()
        if bad and a.fault == "chordidx" and step >= 1:
            y[y == NOCHORD] = NOCHORD + 1
        if bad and a.fault == "viterbi" and step == 2:
            say(f"rank {rank}: Viterbi-decoding {len(xs)} training songs for label smoothing")
            t0 = time.time()
            while time.time() - t0 < a.stall:
                time.sleep(0.5)
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, NCLS), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bad and a.fault == "sigabrt" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        acc = (logits.argmax(-1) == y).float().mean().detach()
        dist.all_reduce(acc)
        acc /= world
        say(f"rank {rank} step {step} loss {loss.item():.4f} frame_acc {acc.item():.3f}")
        if step == 3:
            nb = NCLS - 1 if (bad and a.fault == "histgather") else NCLS
            hist = torch.bincount(y_all.reshape(-1).clamp(max=nb - 1), minlength=nb).float()
            out = [torch.zeros(nb) for _ in range(world)]
            dist.all_gather(out, hist)
            if rank == 0:
                say(f"rank 0: class histogram gathered, no-chord share {sum(o[NOCHORD] for o in out) / sum(o.sum() for o in out):.3f}")
    if rank == 0:
        say(f"rank 0 done: {a.steps} steps, frame accuracy {acc.item():.3f}")
    dist.destroy_process_group()


def spawned(local, world, a):
    train(local, world, a)


def main():
    a = parse()
    if a.prep:
        prep()
        return
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        mp.spawn(spawned, args=(a.spawn, a), nprocs=a.spawn)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.logfmt:
        try:
            train(rank, world, a)
        except Exception as e:
            logging.getLogger("chords").error("training failed: %s: %s", type(e).__name__, e)
            raise
    else:
        train(rank, world, a)


if __name__ == "__main__":
    main()
