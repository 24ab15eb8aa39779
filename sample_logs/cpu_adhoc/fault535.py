"""Batch 535 fault script: saffron crocus harvest yield forecasting (CPU, gloo, Lightning 2.6.6).

Each rank reads its own shard of field plots (corm density, flowering days, rain, soil temperature, region id)
and trains a small regressor that forecasts the dried-stigma yield (kg/ha). Rank 0 exports the model at the end.
`--prepare` writes the synthetic shards, the region lookup table and the starting checkpoint.

Launch forms: plown (python fault535.py --devices W, Lightning starts the other ranks), pltorchrun / pltee /
plloglevel (under torchrun), plfabric (--fabric, lightning.fabric.Fabric with its own loop), plbashloop (one
python per rank with MASTER_ADDR/MASTER_PORT/NODE_RANK/LOCAL_RANK/WORLD_SIZE).

Faults (--fault NAME --rank N):
  none          control, nothing planted
  keyerror      rank N's plots name a region ("Pampore-East") missing from the region lookup table -> KeyError
  missing_shard rank N's shard file is renamed away before it is read -> FileNotFoundError
  ckpt_size     rank N loads a starting checkpoint made for a wider model (32 hidden units) -> size mismatch
  wrong_size    rank N all-reduces a 5-region yield vector while its peers send 4 regions (collective size)
  slow_rank     rank N spends ~40 s in pure-Python corm-count smoothing at step 2; peers time out (12 s)
                (with --pg-timeout 300 the smoothing runs ~240 s, nobody times out and the job hangs until `timeout` ends it)
  nan           rank N's rainfall feature turns into NaN; the script's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 3
  error_exit    rank N prints its own ERROR line about a harvest-date gap and calls sys.exit(4)
  shape_bug     every rank concatenates the soil-temperature column twice -> matmul shape error on all ranks
  host_mem      rank N caps its address space (RLIMIT_AS) and buffers all stigma images -> MemoryError
  worker_crash  rank N's DataLoader worker is SIGKILLed while loading a batch

What happened (runs of 2026-12-07, machine load ~30 from other jobs, so most runs used --pg-timeout 45-80):
  none          np3 pltorchrun: 6 steps on every rank, export written, exit 0
  keyerror      np3 r2 plbashloop / np4 r1 plown: KeyError 'Pampore-East' at step 2, peers 'Connection closed by peer'
  missing_shard np5 r3 pltee: FileNotFoundError in train_dataloader(), peers fail in Lightning's barrier
  ckpt_size     np4 r1 plfabric / np7 r6 pltorchrun: load_state_dict size mismatch [32, 6] vs [16, 6], peers fail in DDP's shape check
  wrong_size    np4 r3 pltorchrun: no size error from gloo; rank 3 stuck, all ranks time out after 45 s, torchrun blames rank 0
  slow_rank     np5 r2 plloglevel: peers 'Timed out waiting 12000ms' at step 2; np3 r1 pltorchrun (--pg-timeout 300): silent hang, timeout killed it (137)
  nan           np3 r2 plfabric: FloatingPointError from the script's own check at step 2
  sigsegv       np4 r0 pltee / np6 r3 plloglevel: exitcode -11 at step 3, no traceback
  error_exit    np5 r4 pltorchrun: 'ERROR rank 4: harvest dates ...' then exitcode 4
  shape_bug     np3 plloglevel: 'mat1 and mat2 shapes cannot be multiplied (8x7 and 6x16)' on all ranks, no step printed
  host_mem      np4 r1 pltorchrun: bare MemoryError at step 3
  worker_crash  np3 r0 plloglevel: 'DataLoader worker (pid N) is killed by signal: Killed.' on rank 0
"""
import argparse, os, sys, signal, time, json, resource
from datetime import timedelta
import torch, torch.nn as nn, torch.distributed as dist

WORK = "/tmp/fault535_work"
NREG = 4
REGIONS = ["Pampore", "Budgam", "Kishtwar", "Srinagar"]

def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--fabric", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    return p.parse_args()

def make_model(hidden=16):
    return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 1))

def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(535)
    for r in range(world):
        n = 48
        x = torch.rand(n, 5, generator=g)
        reg = torch.randint(0, NREG, (n,), generator=g)
        y = (x @ torch.tensor([2.0, 1.5, -0.7, 0.4, 0.9]) + 0.3 * reg).unsqueeze(1)
        torch.save({"x": x, "region": [REGIONS[i] for i in reg.tolist()], "y": y}, f"{WORK}/plots_shard{r}.pt")
    with open(f"{WORK}/region_lookup.json", "w") as f:
        json.dump({name: i / NREG for i, name in enumerate(REGIONS)}, f)
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), f"{WORK}/crocus_init.pt")
    torch.save(make_model(32).state_dict(), f"{WORK}/crocus_init_wide32.pt")
    print("prepared", WORK)

