"""Ochre pigment hue classifier: a small distributed (gloo, CPU) training job under Lightning.

Each rank reads its own shard of pigment assay rows (Fe2O3 %, MnO %, clay %, particle size,
lightness, chroma plus a pigment code such as PY43 / PR102), maps the code to a hue class
through a lookup table, starts from a checkpoint and trains 6 steps. Every step each rank
prints `rank R step S loss L hue_acc M`, and the ranks agree on the mean loss with an
all_reduce (waited on with --pg-timeout seconds, default 12). Rank 0 writes an export at the end.

Usage:  fault571.py --prepare
        fault571.py [--devices W] [--fabric] [--fault NAME --rank N] [--pg-timeout S]

Faults (--fault NAME, planted on --rank N unless noted):
  none          control run, nothing planted
  keyerror      rank N's shard holds a pigment code ("PY43-burnt") the lookup table lacks -> KeyError
  missing_shard rank N opens a shard file that was never written -> FileNotFoundError
  ckpt_size     rank N loads the starting checkpoint of a wider model (hidden 24, not 16) -> size mismatch
  weights_only  rank N's checkpoint pickles a PigmentMeta object; torch.load(weights_only=True) refuses it
  badgather     at step 3 rank N all_gathers a 5-element lot summary instead of 4 -> gloo size error
  slow          at step 3 rank N does ~45 s of pure-Python colour matching; its peers time out waiting
  hang          same slow work that never ends, with --pg-timeout 300: the job stalls until killed
  nan           at step 3 rank N's batch holds an inf assay; the script's own finiteness check raises
  sigsegv       at step 2 rank N sends itself SIGSEGV
  exit4         at step 2 rank N prints its own ERROR line (lot failed calibration) and sys.exit(4)
  shape_all     at step 2 every rank drops the chroma column -> matmul shape error on all ranks
  worker_crash  rank N's DataLoader worker kills itself (SIGKILL) while loading a batch
  hostmem       at step 2 rank N caps its address space and builds a huge pigment spectrum cache -> MemoryError

What happened (22 runs, 2026-12-07; see the README paragraph for batch 571):
  none          np3 torchrun and np5 Lightning-own launcher: all ranks print steps 0-5, rank 0 saves the export, exit 0
  keyerror      rank 2 (np4 bash loop) / rank 5 (np7 Fabric): KeyError: 'PY43-burnt' after step 2; peers get gloo
                "Connection closed by peer"; the first bash loop used a bare `wait` and exited 0
  missing_shard rank 6 (np8 bash loop) / rank 0 (np4 LOGLEVEL=INFO torchrun): FileNotFoundError for shard_rN_lotB.jsonl
                before step 0; in the np8 loop two peers sat in a 120 s start-up wait and the outer timeout ended it (124)
  ckpt_size     rank 1 (np3 Fabric): RuntimeError size mismatch ([24, 6] vs [16, 6]) before step 0
  weights_only  rank 3 (np4 torchrun): _pickle.UnpicklingError Weights only load failed (__main__.PigmentMeta)
  badgather     rank 5 (np6 --tee) / rank 2 (np3 Fabric): ProcessGroupGloo::allgather: invalid tensor size at index 0
  slow          rank 2 (np4) / rank 1 (np6): peers raise "Operation timed out!" after 12 s; torchrun blames a peer
  hang          rank 1 (np3, --pg-timeout 300): output stops after step 2, timeout's SIGTERM at 60 s, exit 137
  nan           rank 1 (np5 Fabric) / rank 6 (np7 --tee): FloatingPointError non-finite loss nan at step 3
  sigsegv       rank 4 (np6 torchrun): exitcode -11 (SIGSEGV) root cause; rank 2 (np4 Lightning-own): no signal line at all
  exit4         rank 3 (np5 --tee) / rank 0 (np3 bash loop): own ERROR line, exit 4, peers "Connection closed by peer"
  shape_all     np3 Lightning-own: every rank raises mat1 and mat2 shapes cannot be multiplied (8x5 and 6x16) at step 2
  worker_crash  rank 0 (np3 bash loop): ConnectionResetError [Errno 104] from the DataLoader queue (no "worker killed" line)
  hostmem       rank 2 (np4 Fabric): bare MemoryError at step 2
"""
import argparse
import dataclasses
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault571_work"
CODES = ["PY42", "PY43", "PR101", "PR102", "PBr6", "PBr7", "PY42-sienna", "PR102-umber"]
HUES = {"PY42": 0, "PY43": 0, "PR101": 1, "PR102": 1, "PBr6": 2, "PBr7": 2, "PY42-sienna": 3, "PR102-umber": 3}
STEPS = 6
BATCH = 8


@dataclasses.dataclass
class PigmentMeta:
    quarry: str
    lot: int


def build_model(hidden=16):
    return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    rnd = random.Random(571)
    for r in range(8):
        with open(f"{WORK}/shards/shard_r{r}.jsonl", "w") as f:
            for i in range(STEPS * BATCH + 8):
                code = rnd.choice(CODES)
                h = HUES[code]
                row = {"code": code, "fe2o3": 20 + 15 * h + rnd.random() * 10, "mno": rnd.random() * 3 + (h == 2) * 5,
                       "clay": rnd.random() * 40, "size_um": rnd.random() * 12, "L": 60 - 8 * h + rnd.random() * 5,
                       "C": 30 + rnd.random() * 10}
                f.write(json.dumps(row) + "\n")
    with open(f"{WORK}/hue_table.json", "w") as f:
        json.dump(HUES, f)
    torch.manual_seed(571)
    torch.save(build_model().state_dict(), f"{WORK}/ckpt/ochre_init.pt")
    torch.save(build_model(24).state_dict(), f"{WORK}/ckpt/ochre_init_wide.pt")
    torch.save({"meta": PigmentMeta("Roussillon", 7), "state_dict": build_model().state_dict()},
               f"{WORK}/ckpt/ochre_init_meta.pt")
    print("prepared", WORK)


