"""A four-hundred-and-forty-ninth hand-run batch: BEEHIVE HEALTH FROM ACOUSTIC SENSORS.

Synthetic hive recordings: every clip is a 32-band mel spectrogram over 20 frames from a microphone inside
a hive, tagged with its hive id (looked up in hives.json, which maps each hive to one of 8 apiaries) and a
colony state (healthy, queenless, swarming, varroa).  Every rank reads its clips from
/tmp/fault449_work/data/hive_R.pt, normalises each clip by its RMS, and trains BeeNet (a Conv1d over the
mel bands, a mean over time, an apiary embedding, a linear head) with cross-entropy, wrapped in DDP (gloo)
or with gradients all_reduced by hand (--ddp 0).  The model starts from ckpt/beenet_m32.pt.  The loss and
accuracy are all_reduced every step, per-rank counts of clips per colony state are all_gathered at the
end, and rank 0 saves export/beenet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress through logging).

Faults:
  hivekey    - rank N's clips include hive "H99", missing from hives.json (KeyError at start-up)
  nowav      - rank N reads data/hive_R_v2.pt, which was never written (FileNotFoundError at start-up)
  ckptsize   - rank N initialises from ckpt/beenet_m48.pt, saved with 48 mel bands (size mismatch)
  ckptpickle - rank N initialises from ckpt/beenet_full.pt, a pickled training state with a HiveMeta
               object; torch.load's weights_only unpickler refuses it
  bandindex  - at step 3 rank N picks the queen-piping band as index 32 of 32 bands (IndexError)
  gatherlen  - at the end rank N all_gathers 5 state counts (an extra "unknown") instead of 4
  slowfft    - before the step-2 all_reduce rank N runs a pure-Python DFT over every clip (tens of seconds)
  hang       - at step 2 rank N waits for a queen-piping flag file that never appears (run with --pg-timeout 300)
  nanhum     - at step 2 rank N gets a silent clip: RMS 0, normalised features NaN, the program's check raises
  sigkill    - rank N sends itself SIGKILL after step 3
  exit5      - at step 4 rank N prints its own error line about a dead microphone and calls sys.exit(5)
  melwidth   - every rank: the front end emits 40 mel bands, the Conv1d expects 32 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  hivekey    - rank N at start-up: "KeyError: 'H99'"; the agent SIGTERMs the rest (np4 r1 tee); np8 r5 restart: attempt 1 the
               same KeyError, attempt 2 dies earlier, in init_process_group (gloo connectFullMesh refused on ranks 2, 6)
  nowav      - rank 0 FileNotFoundError for data/hive_0_v2.pt at start-up; ranks 1-5 SIGTERMed (np6 r0 tee_trainer)
  ckptsize   - rank 2 'size mismatch for conv.weight ... [24, 48, 3] ... [24, 32, 3]', only in the redirect files (np3 redirects)
  ckptpickle - rank N 'UnpicklingError: Weights only load failed ... GLOBAL __main__.HiveMeta' (np4 r3 pymodule); np6 r2
               restart: attempt 2 fails in gloo connectFullMesh on three ranks before the load, Root Cause rank 0
  bandindex  - rank 3 'IndexError: index 32 is out of bounds for dimension 1 with size 32' at step 3; peers closed (pdsh2)
  gatherlen  - after step 6 rank 0 'allgather: invalid tensor size at index 0 (expected (5), got (4))' (np3 loglevel)
  slowfft    - rank N silent in its DFT; peers 'Timed out waiting 12000ms' in step 2; Root Cause names a peer (np4 r2, np3 r0)
  hang       - rank 1 waits for the flag; nothing after step 1 until timeout's SIGTERM at 60 s, exit 124 (np3 tee)
  nanhum     - rank 1 'FloatingPointError: ... loss is nan (640 non-finite ...)'; rank 0 monitoredBarrier error (DETAIL)
  sigkill    - rank N -9 after step 3, peers connection reset/closed (np6 r4 prefix, np3 r1 filter)
  exit5      - rank N's ERROR line, exitcode 5, peers SIGTERMed or closed (np4 r2 filter, np3 r0 loglevel)
  melwidth   - all three 'expected input[16, 40, 20] to have 32 channels, but got 40'; train.sh stops with 1 (wrapper)
  none       - 6 steps, export/beenet.pt saved, exit 0 (np3 plain)
"""
import argparse
import json
import logging
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

