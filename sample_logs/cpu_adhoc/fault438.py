"""A four-hundred-and-thirty-eighth hand-run batch: MUSIC GENRE TAGGING.

Synthetic clips: every clip is a 64-bin log-mel patch of 32 frames, a list of genre tags (multi-label, from a
10-entry tag table), an onset list and a gain.  Every rank reads its clips from
/tmp/fault438_work/clips/clips_R.pt, turns the tags into multi-hot targets, peak-normalises each batch and
trains a small conv tagger (Conv1d over frames, mean pooling, a linear head per tag) with BCE, wrapped in DDP
(gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model starts from ckpt/tagger_m64.pt.
Per-rank tag counts are all_gathered at start-up, the loss and a tag accuracy are all_reduced every step,
a clip count is all_reduced at the end and rank 0 saves export/tagger.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  unknowntag  - rank N's metadata carries the tag "vaporwave", missing from the tag table (KeyError, start-up)
  noonset     - rank N's clip 33 has an empty onset list; the tempo feature reads onsets[0] (IndexError, step 4)
  noclips     - rank N reads its clips from clips/holdout/ which does not exist (FileNotFoundError, start-up)
  ckptmels    - rank N initialises from ckpt/tagger_m96.pt, saved for 96 mel bins (size mismatch)
  ckptpickle  - rank N loads ckpt/tagger_full.pt, which pickles a TaggerConfig object (weights_only refusal)
  tagstats    - rank N all_gathers its tag counts plus an "untagged" count (11 vs 10 entries)
  beatscan    - rank N runs a pure-Python beat autocorrelation for --beat-budget s before the step-2 all_reduce
  silentclip  - rank N's clip 26 is digital silence; peak normalisation gives 0/0, the loss check at step 3
  sigsegv     - rank N sends itself SIGSEGV after step 1
  exit4       - rank N's end-of-run tag coverage check prints an ERROR line and calls sys.exit(4)
  melwidth    - every rank: clips resampled to 80 mel bins, the conv expects 64 (shape error, first step)
  none        - control, clean run

What happened (filled in after the runs):
  unknowntag  - KeyError: 'vaporwave' in multi_hot at start-up; peers Connection closed in the all_gather (np4 r2 ranklabel, np6 r0 tee)
  noonset     - steps 0-3, then IndexError 'list index out of range' in tempo_feature at step 4; peers closed (np3 r1 srunlabel, np8 r5 legacy)
  noclips     - FileNotFoundError for clips/holdout/clips_N.pt at start-up; peers closed (np4 r3 mpitag, np4 r1 pdsh2)
  ckptmels    - load_state_dict size mismatch for conv.weight [32,96,3] vs [32,64,3]; spawn SIGTERMs the rest (np3 r2 spawn);
                the others' files end in Connection closed inside DDP's param-shape check (np6 r4 files)
  ckptpickle  - 'Weights only load failed ... Unsupported global: GLOBAL __main__.TaggerConfig' on rank 0 (np4 r0 logfmt)
  tagstats    - the odd rank: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' (np3 r1 bashloop, np5 r3 mpitag --ddp 0)
  beatscan    - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv', rank 2's beat line only afterwards (np3 r2 srunlabel);
                300 s: silent after step 1, killed at 60 s, exit 124; its ranks outlived the loop and were killed by hand (np4 r1 bashloop)
  silentclip  - 'loss is nan (2048 non-finite input values ...)', FloatingPointError at step 3 (np5 r4 logfmt --ddp 0; np3 r0 ranklabel, loop exit 134 from a peer's abort)
  sigsegv     - silent after step 1; ProcessExitedException SIGSEGV (np4 r2 spawn); Root Cause rank 3 exitcode -11 (np6 r3 tee)
  exit4       - rank N's tag coverage ERROR line after step 5, exit 4; peers closed in the final all_reduce (np4 r1 pdsh2, np3 r2 files: loop exit 4)
  melwidth    - every rank 'expected input[8, 80, 32] to have 64 channels, but got 80 channels instead' in the first forward (np3 legacy)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/tagger.pt, exit 0 (np3 bashloop)
"""
import argparse
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

WORK = "/tmp/fault438_work"
TAGS = {"rock": 0, "jazz": 1, "hiphop": 2, "classical": 3, "electronic": 4, "folk": 5, "metal": 6,
        "reggae": 7, "blues": 8, "pop": 9}
NMEL = 64
NFRAME = 32
HID = 32
BATCH = 8
log = None


@dataclass
class TaggerConfig:
    n_mels: int = NMEL
    hidden: int = HID
    sample_rate: int = 22050


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("mgenre")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class Tagger(nn.Module):
    def __init__(self, n_mels=NMEL, hidden=HID, ntags=len(TAGS)):
        super().__init__()
        self.conv = nn.Conv1d(n_mels, hidden, 3, padding=1)
        self.conv2 = nn.Conv1d(hidden, hidden, 3, padding=1)
        self.head = nn.Linear(hidden + 1, ntags)

    def forward(self, mel, tempo):
        h = F.relu(self.conv2(F.relu(self.conv(mel))))
        return self.head(torch.cat([h.mean(2), tempo.unsqueeze(1)], 1))


