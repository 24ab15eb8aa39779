"""Batch 603 fault script: "saxifrage rock cracks".

A small regression job that predicts how wide a rock crack gets once a saxifrage
("stone-breaker") root settles in it.  Each rank reads its own shard of crack
observations from /tmp/fault603_work (made by --prepare), maps the crack's rock
type through a lookup table, starts from a checkpoint, trains 6 steps with DDP on
gloo (CPU) and rank 0 saves an export.  Every rank prints
`rank R step S loss L crack_width M` each step.

Modes: --mode trainer (Lightning Trainer; started by torchrun, by a bash loop, or
by Lightning itself with --devices W) and --mode fabric (lightning.fabric.Fabric
with its own loop, under torchrun).

Faults (--fault NAME --rank N), one per run:
  none          control, nothing planted
  rock_key      rank N meets a rock type that is not in the lookup table (KeyError)
  shard_missing rank N's shard file is looked up under a name that does not exist (FileNotFoundError)
  ckpt_size     rank N loads a checkpoint saved for a wider root model (load_state_dict size mismatch)
  ckpt_pickle   rank N loads a checkpoint that pickles a custom class; torch.load(weights_only=True) refuses it
  gather_size   rank N all-reduces a crack-width tensor of the wrong length (gloo size mismatch)
  slow_root     rank N does ~60 s of pure-Python work at step 2; the others time out in the gradient all-reduce
  hang_root     rank N sleeps forever at step 2 (use with --pg-timeout 300; the outer `timeout` ends it)
  nan_width     rank N's crack width becomes NaN at step 3; the script's own check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_all     every rank builds its feature matrix one column short (matmul shape error on all ranks)
  worker_crash  rank N's DataLoader worker kills itself with SIGKILL

What happened (logs saxifrage_<fault>_np<W>_r<N>_<form>.log):
  none          np3 pltorchrun, np5 plown: all ranks ran 6 steps, rank 0 saved the export, exit 0
  rock_key      np4 r2 pltee, np4 r3 plbashloop: KeyError 'limestone_scree' on rank N at step 1; peers: gloo connection closed; exit 1
  shard_missing np5 r3 plloglevel, np3 r0 plown: FileNotFoundError shard_rN_v2.pt on rank N before any step; peers: connection closed; exit 1
  ckpt_size     np4 r1 pltorchrun, np8 r7 plfabric: load_state_dict size mismatch (48 vs 32) on rank N; peers: connection closed; exit 1
  ckpt_pickle   np3 r2 plfabric: UnpicklingError "Weights only load failed" on rank 2; peers: connection closed; exit 1
  gather_size   np5 r4 pltorchrun, np3 r0 plfabric: no size error from gloo; peers print a wrong crack_width, then 12000ms send/recv timeouts; exit 1
  slow_root     np4 r3 pltee (exit 1), np6 r1 plbashloop (exit 124): peers raise gloo 12000ms timeouts while rank N is busy
  hang_root     np3 r1 pltorchrun, --pg-timeout 300: output stops after step 1, no error, timeout ended it (exit 137)
  nan_width     np5 r2 plfabric, np8 r6 pltorchrun: FloatingPointError on rank N at step 3; peers: connection closed / timeouts; exit 1
  segv          np4 r1 plloglevel (exit 1, agent shows -11), np7 r4 plown (Lightning kills all after code -11; exit 137)
  error_exit    np6 r3 pltorchrun: rank 3 prints its ERROR line and exits 4; torchrun summary exitcode 4; exit 1
  shape_all     np3 plbashloop: every rank RuntimeError mat1 and mat2 shapes cannot be multiplied (8x7 and 8x32); exit 1
  worker_crash  np4 r2 pltorchrun: DataLoader worker (pid ...) is killed by signal: Killed on rank 2; exit 1
  (dropped: rock_key np6 r5 plbashloop, no output at all before the 100 s timeout on the loaded machine)
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

WORK = "/tmp/fault603_work"
ROCKS = ["granite", "gneiss", "schist", "limestone", "basalt", "slate"]
NFEAT = 8


def prepare(world_max=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(603)
    table = {r: i for i, r in enumerate(ROCKS)}
    with open(os.path.join(WORK, "rock_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(world_max):
        n = 64
        feats = torch.randn(n, NFEAT - 1, generator=g)
        rocks = [ROCKS[(i * 7 + r) % len(ROCKS)] for i in range(n)]
        width = feats.sum(1, keepdim=True) * 0.3 + 1.0
        torch.save({"feats": feats, "rocks": rocks, "width": width}, os.path.join(WORK, f"shard_r{r}.pt"))
    torch.save(RootNet().state_dict(), os.path.join(WORK, "init_root.pt"))
    torch.save(RootNet(hidden=48).state_dict(), os.path.join(WORK, "init_root_wide.pt"))

    class CrackMeta:  # a custom class: weights_only loading refuses it
        pass
    import types
    mod = types.ModuleType("saxifrage_meta")
    CrackMeta.__module__ = "saxifrage_meta"
    CrackMeta.__qualname__ = "CrackMeta"
    mod.CrackMeta = CrackMeta
    sys.modules["saxifrage_meta"] = mod
    torch.save({"state": RootNet().state_dict(), "meta": CrackMeta()}, os.path.join(WORK, "init_root_meta.pt"))
    print("prepared", WORK)


class RootNet(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.root = nn.Linear(NFEAT, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.root(x)))


class CrackShard(Dataset):
    def __init__(self, rank, fault, frank):
        name = f"shard_r{rank}.pt"
        if fault == "shard_missing" and rank == frank:
            name = f"shard_r{rank}_v2.pt"
        d = torch.load(os.path.join(WORK, name), weights_only=True)
        with open(os.path.join(WORK, "rock_table.json")) as f:
            self.table = json.load(f)
        self.feats, self.rocks, self.width = d["feats"], d["rocks"], d["width"]
        if fault == "rock_key" and rank == frank:
            self.rocks[13] = "limestone_scree"
        self.fault, self.rank, self.frank = fault, rank, frank

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.frank and i >= 20:
            info = torch.utils.data.get_worker_info()
            if info is not None:
                os.kill(os.getpid(), signal.SIGKILL)
        rock = torch.tensor([self.table[self.rocks[i]] / len(ROCKS)])
        x = torch.cat([self.feats[i], rock])
        if self.fault == "shape_all":
            x = x[:-1]
        return x, self.width[i]


def loader(rank, a):
    nw = 1 if a.fault == "worker_crash" else 0
    return DataLoader(CrackShard(rank, a.fault, a.rank), batch_size=8, shuffle=False, num_workers=nw)


def load_start(model, rank, a):
    path = os.path.join(WORK, "init_root.pt")
    if a.fault == "ckpt_size" and rank == a.rank:
        path = os.path.join(WORK, "init_root_wide.pt")
    if a.fault == "ckpt_pickle" and rank == a.rank:
        path = os.path.join(WORK, "init_root_meta.pt")
    sd = torch.load(path, weights_only=True)
    if "state" in sd:
        sd = sd["state"]
    model.load_state_dict(sd)
    print(f"rank {rank} loaded start checkpoint {path}", flush=True)


def shorten_timeout(a):
    # start-up ran under a long timeout; the collectives get the short one
    try:
        dist.barrier()
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=a.pg_timeout), None)
    except Exception as e:  # pragma: no cover
        print(f"could not shorten the PG timeout: {e}", flush=True)


def fault_at_step(step, rank, a):
    if rank != a.rank:
        return
    if a.fault == "slow_root" and step == 2:
        t0, acc = time.time(), 0
        while time.time() - t0 < 60:
            for k in range(20000):
                acc += k * k % 7
    if a.fault == "hang_root" and step == 2:
        while True:
            time.sleep(5)
    if a.fault == "segv" and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if a.fault == "error_exit" and step == 2:
        print(f"ERROR rank {rank}: crack survey for shard_r{rank} reports 0 valid fissures; aborting", flush=True)
        sys.exit(4)


def step_metric(width_pred, step, rank, a):
    m = width_pred.detach().mean().reshape(1)
    if a.fault == "nan_width" and rank == a.rank and step == 3:
        m = m * float("nan")
    if not torch.isfinite(m).all():
        raise FloatingPointError(f"rank {rank} step {step}: crack_width is not finite ({m.item()})")
    if a.fault == "gather_size" and rank == a.rank and step == 2:
        m = torch.cat([m, m, m])
    dist.all_reduce(m)
    return m[0].item() / dist.get_world_size()


def run_trainer(a):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = RootNet()

        def on_train_start(self):
            shorten_timeout(a)
            load_start(self.net, self.global_rank, a)

        def training_step(self, batch, idx):
            x, y = batch
            r = self.global_rank
            fault_at_step(idx, r, a)
            pred = self.net(x)
            loss = ((pred - y) ** 2).mean()
            m = step_metric(pred, idx, r, a)
            print(f"rank {r} step {idx} loss {loss.item():.4f} crack_width {m:.4f}", flush=True)
            return loss

        def train_dataloader(self):
            return loader(self.global_rank, a)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = pl.Trainer(
        accelerator="cpu", devices=a.devices, num_nodes=1, max_steps=6,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=max(a.pg_timeout, 120))),
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    lit = Lit()
    trainer.fit(lit)
    if trainer.global_rank == 0:
        torch.save(lit.net.state_dict(), os.path.join(WORK, "export_root.pt"))
        print(f"rank 0 saved export {os.path.join(WORK, 'export_root.pt')}", flush=True)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=a.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=max(a.pg_timeout, 120))))
    fabric.launch()
    r = fabric.global_rank
    shorten_timeout(a)
    net = RootNet()
    load_start(net, r, a)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    dl = fabric.setup_dataloaders(loader(r, a), use_distributed_sampler=False)
    for idx, (x, y) in enumerate(dl):
        if idx >= 6:
            break
        fault_at_step(idx, r, a)
        pred = net(x)
        loss = ((pred - y) ** 2).mean()
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        m = step_metric(pred, idx, r, a)
        print(f"rank {r} step {idx} loss {loss.item():.4f} crack_width {m:.4f}", flush=True)
    fabric.barrier()
    if r == 0:
        torch.save(net.module.state_dict(), os.path.join(WORK, "export_root.pt"))
        print(f"rank 0 saved export {os.path.join(WORK, 'export_root.pt')}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    torch.manual_seed(603)
    if a.mode == "fabric":
        run_fabric(a)
    else:
        run_trainer(a)


if __name__ == "__main__":
    main()
