"""A four-hundred-and-thirty-second hand-run batch: BIRD SONG DETECTION IN FIELD RECORDINGS.

Synthetic field recordings from autonomous recorders: every rank reads its own shard of 96 clips
(/tmp/fault432_work/clips/clips_R.pt: a 32x32 power spectrogram per clip, the species heard, the recorder
id).  The species name is looked up in an 8-entry species table, the spectrogram is log-compressed and
standardised per clip, and a small CNN (two convs, a pool, a species head) is trained with Lightning:
a LightningModule under Trainer(strategy=DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout)),
or with --fabric 1 a lightning.fabric.Fabric loop of my own.  The model starts from ckpt/songnet_init.pt
(loaded through lightning's cloud_io._load, weights_only=True); per-rank species call counts are
all_gathered at the start, loss and accuracy are reduced every step and printed as
`rank R step S loss L acc A`, and rank 0 saves export/songnet.ckpt at the end (trainer.save_checkpoint /
fabric.save).

Faults (--fault NAME --rank R, -1 = every rank):
  species    - rank R's shard names a species "Turdus torquatus" missing from the species table (KeyError, step 2)
  noclips    - rank R reads its clips from clips/dawn/ which does not exist (FileNotFoundError, start-up)
  ckptwide   - rank R starts from ckpt/songnet_wide.pt, saved with 12 conv channels (size mismatch, start-up)
  ckptpickle - rank R starts from ckpt/songnet_meta.pt, which pickles a RecorderMeta object (weights_only refusal)
  callgather - rank R all_gathers its call counts per species plus a noise row (2-D instead of 1-D)
  slowdenoise- rank R runs a slow pure-Python spectral denoiser before the step-3 reduce (12 s PG timeout)
  stuckmic   - rank R waits for a recorder lock that is never released at step 2 (hang; --pg-timeout 300)
  nanclip    - rank R's clip 50 holds an infinite power bin: its standardised log-mel is NaN; the program's check
               raises FloatingPointError at step 4
  sigsegv    - rank R sends itself SIGSEGV in on_train_end (Fabric: after the last step), before the save
  exit3      - rank R prints its own error line about a recorder sample rate and calls sys.exit(3) at train start
  melbins    - every rank: spectrograms built with 40 mel bins, the head expects 32 (shape error, first step)
  none       - control, clean run

What happened (filled in after the runs):
  species    - KeyError: 'Turdus torquatus' in the dataset at step 2; peers Connection closed by peer (np4 r1 pltorchrun, np5 r0 plbashloop)
  noclips    - FileNotFoundError for clips/dawn/clips_R.pt in setup; peers closed in the post_setup barrier (np3 r2 plown, np6 r3 pltee)
  ckptwide   - load_state_dict size mismatch [12,1,3,3] vs [8,1,3,3] at start-up (np4 r0 plloglevel, np3 r1 plfabric)
  ckptpickle - UnpicklingError: Weights only load failed, Unsupported global __main__.RecorderMeta (np5 r2 pltorchrun)
  callgather - no traceback from rank R; a peer aborts on gloo::EnforceNotMet 'Received data size doesn't match expected size' (np4 r3 plbashloop exit 134, np3 r1 plfabric Root Cause rank 2 SIGABRT)
  slowdenoise- peers 'Timed out waiting 12000ms for recv/send operation'; Root Cause names a victim (np3 r1 pltee, np4 r2 plfabric)
  stuckmic   - silent after step 1; timeout SIGTERM then SIGKILL at 60 s, exit 137 (np4 r1 plloglevel)
  nanclip    - FloatingPointError: 1024 non-finite log-mel values at step 4 (np3 r0 pltorchrun); np5 plown never started: DistStoreError 1/5 clients joined (relabelled rendezvous)
  sigsegv    - after step 6, silent under plown (peers Connection reset in save_checkpoint's barrier, exit 1; np4 r2); Root Cause SIGSEGV -11 under Fabric (np3 r1)
  exit3      - rank R's sample-rate ERROR line and exit 3 (np6 r4 plbashloop exit 3, np3 r0 plloglevel Root Cause exitcode 3)
  melbins    - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x320 and 256x8)' (np3 pltee; first try ran clean: pooling bug, fixed)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/songnet.ckpt, exit 0 (np3 plbashloop)
"""
import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault432_work"
SPECIES = ["Turdus merula", "Erithacus rubecula", "Fringilla coelebs", "Parus major",
           "Sylvia atricapilla", "Phylloscopus collybita", "Troglodytes troglodytes", "Cyanistes caeruleus"]
