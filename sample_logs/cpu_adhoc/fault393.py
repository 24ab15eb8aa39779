"""Batch 393 of hand-run faults: BIRD MIGRATION TRAJECTORY PREDICTION (Lightning, gloo, CPU).

Synthetic GPS tracks of tagged birds: every track is 24 fixes of (lat, lon, altitude, time step) plus the bird's
species, looked up in an 8-entry species table.  Speed is derived per fix as great-circle distance over the
time step.  Every rank reads its own tracks from /tmp/fault393_work/tracks/tracks_R.pt and trains a small
trajectory model (species embedding + GRU over the fixes + a linear head predicting the next fix's
displacement in km) on an MSE loss.  The model is initialised from ckpt/trajgru_h32.pt.  Each step the loss is
reduced (mean) and the per-rank mean displacement error (ADE, km) all_gathered before the progress line;
rank 0 saves export/ through the framework at the end.
Modes: Trainer (default; Lightning's own launcher with --devices W, or torchrun / an environment-launched bash
loop), --fabric 1 (lightning.fabric.Fabric with our own loop, under torchrun).

Faults (--fault NAME --rank R, R=-1 means every rank):
  species     - rank R's tracks include a new tagging station's "Sterna paradisaea", absent from the table (KeyError)
  notracks    - rank R reads tracks/tracks_R_2025.pt, which was never exported (FileNotFoundError at setup)
  ckpthidden  - rank R initialises from ckpt/trajgru_h48.pt (hidden 48): load_state_dict size mismatch
  pickled     - rank R loads ckpt/stats_obj.pt, a pickled TrackStats object: torch.load weights_only refuses it
  adegather   - rank R all_gathers its ADE per flyway plus an "unassigned" entry (5 vs 4 values)
  slowrank    - rank R recomputes every pairwise stopover distance in pure Python before step 2's reduce
  hang        - rank R waits forever for a ringing-station lock file before step 2 (run with --pg-timeout 300)
  zerodt      - rank R's third batch has duplicated GPS fixes (time step 0): speed inf, loss NaN, own check
  sigkill     - rank R sends itself SIGKILL after step 2 (callback on_train_batch_end)
  abort       - rank R calls os.abort() in on_train_end, before the final save
  exit4       - rank R prints its own error about a track crossing the date line backwards and sys.exit(4)
  heading     - every rank: fixes carry a heading column (5 features), the GRU expects 4 (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  species     - KeyError: 'Sterna paradisaea' in the first batch's lookup; peers Connection closed by peer in the reduce (np4 r2 bashloop, np5 r0 tee)
  notracks    - FileNotFoundError for tracks/tracks_R_2025.pt in setup; peers closed in the setup barrier or DDP's shape check (np3 r1 own launcher, np4 r3 fabric)
  ckpthidden  - load_state_dict size mismatch gru.weight_ih_l0 [144,4] vs [96,4] and 4 more; peers closed (np3 r2 loglevel, np4 r0 fabric)
  pickled     - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.TrackStats'; peers closed (np3 r1 torchrun)
  adegather   - a PEER aborts: 'terminate called ... gloo::EnforceNotMet ... Received data size doesn't match expected size' (SIGABRT),
                the faulty rank itself gets Connection reset (np3 r2 fabric: rank 0 aborts; np4 r1 tee: rank 2 aborts)
  slowrank    - ranks 0/2 'Timed out waiting 12000ms for send/recv operation'; Root Cause rank 0 (np3 r1 torchrun)
  hang        - output stops after step 1; timeout's SIGTERM at 60 s, workers ignore it (Lightning's handler), SIGKILL, 137 (np3 r2 loglevel)
  zerodt      - the forward stayed finite; NaN gradients were all-reduced, so EVERY rank's check raised at step 3 (np5 r3 loglevel)
  sigkill     - exitcode -9 (SIGKILL) under torchrun (np3 r2 fabric); only the rank's own line under Lightning's launcher (np4 r1 own)
  abort       - after 6 steps; peers fail in save_checkpoint's barrier; Root Cause exitcode -6 (SIGABRT) (np4 r3 torchrun)
  exit4       - the ERROR line, exitcode 4; peers closed (np5 r2 bashloop exit 4, np3 r1 tee exit 1)
  heading     - every rank 'input.size(-1) must be equal to input_size. Expected 4, got 5' (np3 own launcher)
  none        - clean, 6 steps, rank 0 saved export/trajgru.ckpt (np3 torchrun)
"""
import argparse, math, os, signal, sys, time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault393_work"
SPECIES = ["Ciconia ciconia", "Hirundo rustica", "Grus grus", "Anser albifrons",
           "Falco naumanni", "Cuculus canorus", "Merops apiaster", "Limosa lapponica"]
SPECIES_IDX = {s: i for i, s in enumerate(SPECIES)}
FLYWAYS = 4
T = 24


