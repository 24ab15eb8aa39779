"""A four-hundred-and-third hand-run batch: PEDESTRIAN TRAJECTORY PREDICTION (Lightning).

Synthetic pedestrian scenes: every agent has 8 observed (x, y) positions at 2.5 Hz, 12 future positions to
predict, a frame interval dt and an agent type (pedestrian, cyclist, skater, cart; looked up in AGENT_TYPES).
Every rank reads its scenes from /tmp/fault403_work/scenes/scene_R.pt (no distributed sampler: one file per
rank), turns positions into velocities (displacement / dt), and trains a small LSTM encoder-decoder with an
agent-type embedding on an MSE loss over the 12 future offsets.  The model is initialised from
ckpt/traj_lstm_h32.pt.  Every step the per-rank ADE (average displacement error) is all_gathered through the
framework (LightningModule.all_gather / Fabric.all_gather) and printed; at the end every rank calls the
framework's save (Trainer.save_checkpoint / Fabric.save) and rank 0 writes export/traj_lstm.ckpt.
Options: --devices W, --fabric 1 (lightning.fabric.Fabric with a hand-written loop instead of the Trainer),
--pg-timeout S (DDPStrategy(timeout=...)), --slow-s S (how long the slow fault works), --prepare.

Faults:
  agenttype  - rank N's scene file has an agent of type "scooter", missing from AGENT_TYPES (KeyError, first batch)
  noscene    - rank N reads scenes/eth_hotel/scene_N.pt, which does not exist (FileNotFoundError at setup)
  ckptsize   - rank N initialises from ckpt/traj_lstm_h48.pt (hidden 48, model 32): size mismatch at fit start
  ckptpickle - rank N initialises from ckpt/traj_lstm_norm.pt, which pickles a TrajNormalizer object;
               torch.load(weights_only=True) refuses it (UnpicklingError at fit start)
  adegather  - rank N all_gathers its per-horizon ADE with 13 horizons instead of 12 at step 2
  socialslow - rank N builds a social-pooling grid pair by pair in Python before step 3 (--slow-s seconds)
  nanvel     - rank N's fourth batch has dt = 0: velocities inf/NaN, the program's check raises FloatingPointError
  nbridx     - rank N's neighbour table at step 4 names agent 16 in a batch of 16 (IndexError)
  segv       - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error (predictions leave the walkable area) at train end and sys.exit(5)
  coordwidth - every rank: inputs are (x, y, t), 3 wide, the LSTM expects 2 (RuntimeError, first step)
  none       - control, clean run

What happened (filled in after the runs):
  agenttype  - "KeyError: 'scooter'" in __getitem__ under Lightning's data fetcher on the first batch; peers Connection closed by peer in the step-1 all_gather (np4 r2 pltorchrun, np3 r0 plbashloop)
  noscene    - FileNotFoundError for scenes/eth_hotel/scene_N.pt in DataModule.setup / at Fabric start-up; peers Connection closed in the post_setup barrier or DDP init (np5 r3 pltee, np3 r1 plfabric)
  ckptsize   - 'Error(s) in loading state_dict for TrajLSTM: size mismatch for enc.weight_hh_l0 ... [192, 48] ... [128, 32]' at fit start; peers closed in a barrier (np4 r1 plloglevel, np3 r2 plown)
  ckptpickle - '_pickle.UnpicklingError: Weights only load failed' 'Unsupported global: GLOBAL __main__.TrajNormalizer' on rank 0; peers closed (np3 r0 pltorchrun)
  adegather  - a receiving rank aborts: "terminate called after throwing an instance of 'gloo::EnforceNotMet'" 'Received data size doesn't match expected size' (SIGABRT, Root Cause names the aborting rank, not the faulty one); others Connection reset/closed (np4 r1 plfabric, np3 r2 pltee)
  socialslow - 12 s PG timeout: ranks 0 and 2 'Timed out waiting 12000ms for send/recv operation', rank 1 then Connection closed (np3 r1 plbashloop); 300 s: silent after step 2, killed at 60 s, agent 'Received 15 death signal', exit 137 (np4 r2 plloglevel; the 4 workers outlived torchrun and were killed by PID)
  nanvel     - own check: 'rank N step 4: 256 non-finite velocity values' then FloatingPointError; peers closed (np5 r4 plfabric, np3 r1 plown)
  nbridx     - 'IndexError: index 16 is out of bounds for dimension 0 with size 16' at step 4 on rank 3; 5 peers closed; Root Cause rank 3 (np6 r3 pltorchrun)
  segv       - no traceback; bash 'Segmentation fault' line, exit 139 (np4 r0 plbashloop); Root Cause rank 2 exitcode -11 (SIGSEGV) (np3 r2 pltee)
  exit5      - rank N's 'ERROR rank N: 14 predicted trajectories ... refusing to export' after 6 steps, exit 5; peers closed in the save barrier; Root Cause exitcode 5 (np5 r2 plloglevel, np3 r1 plfabric)
  coordwidth - every rank 'RuntimeError: input.size(-1) must be equal to input_size. Expected 2, got 3' in the first forward, exit 1 (np3 plown)
  none       - clean: 6 steps on 3 ranks, max_steps reached, rank 0 saved export/traj_lstm.ckpt, exit 0 (np3 plown)
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault403_work"
AGENT_TYPES = {"pedestrian": 0, "cyclist": 1, "skater": 2, "cart": 3}
OBS, PRED, HID, BATCH = 8, 12, 32, 16


class TrajNormalizer:
    def __init__(self, scale=1.0, shift=(0.0, 0.0)):
        self.scale = scale
        self.shift = shift


class TrajLSTM(nn.Module):
    def __init__(self, hid=HID, inp=2):
        super().__init__()
        self.type_emb = nn.Embedding(len(AGENT_TYPES), 8)
        self.enc = nn.LSTM(inp, hid, batch_first=True)
        self.dec = nn.Linear(hid + 8, PRED * 2)

    def forward(self, vel, atype):
        _, (h, _) = self.enc(vel)
        z = torch.cat([h[-1], self.type_emb(atype)], dim=1)
        return self.dec(z).view(-1, PRED, 2)


def say(msg, err=False):
    print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def prepare():
    g = torch.Generator().manual_seed(403)
    os.makedirs(f"{WORK}/scenes", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    names = list(AGENT_TYPES)
    for r in range(6):
        n = 128
        start = torch.rand(n, 1, 2, generator=g) * 20
        heading = torch.randn(n, 1, 2, generator=g) * 0.5
        steps = torch.arange(OBS + PRED).view(1, -1, 1).float()
        traj = start + heading * steps * 0.4 + torch.randn(n, OBS + PRED, 2, generator=g) * 0.05
        types = [names[int(i)] for i in torch.randint(0, 4, (n,), generator=g)]
        torch.save({"traj": traj, "dt": torch.full((n,), 0.4), "types": types}, f"{WORK}/scenes/scene_{r}.pt")
    torch.manual_seed(0)
    torch.save(TrajLSTM().state_dict(), f"{WORK}/ckpt/traj_lstm_h32.pt")
    torch.save(TrajLSTM(hid=48).state_dict(), f"{WORK}/ckpt/traj_lstm_h48.pt")
    torch.save({"state_dict": TrajLSTM().state_dict(), "normalizer": TrajNormalizer(0.4, (10.0, 10.0))},
               f"{WORK}/ckpt/traj_lstm_norm.pt")
    say(f"prepared 6 scene files and 3 checkpoints under {WORK}")


class SceneSet(Dataset):
    def __init__(self, path, rank, args):
        blob = torch.load(path, weights_only=True)
        self.traj, self.dt, self.types = blob["traj"], blob["dt"].clone(), list(blob["types"])
        mine = args.rank in (-1, rank)
        if args.fault == "agenttype" and mine:
            self.types[5] = "scooter"
        if args.fault == "nanvel" and mine:
            self.dt[3 * BATCH:4 * BATCH] = 0.0
        self.width3 = args.fault == "coordwidth"

    def __len__(self):
        return len(self.traj)

    def __getitem__(self, i):
        atype = AGENT_TYPES[self.types[i]]
        obs = self.traj[i, :OBS]
        vel = torch.diff(obs, dim=0, prepend=obs[:1]) / self.dt[i]
        if self.width3:
            t = torch.arange(OBS).float().unsqueeze(1) * self.dt[i]
            vel = torch.cat([vel, t], dim=1)
        fut = self.traj[i, OBS:] - obs[-1]
        return vel, torch.tensor(atype), fut


def scene_path(rank, args):
    if args.fault == "noscene" and args.rank in (-1, rank):
        return f"{WORK}/scenes/eth_hotel/scene_{rank}.pt"
    return f"{WORK}/scenes/scene_{rank}.pt"


def init_path(rank, args):
    mine = args.rank in (-1, rank)
    if args.fault == "ckptsize" and mine:
        return f"{WORK}/ckpt/traj_lstm_h48.pt"
    if args.fault == "ckptpickle" and mine:
        return f"{WORK}/ckpt/traj_lstm_norm.pt"
    return f"{WORK}/ckpt/traj_lstm_h32.pt"


def load_init(net, rank, args):
    path = init_path(rank, args)
    sd = torch.load(path, weights_only=True)
    if "state_dict" in sd:
        sd = sd["state_dict"]
    net.load_state_dict(sd)
    say(f"rank {rank} initialised from {os.path.basename(path)}")


def before_step(step, rank, args):
    """Faults that act before a step's forward; step counts from 1."""
    mine = args.rank in (-1, rank)
    if args.fault == "socialslow" and mine and step == 3:
        say(f"rank {rank} building social-pooling grid for all agent pairs")
        deadline = time.time() + args.slow_s
        pts = [(i * 0.37 % 20, i * 0.91 % 20) for i in range(300)]
        grid = {}
        while time.time() < deadline:
            for a in pts:
                for b in pts:
                    d = ((a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2) ** 0.5
                    grid[int(d)] = grid.get(int(d), 0) + 1
        say(f"rank {rank} social grid done ({len(grid)} bins)")


def step_math(net, batch, step, rank, args):
    vel, atype, fut = batch
    if not torch.isfinite(vel).all():
        bad = int((~torch.isfinite(vel)).sum())
        say(f"rank {rank} step {step}: {bad} non-finite velocity values (min dt {0.0:.3f})", err=True)
        raise FloatingPointError(f"rank {rank}: non-finite velocities in batch {step} ({bad} values)")
    if args.fault == "nbridx" and args.rank in (-1, rank) and step == 4:
        nbr = torch.arange(1, vel.shape[0] + 1)
        _ = fut[:, -1][nbr]
    pred = net(vel, atype)
    loss = nn.functional.mse_loss(pred, fut)
    err = (pred.detach() - fut).norm(dim=-1)
    per_h = err.mean(0)
    if args.fault == "adegather" and args.rank in (-1, rank) and step == 2:
        per_h = torch.cat([per_h, err[:, -1:].mean(0)])
    return loss, per_h


def after_step(step, rank, args):
    if args.fault == "segv" and args.rank in (-1, rank) and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)