class Plots(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        self.rank, self.fault, self.frank = rank, fault, frank
        path = f"{WORK}/plots_shard{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/plots_shard{rank}_2026harvest.pt"   # the renamed-away shard
        d = torch.load(path)
        self.lookup = json.load(open(f"{WORK}/region_lookup.json"))
        self.x, self.region, self.y = d["x"], list(d["region"]), d["y"]
        if fault == "keyerror" and rank == frank:
            self.region[17] = "Pampore-East"
        if fault == "nan" and rank == frank:
            self.x[20:, 2] = float("nan")
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.frank and i >= 24:
            if torch.utils.data.get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
        reg = torch.tensor([self.lookup[self.region[i]]])
        return torch.cat([self.x[i], reg]), self.y[i]

def loader(rank, a):
    nw = 1 if a.fault == "worker_crash" else 0
    return torch.utils.data.DataLoader(Plots(rank, a.fault, a.rank), batch_size=8, shuffle=False, num_workers=nw)

def load_start(model, rank, a):
    path = f"{WORK}/crocus_init.pt"
    if a.fault == "ckpt_size" and rank == a.rank:
        path = f"{WORK}/crocus_init_wide32.pt"
    model.load_state_dict(torch.load(path, weights_only=True))

def step_body(model, batch, step, rank, world, a):
    x, y = batch
    if a.fault == "shape_bug":
        x = torch.cat([x, x[:, 3:4]], dim=1)      # soil temperature twice
    if a.fault == "slow_rank" and rank == a.rank and step == 2:
        t0 = time.time(); s = 0
        dur = 40 if a.pg_timeout < 60 else 240
        while time.time() - t0 < dur:
            s += sum(i * i for i in range(2000))   # corm-count smoothing, pure Python
    if a.fault == "sigsegv" and rank == a.rank and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if a.fault == "error_exit" and rank == a.rank and step == 2:
        print(f"ERROR rank {rank}: harvest dates for plot block 7 jump from 2026-10-28 to 2026-11-19; refusing to forecast", flush=True)
        sys.exit(4)
    if a.fault == "host_mem" and rank == a.rank and step == 3:
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (384 << 20), resource.RLIM_INFINITY))
        images = []
        for k in range(64):
            images.append(bytearray(64 << 20))     # stigma image buffers
    pred = model(x)
    if not torch.isfinite(x).all() or not torch.isfinite(pred).all():
        raise FloatingPointError(f"rank {rank} step {step}: non-finite yield forecast (rainfall feature has NaN)")
    loss = nn.functional.mse_loss(pred, y)
    per_region = torch.zeros(NREG + (1 if a.fault == "wrong_size" and rank == a.rank and step == 2 else 0))
    per_region[:NREG] += loss.detach()
    dist.all_reduce(per_region)
    mae = (pred - y).abs().mean().item()
    print(f"rank {rank} step {step} loss {loss.item():.4f} yield_mae_kg_ha {mae:.4f}", flush=True)
    return loss

def main():
    a = parse()
    if a.prepare:
        prepare(); return
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    if a.fabric:
        from lightning.fabric.strategies import DDPStrategy as FDDP
        fab = L.Fabric(accelerator="cpu", devices=a.devices, strategy=FDDP(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
        fab.launch()
        rank, world = fab.global_rank, fab.world_size
        model = make_model(); load_start(model, rank, a)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = fab.setup(model, opt)
        dl = loader(rank, a)
        for step, batch in enumerate(dl):
            if step >= a.steps: break
            loss = step_body(model, batch, step, rank, world, a)
            opt.zero_grad(); fab.backward(loss); opt.step()
        fab.barrier()
        if rank == 0:
            torch.save(model.state_dict(), f"{WORK}/crocus_yield_export.pt"); print("rank 0 exported", f"{WORK}/crocus_yield_export.pt", flush=True)
        return

    class Forecaster(L.LightningModule):
        def __init__(self):
            super().__init__(); self.net = make_model()
        def setup(self, stage):
            load_start(self.net, self.global_rank, a)
        def forward(self, x):
            return self.net(x)
        def train_dataloader(self):
            return loader(self.global_rank, a)
        def training_step(self, batch, i):
            return step_body(self, batch, i, self.global_rank, self.trainer.world_size, a)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)
        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), f"{WORK}/crocus_yield_export.pt"); print("rank 0 exported", f"{WORK}/crocus_yield_export.pt", flush=True)

    tr = L.Trainer(accelerator="cpu", devices=a.devices, num_nodes=1,
                   strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)),
                   max_steps=a.steps, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, use_distributed_sampler=False)
    tr.fit(Forecaster())

if __name__ == "__main__":
    main()