SPIDX = {s: i for i, s in enumerate(SPECIES)}
NMEL = 32
NCLIP = 96


@dataclass
class RecorderMeta:
    site: str
    sample_rate: int
    gain_db: float


def say(msg):
    print(msg, flush=True)


class SongNet(nn.Module):
    def __init__(self, ch=8, nmel=NMEL, nspec=len(SPECIES)):
        super().__init__()
        self.conv1 = nn.Conv2d(1, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d((1, None))
        self.head = nn.Linear(ch * nmel, nspec)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        h = self.pool(h).flatten(1)  # pool over time (dim 2), keep the mel bins
        return self.head(h)


def make_shard(rank, seed, nmel=NMEL):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SPECIES), (NCLIP,), generator=g)
    spec = torch.rand(NCLIP, 1, 32, nmel, generator=g) * 0.2
    for i, y in enumerate(labels.tolist()):
        spec[i, 0, 8:24, 2 + 3 * y:5 + 3 * y] += 3.0  # a song band per species
    return {"spec": spec, "species": [SPECIES[y] for y in labels.tolist()],
            "recorder": [f"AR-{rank:02d}-{i % 4}" for i in range(NCLIP)]}


def prepare():
    os.makedirs(f"{WORK}/clips", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(r, 100 + r), f"{WORK}/clips/clips_{r}.pt")
        torch.save(make_shard(r, 100 + r, nmel=40), f"{WORK}/clips/clips40_{r}.pt")
    torch.manual_seed(0)
    torch.save(SongNet().state_dict(), f"{WORK}/ckpt/songnet_init.pt")
    torch.save(SongNet(ch=12).state_dict(), f"{WORK}/ckpt/songnet_wide.pt")
    torch.save({"state_dict": SongNet().state_dict(), "meta": RecorderMeta("Bialowieza-N3", 32000, 6.0)},
               f"{WORK}/ckpt/songnet_meta.pt")
    say(f"prepared clips and checkpoints under {WORK}")


class ClipSet(Dataset):
    def __init__(self, rank, args):
        self.rank, self.args = rank, args
        faulty = is_faulty(args, rank)
        if faulty and args.fault == "noclips":
            path = f"{WORK}/clips/dawn/clips_{rank}.pt"
        elif args.fault == "melbins" and faulty:
            path = f"{WORK}/clips/clips40_{rank}.pt"
        else:
            path = f"{WORK}/clips/clips_{rank}.pt"
        d = torch.load(path, weights_only=True)
        self.spec, self.species, self.recorder = d["spec"], list(d["species"]), d["recorder"]
        if faulty and args.fault == "species":
            self.species[21] = "Turdus torquatus"
        if faulty and args.fault == "nanclip":
            self.spec[50, 0, 12, 7] = float("inf")

    def __len__(self):
        return len(self.species)

    def __getitem__(self, i):
        x = torch.log1p(self.spec[i])
        x = (x - x.mean()) / x.std()
        y = SPIDX[self.species[i]]
        return x, y

    def call_counts(self):
        c = torch.zeros(len(SPECIES))
        for s in self.species:
            if s in SPIDX:
                c[SPIDX[s]] += 1
        return c


def is_faulty(args, rank):
    return args.fault != "none" and (args.rank == -1 or args.rank == rank)


def load_init(rank, args):
    from lightning.fabric.utilities.cloud_io import _load as pl_load
    name = "songnet_init.pt"
    if is_faulty(args, rank) and args.fault == "ckptwide":
        name = "songnet_wide.pt"
    if is_faulty(args, rank) and args.fault == "ckptpickle":
        name = "songnet_meta.pt"
    sd = pl_load(f"{WORK}/ckpt/{name}", map_location="cpu", weights_only=True)
    return sd["state_dict"] if "state_dict" in sd else sd


