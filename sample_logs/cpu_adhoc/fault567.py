"""Batch 567, theme "basalt columns": a small regression job that predicts the cooling rate of basalt columns
from hexagonal-joint features (side count, column width, joint spacing ...). `--prepare` writes synthetic data
into /tmp/fault567_work: one shard per rank (shard_R.pt), a lookup table of lava-flow units (units.json), and a
start checkpoint (init.pt). The job is a Lightning 2.6.6 LightningModule under Trainer (or, with --fabric, a
lightning.fabric loop), DDP on gloo, CPU only, 6 steps. Each step every rank all-reduces its "hexfrac" metric
over its own gloo group whose timeout is --pg-timeout (12 s by default; start-up uses 120 s), prints
`rank R step S loss L hexfrac M`, and rank 0 saves export.pt at the end.

--fault NAME --rank N plants one fault:
  none           control, nothing planted
  keyerror       rank N looks up a lava-flow unit the table does not have (KeyError)
  missing_shard  rank N's shard file is missing (FileNotFoundError)
  ckpt_size      rank N loads a start checkpoint whose first layer is 12 wide, not 16 (load_state_dict size mismatch)
  weights_only   rank N loads a checkpoint that pickles a custom ColumnSurvey object with weights_only=True
  allreduce_size rank N all-reduces its metric as 7 values instead of 4 (gloo size mismatch)
  slow           rank N re-measures every column in pure Python for ~45 s at step 2; its peers time out
  nan            rank N's joint spacing becomes NaN; the job's own finiteness check raises FloatingPointError
  sigsegv        rank N sends itself SIGSEGV at step 3
  error_exit     rank N prints its own ERROR line and calls sys.exit(4)
  shape_all      every rank builds a 7-wide feature tensor for an 8-wide layer (shape bug, mat1/mat2)
  hostmem        rank N asks for a 16 PiB joint-distance matrix (CPU allocator refuses, nothing really allocated)
  worker_crash   rank N's DataLoader worker SIGKILLs itself
  (hang = slow with --pg-timeout 300, ended by `timeout 60`)

What happened (22 runs, torch 2.13.0+cpu, Lightning 2.6.6, gloo):
  none           np3 torchrun: 6 steps on every rank, export saved, exit 0.
  keyerror       KeyError 'flow_staffa' on rank N at step 2; peers fail with gloo Connection closed (np4 plown, np6 torchrun).
  missing_shard  FileNotFoundError shard_N_v2.pt in train_dataloader / before step 0; peers Connection closed
                 (np3 Fabric exit 1; np5 bash loop: nothing stops the loop, timeout ends it, exit 124).
  ckpt_size      load_state_dict size mismatch (12 vs 16) in setup() on rank N; peers Connection closed (np4 --tee, np7).
  weights_only   UnpicklingError: Unsupported global __main__.ColumnSurvey on rank 4 (np5, LOGLEVEL=INFO).
  allreduce_size gloo never says "size": the other ranks finish step 0 (silently wrong metric), rank N (and a
                 neighbour) time out after 12000 ms, the rest get Connection closed (np4 Fabric, np6).
  slow           peers time out after 12000 ms in the metric all_reduce; the slow rank gets Connection closed (bash
                 loop) or is SIGTERMed and Lightning's SIGTERM broadcast fails (torchrun; summary blames rank 0).
  hang           steps 0-1, then silence until timeout SIGTERMs torchrun; SIGKILL after 5 s, exit 137.
  nan            FloatingPointError from the script's own check on rank N at step 3 (np3 plown; np6 Fabric, where a
                 peer aborts with 'terminate called without an active exception' and the summary blames it).
  sigsegv        rank N exitcode -11 (SIGSEGV), no traceback; peers Connection closed / time out (np5, np8 --tee).
  error_exit     rank N's own ERROR line, exit 4; peers Connection closed (np4 LOGLEVEL=INFO, np7 plown).
  shape_all      every rank: mat1 and mat2 shapes cannot be multiplied (4x7 and 8x16) at step 0.
  hostmem        DefaultCPUAllocator: can't allocate memory (18014398509481984 bytes) on rank 3; summary blames rank 2 (SIGABRT).
  worker_crash   rank 1: DataLoader worker (pid N) is killed by signal: Killed.; peers Connection closed.
"""
import argparse, datetime, json, os, signal, sys, time

p = argparse.ArgumentParser()
p.add_argument("--prepare", action="store_true")
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--devices", type=int, default=0)
p.add_argument("--fabric", action="store_true")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--work", default="/tmp/fault567_work")
a = p.parse_args()

import torch
import torch.nn as nn
import torch.distributed as dist

W = a.work


class ColumnSurvey:
    def __init__(self, site):
        self.site = site


def build_model(width=16):
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


