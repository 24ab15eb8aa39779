"""fault563.py - skerry seal haul-out counter: a small DDP job (gloo, CPU) under Lightning.

Each rank reads its own shard of haul-out survey rows (skerry id, tide, hour, features -> seal count),
maps skerry names through a lookup table, starts from a checkpoint, trains 6 steps and all-reduces a
"hauled" metric over a side group with a short timeout (--pg-timeout, 12 s). Rank 0 saves an export.

  --prepare                 write synthetic data into /tmp/fault563_work
  --mode trainer|fabric     Lightning Trainer (plown / torchrun / bash loop) or Fabric with its own loop
  --fault NAME --rank N     plant one fault

Faults:
  none          control, nothing planted
  keyerror      rank N meets a skerry name missing from the lookup table (KeyError)
  missing_shard rank N opens a survey shard that does not exist (FileNotFoundError)
  ckpt_size     rank N loads a checkpoint whose head has another shape (load_state_dict size mismatch)
  weights_only  rank N loads a checkpoint holding a pickled survey object (torch.load weights_only refusal)
  wrong_size    rank N all-gathers a metric tensor of the wrong length
  slow          rank N does pure-Python tide-table work at step 3; peers time out (with --pg-timeout 300: a hang)
  nan           rank N's loss turns inf at step 3; the script's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line and sys.exit(4)
  shape_all     every rank builds the tide feature one column short at step 2 (matmul shape error)
  hostmem       rank N asks for a huge host buffer for a count grid (CPU allocator refuses; kept small)
  worker_crash  rank N's DataLoader worker is SIGKILLed while reading rows
  skip_collective  rank N skips the metric all-reduce at step 3

What happened (runs of 2026-12-07, Lightning 2.6.6, torch 2.13.0+cpu, gloo):
  none          plown np3 and plfabric np4: 6 steps on every rank, export saved, exit 0
  keyerror      pltorchrun np5 r3: KeyError 'Linga Skerry' in rank 3's DataLoader, peers Connection closed, exit 1;
                plfabric np7 r6: KeyError on rank 6, exit 1
  missing_shard plbashloop np3 r1: no output at all within 100 s on the loaded machine (dropped)
  ckpt_size     plfabric np4 r2: load_state_dict size mismatch for head.weight/bias on rank 2, exit 1
  weights_only  pltee np3 r2: UnpicklingError (Unsupported global __main__.Survey) on rank 2, exit 1
  wrong_size    plloglevel np4 r1: ProcessGroupGloo::allgather invalid tensor size on rank 1, exit 1
  slow          pltorchrun np5 r2: peers timed out after 12000ms, torchrun blames rank 1, exit 1;
                plfabric np4 r1 --pg-timeout 300: output stops after step 2 until timeout, exit 124
  nan           plfabric np3 r2: FloatingPointError loss is inf on rank 2, exit 1
  sigsegv       plfabric np4 r3: rank 3 exitcode -11 (SIGSEGV), exit 1
  error_exit    pltorchrun np4 r0: rank 0's ERROR line and exitcode 4, exit 1
  shape_all     pltee np4: mat1 and mat2 shapes cannot be multiplied on every rank, exit 1
  hostmem       plfabric np5 r1: DefaultCPUAllocator can't allocate 16 TiB on rank 1, exit 1
  worker_crash  pltorchrun np3 r0: DataLoader worker killed by signal: Killed on rank 0, exit 1
  skip_collective plbashloop np5 r3: no output within 150 s (dropped); rerun pltorchrun np5 r3: peers timed out
                after 12000ms, rank 3 Connection closed, torchrun blames rank 0, exit 1
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault563_work"
SKERRIES = ["Hellisey", "Ronas", "Muckle Skerry", "Out Skerries", "Sule", "Fair Isle Stack",
            "Papa Stour", "Foula Holm"]


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(563)
    for r in range(8):
        x = torch.randn(96, 8, generator=g)
        y = (x[:, :3].sum(1) * 4 + 20).clamp(min=0)
        names = [SKERRIES[(r + i) % len(SKERRIES)] for i in range(96)]
        torch.save({"x": x, "y": y, "names": names}, f"{WORK}/shards/haulout_{r}.pt")
    with open(f"{WORK}/lookup.json", "w") as f:
        json.dump({n: i for i, n in enumerate(SKERRIES)}, f)
    m = Net()
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    bad = Net(out=2)
    torch.save(bad.state_dict(), f"{WORK}/start_v2head.pt")
    torch.save({"state": m.state_dict(), "survey": Survey("Shetland", 2026)}, f"{WORK}/start_survey.pt")
    print("prepared", WORK, flush=True)


class Survey:
    def __init__(self, region, year):
        self.region, self.year = region, year


class Net(nn.Module):
    def __init__(self, out=1):
        super().__init__()
        self.emb = nn.Embedding(len(SKERRIES), 4)
        self.body = nn.Sequential(nn.Linear(12, 16), nn.ReLU())
        self.head = nn.Linear(16, out)

    def forward(self, x, sid):
        return self.head(self.body(torch.cat([x, self.emb(sid)], 1))).squeeze(-1)


class Rows(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        path = f"{WORK}/shards/haulout_{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shards/haulout_{rank}_spring.pt"
        d = torch.load(path)
        self.x, self.y, self.names = d["x"], d["y"], d["names"]
        with open(f"{WORK}/lookup.json") as f:
            self.lookup = json.load(f)
        if fault == "keyerror" and rank == frank:
            self.names[19] = "Linga Skerry"
        self.kill = fault == "worker_crash" and rank == frank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.kill and i >= 20:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], torch.tensor(self.lookup[self.names[i]]), self.y[i]


def loader(rank, a):
    nw = 1 if (a.fault == "worker_crash" and rank == a.rank) else 0
    return torch.utils.data.DataLoader(Rows(rank, a.fault, a.rank), batch_size=8, num_workers=nw)


def load_start(model, rank, a):
    path = f"{WORK}/start.pt"
    if a.fault == "ckpt_size" and rank == a.rank:
        path = f"{WORK}/start_v2head.pt"
    if a.fault == "weights_only" and rank == a.rank:
        sd = torch.load(f"{WORK}/start_survey.pt")["state"]
    else:
        sd = torch.load(path)
    model.load_state_dict(sd)


def step_body(model, batch, step, rank, a, group, world):
    x, sid, y = batch
    if a.fault == "shape_all" and step == 2:
        x = x[:, :7]
    if a.fault == "hostmem" and rank == a.rank and step == 2:
        grid = torch.zeros(1 << 22, 1 << 20, dtype=torch.float32)  # 16 TiB count grid
    pred = model(x, sid)
    loss = ((pred - y) ** 2).mean()
    if a.fault == "nan" and rank == a.rank and step == 3:
        loss = loss * float("inf")
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite haul-out loss)")
    if a.fault == "sigsegv" and rank == a.rank and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if a.fault == "error_exit" and rank == a.rank and step == 2:
        print(f"ERROR rank {rank}: tide table for skerry shard {rank} has 0 low-water slots; cannot count haul-outs", flush=True)
        sys.exit(4)
    if a.fault == "slow" and rank == a.rank and step == 3:
        t = time.time(); acc = 0
        while time.time() - t < 45:
            for k in range(20000):
                acc += (k * 7) % 13
    hauled = pred.detach().clamp(min=0).mean().reshape(1)
    if a.fault == "wrong_size" and rank == a.rank and step == 2:
        out = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(out, torch.cat([hauled, hauled]), group=group)
    elif not (a.fault == "skip_collective" and rank == a.rank and step == 3):
        dist.all_reduce(hauled, group=group)
    hauled = hauled / world
    print(f"rank {rank} step {step} loss {loss.item():.4f} hauled {hauled.item():.3f}", flush=True)
    return loss


def export(model):
    torch.save(model.state_dict(), f"{WORK}/export_haulout.pt")
    print("rank 0 saved export", f"{WORK}/export_haulout.pt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer")
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--startup-timeout", type=float, default=120)
    a = p.parse_args()
    if a.prepare:
        return prepare()
    devices = a.devices or int(os.environ.get("WORLD_SIZE", "1"))
    if a.mode == "fabric":
        import lightning as L
        from lightning.fabric.strategies import DDPStrategy
        fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=DDPStrategy(
            process_group_backend="gloo", timeout=timedelta(seconds=a.startup_timeout)))
        fabric.launch()
        rank, world = fabric.global_rank, fabric.world_size
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
        model = Net(); load_start(model, rank, a)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = fabric.setup(model, opt)
        dl = loader(rank, a)
        for step, batch in enumerate(dl):
            if step >= 6:
                break
            opt.zero_grad()
            loss = step_body(model, batch, step, rank, a, group, world)
            fabric.backward(loss)
            opt.step()
        if rank == 0:
            export(model.module if hasattr(model, "module") else model)
        return
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class Mod(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def setup(self, stage):
            load_start(self.net, self.global_rank, a)

        def on_fit_start(self):
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))

        def train_dataloader(self):
            return loader(self.global_rank, a)

        def training_step(self, batch, idx):
            return step_body(self.net, batch, self.global_step, self.global_rank, a, self.group,
                             self.trainer.world_size)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    tr = pl.Trainer(accelerator="cpu", devices=devices, max_steps=6, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=a.startup_timeout)))
    m = Mod()
    tr.fit(m)
    if tr.global_rank == 0:
        export(m.net)


if __name__ == "__main__":
    main()
