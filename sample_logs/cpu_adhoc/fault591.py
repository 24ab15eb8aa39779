"""Marmot colony whistles: a small Lightning DDP job that classifies alarm whistles
(aerial vs terrestrial predator) from per-rank shards of synthetic spectrogram features.

--prepare writes into the work dir: shards/shard_R.pt per rank, colonies.json (colony id ->
habitat index), init_ckpt.pt (start weights), plus a legacy checkpoint (hidden 24) and a
checkpoint carrying a pickled WhistleMeta object. Gloo backend, CPU only, 6 steps; every
rank prints `rank R step S loss L whistle_acc M`; rank 0 saves export.pt at the end.
Start-up uses a 120 s process-group timeout, then the group's timeout drops to --pg-timeout.

Modes: --mode trainer (Lightning Trainer; launched by itself with --devices W, by torchrun,
or one python per rank) or --mode fabric (lightning.fabric.Fabric, own loop, under torchrun).

Faults (--fault NAME --rank N):
  none               control, nothing planted
  colony_key         rank N meets colony id "colony_K99" that colonies.json lacks -> KeyError (step 2)
  shard_missing      rank N looks for its shard under shards_v2/ (never written) -> FileNotFoundError
  ckpt_size          rank N starts from the legacy hidden-24 checkpoint -> load_state_dict size mismatch
  ckpt_weights_only  rank N loads the checkpoint that pickles a WhistleMeta object -> weights_only refusal
  gather_size        rank N all_gathers 5 whistle counts instead of 4 (step 2)
  slow_rank          rank N re-scores the colony table in pure Python for ~60 s at step 2; peers time out
  hang               rank N waits forever on an event at step 2 (run with --pg-timeout 300)
  nan_check          rank N's batch gets an inf gain -> the script's own finiteness check raises FloatingPointError
  sigsegv            rank N sends itself SIGSEGV at step 3
  error_exit4        rank N prints its own ERROR line and sys.exit(4) at step 2
  shape_all          every rank: the feature window is concatenated along the wrong dim -> matmul shape error
  worker_crash       rank N's DataLoader worker SIGKILLs itself on its 4th sample

What happened (see the runs' logs and the readme):
  none               all ranks ran 6 steps, rank 0 saved export.pt; exit 0
  colony_key         rank N raised KeyError: 'colony_K99' at step 2; peers saw 'Connection closed by peer'
  shard_missing      rank N raised FileNotFoundError for shards_v2/shard_N.pt before any step
  ckpt_size          rank N raised RuntimeError: size mismatch in load_state_dict
  ckpt_weights_only  rank N raised _pickle.UnpicklingError (Weights only load failed)
  gather_size        a receiving peer aborted (gloo EnforceNotMet 'Received data size doesn't match', SIGABRT); torchrun blamed it, not rank N
  slow_rank          peers hit the 12 s gloo timeout ('Timed out waiting 12000ms for send/recv') while rank N was busy; torchrun blamed rank 0
  hang               no rank printed past step 1; `timeout` ended the run (exit 124)
  nan_check          rank N raised FloatingPointError from the script's own check
  sigsegv            rank N died of SIGSEGV (exitcode -11) silently; peers saw the gloo connection close/reset
  error_exit4        rank N printed ERROR and exited 4; peers were stopped or timed out
  shape_all          every rank raised RuntimeError (mat1 and mat2 shapes cannot be multiplied)
  worker_crash       rank N's DataLoader worker was killed by signal; rank N raised RuntimeError
"""
import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault591_work"
STEPS = 6
BATCH = 8
FEAT = 16
HIDDEN = 32


@dataclasses.dataclass
class WhistleMeta:
    colony: str
    recorder: str