def make_clips(n, seed, n_mels=NMEL):
    g = torch.Generator().manual_seed(seed)
    names = list(TAGS)
    mels = torch.rand(n, n_mels, NFRAME, generator=g) * 4.0 + 0.5
    tags, onsets = [], []
    for i in range(n):
        k = int(torch.randint(1, 4, (1,), generator=g))
        tags.append([names[int(j)] for j in torch.randperm(10, generator=g)[:k]])
        step = int(torch.randint(3, 9, (1,), generator=g))
        onsets.append(list(range(int(torch.randint(0, 3, (1,), generator=g)), NFRAME, step)))
    gain = torch.randn(n, generator=g) * 3.0
    return {"mels": mels, "tags": tags, "onsets": onsets, "gain_db": gain}


def prepare():
    os.makedirs(f"{WORK}/clips", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_clips(64, 400 + r), f"{WORK}/clips/clips_{r}.pt")
        torch.save(make_clips(64, 400 + r, n_mels=80), f"{WORK}/clips/clips80_{r}.pt")
    torch.manual_seed(0)
    torch.save(Tagger().state_dict(), f"{WORK}/ckpt/tagger_m64.pt")
    torch.save(Tagger(96).state_dict(), f"{WORK}/ckpt/tagger_m96.pt")
    torch.save({"model": Tagger().state_dict(), "config": TaggerConfig()}, f"{WORK}/ckpt/tagger_full.pt")
    print("prepared", WORK)


def multi_hot(tag_lists):
    y = torch.zeros(len(tag_lists), len(TAGS))
    for i, ts in enumerate(tag_lists):
        for t in ts:
            y[i, TAGS[t]] = 1.0
    return y


def tempo_feature(onsets, idx):
    # frames between the first two onsets, scaled; a clip with no onset has no tempo
    out = []
    for c in idx:
        o = onsets[c]
        first = o[0]
        second = o[1] if len(o) > 1 else first + NFRAME
        out.append((second - first) / 8.0)
    return torch.tensor(out)


def beat_autocorr(mels, budget):
    t0 = time.time()
    best = 0.0
    n = 0
    while time.time() - t0 < budget:
        env = [float(v) for v in mels[n % mels.shape[0]].sum(0)]
        for lag in range(1, len(env)):
            s = 0.0
            for t in range(len(env) - lag):
                s += env[t] * env[t + lag]
            best = max(best, s)
        n += 1
    return n, best


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(438 + rank)
    say(f"rank {rank}/{world} up, loading clips")
    sub = "holdout/" if bad and a.fault == "noclips" else ""
    name = "clips80" if bad and a.fault == "melwidth" else "clips"
    data = torch.load(f"{WORK}/clips/{sub}{name}_{rank}.pt")
    if bad and a.fault == "unknowntag":
        data["tags"][11].append("vaporwave")
    if bad and a.fault == "noonset":
        data["onsets"][33] = []
    if bad and a.fault == "silentclip":
        data["mels"][26].zero_()
    y = multi_hot(data["tags"])
    counts = y.sum(0)
    if bad and a.fault == "tagstats":
        counts = torch.cat([counts, torch.tensor([float((y.sum(1) == 0).sum())])])
    allc = [torch.zeros(len(TAGS)) for _ in range(world)]
    dist.all_gather(allc, counts)
    glob = torch.stack(allc).sum(0)
    say(f"rank {rank} clips {y.shape[0]} tags {int(counts.sum())} global tags {int(glob.sum())} "
        f"rarest {list(TAGS)[int(glob.argmin())]}")
    model = Tagger()
    ck = {"ckptmels": "tagger_m96.pt", "ckptpickle": "tagger_full.pt"}.get(a.fault if bad else "", "tagger_m64.pt")
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state["model"] if "model" in state else state)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    mels = data["mels"]
    for step in range(a.steps):
        idx = list(range(step * BATCH, (step + 1) * BATCH))
        x = mels[idx]
        x = x / x.amax(dim=(1, 2), keepdim=True)
        tempo = tempo_feature(data["onsets"], idx)
        logits = net(x, tempo)
        loss = F.binary_cross_entropy_with_logits(logits, y[idx])
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nbad} non-finite input values after "
                f"peak normalisation)", err=True)
            raise FloatingPointError(f"non-finite BCE loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "beatscan" and step == 2:
            n, best = beat_autocorr(mels, a.beat_budget)
            say(f"rank {rank} beat autocorrelation: {n} clips, peak {best:.1f}")
        acc = ((logits.detach() > 0).float() == y[idx]).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} tag_acc {stats[1].item():.3f}")
        if bad and a.fault == "sigsegv" and step == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"ERROR rank {rank}: tag coverage check failed: 'reggae', 'blues' seen in under 2% of clips; "
            f"refusing to export a tagger with dead heads", err=True)
        sys.exit(4)
    seen = torch.tensor([float(a.steps * BATCH)])
    dist.all_reduce(seen)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/tagger.pt")
        say(f"rank 0 done: {a.steps} steps, {int(seen.item())} clips seen, saved export/tagger.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
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
    p.add_argument("--beat-budget", type=int, default=25)
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