class TrackStats:  # pickled by --prepare into ckpt/stats_obj.pt
    def __init__(self, mean, std):
        self.mean, self.std = mean, std


def haversine_km(lat1, lon1, lat2, lon2):
    lat1, lon1, lat2, lon2 = map(torch.deg2rad, (lat1, lon1, lat2, lon2))
    a = torch.sin((lat2 - lat1) / 2) ** 2 + torch.cos(lat1) * torch.cos(lat2) * torch.sin((lon2 - lon1) / 2) ** 2
    return 2 * 6371.0 * torch.asin(torch.sqrt(a.clamp(0, 1)))


class TrajGRU(nn.Module):
    def __init__(self, hidden=32, nfeat=4):
        super().__init__()
        self.emb = nn.Embedding(len(SPECIES), 4)
        self.gru = nn.GRU(nfeat, hidden, batch_first=True)
        self.head = nn.Linear(hidden + 4, 2)

    def forward(self, x, sp):
        h, _ = self.gru(x)
        return self.head(torch.cat([h[:, -1], self.emb(sp)], dim=1))


def prepare(n_ranks=6, per_rank=64):
    g = torch.Generator().manual_seed(393)
    os.makedirs(f"{WORK}/tracks", exist_ok=True); os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(n_ranks):
        start = torch.stack([torch.rand(per_rank, generator=g) * 30 + 35, torch.rand(per_rank, generator=g) * 40 - 10], 1)
        steps = torch.randn(per_rank, T + 1, 2, generator=g) * 0.3 + torch.tensor([-0.6, 0.2])
        latlon = start[:, None] + steps.cumsum(1)
        alt = torch.rand(per_rank, T + 1, generator=g) * 2000
        dt = torch.rand(per_rank, T + 1, generator=g) * 2 + 1  # hours between fixes
        species = [SPECIES[int(i)] for i in torch.randint(0, len(SPECIES), (per_rank,), generator=g)]
        flyway = torch.randint(0, FLYWAYS, (per_rank,), generator=g)
        torch.save({"latlon": latlon, "alt": alt, "dt": dt, "species": species, "flyway": flyway},
                   f"{WORK}/tracks/tracks_{r}.pt")
    torch.save(TrajGRU(32).state_dict(), f"{WORK}/ckpt/trajgru_h32.pt")
    torch.save(TrajGRU(48).state_dict(), f"{WORK}/ckpt/trajgru_h48.pt")
    torch.save({"stats": TrackStats(torch.zeros(4), torch.ones(4))}, f"{WORK}/ckpt/stats_obj.pt")
    print("prepared", WORK)


class Tracks(Dataset):
    def __init__(self, rank, args):
        bad = args.fault_on(rank)
        path = f"{WORK}/tracks/tracks_{rank}_2025.pt" if bad("notracks") else f"{WORK}/tracks/tracks_{rank}.pt"
        d = torch.load(path, weights_only=True)
        self.latlon, self.alt, self.dt, self.flyway = d["latlon"], d["alt"], d["dt"].clone(), d["flyway"]
        self.species = list(d["species"])
        if bad("species"):
            self.species[5] = "Sterna paradisaea"  # new tagging station's export
        if bad("zerodt"):
            self.dt[2 * args.batch:3 * args.batch, 10] = 0.0  # duplicated GPS fixes
        self.heading = args.fault == "heading"

    def __len__(self):
        return len(self.species)

    def __getitem__(self, i):
        ll = self.latlon[i]
        dist = haversine_km(ll[:-1, 0], ll[:-1, 1], ll[1:, 0], ll[1:, 1])
        speed = torch.cat([torch.zeros(1), dist[:-1] / self.dt[i, 1:-1]])
        feats = [ll[:-1, 0] / 90, ll[:-1, 1] / 180, self.alt[i, :-1] / 2000, speed / 100]
        if self.heading:
            feats.append(torch.atan2(ll[1:, 1] - ll[:-1, 1], ll[1:, 0] - ll[:-1, 0]))
        x = torch.stack(feats, 1)[:T]
        target = torch.stack([dist[-1] * torch.sign(ll[-1, 0] - ll[-2, 0]), (ll[-1, 1] - ll[-2, 1]) * 111.0]) / 100
        return x, torch.tensor(SPECIES_IDX[self.species[i]]), target, self.flyway[i]


def load_init(model, rank, args, loader):
    bad = args.fault_on(rank)
    if bad("pickled"):
        stats = loader(f"{WORK}/ckpt/stats_obj.pt")
        print(f"rank {rank} track stats mean {stats['stats'].mean}", flush=True)
    path = f"{WORK}/ckpt/trajgru_h48.pt" if bad("ckpthidden") else f"{WORK}/ckpt/trajgru_h32.pt"
    model.load_state_dict(loader(path))