def train_end(rank, args):
    if args.fault == "exit5" and args.rank in (-1, rank):
        say(f"ERROR rank {rank}: 14 predicted trajectories in scene_{rank} leave the walkable area "
            f"(obstacle map zara01); refusing to export", err=True)
        sys.exit(5)


class TrajModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = TrajLSTM()

    def on_fit_start(self):
        load_init(self.net, self.global_rank, self.args)

    def training_step(self, batch, idx):
        step = self.global_step + 1
        before_step(step, self.global_rank, self.args)
        loss, per_h = step_math(self.net, batch, step, self.global_rank, self.args)
        g = self.all_gather(per_h)
        say(f"rank {self.global_rank} step {step} loss {loss.item():.4f} ade {g.mean().item():.4f}")
        return loss

    def on_train_batch_end(self, outputs, batch, idx):
        after_step(self.global_step, self.global_rank, self.args)

    def on_train_end(self):
        train_end(self.global_rank, self.args)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class SceneData(pl.LightningDataModule):
    def __init__(self, args):
        super().__init__()
        self.args = args

    def setup(self, stage):
        rank = self.trainer.global_rank
        self.ds = SceneSet(scene_path(rank, self.args), rank, self.args)
        say(f"rank {rank} loaded {len(self.ds)} agents")

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=BATCH, shuffle=False)