def prepare(max_world=8):
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(591)
    colonies = {f"colony_K{i:02d}": i % 3 for i in range(12)}
    with open(f"{WORK}/colonies.json", "w") as f:
        json.dump(colonies, f)
    for r in range(max_world):
        x = torch.randn(STEPS * BATCH * 2, FEAT, generator=g)
        y = (x[:, 0] > 0).long()
        ids = [f"colony_K{(r * 5 + i) % 12:02d}" for i in range(len(x))]
        torch.save({"x": x, "y": y, "colony": ids}, f"{WORK}/shards/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(WhistleNet(HIDDEN).state_dict(), f"{WORK}/init_ckpt.pt")
    torch.save(WhistleNet(24).state_dict(), f"{WORK}/init_ckpt_legacy.pt")
    torch.save({"state_dict": WhistleNet(HIDDEN).state_dict(), "meta": WhistleMeta("K03", "mic-7")},
               f"{WORK}/init_ckpt_meta.pt")
    print("prepared", WORK)


class WhistleNet(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.enc = nn.Linear(FEAT + 3, hidden)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.head(torch.relu(self.enc(x)))


class Shard(torch.utils.data.Dataset):
    def __init__(self, path, colonies, rank, fault, fault_rank):
        d = torch.load(path)
        self.x, self.y, self.ids = d["x"], d["y"], d["colony"]
        self.colonies, self.rank = colonies, rank
        self.fault, self.fault_rank = fault, fault_rank
        if fault == "colony_key" and rank == fault_rank:
            self.ids[2 * BATCH + 3] = "colony_K99"

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if (self.fault == "worker_crash" and self.rank == self.fault_rank and i >= 3
                and torch.utils.data.get_worker_info() is not None):
            os.kill(os.getpid(), signal.SIGKILL)
        hab = torch.zeros(3)
        hab[self.colonies[self.ids[i]]] = 1.0
        return torch.cat([self.x[i], hab]), self.y[i]


def load_start(model, rank, a):
    path = f"{WORK}/init_ckpt.pt"
    if a.fault == "ckpt_size" and rank == a.rank:
        path = f"{WORK}/init_ckpt_legacy.pt"
    if a.fault == "ckpt_weights_only" and rank == a.rank:
        path = f"{WORK}/init_ckpt_meta.pt"
    sd = torch.load(path)
    model.load_state_dict(sd["state_dict"] if "state_dict" in sd else sd)


def make_loader(rank, a):
    with open(f"{WORK}/colonies.json") as f:
        colonies = json.load(f)
    sub = "shards_v2" if (a.fault == "shard_missing" and rank == a.rank) else "shards"
    ds = Shard(f"{WORK}/{sub}/shard_{rank}.pt", colonies, rank, a.fault, a.rank)
    nw = 1 if (a.fault == "worker_crash" and rank == a.rank) else 0
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)


def step_hook(rank, step, x, a):
    """Faults planted inside a step, before the forward pass."""
    if a.fault == "shape_all":
        x = torch.cat([x, x[:, FEAT:]], dim=1)  # habitat one-hot appended a second time: 22 features, not 19
    if rank != a.rank:
        return x
    if a.fault == "nan_check" and step == 3:
        x = x * float("inf")
    if a.fault == "slow_rank" and step == 2:
        with open(f"{WORK}/colonies.json") as f:
            table = json.load(f)
        t0, acc = time.time(), 0
        while time.time() - t0 < 60:
            for k, v in table.items():
                acc += sum(ord(c) for c in k) * (v + 1) % 7
    if a.fault == "hang" and step == 2:
        threading.Event().wait()
    if a.fault == "sigsegv" and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if a.fault == "error_exit4" and step == 2:
        print(f"ERROR: rank {rank}: colony registry lists 0 recorders for site K07; refusing to train", flush=True)
        sys.exit(4)
    return x


def gather_counts(rank, step, y, a):
    n = 5 if (a.fault == "gather_size" and rank == a.rank and step == 2) else 4
    t = torch.bincount(y, minlength=n)[:n].float()
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).sum(0)


def check_loss(loss, rank, step):
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: whistle loss is not finite ({loss.item()})")


def shrink_timeout(a):
    from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(timedelta(seconds=a.pg_timeout))


def run_trainer(a):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Mod(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = WhistleNet()

        def setup(self, stage):
            load_start(self.net, self.global_rank, a)

        def on_fit_start(self):
            shrink_timeout(a)

        def training_step(self, batch, idx):
            x, y = batch
            r = self.global_rank
            x = step_hook(r, idx, x, a)
            logits = self.net(x)
            loss = nn.functional.cross_entropy(logits, y)
            check_loss(loss, r, idx)
            counts = gather_counts(r, idx, y, a)
            acc = (logits.argmax(1) == y).float().mean().item()
            print(f"rank {r} step {idx} loss {loss.item():.4f} whistle_acc {acc:.3f} (alarm calls seen {int(counts.sum())})", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return make_loader(self.global_rank, a)

    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120))
    tr = L.Trainer(accelerator="cpu", devices=a.devices, num_nodes=1, strategy=strat, max_steps=STEPS,
                   max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, use_distributed_sampler=False)
    m = Mod()
    tr.fit(m)
    if tr.global_rank == 0:
        torch.save(m.net.state_dict(), f"{WORK}/export.pt")
        print(f"rank 0 saved {WORK}/export.pt", flush=True)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fab = Fabric(accelerator="cpu", devices=a.devices, strategy=DDPStrategy(process_group_backend="gloo",
                 timeout=timedelta(seconds=120)))
    fab.launch()
    shrink_timeout(a)
    r = fab.global_rank
    net = WhistleNet()
    load_start(net, r, a)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fab.setup(net, opt)
    loader = make_loader(r, a)
    for step, (x, y) in enumerate(loader):
        if step >= STEPS:
            break
        x = step_hook(r, step, x, a)
        logits = net(x)
        loss = nn.functional.cross_entropy(logits, y)
        check_loss(loss, r, step)
        counts = gather_counts(r, step, y, a)
        opt.zero_grad()
        fab.backward(loss)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean().item()
        print(f"rank {r} step {step} loss {loss.item():.4f} whistle_acc {acc:.3f} (alarm calls seen {int(counts.sum())})", flush=True)
    fab.barrier()
    if r == 0:
        torch.save(net.module.state_dict(), f"{WORK}/export.pt")
        print(f"rank 0 saved {WORK}/export.pt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", choices=["trainer", "fabric"], default="trainer")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    torch.set_num_threads(1)
    if a.mode == "fabric":
        run_fabric(a)
    else:
        run_trainer(a)


if __name__ == "__main__":
    main()
