"""Batch 579 fault script, theme "sorrel leaves".

A small training job that learns to tell sorrel species apart from leaf measurements
(blade length, hastate lobe angle, oxalate content, ...). `--prepare` writes synthetic data
into /tmp/fault579_work: one shard of leaves per rank, a species lookup table (JSON) and an
initial checkpoint. Training: gloo, CPU, 6 steps; every rank prints
`rank R step S loss L oxalate M` each step; rank 0 saves an export at the end.
Process-group start-up timeout 120 s (Lightning start-up is slow); the per-step collectives run
on a group with the --pg-timeout (default 12 s).

Modes: --mode trainer (Lightning Trainer, DDPStrategy gloo) or --mode fabric (Lightning Fabric,
own loop).

Faults (--fault NAME --rank N):
  none            control, nothing planted
  keyerror        rank N's shard names a species missing from the lookup table (KeyError)
  missing_shard   rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size       rank N builds its head with 48 hidden units and loads the 32-unit checkpoint
  gather_size     rank N passes a 5-element tensor to the per-step all_gather (others pass 4)
  slow            rank N counts leaf veins in pure Python at step 3 (~45 s); peers time out
  hang            like slow but for ~400 s; run with --pg-timeout 300 so `timeout` ends it
  nan             rank N's oxalate readings become inf at step 3; the NaN check raises
  sigsegv         rank N sends itself SIGSEGV at step 2
  exit4           rank N prints its own ERROR line and calls sys.exit(4) at step 1
  shape_all       every rank: the lobe-angle head multiplies by a wrongly shaped matrix at step 2
  worker_crash    rank N's DataLoader worker SIGKILLs itself while loading a leaf

What happened (20 runs, Lightning 2.6.6, gloo, CPU; traceback line numbers in the logs are those
of this file before this block was added, 13 lines fewer):
  none            plown np3: all 6 steps on 3 ranks, export saved, exit 0.
  keyerror        rank 2 (torchrun np4) / rank 4 (bash loop np5): KeyError 'rumex_alpinus_var_sorrelii' after step 1; peers: gloo connection closed.
  missing_shard   rank 1 (--tee 3 np3) / rank 4 (plown np5): FileNotFoundError in train_dataloader before step 0.
  ckpt_size       rank 3 (fabric np4) / rank 0 (torchrun np7): load_state_dict size mismatch [32,16] vs [48,16] before step 0.
  gather_size     rank 5 (torchrun np6) / rank 1 (fabric np4): ProcessGroupGloo::allgather invalid tensor size at step 2.
  slow            rank 1 (LOGLEVEL=INFO np4) / rank 2 (fabric np3): peers time out after 12000 ms in the step-3 all_gather.
  hang            rank 2 (torchrun np3, --pg-timeout 300): steps 0-2, then silence until `timeout` (60 s) stopped torchrun.
  nan             rank 3 (fabric np5) / rank 1 (--tee 3 np3): FloatingPointError 'loss is nan' from the script's check at step 3.
  sigsegv         rank 2 (--tee 3 np4): torchrun exitcode -11; rank 0 (bash loop np6): bash 'Segmentation fault'.
  exit4           rank 1 (plown np3) / rank 6 (torchrun np8): own ERROR line, exit 4, peers: gloo connection closed.
  shape_all       every rank (LOGLEVEL=INFO np3): RuntimeError mat1 and mat2 shapes cannot be multiplied (4x16 and 15x3).
  worker_crash    rank 3 (torchrun np5): DataLoader worker killed by signal: Killed after step 0.
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

WORK = "/tmp/fault579_work"
SPECIES = ["rumex_acetosa", "rumex_scutatus", "rumex_acetosella", "rumex_sanguineus"]
N_PER_SHARD = 24
BATCH = 4
STEPS = 6


def prepare(world):
    import torch
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(579)
    with open(f"{WORK}/species_table.json", "w") as f:
        json.dump({s: i for i, s in enumerate(SPECIES)}, f)
    for r in range(world):
        feats = torch.randn(N_PER_SHARD, 16, generator=g)
        names = [SPECIES[int(i)] for i in torch.randint(0, 4, (N_PER_SHARD,), generator=g)]
        torch.save({"features": feats, "species": names}, f"{WORK}/shards/leaves_rank{r}.pt")
    torch.save(make_model(32).state_dict(), f"{WORK}/ckpt/sorrel_init.pt")
    print(f"prepared {world} shards in {WORK}")


def make_model(hidden):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def build_dataset(args, rank):
    import torch
    from torch.utils.data import Dataset

    path = f"{WORK}/shards/leaves_rank{rank}.pt"
    if args.fault == "missing_shard" and rank == args.rank:
        path = f"{WORK}/shards/leaves_rank{rank}_pressed.pt"
    shard = torch.load(path)
    with open(f"{WORK}/species_table.json") as f:
        table = json.load(f)
    if args.fault == "keyerror" and rank == args.rank:
        shard["species"][9] = "rumex_alpinus_var_sorrelii"

    class Leaves(Dataset):
        def __len__(self):
            return N_PER_SHARD

        def __getitem__(self, i):
            if args.fault == "worker_crash" and rank == args.rank and i == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            return shard["features"][i], table[shard["species"][i]]

    return Leaves()


def make_loader(args, rank):
    from torch.utils.data import DataLoader
    nw = 1 if args.fault == "worker_crash" else 0
    return DataLoader(build_dataset(args, rank), batch_size=BATCH, shuffle=False, num_workers=nw)


def load_head(args, rank):
    import torch
    hidden = 48 if (args.fault == "ckpt_size" and rank == args.rank) else 32
    model = make_model(hidden)
    model.load_state_dict(torch.load(f"{WORK}/ckpt/sorrel_init.pt"))
    return model


def before_loss(args, rank, step, x):
    import torch
    if args.fault == "exit4" and rank == args.rank and step == 1:
        print(f"ERROR sorrel: rank {rank} found no leaf-moisture calibration for shard {rank}; giving up", flush=True)
        sys.exit(4)
    if args.fault == "sigsegv" and rank == args.rank and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "nan" and rank == args.rank and step == 3:
        x = x.clone()
        x[:, 2] = float("inf")
    if args.fault in ("slow", "hang") and rank == args.rank and step == 3:
        budget = 45 if args.fault == "slow" else 400
        t0 = time.time(); veins = 0
        while time.time() - t0 < budget:
            for k in range(20000):
                veins += (k * 7919) % 13
    if args.fault == "shape_all" and step == 2:
        lobe = torch.randn(15, 3)
        x = x @ lobe  # wrong: features have 16 columns
    return x


def step_collective(args, rank, step, loss, group, world):
    import torch
    import torch.distributed as dist
    n = 5 if (args.fault == "gather_size" and rank == args.rank and step == 2) else 4
    mine = torch.full((n,), float(loss.detach()))
    outs = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(outs, mine, group=group)
    return torch.stack(outs)[:, 0].mean()


def check_finite(loss, rank, step):
    import torch
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite oxalate reading)")


def run_trainer(args):
    import torch
    import torch.nn.functional as F
    import torch.distributed as dist
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class SorrelModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None
            self.step_no = 0

        def setup(self, stage):
            self.g12 = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
            self.net = load_head(args, self.global_rank)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return make_loader(args, self.global_rank)

        def training_step(self, batch, idx):
            x, y = batch
            r, s = self.global_rank, self.step_no
            x = before_loss(args, r, s, x)
            out = self.net(x)
            loss = F.cross_entropy(out, y)
            check_finite(loss, r, s)
            avg = step_collective(args, r, s, loss, self.g12, self.trainer.world_size)
            ox = float(x[:, 2].mean())
            print(f"rank {r} step {s} loss {loss.item():.4f} oxalate {ox:.4f} (mean loss {avg.item():.4f})", flush=True)
            self.step_no += 1
            return loss

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), f"{WORK}/sorrel_export.pt")
                print(f"rank 0 saved export to {WORK}/sorrel_export.pt", flush=True)

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=max(120, args.pg_timeout)))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy,
                        max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, use_distributed_sampler=False)
    trainer.fit(SorrelModule())


def run_fabric(args):
    import torch
    import torch.nn.functional as F
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=max(120, args.pg_timeout))))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    g12 = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    net = load_head(args, rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(make_loader(args, rank), use_distributed_sampler=False)
    for s, (x, y) in enumerate(loader):
        if s >= STEPS:
            break
        x = before_loss(args, rank, s, x)
        loss = F.cross_entropy(net(x), y)
        check_finite(loss, rank, s)
        avg = step_collective(args, rank, s, loss, g12, world)
        opt.zero_grad(); fabric.backward(loss); opt.step()
        print(f"rank {rank} step {s} loss {loss.item():.4f} oxalate {float(x[:, 2].mean()):.4f} (mean loss {avg.item():.4f})", flush=True)
    if rank == 0:
        torch.save(net.module.state_dict() if hasattr(net, "module") else net.state_dict(), f"{WORK}/sorrel_export.pt")
        print(f"rank 0 saved export to {WORK}/sorrel_export.pt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    args = p.parse_args()
    if args.prepare:
        prepare(args.world)
        return
    if args.mode == "fabric":
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