def strategy(args):
    return DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))


def run_trainer(args):
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy(args),
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    model = TrajModule(args)
    trainer.fit(model, datamodule=SceneData(args))
    trainer.save_checkpoint(f"{WORK}/export/traj_lstm.ckpt")
    if trainer.global_rank == 0:
        say(f"rank 0 saved {WORK}/export/traj_lstm.ckpt")


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FDDP
    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=FDDP(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    ds = SceneSet(scene_path(rank, args), rank, args)
    say(f"rank {rank} loaded {len(ds)} agents")
    net = TrajLSTM()
    load_init(net, rank, args)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH), use_distributed_sampler=False)
    step = 0
    for batch in loader:
        step += 1
        if step > args.steps:
            break
        before_step(step, rank, args)
        loss, per_h = step_math(net, batch, step, rank, args)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        g = fabric.all_gather(per_h)
        say(f"rank {rank} step {step} loss {loss.item():.4f} ade {g.mean().item():.4f}")
        after_step(step, rank, args)
    train_end(rank, args)
    fabric.save(f"{WORK}/export/traj_lstm.ckpt", {"model": net, "step": step})
    if rank == 0:
        say(f"rank 0 saved {WORK}/export/traj_lstm.ckpt")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    torch.set_num_threads(1)
    if args.fault == "coordwidth":
        pass  # the data gives (x, y, t); the model still expects 2 inputs
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