class PigmentShard(Dataset):
    def __init__(self, path, table, poison=False, worker_kill=False):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        if poison:
            self.rows[3 * BATCH + 2]["code"] = "PY43-burnt"
        self.table = table
        self.worker_kill = worker_kill

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.worker_kill and i == 2 * BATCH + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        r = self.rows[i]
        hue = self.table[r["code"]]
        x = torch.tensor([r["fe2o3"] / 50, r["mno"] / 5, r["clay"] / 40, r["size_um"] / 12, r["L"] / 60, r["C"] / 40])
        return x, hue


def make_loader(args, rank):
    with open(f"{WORK}/hue_table.json") as f:
        table = json.load(f)
    path = f"{WORK}/shards/shard_r{rank}.jsonl"
    if args.fault == "missing_shard" and rank == args.rank:
        path = f"{WORK}/shards/shard_r{rank}_lotB.jsonl"
    ds = PigmentShard(path, table, poison=(args.fault == "keyerror" and rank == args.rank),
                      worker_kill=(args.fault == "worker_crash" and rank == args.rank))
    nw = 1 if args.fault == "worker_crash" else 0
    return DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)


def load_start(model, args, rank):
    path = f"{WORK}/ckpt/ochre_init.pt"
    if args.fault == "ckpt_size" and rank == args.rank:
        path = f"{WORK}/ckpt/ochre_init_wide.pt"
    if args.fault == "weights_only" and rank == args.rank:
        path = f"{WORK}/ckpt/ochre_init_meta.pt"
    sd = torch.load(path, map_location="cpu")
    if "state_dict" in sd:
        sd = sd["state_dict"]
    model.load_state_dict(sd)


def slow_colour_match(seconds):
    # pure-Python CIELAB nearest-swatch search, standing in for a rank stuck in slow work
    end = time.time() + seconds
    best = 1e9
    while time.time() < end:
        for a in range(200):
            for b in range(200):
                d = (a - 37.5) ** 2 + (b - 61.2) ** 2
                if d < best:
                    best = d
    return best


def step_body(model, batch, step, rank, args):
    x, y = batch
    f = args.fault
    mine = rank == args.rank
    if f == "sigsegv" and mine and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if f == "exit4" and mine and step == 2:
        print(f"ERROR rank {rank}: pigment lot 7 (Roussillon) failed colorimetric calibration: "
              f"delta-E 14.2 > 3.0, refusing to train on it", flush=True)
        sys.exit(4)
    if f == "hostmem" and mine and step == 2:
        import resource
        with open("/proc/self/statm") as fh:
            vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))
        cache = []
        for i in range(64):
            cache.append(bytearray(64 * 2**20))
    if f in ("slow", "hang") and mine and step == 3:
        slow_colour_match(45 if f == "slow" else 10**6)
    if f == "nan" and mine and step == 3:
        x = x.clone()
        x[1, 0] = float("inf")
    if f == "shape_all" and step == 2:
        x = x[:, :5]
    if f == "badgather" and step == 3:
        summary = torch.tensor([float(x[:, 0].mean()), float(x[:, 1].mean()), float(x[:, 4].mean()), float(len(x))])
        if mine:
            summary = torch.cat([summary, torch.tensor([float(rank)])])
        out = [torch.zeros(4) for _ in range(dist.get_world_size())]
        w = dist.all_gather(out, summary, async_op=True)
        w.wait(timeout=timedelta(seconds=args.pg_timeout))
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (assay batch has inf/nan)")
    acc = (logits.argmax(1) == y).float().mean()
    t = loss.detach().clone()
    w = dist.all_reduce(t, async_op=True)
    w.wait(timeout=timedelta(seconds=args.pg_timeout))
    print(f"rank {rank} step {step} loss {loss.item():.4f} hue_acc {acc.item():.3f}", flush=True)
    return loss


def save_export(model):
    os.makedirs(f"{WORK}/export", exist_ok=True)
    torch.save(model.state_dict(), f"{WORK}/export/ochre_hue_export.pt")
    print(f"rank 0 saved export to {WORK}/export/ochre_hue_export.pt", flush=True)


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class OchreModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model()

        def forward(self, x):
            return self.net(x)

        def setup(self, stage):
            load_start(self.net, args, self.global_rank)

        def train_dataloader(self):
            return make_loader(args, self.global_rank)

        def training_step(self, batch, batch_idx):
            return step_body(self, batch, self.global_step, self.global_rank, args)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            if self.global_rank == 0:
                save_export(self.net)

    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.startup_timeout))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strat, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(OchreModule())


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.startup_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    model = build_model()
    load_start(model, args, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    loader = make_loader(args, rank)
    it = iter(loader)
    for step in range(STEPS):
        batch = next(it)
        loss = step_body(model, batch, step, rank, args)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
    if rank == 0:
        save_export(model.module)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--fabric", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--startup-timeout", type=float, default=120.0)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.devices is None:
        args.devices = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(1)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()
