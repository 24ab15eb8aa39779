r"""fault607.py -- batch 607 fault job, theme "polynya open water".

A tiny regression model ("OpenWaterNet") predicts the open-water fraction of polynya grid
cells from 8 synthetic sea-ice features. `--prepare` writes into /tmp/fault607_work:
per-rank shards (shard_R.pt: features, region ids, targets), a JSON lookup table
(regions.json: region id -> mean ice thickness, added to each target), and a start
checkpoint (start.pt). Training: torch.distributed gloo on CPU, process-group timeout 12 s
(--pg-timeout), 6 steps; every rank prints `rank R step S loss L open_water_frac M` each
step; rank 0 writes an export (export.pt) at the end.

Modes: --mode plain (torch.distributed + DDP, own loop), --mode trainer (LightningModule +
L.Trainer, DDPStrategy gloo), --mode fabric (lightning.fabric.Fabric, own loop).
All three modes run the same step body (manual optimisation in the Trainer).

Faults (--fault NAME --rank N; "all" = every rank):
  none              control run
  zerodiv           rank N: open-water fraction divided by its ice-free cell count, which is 0 -> ZeroDivisionError
  json_decode       rank N reads a truncated copy of the region lookup table -> json.JSONDecodeError
  lookup_key        rank N looks up a region id missing from the table -> KeyError
  loader_worker     rank N's DataLoader (num_workers=1) indexes past its shard in the worker -> IndexError in worker
  ckpt_truncated    rank N loads a truncated copy of start.pt -> torch.load fails
  save_missing_dir  rank N (0) saves the export into a folder that does not exist
  skip_barrier      rank N skips the pre-export barrier and waits for rank 0's export file; others time out
  quiet_exit        rank N calls os._exit(0) after step 2
  exit3             rank N calls os._exit(3) after step 2, printing nothing
  sigkill           rank N sends itself SIGKILL after step 3
  sigabrt           rank N sends itself SIGABRT after step 3
  anomaly_nan       rank N's loss becomes NaN at step 2 under torch.autograd.set_detect_anomaly(True)
  clip_nonfinite    rank N's gradients become inf at step 2; clip_grad_norm_(error_if_nonfinite=True)
  module_missing    rank N imports a module that does not exist (polynya_icebridge)
  host_mem          rank N caps RLIMIT_AS to its address space + 1 GiB then allocates a 4 GiB ice map -> MemoryError/RuntimeError
  stall             rank N sleeps 200 s after step 2; others time out (or, with --pg-timeout 300, the run hangs)
  unused_param      all ranks: model has an unused head under DDP without find_unused_parameters
  shape_all         all ranks: the config says 9 features, shards have 8 -> matmul shape error
  port_in_use       launch-time: the master port is held by another socket (done by the runner, not the script)

Runs (one line per kept log; launcher forms and labels in .scratch/readme_607.md):
  polynya_none_np3_rnone_pltorchrun: Control run: all three ranks print six steps, rank 0 saves the export, exit 0. (exit 0)
  polynya_zerodiv_np5_r2_pltorchrun: Rank 2 raises ZeroDivisionError at step 3 (open-water sum over zero ice-free cells); the others fail in all_reduce with gloo Connection closed by peer; torchrun names rank 2 as root cause. (exit 1)
  polynya_json_decode_np4_r3_plfabric: Rank 3 reads a truncated region lookup table and raises json.decoder.JSONDecodeError before training; ranks 0-2 fail with gloo Connection closed by peer. (exit 1)
  polynya_loader_worker_np5_r4_plbashloop: Rank 4's DataLoader worker raises IndexError (Caught IndexError in DataLoader worker process 0) on the step-5 batch; ranks 0-3 fail in all_reduce with Connection closed by peer. (exit 1)
  polynya_ckpt_truncated_np6_r0_pltee: Rank 0 torch.load-s a truncated start checkpoint: PytorchStreamReader failed reading zip archive; the others fail with Connection closed by peer; torchrun --tee 3 prefixes every line with [defaultN]. (exit 1)
  polynya_save_missing_dir_np3_r0_plown: Lightning launches its own 3 processes (pg timeout 60 s); after six steps rank 0's torch.save fails: Parent directory /tmp/job_work/exports/polynya_run does not exist; ranks 1-2 fail with Connection closed by peer. (exit 1)
  polynya_skip_barrier_np5_r3_plbashloop: Rank 3 skips the pre-export barrier; ranks 1, 2, 4 time out in barrier after 12000ms, rank 0 sees Connection closed by peer; rank 3 stays silent and the outer timeout ends the loop (exit 124). (exit 124)
  polynya_quiet_exit_np6_r5_plfabric: Rank 5 os._exit(0)s after step 2 with no message; the others fail in the step-3 all_reduce with gloo Connection reset/closed by peer; torchrun's summary lists ranks 0-4 (root cause rank 0) and not rank 5. (exit 1)
  polynya_exit3_np4_r1_plloglevel: Rank 1 os._exit(3)s after step 2 with no message; ranks 0, 2, 3 fail with gloo Connection closed/reset by peer; torchrun (LOGLEVEL=INFO) reports root cause rank 1 exitcode 3. (exit 1)
  polynya_sigkill_np8_r6_plbashloop: Rank 6 SIGKILLs itself after step 3; bash prints 'Killed' for that child and rank 6 leaves no traceback; the seven others fail with gloo Connection reset/closed by peer (rank 2: recv timeout in backward). The loop's exit code is 1 (it keeps the last non-zero rank status), not 137. (exit 1)
  polynya_anomaly_nan_np5_r1_plfabric: Rank 1's step-2 loss is NaN under set_detect_anomaly(True): UserWarning Error detected in PowBackward0, then RuntimeError Function 'PowBackward0' returned nan values; the others fail with Connection closed by peer; torchrun root cause rank 1. (exit 1)
  polynya_clip_nonfinite_np3_r2_plown: Lightning launches its own 3 processes (pg timeout 60 s); rank 2's step-2 gradients are inf and clip_grad_norm_(error_if_nonfinite=True) raises RuntimeError (total norm non-finite); ranks 0-1 fail with Connection closed by peer. (exit 1)
  polynya_module_missing_np4_r2_pltorchrun: Rank 2 raises ModuleNotFoundError: No module named 'polynya_icebridge' before the first step; the others fail with gloo Connection closed by peer; torchrun root cause rank 2. (exit 1)
  polynya_host_mem_np5_r0_plbashloop: Rank 0 caps RLIMIT_AS at its address space + 1 GiB then allocates 4 GiB: RuntimeError DefaultCPUAllocator can't allocate memory (4294967296 bytes, error 12); ranks 1-4 fail with Connection closed by peer. (exit 1)
  polynya_stall_np3_r1_plbashloop: Rank 1 sleeps 200 s after step 2 with --pg-timeout 300; the log stops after the three step-2 lines with no error until timeout 60 kills the loop (exit 124); the leftover ranks were then killed by process group. (exit 124)
  polynya_unused_param_np6_rall_plbashloop: All six ranks have an unused parameter under DDP without find_unused_parameters; each prints step 0 and raises Expected to have finished reduction in the prior iteration (indices 4 5). (exit 1)
  polynya_shape_all_np5_rall_pltee: All five ranks raise RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x8 and 9x16) in the first forward (config says 9 features, shards have 8); torchrun --tee 3 prefixes lines with [defaultN]. (exit 1)
  polynya_port_in_use_np3_rnone_pltorchrun: Port 37218 was held by a python socket first; torchrun fails at once with DistNetworkError EADDRINUSE before any worker starts. (exit 1)
  polynya_lookup_key_np7_r3_plloglevel: Rank 3 raises KeyError: 'polynya_2' looking up a region id absent from the table on the step-5 batch; the six others fail with Connection closed by peer; torchrun (LOGLEVEL=INFO) root cause rank 3. (exit 1)
  polynya_sigabrt_np5_r4_pltorchrun: Rank 4 SIGABRTs itself after step 3 (no traceback); the others fail with Connection reset/closed by peer; torchrun root cause rank 4 exitcode -6 (SIGABRT). (exit 1)
  Dropped: save_missing_dir under plown with the 12 s timeout (DistStoreError at start-up: children too slow on a loaded host).
"""
import argparse, json, os, sys, time, signal, math
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader

