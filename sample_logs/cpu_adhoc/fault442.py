"""A four-hundred-and-forty-second hand-run batch: TREMOR EVENT DETECTION IN SEISMOGRAMS (Lightning).

Synthetic three-component seismogram windows (Z, N, E; 256 samples at 50 Hz) from an 8-station network:
tectonic tremor bursts (a band-limited envelope-modulated wiggle) against ambient noise.  Every rank reads
its windows from /tmp/fault442_work/waves/wave_R.pt, normalises each window by its peak amplitude, looks the
station code up in the station table (a learned station embedding), and trains a small 1-D CNN picker
(two Conv1d layers, global pooling, station embedding, a linear head) on a BCE loss with lightning.pytorch's
Trainer and DDPStrategy (gloo, timeout from --pg-timeout).  The picker is initialised from
ckpt/picker_k5.pt.  Each step the loss and per-station pick counts are gathered with LightningModule.all_gather
and rank 0 saves export/picker.pt at the end.  --fabric 1 runs the same model with lightning.fabric.Fabric and
an own loop.  Options: --devices W, --pg-timeout, --steps, --prepare, --fault, --rank.

Faults:
  station     - rank N reads the 2024 catalogue (waves/2024/wave_N.pt) whose late windows come from a new
                station "XKAB", missing from the station table (KeyError in the dataset, step 5)
  nowave      - rank N reads its windows from waves/test/ which does not exist (FileNotFoundError in setup)
  ckptsize    - rank N initialises from ckpt/picker_k7.pt, saved with kernel size 7 (size mismatch)
  weightsonly - rank N loads ckpt/picker_meta.pt, which pickles a StationMeta object (weights_only refusal)
  pickshape   - rank N all_gathers its pick counts as an [8, 2] table (per station, P and S) instead of [8]
                (Lightning's gather exchanges shapes first: 2 vs 1 entries)
  stalta      - rank N recomputes an STA/LTA trigger over its windows in pure Python before step 2's gather
  hang        - rank N waits for a catalogue lock file that is never written, before step 3
  deadchan    - rank N has a dead channel (all zeros): peak 0, normalised windows NaN, the program's check
  sigkill     - rank N sends itself SIGKILL after step 2
  sigsegv     - rank N sends itself SIGSEGV after step 4
  exit5       - after the last step rank N's catalogue check prints an ERROR line and calls sys.exit(5)
  hydrophone  - every rank: windows carry a fourth (hydrophone) channel, the first conv expects 3 (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  station     - KeyError: 'XKAB' in the dataset's __getitem__ via Lightning's fetcher at step 5; peers Connection closed in all_gather (np4 r2 bashloop, np5 r0 fabric: Root Cause rank 0)
  nowave      - FileNotFoundError for waves/test/wave_N.pt in the setup hook; peers Connection closed in barrier("post_setup") (np3 r1 tee, np4 r3 own launcher)
  ckptsize    - load_state_dict size mismatch for conv1/conv2.weight [16,3,7] vs [16,3,5]; peers closed in DDP's param-shape check (np4 r1 fabric) or the post_setup barrier (np6 r5 bashloop)
  weightsonly - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.StationMeta'; peers closed in the post_setup barrier (np3 r2 loglevel, np5 r4 torchrun)
  pickshape   - Lightning's all_gather does not exchange shapes here: a receiving rank aborts on gloo::EnforceNotMet 'Received data size doesn't match expected size' (SIGABRT); Root Cause names that receiver (np3 r1 torchrun -> rank 2, np4 r0 fabric -> rank 1)
  stalta      - 12 s PG timeout: peers 'Timed out waiting 12000ms for recv/send'; the slow rank then Connection closed (np3 r2 bashloop) or, SIGTERMed by torchrun inside stalta_python, fails in Lightning's SIGTERM broadcast (np4 r0 tee, Root Cause rank 1)
  hang        - silent after step 2; at 60 s torchrun 'Received 15 death signal', Lightning 'Received SIGTERM', then Killed, exit 137 (np4 r1 torchrun, PG timeout 300)
  deadchan    - the program's check: 2048 non-finite values, FloatingPointError at step 1 (np6 r3 tee, Root Cause rank 3; np3 r0 fabric, peers terminate -> SIGABRT, Root Cause names rank 1)
  sigkill     - no traceback from rank N after step 2; Root Cause exitcode -9 SIGKILL (np4 r2 loglevel, np3 r1 tee)
  sigsegv     - after step 4: own launcher shows only the survivors' Connection reset/closed, exit 1 (np5 r3); torchrun Root Cause exitcode -11 SIGSEGV (np3 r2 loglevel)
  exit5       - rank N's catalogue ERROR line and exit 5 after step 6: loop exit 5, rank 0 still saved (np3 r1 bashloop); peers closed in fabric.barrier, Root Cause exitcode 5 (np4 r2 fabric)
  hydrophone  - every rank: 'expected input[8, 4, 256] to have 3 channels, but got 4 channels instead' in the first forward (np3 own launcher, np4 loglevel)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/picker.pt, exit 0 (np3 torchrun)
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

import lightning.pytorch as pl
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy as PLDDPStrategy
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

WORK = "/tmp/fault442_work"
STATIONS = {"PB01": 0, "PB02": 1, "PB03": 2, "B004": 3, "B005": 4, "KHBB": 5, "TWKB": 6, "LZB": 7}
NSAMP = 256
NCHAN = 3
BATCH = 8
NWIN = 64


@dataclass
class StationMeta:
    network: str
    codes: list


def synth_windows(gen, n, nchan=NCHAN, extra_station=None):
    t = torch.arange(NSAMP) / 50.0
    y = (torch.rand(n, generator=gen) < 0.5).float()
    x = 0.3 * torch.randn(n, nchan, NSAMP, generator=gen)
    for i in range(n):
        if y[i] > 0:
            f = 2.0 + 3.0 * torch.rand(1, generator=gen).item()
            env = torch.exp(-((t - 2.5) ** 2) / 0.8)
            x[i] += env * torch.sin(2 * torch.pi * f * t)
    codes = list(STATIONS)
    st = [codes[i % len(codes)] for i in range(n)]
    if extra_station is not None:
        for i in range(36, n):
            st[i] = extra_station
    return {"x": x, "y": y, "station": st}


def prepare():
    gen = torch.Generator().manual_seed(442)
    for sub in ("waves", "waves/2024", "ckpt", "export", "deadchan"):
        os.makedirs(os.path.join(WORK, sub), exist_ok=True)
    for r in range(8):
        torch.save(synth_windows(gen, NWIN), f"{WORK}/waves/wave_{r}.pt")
        torch.save(synth_windows(gen, NWIN, extra_station="XKAB"), f"{WORK}/waves/2024/wave_{r}.pt")
        torch.save(synth_windows(gen, NWIN, nchan=4), f"{WORK}/waves/hydro_{r}.pt")
        d = synth_windows(gen, NWIN)
        d["x"][:, 2, :] = 0.0  # E channel dead
        torch.save(d, f"{WORK}/deadchan/wave_{r}.pt")
    torch.manual_seed(0)
    torch.save({"state_dict": Picker(kernel=5).state_dict()}, f"{WORK}/ckpt/picker_k5.pt")
    torch.save({"state_dict": Picker(kernel=7).state_dict()}, f"{WORK}/ckpt/picker_k7.pt")
    torch.save({"state_dict": Picker(kernel=5).state_dict(),
                "meta": StationMeta("PB", list(STATIONS))}, f"{WORK}/ckpt/picker_meta.pt")
    print(f"prepared {WORK}")


class Picker(nn.Module):
    def __init__(self, kernel=5, nchan=NCHAN):
        super().__init__()
        self.conv1 = nn.Conv1d(nchan, 16, kernel, padding=kernel // 2)
        self.conv2 = nn.Conv1d(16, 16, kernel, padding=kernel // 2, stride=2)
        self.sta = nn.Embedding(len(STATIONS), 4)
        self.head = nn.Linear(20, 1)

    def forward(self, x, st):
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h)).mean(-1)
        return self.head(torch.cat([h, self.sta(st)], -1)).squeeze(-1)


class WaveSet(Dataset):
    def __init__(self, path):
        d = torch.load(path)
        x = d["x"]
        peak = x.abs().amax(-1, keepdim=True)
        self.x = x / peak
        self.y = d["y"]
        self.station = d["station"]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], STATIONS[self.station[i]], self.y[i]


def faulty(args, rank):
    return args.fault != "none" and (args.rank == -1 or args.rank == rank)


def wave_path(args, rank):
    if faulty(args, rank) and args.fault == "station":
        return f"{WORK}/waves/2024/wave_{rank}.pt"
    if faulty(args, rank) and args.fault == "nowave":
        return f"{WORK}/waves/test/wave_{rank}.pt"
    if faulty(args, rank) and args.fault == "deadchan":
        return f"{WORK}/deadchan/wave_{rank}.pt"
    if args.fault == "hydrophone":
        return f"{WORK}/waves/hydro_{rank}.pt"
    return f"{WORK}/waves/wave_{rank}.pt"


def init_weights(args, rank, net):
    path = f"{WORK}/ckpt/picker_k5.pt"
    if faulty(args, rank) and args.fault == "ckptsize":
        path = f"{WORK}/ckpt/picker_k7.pt"
    if faulty(args, rank) and args.fault == "weightsonly":
        path = f"{WORK}/ckpt/picker_meta.pt"
    sd = torch.load(path, map_location="cpu")["state_dict"]
    net.load_state_dict(sd)


def check_finite(args, rank, x, step):
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        print(f"rank {rank}: {bad} non-finite sample values after peak normalisation (dead channel?)", flush=True)
        raise FloatingPointError(f"non-finite picker input at step {step} on rank {rank}")


def stalta_python(x):
    # deliberately slow: classic STA/LTA in plain Python over every window and channel
    trig = 0
    t0 = time.time()
    while time.time() - t0 < 40:
        for w in x.tolist():
            for ch in w:
                for j in range(50, len(ch)):
                    sta = sum(abs(v) for v in ch[j - 5:j]) / 5
                    lta = sum(abs(v) for v in ch[j - 50:j]) / 50 + 1e-9
                    trig += sta / lta > 3.0
                if time.time() - t0 > 40:
                    break
    return trig


def pre_gather_fault(args, rank, step, x):
    if faulty(args, rank) and args.fault == "stalta" and step == 2:
        n = stalta_python(x)
        print(f"rank {rank} stalta triggers {n}", flush=True)
    if faulty(args, rank) and args.fault == "hang" and step == 3:
        lock = f"{WORK}/catalogue.lock"
        while not os.path.exists(lock):
            time.sleep(0.5)


def pick_counts(args, rank, logits, st):
    picks = (logits > 0).float()
    counts = torch.zeros(len(STATIONS)).index_add_(0, st, picks)
    if faulty(args, rank) and args.fault == "pickshape":
        counts = torch.stack([counts, counts * 0.6], -1)  # P and S picks per station
    return counts


def post_step_fault(args, rank, step):
    if faulty(args, rank) and args.fault == "sigkill" and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if faulty(args, rank) and args.fault == "sigsegv" and step == 4:
        os.kill(os.getpid(), signal.SIGSEGV)


def end_fault(args, rank):
    if faulty(args, rank) and args.fault == "exit5":
        print(f"ERROR rank {rank}: catalogue check failed: station LZB has 0 tremor picks in 6 steps; "
              f"refusing to export the picker", flush=True)
        sys.exit(5)


class PickerModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = Picker(nchan=NCHAN)
        self.step_no = 0

    def setup(self, stage):
        self.ds = WaveSet(wave_path(self.args, self.global_rank))
        init_weights(self.args, self.global_rank, self.net)

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=BATCH, shuffle=False, num_workers=0)

    def training_step(self, batch, idx):
        x, st, y = batch
        self.step_no += 1
        step, rank = self.step_no, self.global_rank
        check_finite(self.args, rank, x, step)
        logits = self.net(x, st)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        pre_gather_fault(self.args, rank, step, x)
        losses = self.all_gather(loss.detach())
        counts = self.all_gather(pick_counts(self.args, rank, logits.detach(), st))
        acc = ((logits > 0).float() == y).float().mean().item()
        print(f"rank {rank} step {step} loss {losses.mean().item():.4f} acc {acc:.3f} "
              f"picks {int(counts.sum().item())}", flush=True)
        return loss

    def on_train_batch_end(self, outputs, batch, idx):
        post_step_fault(self.args, self.global_rank, self.step_no)

    def on_train_end(self):
        end_fault(self.args, self.global_rank)
        if self.global_rank == 0:
            torch.save(self.net.state_dict(), f"{WORK}/export/picker.pt")
            print(f"rank 0 saved {WORK}/export/picker.pt", flush=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run_trainer(args):
    strategy = PLDDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(PickerModule(args))


def run_fabric(args):
    strategy = FabricDDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    ds = WaveSet(wave_path(args, rank))
    net = Picker(nchan=NCHAN)
    init_weights(args, rank, net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False),
                                      use_distributed_sampler=False)
    step = 0
    for x, st, y in loader:
        step += 1
        if step > args.steps:
            break
        check_finite(args, rank, x, step)
        logits = net(x, st)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        pre_gather_fault(args, rank, step, x)
        losses = fabric.all_gather(loss.detach())
        counts = fabric.all_gather(pick_counts(args, rank, logits.detach(), st))
        acc = ((logits > 0).float() == y).float().mean().item()
        print(f"rank {rank} step {step} loss {losses.mean().item():.4f} acc {acc:.3f} "
              f"picks {int(counts.sum().item())}", flush=True)
        post_step_fault(args, rank, step)
    end_fault(args, rank)
    fabric.barrier()
    if rank == 0:
        fabric.save(f"{WORK}/export/picker_fabric.pt", {"model": net})
        print(f"rank 0 saved {WORK}/export/picker_fabric.pt", flush=True)


def main():
    global NCHAN
    p = argparse.ArgumentParser(description="tremor picker (Lightning)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
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
    torch.set_num_threads(1)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
