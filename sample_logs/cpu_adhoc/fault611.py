"""Batch 611 fault job: stonecrop leaf succulence (synthetic), torch.distributed gloo on CPU.

Each rank reads its own shard of stonecrop (Sedum) leaf measurements (thickness, area, light, soil water...),
maps every leaf's species id through a JSON lookup table of water-storage factors, starts from a shared
checkpoint and fits a small MLP to leaf water content for 6 steps, printing
`rank R step S loss L succulence M` (M = mean predicted water content of the batch, %). Rank 0 saves an
export at the end. `--mode trainer` uses a LightningModule with L.Trainer + DDPStrategy(gloo, 12 s);
`--mode fabric` uses lightning.fabric.Fabric with its own loop (metric all_reduce per step).
`--prepare` writes the shards, the lookup table and the start checkpoint into /tmp/fault611_work.

Faults (`--fault NAME --rank N`; "all" faults hit every rank):
  none          control run
  valueerror    rank N's own check raises ValueError on a negative leaf thickness at step 3
  jsondecode    rank N reads a truncated copy of the lookup table -> json.JSONDecodeError
  loaderworker  rank N's shard holds species id 99; the lookup list index fails in DataLoader worker 0 (IndexError)
  ckpttrunc     rank N loads a truncated copy of the start checkpoint -> torch.load fails
  ckptkeys      rank N loads a start checkpoint whose keys were renamed -> load_state_dict missing/unexpected keys
  savedir       rank N (0) saves the export into a directory that does not exist
  exit0         rank N calls sys.exit(0) at step 3 (quiet early exit)
  exit3         rank N calls os._exit(3) at step 2 without printing anything
  sigkill       rank N sends itself SIGKILL at step 3
  sigabrt       rank N calls os.abort() (SIGABRT) at step 2
  anomaly       anomaly detection on; rank N's turgor term takes sqrt of a negative at step 4 -> NaN in backward
  unusedparam   every rank: a spare layer outside forward, DDP without find_unused_parameters (all)
  shapediff     rank N builds its hidden layer 24 wide instead of 16 (DDP param shapes differ)
  stall         rank N sleeps 400 s at step 3 (others time out after --pg-timeout)
  portinuse     launch-time: the master port is held by another socket (set up by the command, not the script)
  allsame       every rank builds the model for 9 features while the data has 8 (shape error on all ranks)
  hostmem       rank N caps RLIMIT_AS and then allocates 8 GiB at step 2
  modnotfound   rank N imports a helper module that does not exist

Runs (one line per log; filled in after the runs):
  slot 01: stonecrop_none_np3_rnone_pltorchrun: control, all ranks steps 0-5, export saved; exit 0
  slot 02: stonecrop_valueerror_np5_r2_pltorchrun: rank 2 ValueError at step 3, others gloo connection closed; exit 1
  slot 03: stonecrop_jsondecode_np4_r3_plfabric: rank 3 JSONDecodeError before step 0, others connection closed; exit 1
  slot 04: stonecrop_loaderworker_np5_r4_pltee: rank 4 'Caught IndexError in DataLoader worker process 0'; exit 1
  slot 05: stonecrop_ckpttrunc_np6_r1_plfabric: rank 1 torch.load 'failed finding central directory'; exit 1
  slot 06: stonecrop_ckptkeys_np3_r2_plbashloop: rank 2 load_state_dict missing/unexpected keys; exit 1
  slot 07: stonecrop_savedir_np5_r0_plfabric: steps done, rank 0 export 'Parent directory ... does not exist'; exit 1
  slot 08: stonecrop_exit0_np5_r2_plloglevel: rank 2 quietly exits 0 at step 3, torchrun blames rank 3; exit 1
  slot 09: stonecrop_exit3_np4_r3_pltorchrun: rank 3 os._exit(3) silently at step 2, root cause rank 3 exitcode 3; exit 1
  slot 10: stonecrop_sigkill_np6_r5_pltee: rank 5 SIGKILL at step 3, root cause exitcode -9; exit 1
  slot 11: stonecrop_sigabrt_np4_r0_plown: DROPPED, store timed out (1/4 clients) before the fault, host overloaded
  slot 12: stonecrop_unusedparam_np3_rall_plown: all ranks Lightning unused-parameters RuntimeError at step 1; exit 1
  slot 13: stonecrop_anomaly_np5_r1_plfabric: rank 1 SqrtBackward0 returned nan (anomaly mode) at step 4; exit 1
  slot 14: stonecrop_shapediff_np4_r2_plbashloop: rank 2 params[0] sizes [24, 8] do not match process 0; exit 1
  slot 15: stonecrop_stall_np5_r4_plloglevel: rank 4 sleeps at step 3, ranks 0-3 gloo 12000ms timeouts; exit 1
  slot 16: stonecrop_allsame_np6_rall_pltorchrun: all ranks mat1 and mat2 shapes (8x8 and 9x16) at step 0; exit 1
  slot 17: not run (time): hostmem, modnotfound, portinuse, stall with --pg-timeout 300
  slot 18: (reserved)
  slot 19: (reserved)
  slot 20: (reserved)
  slot 21: (reserved)
  slot 22: (reserved)
  slot 23: (reserved)
  slot 24: (reserved)
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault611_work"
FEATURES = 8


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", choices=["trainer", "fabric"], default="trainer")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--steps", type=int, default=6)
    return p.parse_args()


def prepare():
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(os.path.join(WORK, "export"), exist_ok=True)
    g = torch.Generator().manual_seed(611)
    table = {"water_factor": [0.62, 0.71, 0.80, 0.88, 0.93, 0.97], "species": ["acre", "album", "reflexum",
             "spurium", "telephium", "sexangulare"]}
    with open(os.path.join(WORK, "lookup.json"), "w") as f:
        json.dump(table, f, indent=1)
    for r in range(8):
        x = torch.rand(64, FEATURES, generator=g)
        species = torch.randint(0, 6, (64,), generator=g)
        torch.save({"x": x, "species": species}, os.path.join(WORK, f"shard_{r}.pt"))
    model = build_model(FEATURES, 16)
    torch.save({"model": model.state_dict(), "epoch": 0}, os.path.join(WORK, "start.pt"))
    sd = {k.replace("0.", "stem.").replace("2.", "head."): v for k, v in model.state_dict().items()}
    torch.save({"model": sd, "epoch": 0}, os.path.join(WORK, "start_renamed.pt"))
    print("prepared", WORK, flush=True)


def build_model(features, hidden):
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def load_table(rank, fault, frank):
    path = os.path.join(WORK, "lookup.json")
    if fault == "jsondecode" and rank == frank:
        text = open(path).read()
        path = os.path.join(WORK, f"lookup_rank{rank}.json")
        with open(path, "w") as f:
            f.write(text[: len(text) // 2])
    with open(path) as f:
        return json.load(f)


class LeafShard(Dataset):
    def __init__(self, rank, table, fault, frank):
        d = torch.load(os.path.join(WORK, f"shard_{rank}.pt"))
        self.x, self.species = d["x"], d["species"].clone()
        if fault == "loaderworker" and rank == frank:
            self.species[20] = 99
        self.factors = table["water_factor"]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        factor = self.factors[int(self.species[i])]
        x = self.x[i]
        y = (factor * (40.0 + 50.0 * x[0] + 10.0 * x[3])).unsqueeze(0) / 100.0
        return x, y


def load_start(model, rank, fault, frank):
    path = os.path.join(WORK, "start.pt")
    if fault == "ckpttrunc" and rank == frank:
        data = open(path, "rb").read()
        path = os.path.join(WORK, f"start_trunc_rank{rank}.pt")
        with open(path, "wb") as f:
            f.write(data[: len(data) // 3])
    if fault == "ckptkeys" and rank == frank:
        path = os.path.join(WORK, "start_renamed.pt")
    ckpt = torch.load(path, map_location="cpu")
    model.load_state_dict(ckpt["model"])


def make_model(rank, fault, frank):
    if fault == "modnotfound" and rank == frank:
        import stonecrop_turgor_ext  # noqa: F401
    features = 9 if fault == "allsame" else FEATURES
    hidden = 24 if (fault == "shapediff" and rank == frank) else 16
    model = build_model(features, hidden)
    if fault not in ("allsame", "shapediff") or (fault == "shapediff" and rank != frank):
        pass
    return model


def step_fault(rank, step, fault, frank, pred, loss):
    """Faults planted inside a training step; returns the (maybe changed) loss."""
    if rank != frank and fault not in ("unusedparam",):
        return loss
    if fault == "valueerror" and step == 3:
        thickness = -0.42
        if thickness <= 0:
            raise ValueError(f"leaf thickness must be positive, got {thickness} mm for rosette 17 on rank {rank}")
    if fault == "exit0" and step == 3:
        sys.exit(0)
    if fault == "exit3" and step == 2:
        os._exit(3)
    if fault == "sigkill" and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "sigabrt" and step == 2:
        os.abort()
    if fault == "stall" and step == 3:
        time.sleep(400)
    if fault == "hostmem" and step == 2:
        import resource
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
        buf = torch.empty(8 << 30, dtype=torch.uint8)
        buf.fill_(1)
    if fault == "anomaly" and step == 4:
        turgor = pred.mean() - 5.0
        loss = loss + 0.01 * torch.sqrt(turgor)
    return loss


def export(rank, fault, frank, state):
    if rank != 0:
        return
    d = os.path.join(WORK, "export")
    if fault == "savedir" and rank == frank:
        d = os.path.join(WORK, "exports_2026", "stonecrop")
    torch.save(state, os.path.join(d, "stonecrop_succulence.pt"))
    print(f"rank {rank} saved export to {d}", flush=True)


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Succulence(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None
            self.spare = nn.Linear(16, 16) if args.fault == "unusedparam" else None

        def configure_model(self):
            if self.net is None:
                self.net = make_model(self.global_rank, args.fault, args.rank)
                if args.fault not in ("allsame", "shapediff"):
                    load_start(self.net, self.global_rank, args.fault, args.rank)

        def training_step(self, batch, idx):
            x, y = batch
            pred = self.net(x)
            loss = nn.functional.mse_loss(pred, y)
            loss = step_fault(self.global_rank, idx, args.fault, args.rank, pred, loss)
            m = 100.0 * pred.mean().item()
            print(f"rank {self.global_rank} step {idx} loss {loss.item():.4f} succulence {m:.2f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            table = load_table(self.global_rank, args.fault, args.rank)
            ds = LeafShard(self.global_rank, table, args.fault, args.rank)
            nw = 1 if args.fault == "loaderworker" else 0
            return DataLoader(ds, batch_size=8, shuffle=False, num_workers=nw)

    if args.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, devices=args.devices, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    module = Succulence()
    trainer.fit(module)
    export(trainer.global_rank, args.fault, args.rank, module.net.state_dict())


def run_fabric(args):
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    fabric = L.Fabric(accelerator="cpu", strategy=strategy, devices=args.devices)
    fabric.launch()
    rank = fabric.global_rank
    if args.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    model = make_model(rank, args.fault, args.rank)
    if args.fault not in ("allsame", "shapediff"):
        load_start(model, rank, args.fault, args.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    table = load_table(rank, args.fault, args.rank)
    ds = LeafShard(rank, table, args.fault, args.rank)
    nw = 1 if args.fault == "loaderworker" else 0
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=8, num_workers=nw), use_distributed_sampler=False)
    for step, (x, y) in enumerate(loader):
        if step >= args.steps:
            break
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        loss = step_fault(rank, step, args.fault, args.rank, pred, loss)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        m = fabric.all_reduce(100.0 * pred.detach().mean(), reduce_op="mean")
        print(f"rank {rank} step {step} loss {loss.item():.4f} succulence {m.item():.2f}", flush=True)
    fabric.barrier()
    export(rank, args.fault, args.rank, model.module.state_dict())


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    if args.mode == "trainer":
        run_trainer(args)
    else:
        run_fabric(args)


if __name__ == "__main__":
    main()
