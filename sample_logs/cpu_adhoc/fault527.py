"""Batch 527 fault script: river weir fish passage counts (Lightning / Fabric, gloo, CPU).

Each rank reads its own shard of fish-counter records (station id, hour, river flow,
water temperature, counted fish) from /tmp/fault527_work, maps the station to its weir
with a lookup table, starts from a checkpoint, and fits a small count model for 6 steps.
Every step it all-reduces the mean predicted passage rate and all-gathers per-species
counts; rank 0 writes an export at the end.

Faults (--fault NAME --rank N):
  none            control, no fault
  keyerror        rank N meets a station id missing from the weir lookup table (KeyError)
  missing_shard   rank N's shard file is looked up under a name that does not exist
  ckpt_size       rank N loads the stale v1 checkpoint (hidden 24) into the v2 model (size mismatch)
  gather_size     rank N all-gathers 5 species counts instead of 4 at step 2
  slow            rank N does 40 s of pure-Python counter reconciliation at step 2; peers time out
  hang            like slow but forever (run with --pg-timeout 300; `timeout` ends it)
  nan             rank N's flow reading is NaN at step 3; the script's own check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 3
  logexit         rank N prints its own ERROR line (counter offline) and sys.exit(4) at step 2
  shape_all       every rank keeps the count column in its features (matmul shape error)
  worker_crash    rank N's DataLoader worker SIGKILLs itself

What happened (runs of 2026-12-07, torch 2.13.0+cpu, Lightning 2.6.6):
  none            np3 pltorchrun: clean, exit 0. np5 plfabric: all 6 steps and the export, then rank 1
                  aborted at exit ('terminate called without an active exception', -6), exit 1.
  keyerror        np4 plown r2 / np8 pltorchrun r6: KeyError 'ST117' at step 2, peers get gloo connection
                  closed or 12000 ms recv timeouts; exit 1.
  missing_shard   np3 plbashloop r1: FileNotFoundError in train_dataloader; peers sat in a barrier until
                  timeout (exit 124), then connection closed.
  ckpt_size       np5 pltee r3: load_state_dict size mismatch (24 vs 32) in setup; exit 1.
  gather_size     np4 pltorchrun r1 / np5 plfabric r4: another rank aborts with gloo::EnforceNotMet
                  '10 vs 8 ... collective mismatch' (-6), torchrun blames that rank; exit 1.
  slow            np3 plloglevel r2: rank 1 'Timed out waiting 12000ms', torchrun blames rank 1; exit 1.
  hang            np3 pltorchrun r1 --pg-timeout 300: output stops after step 1, timeout SIGTERM then KILL; exit 137.
  nan             np6 pltorchrun r4 / np3 plown r2: FloatingPointError 'loss is nan' at step 3; exit 1.
  sigsegv         np4 plfabric r3 (exitcode -11) / np3 plbashloop r1 (bash 'Segmentation fault'); exit 1.
  logexit         np5 plown r2 / np3 plloglevel r1: own ERROR line, exit 4 (torchrun root cause exitcode 4); exit 1.
  shape_all       np3 plfabric: every rank 'mat1 and mat2 shapes cannot be multiplied (8x9 and 8x32)'; exit 1.
  worker_crash    np3 pltorchrun r1: 'DataLoader worker (pid N) is killed by signal: Killed.'; exit 1.
  plown runs with the default 12 s PG timeout failed in the TCPStore wait (children too slow to start on a
  loaded 2-core machine); they were rerun with --pg-timeout 45.
"""
import argparse, json, os, signal, sys, time, math, random
from datetime import timedelta

WORK = "/tmp/fault527_work"
SPECIES = 4

p = argparse.ArgumentParser()
p.add_argument("--prepare", action="store_true")
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=float, default=12.0)
p.add_argument("--devices", type=int, default=None)
p.add_argument("--fabric", action="store_true")
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

import torch
import torch.nn as nn
import torch.distributed as dist


def prepare():
    rng = random.Random(527)
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    stations = [f"ST{i:03d}" for i in range(12)]
    table = {s: i % 5 for i, s in enumerate(stations)}
    with open(f"{WORK}/weir_lookup.json", "w") as f:
        json.dump(table, f)
    for r in range(8):
        recs = []
        for k in range(64):
            st = rng.choice(stations)
            recs.append({"station": st, "hour": rng.randrange(24), "flow": rng.uniform(2, 40),
                         "temp": rng.uniform(4, 19), "count": [rng.randrange(0, 30) for _ in range(SPECIES)]})
        with open(f"{WORK}/shards/counts_rank{r}.json", "w") as f:
            json.dump(recs, f)
    torch.manual_seed(527)
    torch.save(Model(32).state_dict(), f"{WORK}/weir_model_v2.pt")
    torch.save(Model(24).state_dict(), f"{WORK}/weir_model_v1.pt")
    print("prepared", WORK)