WORK = "/tmp/fault449_work"
STATES = ["healthy", "queenless", "swarming", "varroa"]
N_MELS = 32
N_FRAMES = 20
N_APIARIES = 8

log = logging.getLogger("beehive")


def out(msg):
    if ARGS.logfmt:
        log.info(msg)
    else:
        print(msg, flush=True)


class HiveMeta:
    """Metadata pickled into the full training state (not a tensor)."""

    def __init__(self, site, season):
        self.site = site
        self.season = season


class BeeNet(nn.Module):
    def __init__(self, n_mels=N_MELS, hidden=24, emb=4):
        super().__init__()
        self.conv = nn.Conv1d(n_mels, hidden, kernel_size=3, padding=1)
        self.apiary = nn.Embedding(N_APIARIES, emb)
        self.head = nn.Linear(hidden + emb, len(STATES))

    def forward(self, spec, apiary):
        h = F.relu(self.conv(spec)).mean(dim=2)
        return self.head(torch.cat([h, self.apiary(apiary)], dim=1))


def prepare(world=8):
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(449)
    hives = {f"H{i:02d}": i % N_APIARIES for i in range(24)}
    with open(f"{WORK}/hives.json", "w") as f:
        json.dump(hives, f, indent=1)
    for r in range(world):
        n = 96
        label = torch.randint(0, len(STATES), (n,), generator=g)
        spec = torch.rand(n, N_MELS, N_FRAMES, generator=g) * 0.5
        # swarming colonies hum louder in the low bands, queenless ones "roar" higher up
        spec[label == 2, :8] += 0.6
        spec[label == 1, 20:28] += 0.4
        hive = [f"H{int(i):02d}" for i in torch.randint(0, 24, (n,), generator=g)]
        torch.save({"spec": spec, "label": label, "hive": hive}, f"{WORK}/data/hive_{r}.pt")
    torch.manual_seed(0)
    torch.save(BeeNet().state_dict(), f"{WORK}/ckpt/beenet_m32.pt")
    torch.save(BeeNet(n_mels=48).state_dict(), f"{WORK}/ckpt/beenet_m48.pt")
    torch.save({"model": BeeNet().state_dict(), "meta": HiveMeta("north-meadow", "spring"), "epoch": 3},
               f"{WORK}/ckpt/beenet_full.pt")
    print(f"prepared {world} shards, 3 checkpoints and hives.json under {WORK}")


def faulty(rank, name):
    return ARGS.fault == name and (ARGS.rank == -1 or ARGS.rank == rank)


def load_clips(rank):
    path = f"{WORK}/data/hive_{rank}.pt"
    if faulty(rank, "nowav"):
        path = f"{WORK}/data/hive_{rank}_v2.pt"
    blob = torch.load(path)
    with open(f"{WORK}/hives.json") as f:
        hives = json.load(f)
    ids = list(blob["hive"])
    if faulty(rank, "hivekey"):
        ids[17] = "H99"
    apiary = torch.tensor([hives[h] for h in ids])
    spec = blob["spec"]
    if ARGS.fault == "melwidth":
        # the new front end: 40 mel bands (resampled by interpolation)
        spec = F.interpolate(spec.transpose(1, 2), size=40, mode="linear").transpose(1, 2)
    return spec, apiary, blob["label"]


def normalise(spec):
    rms = spec.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
    return spec / rms