WORK = "/tmp/fault607_work"
NFEAT = 8


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="plain", choices=["plain", "trainer", "fabric"])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", default="-1")
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--steps", type=int, default=6)
    return p.parse_args()


class OpenWaterNet(nn.Module):
    def __init__(self, nfeat=NFEAT, unused_head=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(nfeat, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        if unused_head:
            self.lead_head = nn.Linear(16, 1)  # never used in forward

    def forward(self, x):
        return torch.sigmoid(self.head(self.body(x))).squeeze(-1)


def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(607)
    table = {str(i): round(0.1 + 0.05 * i, 3) for i in range(12)}
    with open(f"{WORK}/regions.json", "w") as f:
        json.dump(table, f)
    with open(f"{WORK}/regions.json") as f:
        txt = f.read()
    with open(f"{WORK}/regions_truncated.json", "w") as f:
        f.write(txt[: len(txt) // 2])
    for r in range(world):
        x = torch.rand(64, NFEAT, generator=g)
        reg = torch.randint(0, 12, (64,), generator=g)
        y = (x[:, :3].mean(1) * 0.6).clamp(0, 1)
        torch.save({"x": x, "region": reg, "y": y}, f"{WORK}/shard_{r}.pt")
    torch.manual_seed(607)
    torch.save(OpenWaterNet().state_dict(), f"{WORK}/start.pt")
    with open(f"{WORK}/start.pt", "rb") as f:
        b = f.read()
    with open(f"{WORK}/start_truncated.pt", "wb") as f:
        f.write(b[: len(b) // 3])
    print(f"prepared {world} shards, regions.json, start.pt in {WORK}")


class Ctx:
    def __init__(self, args, rank, world):
        self.args, self.rank, self.world = args, rank, world
        self.fault = args.fault
        fr = args.rank
        self.hit = args.fault != "none" and (fr == "all" or int(fr) == rank)


class ShardSet(Dataset):
    def __init__(self, ctx, table):
        d = torch.load(f"{WORK}/shard_{ctx.rank}.pt", weights_only=True)
        self.x, self.region, self.y = d["x"], d["region"], d["y"]
        self.table = table
        self.ctx = ctx
        if ctx.hit and ctx.fault == "shape_all":
            self.x = self.x  # config says 9 features; the model below is built with 9

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.ctx.hit and self.ctx.fault == "loader_worker" and i >= 40:
            i = i + len(self.x)  # an off-by-shard index inside the worker
        x = self.x[i]
        reg = int(self.region[i])
        key = str(reg)
        if self.ctx.hit and self.ctx.fault == "lookup_key" and i >= 40:
            key = "polynya_" + key
        thick = self.table[key]
        return x, self.y[i] + 0.1 * thick


def early(ctx):
    """Start-of-run: lookup table, start checkpoint, imports, memory."""
    if ctx.hit and ctx.fault == "module_missing":
        import polynya_icebridge  # noqa: F401
    path = f"{WORK}/regions.json"
    if ctx.hit and ctx.fault == "json_decode":
        path = f"{WORK}/regions_truncated.json"
    with open(path) as f:
        table = json.load(f)
    ck = f"{WORK}/start.pt"
    if ctx.hit and ctx.fault == "ckpt_truncated":
        ck = f"{WORK}/start_truncated.pt"
    state = torch.load(ck, map_location="cpu", weights_only=True)
    if ctx.hit and ctx.fault == "host_mem":
        import resource
        vm = [l for l in open("/proc/self/status") if l.startswith("VmSize")][0]
        lim = int(vm.split()[1]) * 1024 + 2**30  # current address space + 1 GiB
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        icemap = torch.zeros(2**30, dtype=torch.float32)  # 4 GiB ice concentration map
        icemap += 1
    return table, state


def build_model(ctx, state):
    nfeat = 9 if ctx.fault == "shape_all" else NFEAT
    m = OpenWaterNet(nfeat=nfeat, unused_head=(ctx.fault == "unused_param"))
    if nfeat == NFEAT:
        m.load_state_dict(state, strict=False)
    return m


def loader(ctx, table):
    nw = 1 if ctx.fault == "loader_worker" else 0
    return DataLoader(ShardSet(ctx, table), batch_size=8, shuffle=False, num_workers=nw)


def step_body(ctx, model, opt, batch, step, backward):
    x, y = batch
    if ctx.hit and ctx.fault == "anomaly_nan":
        torch.autograd.set_detect_anomaly(True)
    pred = model(x)
    if ctx.hit and ctx.fault == "anomaly_nan" and step == 2:
        pred = torch.log(pred - pred.detach() - 1.0)  # log of a negative -> NaN
    loss = ((pred - y) ** 2).mean()
    opt.zero_grad()
    backward(loss)
    if ctx.hit and ctx.fault == "clip_nonfinite" and step == 2:
        for p in model.parameters():
            p.grad.fill_(float("inf"))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    opt.step()
    open_cells = float(pred.detach().sum())
    ice_free = len(pred)
    if ctx.hit and ctx.fault == "zerodiv" and step == 3:
        ice_free = int((pred.detach() > 2.0).sum())  # a threshold no sigmoid output passes -> 0 cells
    frac = open_cells / ice_free
    t = torch.tensor([frac])
    dist.all_reduce(t)
    frac = t.item() / ctx.world
    print(f"rank {ctx.rank} step {step} loss {loss.item():.5f} open_water_frac {frac:.4f}", flush=True)
    if ctx.hit and step == 2:
        if ctx.fault == "quiet_exit":
            os._exit(0)
        if ctx.fault == "exit3":
            os._exit(3)
        if ctx.fault == "stall":
            time.sleep(200)
    if ctx.hit and step == 3:
        if ctx.fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.fault == "sigabrt":
            os.kill(os.getpid(), signal.SIGABRT)
    return loss


def finish(ctx, model):
    exp_dir = WORK
    if ctx.hit and ctx.fault == "save_missing_dir":
        exp_dir = f"{WORK}/exports/polynya_run"
    if ctx.hit and ctx.fault == "skip_barrier":
        # skips the barrier, waits for rank 0's export file instead
        for _ in range(40):
            if os.path.exists(f"{WORK}/export_done"):
                break
            time.sleep(1)
    else:
        dist.barrier()
    if ctx.rank == 0 or (ctx.hit and ctx.fault == "save_missing_dir"):
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(sd, f"{exp_dir}/export_r{ctx.rank}.pt")
        print(f"rank {ctx.rank} saved export to {exp_dir}/export_r{ctx.rank}.pt", flush=True)
    dist.barrier()


def run_plain(args):
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    ctx = Ctx(args, dist.get_rank(), dist.get_world_size())
    table, state = early(ctx)
    model = DDP(build_model(ctx, state))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = iter(loader(ctx, table))
    for step in range(args.steps):
        step_body(ctx, model, opt, next(it), step, lambda l: l.backward())
    finish(ctx, model.module)
    dist.destroy_process_group()


def run_fabric(args):
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy
    fabric = L.Fabric(accelerator="cpu", devices=args.devices or int(os.environ.get("WORLD_SIZE", 1)),
                      strategy=DDPStrategy(process_group_backend="gloo",
                                           timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    ctx = Ctx(args, fabric.global_rank, fabric.world_size)
    table, state = early(ctx)
    model = build_model(ctx, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    dl = fabric.setup_dataloaders(loader(ctx, table), use_distributed_sampler=False)
    it = iter(dl)
    for step in range(args.steps):
        step_body(ctx, model, opt, next(it), step, fabric.backward)
    finish(ctx, model.module)


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class PolynyaModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = None

        def configure_model(self):
            if self.net is not None:
                return
            self.ctx = Ctx(args, self.global_rank, self.trainer.world_size)
            self.table, state = early(self.ctx)
            self.net = build_model(self.ctx, state)

        def train_dataloader(self):
            return loader(self.ctx, self.table)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.1)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, idx):
            opt = self.optimizers()
            step_body(self.ctx, self, opt, batch, self.global_step, self.manual_backward)

        def on_train_end(self):
            finish(self.ctx, self.net)

    devices = args.devices or int(os.environ.get("WORLD_SIZE", 1))
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=args.steps,
                        strategy=DDPStrategy(process_group_backend="gloo",
                                             timeout=timedelta(seconds=args.pg_timeout)),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(PolynyaModule())


if __name__ == "__main__":
    a = parse()
    if a.prepare:
        prepare()
    elif a.mode == "plain":
        run_plain(a)
    elif a.mode == "fabric":
        run_fabric(a)
    else:
        run_trainer(a)
