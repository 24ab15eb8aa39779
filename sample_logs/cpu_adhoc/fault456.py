"""A four-hundred-and-fifty-sixth hand-run batch: BIRD SONG SYLLABLE CLASSIFICATION (Lightning).

Synthetic song recordings: every rank reads its clips from /tmp/fault456_work/songs/songs_R.pt (a log-mel
patch of 32 bins x 20 frames per syllable, the syllable's name looked up in an 8-entry syllable table, and
a list of frame indices where the syllable's energy peaks).  A small 1-D conv net over the mel bins (two
conv layers, mean pooling over time, a linear head) is trained with cross entropy by a LightningModule under
Trainer(strategy=DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout)).  The net is initialised
from ckpt/syllnet.pt in setup(); each step the accuracy is reduced with the strategy's reduce() and the
per-class counts are all_gathered with self.all_gather() before the progress line is printed; rank 0 saves
export/syllnet.pt at the end.  --fabric 1 runs the same model in a hand-written loop under
lightning.fabric.Fabric (fabric.all_reduce / fabric.all_gather / fabric.save).

Faults (--fault NAME --rank R, R = -1: every rank):
  syllable   - rank R's clips name a syllable "zeep" missing from the syllable table (KeyError, first batch)
  peakidx    - rank R's clip 33 lists a peak at frame 24 of a 20-frame patch (IndexError, step 4's batch)
  nosongs    - rank R reads songs/val/songs_R.pt, which does not exist (FileNotFoundError in setup)
  ckptclass  - rank R initialises from ckpt/syllnet_c12.pt, saved with 12 syllable classes (size mismatch)
  ckptmeta   - rank R loads ckpt/syllnet_meta.pt, which pickles a SongMeta object (weights_only refusal)
  countgather- rank R all_gathers 9 per-class counts (an extra "noise" bin) instead of 8 at step 3
  slowpitch  - rank R traces pitch contours in pure Python for ~40 s before step 2's reduce (PG timeout;
               with --pg-timeout 300 it traces for 900 s: a hang)
  anomaly    - rank R takes sqrt of negative log-mel energies at step 3; detect_anomaly finds NaN in backward
  sigsegv    - rank R sends itself SIGSEGV after step 2 (on_train_batch_end)
  exit4      - rank R prints its own error line about clipped recordings at the end of training, sys.exit(4)
  melwidth   - every rank: the patches have 40 mel bins, the first conv expects 32 (shape error, first step)
  none       - control, clean run

What happened (filled in after the runs):
  syllable   - KeyError: 'zeep' in SongSet.__getitem__ on the first batch; peers Connection closed by peer (np4 r2
               pltorchrun, Root Cause rank 2; np3 r0 plown)
  peakidx    - IndexError 'index 24 is out of bounds for dimension 0 with size 20' fetching step 4's batch; peers
               Connection closed (np5 r4 plbashloop, exit 1; np4 r0 pltorchrun, Root Cause rank 0)
  nosongs    - FileNotFoundError for songs/val/songs_R.pt in setup / after fabric.launch; peers Connection closed
               (np3 r0 plown; np4 r3 plfabric, Root Cause rank 3)
  ckptclass  - load_state_dict size mismatch for head.weight [12, 24] vs [8, 24] and head.bias (np5 r3 pltee,
               Root Cause rank 3; np3 r1 plown)
  ckptmeta   - UnpicklingError 'Weights only load failed' ... 'Unsupported global: GLOBAL __main__.SongMeta'
               (np3 r0 plfabric, Root Cause rank 0; np4 r2 plown)
  countgather- a receiving rank aborts: gloo::EnforceNotMet 'op.preamble.length <= op.nbytes. 18 vs 16', SIGABRT;
               the faulty rank sees Connection reset (np3 r1 plloglevel, Root Cause rank 2 -6; np5 r0 pltorchrun,
               Root Cause rank 1 -6)
  slowpitch  - 12 s: 'Timed out waiting 12000ms for recv/send operation to complete' on ranks 0 and 1, rank 2
               then Connection closed (np3 r2 pltorchrun); 300 s: silent after 'rank 1 tracing pitch contours',
               killed at 60 s, exit 124 (np4 r1 plbashloop; its ranks outlived the timeout, killed by hand after)
  anomaly    - Fabric: 'Function 'LogSoftmaxBackward0' returned nan values in its 0th output.' on rank 1; peers
               Connection closed (np4 r1 plfabric)
  sigsegv    - no traceback after 'rank R step 2 done'; bash 'Segmentation fault', exit 139 (np3 r1 plbashloop);
               Root Cause rank 0 exitcode -11 SIGSEGV (np4 r0 plloglevel)
  exit4      - the ERROR line about clipped recordings and exit 4 at the end; others clean, Root Cause rank 2
               exitcode 4 (np4 r2 pltee); Fabric: peers Connection closed in the final barrier (np3 r1 plfabric)
  melwidth   - every rank: 'expected input[8, 40, 20] to have 32 channels, but got 40 channels instead'
               (np3 plloglevel; np6 pltee, Root Cause rank 1)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/syllnet.pt, exit 0 (np3 plbashloop; the ranks took
               ~40 s to exit)
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault456_work"
SYLL = {"chip": 0, "trill": 1, "buzz": 2, "whistle": 3, "chirp": 4, "rattle": 5, "seet": 6, "warble": 7}
NMEL = 32
NFRAME = 20
NCLS = 8


class SongMeta:
    """Recording metadata saved next to the weights in one old checkpoint."""

    def __init__(self, site, sr):
        self.site = site
        self.sr = sr


def say(msg):
    print(msg, flush=True)


class SyllNet(nn.Module):
    def __init__(self, nmel=NMEL, ncls=NCLS):
        super().__init__()
        self.c1 = nn.Conv1d(nmel, 24, 3, padding=1)
        self.c2 = nn.Conv1d(24, 24, 3, padding=1)
        self.head = nn.Linear(24, ncls)

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = F.relu(self.c2(h))
        return self.head(h.mean(dim=2))


def make_songs(n, seed, nmel=NMEL, bad_syll=False, bad_peak=False):
    g = torch.Generator().manual_seed(seed)
    names = list(SYLL)
    lab = torch.randint(0, NCLS, (n,), generator=g)
    feats = torch.randn(n, nmel, NFRAME, generator=g) * 0.5
    for i in range(n):
        feats[i, int(lab[i]) * 3:(int(lab[i]) * 3) + 4, :] += 2.0
    syl = [names[int(c)] for c in lab]
    peaks = [sorted(int(p) for p in torch.randint(0, NFRAME, (3,), generator=g)) for _ in range(n)]
    if bad_syll:
        syl[2] = "zeep"
    if bad_peak:
        peaks[33] = [3, 11, 24]
    return {"mel": feats, "syllable": syl, "peaks": peaks}


def prepare():
    os.makedirs(f"{WORK}/songs", exist_ok=True)
    os.makedirs(f"{WORK}/songs/wide", exist_ok=True)
    os.makedirs(f"{WORK}/songs/bad", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        torch.save(make_songs(64, 100 + r), f"{WORK}/songs/songs_{r}.pt")
        torch.save(make_songs(64, 100 + r, nmel=40), f"{WORK}/songs/wide/songs_{r}.pt")
        torch.save(make_songs(64, 100 + r, bad_syll=True), f"{WORK}/songs/bad/syll_{r}.pt")
        torch.save(make_songs(64, 100 + r, bad_peak=True), f"{WORK}/songs/bad/peak_{r}.pt")
    torch.manual_seed(0)
    torch.save({"state_dict": SyllNet().state_dict(), "classes": list(SYLL)}, f"{WORK}/ckpt/syllnet.pt")
    torch.save({"state_dict": SyllNet(ncls=12).state_dict(), "classes": list(SYLL) + ["a", "b", "c", "d"]},
               f"{WORK}/ckpt/syllnet_c12.pt")
    torch.save({"state_dict": SyllNet().state_dict(), "meta": SongMeta("marsh-3", 22050)},
               f"{WORK}/ckpt/syllnet_meta.pt")
    say(f"prepared songs and checkpoints under {WORK}")


class SongSet(Dataset):
    def __init__(self, blob):
        self.mel = blob["mel"]
        self.syl = blob["syllable"]
        self.peaks = blob["peaks"]

    def __len__(self):
        return len(self.syl)

    def __getitem__(self, i):
        x = self.mel[i]
        # emphasise the peak frames (indexing fails if a peak lies outside the patch)
        pk = torch.tensor(self.peaks[i])
        boost = torch.zeros(NFRAME)
        boost[pk] = 0.5
        return x + boost, SYLL[self.syl[i]]


def song_path(args, rank):
    if args.fault == "nosongs" and hit(args, rank):
        return f"{WORK}/songs/val/songs_{rank}.pt"
    if args.fault == "melwidth":
        return f"{WORK}/songs/wide/songs_{rank}.pt"
    if args.fault == "syllable" and hit(args, rank):
        return f"{WORK}/songs/bad/syll_{rank}.pt"
    if args.fault == "peakidx" and hit(args, rank):
        return f"{WORK}/songs/bad/peak_{rank}.pt"
    return f"{WORK}/songs/songs_{rank}.pt"


def hit(args, rank):
    return args.rank == -1 or args.rank == rank


def load_init(args, rank, net):
    path = f"{WORK}/ckpt/syllnet.pt"
    if args.fault == "ckptclass" and hit(args, rank):
        path = f"{WORK}/ckpt/syllnet_c12.pt"
    if args.fault == "ckptmeta" and hit(args, rank):
        path = f"{WORK}/ckpt/syllnet_meta.pt"
    say(f"rank {rank} init from {path}")
    ck = torch.load(path, map_location="cpu", weights_only=True)
    net.load_state_dict(ck["state_dict"])


def trace_pitch(rank, budget):
    say(f"rank {rank} tracing pitch contours for every clip")
    t0, acc = time.time(), 0.0
    while time.time() - t0 < budget:
        for f in range(2000):
            acc += (f * 0.37) % 1.3
    say(f"rank {rank} pitch contours done ({acc:.0f})")


def maybe_mangle(args, rank, step, x):
    if args.fault == "slowpitch" and hit(args, rank) and step == 2:
        trace_pitch(rank, 40 if args.pg_timeout < 40 else 900)
    if args.fault == "anomaly" and hit(args, rank) and step == 3:
        x = torch.sqrt(x - 1.0)  # log-mel energies below 1 give NaN
    return x


def class_counts(args, rank, step, y):
    n = NCLS + 1 if (args.fault == "countgather" and hit(args, rank) and step == 3) else NCLS
    return torch.bincount(y, minlength=n).float()


def end_check(args, rank):
    if args.fault == "exit4" and hit(args, rank):
        say(f"ERROR rank {rank}: 7 of 64 recordings are clipped at 0 dBFS; refusing to export syllnet")
        sys.exit(4)


def signal_check(args, rank, step):
    if args.fault == "sigsegv" and hit(args, rank) and step == 2:
        say(f"rank {rank} step {step} done")
        os.kill(os.getpid(), signal.SIGSEGV)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class SongModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = SyllNet()

        def setup(self, stage):
            r = self.global_rank
            self.songs = torch.load(song_path(args, r), weights_only=True)
            say(f"rank {r} loaded {len(self.songs['syllable'])} clips")
            load_init(args, r, self.net)

        def train_dataloader(self):
            return DataLoader(SongSet(self.songs), batch_size=8, shuffle=False)

        def training_step(self, batch, idx):
            r, s = self.global_rank, self.global_step
            x, y = batch
            x = maybe_mangle(args, r, s, x)
            loss = F.cross_entropy(self.net(x), y)
            acc = (self.net(x).argmax(1) == y).float().mean()
            acc = self.trainer.strategy.reduce(acc.detach(), reduce_op="mean")
            counts = self.all_gather(class_counts(args, r, s, y))
            say(f"rank {r} step {s} loss {loss.item():.4f} acc {acc.item():.3f} seen {int(counts.sum())}")
            return loss

        def on_train_batch_end(self, outputs, batch, idx):
            signal_check(args, self.global_rank, self.global_step - 1)

        def on_train_end(self):
            end_check(args, self.global_rank)
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), f"{WORK}/export/syllnet.pt")
                say(f"rank 0 saved {WORK}/export/syllnet.pt after {self.global_step} steps")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=1, max_steps=args.steps,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0, detect_anomaly=(args.fault == "anomaly"),
    )
    mod = SongModule()
    trainer.fit(mod)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    r = fabric.global_rank
    if args.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    songs = torch.load(song_path(args, r), weights_only=True)
    say(f"rank {r} loaded {len(songs['syllable'])} clips")
    net = SyllNet()
    load_init(args, r, net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    dl = fabric.setup_dataloaders(DataLoader(SongSet(songs), batch_size=8, shuffle=False),
                                  use_distributed_sampler=False)
    s = 0
    for x, y in dl:
        if s >= args.steps:
            break
        x = maybe_mangle(args, r, s, x)
        out = net(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        acc = fabric.all_reduce((out.argmax(1) == y).float().mean().detach(), reduce_op="mean")
        counts = fabric.all_gather(class_counts(args, r, s, y))
        say(f"rank {r} step {s} loss {loss.item():.4f} acc {acc.item():.3f} seen {int(counts.sum())}")
        s += 1
        signal_check(args, r, s - 1)
    end_check(args, r)
    fabric.barrier()
    if r == 0:
        fabric.save(f"{WORK}/export/syllnet_fabric.ckpt", {"model": net})
        say(f"rank 0 saved {WORK}/export/syllnet_fabric.ckpt after {s} steps")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(0)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