def python_dft(spec):
    # reference spectral flatness, one bin at a time, in pure Python
    total = 0.0
    for clip in spec.tolist():
        for band in clip:
            band = band + [0.0] * (5 * len(band))  # zero-padded to 6x for finer bins
            n = len(band)
            for k in range(n):
                re = sum(band[t] * math.cos(2 * math.pi * k * t / n) for t in range(n))
                total += re * re
    return total


def load_init(model, rank):
    path = f"{WORK}/ckpt/beenet_m32.pt"
    if faulty(rank, "ckptsize"):
        path = f"{WORK}/ckpt/beenet_m48.pt"
    if faulty(rank, "ckptpickle"):
        state = torch.load(f"{WORK}/ckpt/beenet_full.pt")["model"]
    else:
        state = torch.load(path)
    model.load_state_dict(state)


def train(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=ARGS.pg_timeout))
    torch.manual_seed(1234 + rank)
    spec, apiary, label = load_clips(rank)
    model = BeeNet()
    load_init(model, rank)
    net = nn.parallel.DistributedDataParallel(model) if ARGS.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    out(f"rank {rank} clips {len(label)} hives {len(set(apiary.tolist()))} apiaries, world {world}")
    bs = 16
    for step in range(1, ARGS.steps + 1):
        lo = ((step - 1) * bs) % len(label)
        x, a, y = spec[lo:lo + bs], apiary[lo:lo + bs], label[lo:lo + bs]
        if faulty(rank, "nanhum") and step == 2:
            x = x.clone()
            x[3] = 0.0  # a silent clip: the microphone's preamp was off
        x = normalise(x)
        if faulty(rank, "bandindex") and step == 3:
            piping = x[:, N_MELS]  # queen piping band, off by one
            x = x + piping.mean()
        if faulty(rank, "hang") and step == 2:
            flag = f"{WORK}/queen_piping_{rank}.flag"
            out(f"rank {rank} waiting for piping detector flag {flag}")
            while not os.path.exists(flag):
                time.sleep(0.5)
        logits = net(x, a)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            bad = int((~torch.isfinite(x)).sum())
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} "
                                     f"({bad} non-finite spectrogram values after RMS normalisation)")
        opt.zero_grad()
        loss.backward()
        if not ARGS.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        if faulty(rank, "slowfft") and step == 2:
            out(f"rank {rank} computing reference spectral flatness")
            python_dft(spec)
        stats = torch.tensor([loss.item(), acc.item()])
        dist.all_reduce(stats)
        stats /= world
        out(f"rank {rank} step {step} loss {stats[0]:.4f} acc {stats[1]:.3f}")
        if faulty(rank, "sigkill") and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty(rank, "exit5") and step == 4:
            print(f"ERROR rank {rank}: microphone M{rank}-2 in hive H{rank:02d} reports a flat spectrum "
                  f"(0.000 dB over 32 bands); the sensor is dead, aborting", flush=True)
            sys.exit(5)
    counts = torch.bincount(label, minlength=len(STATES)).float()
    if faulty(rank, "gatherlen"):
        counts = torch.cat([counts, torch.zeros(1)])  # an "unknown" state column
    gathered = [torch.zeros(len(STATES)) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        total = torch.stack(gathered).sum(0)
        out("clips per state: " + ", ".join(f"{s}={int(c)}" for s, c in zip(STATES, total)))
        torch.save(model.state_dict(), f"{WORK}/export/beenet.pt")
        out(f"rank 0 saved {WORK}/export/beenet.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_main(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    setup_logging(rank)
    train(rank, world)


def setup_logging(rank):
    if ARGS.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s %(levelname)s [rank{rank}] %(name)s: %(message)s")


def main():
    global ARGS
    p = argparse.ArgumentParser(description="beehive health from acoustic sensors")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    ARGS = p.parse_args()
    if ARGS.prepare:
        prepare()
        return
    if ARGS.spawn:
        torch.multiprocessing.spawn(spawn_main, args=(ARGS.spawn, ARGS.port), nprocs=ARGS.spawn)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup_logging(rank)
    train(rank, world)


ARGS = None
if __name__ == "__main__":
    main()