def prepare():
    os.makedirs(W, exist_ok=True)
    g = torch.Generator().manual_seed(567)
    for r in range(8):
        x = torch.rand(6 * 4, 8, generator=g)
        x[:, 0] = torch.randint(4, 8, (24,), generator=g).float()  # side count
        units = [f"flow_{i % 5}" for i in range(24)]
        torch.save({"x": x, "units": units}, f"{W}/shard_{r}.pt")
    json.dump({f"flow_{i}": 0.5 + 0.1 * i for i in range(5)}, open(f"{W}/units.json", "w"))
    torch.manual_seed(0)
    torch.save(build_model().state_dict(), f"{W}/init.pt")
    torch.save(build_model(12).state_dict(), f"{W}/init_w12.pt")
    torch.save({"model": build_model().state_dict(), "survey": ColumnSurvey("Giant's Causeway")}, f"{W}/init_survey.pt")
    print("prepared", W)


if a.prepare:
    prepare()
    sys.exit(0)

from torch.utils.data import Dataset, DataLoader


class ColumnShard(Dataset):
    def __init__(self, rank, fault_here):
        path = f"{W}/shard_{rank}.pt"
        if fault_here and a.fault == "missing_shard":
            path = f"{W}/shard_{rank}_v2.pt"
        d = torch.load(path)
        self.x, self.units = d["x"], d["units"]
        self.table = json.load(open(f"{W}/units.json"))
        self.fault_here = fault_here
        if fault_here and a.fault == "keyerror":
            self.units[9] = "flow_staffa"

    def __len__(self):
        return len(self.units)

    def __getitem__(self, i):
        if self.fault_here and a.fault == "worker_crash" and i == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        rate = self.table[self.units[i]]
        x = self.x[i]
        if a.fault == "shape_all":
            x = x[:7]
        return x, torch.tensor([rate, rate * 0.5, rate * 0.25, 1.0])


def step_faults(rank, step, feats):
    here = rank == a.rank
    if here and a.fault == "slow" and step == 2:
        t0 = time.time()
        acc = 0
        while time.time() - t0 < 45:
            for k in range(20000):
                acc += (k * 6) % 7
    if here and a.fault == "nan" and step == 3:
        feats = feats.clone()
        feats[:, 2] = float("nan")
    if here and a.fault == "sigsegv" and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if here and a.fault == "error_exit" and step == 2:
        print(f"ERROR rank {rank}: column-width histogram for flow unit flow_3 is empty; refusing to continue", flush=True)
        sys.exit(4)
    if here and a.fault == "hostmem" and step == 2:
        n = 1 << 24
        torch.empty((n, n, 8), dtype=torch.float64)
    return feats


def check_finite(t, what, rank):
    if not torch.isfinite(t).all():
        raise FloatingPointError(f"rank {rank}: {what} is not finite ({int((~torch.isfinite(t)).sum())} bad values)")


def metric_allreduce(group, rank, hexfrac):
    n = 7 if (rank == a.rank and a.fault == "allreduce_size") else 4
    t = torch.full((n,), hexfrac)
    dist.all_reduce(t, group=group)
    return float(t[0]) / dist.get_world_size()


def load_start(model, rank):
    here = rank == a.rank
    path = f"{W}/init.pt"
    if here and a.fault == "ckpt_size":
        path = f"{W}/init_w12.pt"
    if here and a.fault == "weights_only":
        sd = torch.load(f"{W}/init_survey.pt", weights_only=True)["model"]
    else:
        sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd)


def make_loader(rank):
    here = rank == a.rank
    nw = 1 if (here and a.fault == "worker_crash") else 0
    return DataLoader(ColumnShard(rank, here), batch_size=4, shuffle=False, num_workers=nw)


def main_trainer():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class ColumnModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model()

        def setup(self, stage):
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
            load_start(self.net, self.global_rank)

        def train_dataloader(self):
            return make_loader(self.global_rank)

        def training_step(self, batch, i):
            rank = self.global_rank
            x, y = batch
            x = step_faults(rank, i, x)
            pred = self.net(x)
            loss = nn.functional.mse_loss(pred, y)
            check_finite(loss, "loss", rank)
            hexfrac = metric_allreduce(self.group, rank, float((x[:, 0] == 6).float().mean()))
            print(f"rank {rank} step {i} loss {loss.item():.4f} hexfrac {hexfrac:.3f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), f"{W}/export.pt")
                print("rank 0 saved export", f"{W}/export.pt", flush=True)

    devices = a.devices or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=1,
                         strategy=DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=120)),
                         max_steps=a.steps, max_epochs=1, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ColumnModule())
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main_fabric():
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    fabric = Fabric(accelerator="cpu", devices=devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=120)))
    fabric.launch()
    rank = fabric.global_rank
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    net = build_model()
    load_start(net, rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    loader = make_loader(rank)
    for i, (x, y) in enumerate(loader):
        if i >= a.steps:
            break
        x = step_faults(rank, i, x)
        loss = nn.functional.mse_loss(net(x), y)
        check_finite(loss, "loss", rank)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        hexfrac = metric_allreduce(group, rank, float((x[:, 0] == 6).float().mean()))
        print(f"rank {rank} step {i} loss {loss.item():.4f} hexfrac {hexfrac:.3f}", flush=True)
    if rank == 0:
        torch.save(net.state_dict(), f"{W}/export.pt")
        print("rank 0 saved export", f"{W}/export.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if a.fabric:
        main_fabric()
    else:
        main_trainer()