def gather_payload(rank, args, ds):
    counts = ds.call_counts()
    if is_faulty(args, rank) and args.fault == "callgather":
        noise = torch.full((len(SPECIES),), 3.0)
        counts = torch.stack([counts, noise])  # calls and a noise row: 2-D on this rank only
    return counts


def step_faults(rank, args, step):
    if not is_faulty(args, rank):
        return
    if args.fault == "slowdenoise" and step == 3:
        say(f"rank {rank}: running spectral-subtraction denoiser on recorder AR-{rank:02d} (python reference)")
        t0, acc = time.time(), 0.0
        while time.time() - t0 < 40:
            for k in range(20000):
                acc += (k % 7) * 0.5
    if args.fault == "stuckmic" and step == 2:
        say(f"rank {rank}: waiting for recorder lock {WORK}/locks/AR-{rank:02d}.lock")
        while not os.path.exists(f"{WORK}/locks/AR-{rank:02d}.released"):
            time.sleep(1.0)


def check_finite(rank, x, step):
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise FloatingPointError(f"rank {rank}: {bad} non-finite log-mel values in batch at step {step} "
                                 f"(a clip with an infinite power bin?)")


def exit3(rank, args):
    if is_faulty(args, rank) and args.fault == "exit3":
        say(f"ERROR rank {rank}: recorder AR-{rank:02d} reports sample rate 22050 Hz, the model needs 32000 Hz; "
            f"refusing to train on resampled clips")
        sys.exit(3)


def sigsegv(rank, args):
    if is_faulty(args, rank) and args.fault == "sigsegv":
        say(f"rank {rank}: flushing recorder buffers")
        os.kill(os.getpid(), signal.SIGSEGV)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class SongModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = SongNet()
            self.ds = None

        def setup(self, stage):
            self.ds = ClipSet(self.global_rank, args)
            self.net.load_state_dict(load_init(self.global_rank, args))

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=16, shuffle=False, num_workers=0)

        def on_fit_start(self):
            allc = self.all_gather(gather_payload(self.global_rank, args, self.ds))
            if self.global_rank == 0:
                say(f"call counts per rank: {allc.sum(-1).tolist()}")

        def on_train_start(self):
            exit3(self.global_rank, args)

        def training_step(self, batch, idx):
            x, y = batch
            step = self.global_step + 1
            check_finite(self.global_rank, x, step)
            logits = self.net(x)
            loss = F.cross_entropy(logits, y)
            acc = (logits.argmax(1) == y).float().mean()
            step_faults(self.global_rank, args, step)
            rl = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
            ra = self.trainer.strategy.reduce(acc, reduce_op="mean")
            say(f"rank {self.global_rank} step {step} loss {rl.item():.4f} acc {ra.item():.3f}")
            return loss

        def on_train_end(self):
            sigsegv(self.global_rank, args)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    model = SongModule()
    trainer.fit(model)
    trainer.save_checkpoint(f"{WORK}/export/songnet.ckpt")
    if trainer.global_rank == 0:
        say(f"rank 0 saved {WORK}/export/songnet.ckpt")


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=DDPStrategy(
        process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    ds = ClipSet(rank, args)
    net = SongNet()
    net.load_state_dict(load_init(rank, args))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=16, shuffle=False), use_distributed_sampler=False)
    allc = fabric.all_gather(gather_payload(rank, args, ds))
    if rank == 0:
        say(f"call counts per rank: {allc.sum(-1).tolist()}")
    exit3(rank, args)
    step = 0
    for x, y in loader:
        step += 1
        if step > args.steps:
            break
        check_finite(rank, x, step)
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(1) == y).float().mean()
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        step_faults(rank, args, step)
        rl = fabric.all_reduce(loss.detach(), reduce_op="mean")
        ra = fabric.all_reduce(acc, reduce_op="mean")
        say(f"rank {rank} step {step} loss {rl.item():.4f} acc {ra.item():.3f}")
    sigsegv(rank, args)
    fabric.save(f"{WORK}/export/songnet_fabric.ckpt", {"model": net, "step": step})
    if rank == 0:
        say(f"rank 0 saved {WORK}/export/songnet_fabric.ckpt")


def main():
    p = argparse.ArgumentParser(description="bird song detection in field recordings")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "2")))
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.prepare:
        prepare()
        return
    torch.manual_seed(1234)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
