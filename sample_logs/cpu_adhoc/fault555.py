"""fault555.py - yurt felt insulation: a small DDP job that learns the heat loss of
yurt wall panels from felt layer data (thickness, density, wool grade, moisture).

Synthetic data (`--prepare`) goes to /tmp/fault555_work: one shard per rank, a grade
lookup table (wool grade -> felt density factor) and a start checkpoint. The job runs
under Lightning 2.6.6 (Trainer, or Fabric with its own loop), gloo backend, CPU only,
6 steps; every rank prints `rank R step S loss L rvalue M`; rank 0 writes an export.

Faults (`--fault NAME --rank N`, one per run):
  none          control, nothing planted
  keyerror      rank N's shard names a wool grade ("karakul_x") the lookup table lacks -> KeyError
  missing_shard rank N's shard file is not there -> FileNotFoundError
  ckpt_size     rank N loads a start checkpoint whose first layer is 12 wide, not 10 -> size mismatch
  weights_only  rank N loads a checkpoint that pickles a FeltRecipe object -> torch.load weights_only refusal
  gather_size   rank N all_gathers 5 panel readings instead of 4 -> gloo size error
  slow          rank N does pure-Python felting simulation at step 3, peers time out (--pg-timeout)
  hang          as slow, run with --pg-timeout 300 so nothing fails until `timeout` ends it
  nan           rank N's moisture reading becomes inf, the job's own finiteness check raises
  segv          rank N sends itself SIGSEGV at step 3
  exit4         rank N prints its own ERROR line and calls sys.exit(4)
  shape_all     every rank: a seam layer built 16x3 instead of 16x1 at step 3 -> matmul shape error
  hostmem       rank N asks for a 4 TB felt density grid -> CPU allocator refuses
  worker_crash  rank N's DataLoader worker SIGKILLs itself

What happened (19 runs, all under Lightning 2.6.6, gloo, 12 s PG timeout unless noted):
  none          np3 pltorchrun and np6 plloglevel: 6 steps on every rank, export written, exit 0
  keyerror      np5 r3 pltorchrun: KeyError 'karakul_x' on rank 3, peers 'Connection closed by peer', exit 1;
                np4 r2 plown: KeyError on rank 2, then no more output until timeout 100 (exit 124)
  missing_shard np3 r1 plfabric / np6 r4 pltee: FileNotFoundError on the rank, peers connection closed, exit 1
  ckpt_size     np4 r1 plloglevel: load_state_dict size mismatch [16, 12] vs [16, 10] on rank 1, exit 1
  weights_only  np5 r0 pltorchrun: UnpicklingError (weights_only, __main__.FeltRecipe) on rank 0, exit 1
  gather_size   np4 r2 plfabric: ProcessGroupGloo::allgather invalid tensor size on rank 2, exit 1
  slow          np4 r1 pltorchrun / np3 r2 plbashloop: peers 'Timed out waiting 12000ms', exit 1 / 0 (bash wait)
  hang          np3 r1 pltorchrun --pg-timeout 300: output stops after step 2, timeout 60 ends it (exit 137)
  nan           np5 r2 plfabric: FloatingPointError from the job's own check on rank 2, exit 1
  segv          np4 r3 pltee: rank 3 exitcode -11 (SIGSEGV), root cause in torchrun's summary, exit 1
  exit4         np8 r5 pltee / np3 r1 plbashloop: the rank's own ERROR line, exit code 4, peers connection closed
  shape_all     np4 pltorchrun: every rank 'mat1 and mat2 shapes cannot be multiplied (8x1 and 3x16)', exit 1
  hostmem       np3 r0 plfabric: DefaultCPUAllocator can't allocate 4000000000000 bytes on rank 0, exit 1
  worker_crash  np4 r2 pltorchrun: 'DataLoader worker (pid N) is killed by signal: Killed.' on rank 2, exit 1
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

WORK = "/tmp/fault555_work"
GRADES = ["merino", "karakul", "kazakh", "tuvan", "mongol_white"]


class FeltRecipe:
    def __init__(self, layers):
        self.layers = layers


def prepare(world):
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(555)
    table = {k: 0.8 + 0.1 * i for i, k in enumerate(GRADES)}
    json.dump(table, open(f"{WORK}/grade_table.json", "w"))
    for r in range(world):
        feats = torch.rand(48, 9, generator=g)
        grades = [GRADES[(r + i) % len(GRADES)] for i in range(48)]
        torch.save({"feats": feats, "grades": grades}, f"{WORK}/shard_{r}.pt")
    torch.manual_seed(555)
    m = make_model()
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    bad = make_model(12)
    torch.save(bad.state_dict(), f"{WORK}/start_wide.pt")
    torch.save({"model": m.state_dict(), "recipe": FeltRecipe(["wool", "wool", "canvas"])}, f"{WORK}/start_recipe.pt")
    print(f"prepared {world} shards in {WORK}")


def make_model(width=10):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))


class PanelSet:
    def __init__(self, rank, fault, frank):
        import torch
        self.torch = torch
        path = f"{WORK}/shard_{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shard_{rank}_felted.pt"
        d = torch.load(path)
        table = json.load(open(f"{WORK}/grade_table.json"))
        grades = list(d["grades"])
        if fault == "keyerror" and rank == frank:
            grades[5] = "karakul_x"
        dens = torch.tensor([table[k] for k in grades]).unsqueeze(1)
        self.x = torch.cat([d["feats"], dens], 1)
        self.y = (self.x[:, 0] * 2.0 - self.x[:, 3] + 0.5 * self.x[:, 9]).unsqueeze(1)
        self.fault, self.rank, self.frank = fault, rank, frank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.frank and i >= 24:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def load_start(model, rank, fault, frank):
    import torch
    path = f"{WORK}/start.pt"
    if fault == "ckpt_size" and rank == frank:
        path = f"{WORK}/start_wide.pt"
    if fault == "weights_only" and rank == frank:
        sd = torch.load(f"{WORK}/start_recipe.pt")["model"]
    else:
        sd = torch.load(path)
    model.load_state_dict(sd)


def step_body(model, x, y, step, rank, world, args):
    import torch
    import torch.distributed as dist
    f, fr = args.fault, args.rank
    if f == "nan" and rank == fr and step == 3:
        x = x.clone(); x[2, 4] = float("inf")
    if f in ("slow", "hang") and rank == fr and step == 3:
        felt = 0
        t0 = time.time()
        while time.time() - t0 < (40 if f == "slow" else 600):
            for i in range(20000):
                felt = (felt * 31 + i) % 1000003
    if f == "segv" and rank == fr and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if f == "exit4" and rank == fr and step == 3:
        print(f"ERROR rank {rank}: felt layer thickness sensor returned -1 mm for panel 7, giving up", flush=True)
        sys.exit(4)
    if f == "hostmem" and rank == fr and step == 3:
        grid = torch.empty(4 * 10**12 // 4, dtype=torch.float32)
    pred = model(x)
    if f == "shape_all" and step == 3:
        seam = torch.ones(16, 3)
        pred = pred @ seam.T
    loss = torch.nn.functional.mse_loss(pred, y)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite) for yurt panel batch")
    readings = torch.full((4,), float(loss.item()) + rank)
    if f == "gather_size" and rank == fr and step == 3:
        readings = torch.full((5,), float(loss.item()) + rank)
    outs = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(outs, readings)
    rv = torch.tensor([1.0 / (1e-3 + loss.item())])
    dist.all_reduce(rv)
    print(f"rank {rank} step {step} loss {loss.item():.4f} rvalue {rv.item() / world:.4f}", flush=True)
    return loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=int, default=0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--fabric", action="store_true")
    args = ap.parse_args()
    if args.prepare:
        return prepare(args.prepare)
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    torch.set_num_threads(1)
    nw = 1 if args.fault == "worker_crash" else 0
    if args.fabric:
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy
        fab = Fabric(accelerator="cpu", devices=args.devices,
                     strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120)))
        fab.launch()
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=args.pg_timeout))
        rank, world = fab.global_rank, fab.world_size
        model = make_model()
        load_start(model, rank, args.fault, args.rank)
        ds = PanelSet(rank, args.fault, args.rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = fab.setup(model, opt)
        dl = DataLoader(ds, batch_size=8, num_workers=nw)
        for step, (x, y) in enumerate(dl):
            if step >= 6:
                break
            opt.zero_grad()
            loss = step_body(model, x, y, step, rank, world, args)
            fab.backward(loss)
            opt.step()
        if rank == 0:
            torch.save(model.state_dict(), f"{WORK}/yurt_export.pt")
            print(f"rank 0 wrote export {WORK}/yurt_export.pt", flush=True)
        return
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class YurtModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def setup(self, stage):
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=args.pg_timeout))
            load_start(self.net, self.global_rank, args.fault, args.rank)
            self.ds = PanelSet(self.global_rank, args.fault, args.rank)

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=8, num_workers=nw)

        def training_step(self, batch, idx):
            x, y = batch
            return step_body(self.net, x, y, idx, self.global_rank, self.trainer.world_size, args)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), f"{WORK}/yurt_export.pt")
                print(f"rank 0 wrote export {WORK}/yurt_export.pt", flush=True)

    tr = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, max_steps=6,
                   strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120)),
                   logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, use_distributed_sampler=False)
    tr.fit(YurtModule())


if __name__ == "__main__":
    main()