class Model(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.weir_emb = nn.Embedding(5, 4)
        self.net = nn.Sequential(nn.Linear(4 + 4, hidden), nn.ReLU(), nn.Linear(hidden, SPECIES))

    def forward(self, x, weir):
        return self.net(torch.cat([x, self.weir_emb(weir)], dim=1))


class CountShard(torch.utils.data.Dataset):
    def __init__(self, rank, fault, fault_rank):
        self.rank, self.fault, self.fault_rank = rank, fault, fault_rank
        name = f"counts_rank{rank}.json"
        if fault == "missing_shard" and rank == fault_rank:
            name = f"counts_rank{rank}_2026-12.json"
        with open(f"{WORK}/shards/{name}") as f:
            self.recs = json.load(f)
        with open(f"{WORK}/weir_lookup.json") as f:
            self.table = json.load(f)
        mine = fault_rank == rank
        if fault == "keyerror" and mine:
            self.recs[20]["station"] = "ST117"
        if fault == "nan" and mine:
            self.recs[27]["flow"] = float("nan")

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.fault_rank and i == 19:
            if torch.utils.data.get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
        r = self.recs[i]
        weir = self.table[r["station"]]
        h = r["hour"] / 24 * 2 * math.pi
        feats = [r["flow"] / 40, r["temp"] / 20, math.sin(h), math.cos(h)]
        if self.fault == "shape_all":
            feats.append(sum(r["count"]) / 100)
        y = torch.log1p(torch.tensor(r["count"], dtype=torch.float32))
        return torch.tensor(feats, dtype=torch.float32), torch.tensor(weir), y


def make_loader(rank):
    ds = CountShard(rank, args.fault, args.rank)
    nw = 2 if (args.fault == "worker_crash" and rank == args.rank) else 0
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, num_workers=nw)


def load_start(model, rank):
    path = f"{WORK}/weir_model_v2.pt"
    if args.fault == "ckpt_size" and rank == args.rank:
        path = f"{WORK}/weir_model_v1.pt"
    sd = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(sd)


def step_body(model, batch, rank, step):
    x, weir, y = batch
    mine = rank == args.rank
    if args.fault == "logexit" and mine and step == 2:
        print(f"ERROR rank {rank}: fish counter at weir {int(weir[0])} reports OFFLINE for 3 polls, refusing to train on stale counts", flush=True)
        sys.exit(4)
    if args.fault == "sigsegv" and mine and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "slow" and mine and step == 2:
        end = time.time() + 40
        n = 0
        while time.time() < end:
            n += sum(i * i for i in range(2000)) % 7
    if args.fault == "hang" and mine and step == 2:
        n = 0
        while True:
            n += sum(i * i for i in range(2000)) % 7
    pred = model(x, weir)
    loss = nn.functional.mse_loss(pred, y)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite flow/count input)")
    rate = torch.expm1(pred.detach()).sum(1).mean().reshape(1)
    dist.all_reduce(rate)
    rate /= dist.get_world_size()
    n_sp = SPECIES + 1 if (args.fault == "gather_size" and mine and step == 2) else SPECIES
    counts = torch.expm1(y).sum(0)[:SPECIES].clone()
    if n_sp != SPECIES:
        counts = torch.cat([counts, torch.zeros(1)])
    bufs = [torch.zeros(n_sp) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, counts)
    print(f"rank {rank} step {step} loss {loss.item():.4f} fish_per_hour {rate.item():.2f}", flush=True)
    return loss


def export(model):
    os.makedirs(f"{WORK}/export", exist_ok=True)
    torch.save(model.state_dict(), f"{WORK}/export/weir_passage_model.pt")
    print(f"rank 0 saved export {WORK}/export/weir_passage_model.pt", flush=True)


def run_lightning():
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class WeirModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Model(32)

        def setup(self, stage):
            load_start(self.model, self.global_rank)

        def train_dataloader(self):
            return make_loader(self.global_rank)

        def training_step(self, batch, i):
            return step_body(self.model, batch, self.global_rank, self.global_step)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            if self.global_rank == 0:
                export(self.model)

    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=1,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, use_distributed_sampler=False)
    trainer.fit(WeirModule())


def run_fabric():
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                      strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    model = Model(32)
    load_start(model, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    loader = make_loader(rank)
    for step, batch in enumerate(loader):
        if step >= args.steps:
            break
        opt.zero_grad()
        loss = step_body(model, batch, rank, step)
        fabric.backward(loss)
        opt.step()
    fabric.barrier()
    if rank == 0:
        export(model.module)


if __name__ == "__main__":
    if args.prepare:
        prepare()
    elif args.fabric:
        run_fabric()
    else:
        run_lightning()