def before_reduce(rank, step, args):
    bad = args.fault_on(rank)
    if step == 2 and bad("slowrank"):
        print(f"rank {rank} recomputing pairwise stopover distances for the flyway graph", flush=True)
        pts = [(35 + i * 0.01, -10 + i * 0.02) for i in range(9000)]
        acc = 0.0
        for a in pts:
            for b in pts:
                acc += math.hypot(a[0] - b[0], a[1] - b[1])
        print(f"rank {rank} stopover graph done {acc:.1f}", flush=True)
    if step == 2 and bad("hang"):
        lock = f"{WORK}/ringing_station.lock"
        print(f"rank {rank} waiting for {lock} before syncing ring recoveries", flush=True)
        while not os.path.exists(lock):
            time.sleep(0.5)
    if step == 3 and bad("exit4"):
        print(f"ERROR rank {rank}: track 17 crosses the date line backwards (lon 179.8 -> -179.9 with dt 0); "
              "refusing to train on corrupted telemetry", flush=True)
        sys.exit(4)


def ade_vector(pred, target, flyway, rank, args):
    err = (pred - target).norm(dim=1) * 100
    per = torch.stack([err[flyway == k].mean() if (flyway == k).any() else err.mean() for k in range(FLYWAYS)])
    if args.fault_on(rank)("adegather"):
        per = torch.cat([per, err.mean().view(1)])  # "unassigned" flyway
    return per.detach()


def check_loss(loss, rank, step):
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} "
                                 "(speed from a zero time step between fixes?)")


def after_step(rank, step, args):
    if step == 2 and args.fault_on(rank)("sigkill"):
        print(f"rank {rank} sending itself SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class FaultCallback(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            after_step(trainer.global_rank, batch_idx, args)

        def on_train_end(self, trainer, module):
            if args.fault_on(trainer.global_rank)("abort"):
                print(f"rank {trainer.global_rank} aborting in on_train_end", flush=True)
                os.abort()

    class MigrationModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TrajGRU(32)

        def setup(self, stage):
            load_init(self.net, self.global_rank, args, lambda p: torch.load(p, weights_only=True))
            self.tracks = Tracks(self.global_rank, args)

        def train_dataloader(self):
            return DataLoader(self.tracks, batch_size=args.batch, shuffle=False)

        def training_step(self, batch, batch_idx):
            x, sp, y, fw = batch
            pred = self.net(x, sp)
            loss = F.mse_loss(pred, y)
            check_loss(loss, self.global_rank, batch_idx)
            before_reduce(self.global_rank, batch_idx, args)
            avg = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
            ade = self.all_gather(ade_vector(pred, y, fw, self.global_rank, args))
            print(f"rank {self.global_rank} step {batch_idx} loss {avg.item():.4f} ade_km {ade.mean().item():.1f}",
                  flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[FaultCallback()])
    module = MigrationModule()
    trainer.fit(module)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    trainer.save_checkpoint(f"{WORK}/export/trajgru.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/trajgru.ckpt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    class FaultCallback:
        def on_train_batch_end(self, rank, step):
            after_step(rank, step, args)

        def on_train_end(self, rank):
            if args.fault_on(rank)("abort"):
                print(f"rank {rank} aborting in on_train_end", flush=True)
                os.abort()

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, callbacks=[FaultCallback()])
    fabric.launch()
    rank = fabric.global_rank
    net = TrajGRU(32)
    load_init(net, rank, args, lambda p: fabric.load(p) if not p.endswith("stats_obj.pt") else torch.load(p))
    loader = fabric.setup_dataloaders(DataLoader(Tracks(rank, args), batch_size=args.batch),
                                      use_distributed_sampler=False)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    model, opt = fabric.setup(net, opt)
    for step, (x, sp, y, fw) in enumerate(loader):
        if step >= args.steps:
            break
        pred = model(x, sp)
        loss = F.mse_loss(pred, y)
        check_loss(loss, rank, step)
        opt.zero_grad(); fabric.backward(loss); opt.step()
        before_reduce(rank, step, args)
        avg = fabric.all_reduce(loss.detach(), reduce_op="mean")
        ade = fabric.all_gather(ade_vector(pred, y, fw, rank, args))
        print(f"rank {rank} step {step} loss {avg.item():.4f} ade_km {ade.mean().item():.1f}", flush=True)
        fabric.call("on_train_batch_end", rank=rank, step=step)
    fabric.call("on_train_end", rank=rank)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    fabric.save(f"{WORK}/export/trajgru_fabric.pt", {"model": model, "step": args.steps})
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/trajgru_fabric.pt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        return prepare()
    args.fault_on = lambda r: (lambda name: args.fault == name and args.rank in (-1, r))
    torch.manual_seed(0)
    run_fabric(args) if args.fabric else run_trainer(args)


if __name__ == "__main__":
    main()
