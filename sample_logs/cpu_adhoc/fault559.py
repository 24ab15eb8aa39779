"""Corvid cache recall: a small DDP job (Lightning 2.6 / Fabric, gloo, CPU) that learns to
recall which cache slot a crow hid each item in, from per-rank shards of (cache key, feature).

Prepare the data once:   python fault559.py --prepare
Run (under torchrun, a bash loop, or with --launcher own/fabric):
    python fault559.py --launcher trainer|own|fabric --devices W [--fault NAME --rank N] [--pg-timeout S]

Every rank loads its shard, the cache table (key -> slot) and the starting checkpoint, then runs
6 steps; each step syncs the per-slot hit counts with an all_reduce on a gloo group whose timeout
is --pg-timeout (12 s by default; the default group gets 120 s for start-up) and prints
`rank R step S loss L recall M`. Rank 0 saves an export at the end.

Faults (--fault NAME, planted on --rank N only unless said otherwise):
  none          control, nothing planted
  keyerror      rank N looks up an evicted cache key at step 2 -> KeyError
  missing_shard rank N opens a shard file that does not exist -> FileNotFoundError (in setup)
  ckpt_size     rank N loads an older checkpoint built for 48 slots -> load_state_dict size mismatch
  weights_only  rank N loads a checkpoint holding a pickled CacheMeta object with weights_only=True
  wrong_size    rank N all_reduces a hit-count vector 8 slots longer at step 2 (gloo size mismatch)
  slow_rank     rank N does pure-Python work before the step-2 all_reduce; peers time out
                (with --pg-timeout 300 the job hangs until the outer `timeout` ends it)
  nan           rank N's features become NaN at step 3; the script's own check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line and calls sys.exit(4) at step 3
  shape_all     every rank feeds 15-wide features into the 16-wide projection at step 1 (shape bug)
  worker_crash  rank N's DataLoader worker is SIGKILLed while loading batch 2

What happened (one line per fault, from the kept logs):
  none          np4 torchrun: 6 steps on every rank, export saved, exit 0
  keyerror      np5 --tee 3, rank 3: KeyError 'cache_117'; peers gloo 'Connection closed by peer'; exit 1
  missing_shard np6 LOGLEVEL=INFO, rank 4: FileNotFoundError in setup; peers Connection closed; summary printed as the 100 s timeout fired (124)
  ckpt_size     np5 Fabric, rank 2: load_state_dict size mismatch (48 vs 64 slots); peers Connection closed; exit 1
  weights_only  np4 --tee 3, rank 1: UnpicklingError (Unsupported global __main__.CacheMeta); peers fail in a barrier; exit 1
  wrong_size    np3 torchrun, rank 2: rank 1 aborts on gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT, blamed by torchrun); exit 1
  slow_rank     np5, rank 2: peers 'Timed out waiting 12000ms'; outer timeout during shutdown (124).
                np4 --pg-timeout 300, rank 1: steps 0-1 then silence until `timeout` (hang, 137)
  nan           np3 torchrun and np3 Lightning-own, rank 1: FloatingPointError from the script's check at step 3; exit 1
  sigsegv       np5 --tee 3, rank 2: no signal named in the log; peers Connection closed; outer timeout before summary (137)
  exit4         np4 torchrun, rank 3: own ERROR line, exitcode 4 in torchrun's summary; exit 1
  shape_all     np3 LOGLEVEL=INFO: every rank 'mat1 and mat2 shapes cannot be multiplied (8x15 and 16x16)'; exit 1
  worker_crash  np3 Fabric, rank 2: 'DataLoader worker (pid N) is killed by signal: Killed.'; exit 1
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
import torch.nn as nn

WORK = "/tmp/fault559_work"
NSLOTS, DIM, STEPS, BATCH = 64, 16, 6, 8


class CacheMeta:
    def __init__(self, species, nslots):
        self.species, self.nslots = species, nslots


class RecallNet(nn.Module):
    def __init__(self, nslots=NSLOTS):
        super().__init__()
        self.emb = nn.Embedding(nslots, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, nslots)

    def forward(self, idx, feats):
        return self.head(torch.tanh(self.emb(idx) + self.proj(feats)))


def prepare(maxw=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(559)
    json.dump({f"cache_{i:03d}": i for i in range(NSLOTS)}, open(f"{WORK}/cache_table.json", "w"))
    for r in range(maxw):
        keys = [f"cache_{int(k):03d}" for k in torch.randint(0, NSLOTS, (STEPS * BATCH,), generator=g)]
        torch.save({"keys": keys, "feats": torch.randn(STEPS * BATCH, DIM, generator=g)}, f"{WORK}/shard_{r}.pt")
    torch.manual_seed(0)
    m = RecallNet()
    torch.save(m.state_dict(), f"{WORK}/init.pt")
    torch.save(RecallNet(nslots=48).state_dict(), f"{WORK}/init_v1.pt")
    torch.save({"state": m.state_dict(), "meta": CacheMeta("corvid", NSLOTS)}, f"{WORK}/init_meta.pt")
    print("prepared", WORK)


class Shard(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        path = f"{WORK}/shard_{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shards_v2/shard_{rank:02d}.pt"
        d = torch.load(path)
        self.keys, self.feats = d["keys"], d["feats"]
        self.rank, self.fault, self.frank = rank, fault, frank

    def __len__(self):
        return STEPS

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.frank and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        s = slice(i * BATCH, (i + 1) * BATCH)
        return self.keys[s], self.feats[s]


def load_start(model, rank, fault, frank):
    if fault == "ckpt_size" and rank == frank:
        model.load_state_dict(torch.load(f"{WORK}/init_v1.pt", weights_only=True))
    elif fault == "weights_only" and rank == frank:
        model.load_state_dict(torch.load(f"{WORK}/init_meta.pt", weights_only=True)["state"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/init.pt", weights_only=True))


def recall_step(model, table, batch, rank, step, fault, frank, group):
    keys, feats = batch
    if fault == "keyerror" and rank == frank and step == 2:
        keys = list(keys)
        keys[3] = "cache_117"  # evicted from the table
    idx = torch.tensor([table[k] for k in keys])
    if fault == "shape_all" and step == 1:
        feats = feats[:, : DIM - 1]
    if fault == "nan" and rank == frank and step == 3:
        feats = feats * float("nan")
    counts = torch.bincount(idx, minlength=NSLOTS).float()
    if fault == "wrong_size" and rank == frank and step == 2:
        counts = torch.cat([counts, torch.zeros(8)])
    if fault == "slow_rank" and rank == frank and step == 2:
        t0, acc = time.time(), 0
        while time.time() - t0 < 200:
            acc = (acc * 31 + 7) % 1000003  # re-hashing the whole cache in pure Python
    if fault == "sigsegv" and rank == frank and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "exit4" and rank == frank and step == 3:
        print(f"ERROR rank {rank}: cache table checksum mismatch at step {step}; refusing to recall", flush=True)
        sys.exit(4)
    dist.all_reduce(counts, group=group)
    logits = model(idx, feats)
    loss = nn.functional.cross_entropy(logits, idx)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: recall loss is {loss.item()} (non-finite)")
    recall = (logits.argmax(-1) == idx).float().mean().item()
    print(f"rank {rank} step {step} loss {loss.item():.4f} recall {recall:.3f}", flush=True)
    return loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--launcher", default="trainer", choices=["trainer", "own", "fabric"])
    ap.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))))
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    startup = timedelta(seconds=max(120.0, a.pg_timeout))
    table = json.load(open(f"{WORK}/cache_table.json"))
    nw = 1 if a.fault == "worker_crash" else 0

    if a.launcher == "fabric":
        from lightning.fabric.strategies import DDPStrategy as FDDP
        fabric = L.Fabric(accelerator="cpu", devices=a.devices, strategy=FDDP(process_group_backend="gloo", timeout=startup))
        fabric.launch()
        rank = fabric.global_rank
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
        model = RecallNet()
        load_start(model, rank, a.fault, a.rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt = fabric.setup(model, opt)
        dl = torch.utils.data.DataLoader(Shard(rank, a.fault, a.rank), batch_size=None, num_workers=nw)
        for step, batch in enumerate(dl):
            loss = recall_step(model, table, batch, rank, step, a.fault, a.rank, group)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
        if rank == 0:
            torch.save(model.state_dict(), f"{WORK}/export_corvid.pt")
            print(f"rank 0 exported {WORK}/export_corvid.pt", flush=True)
        return

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = RecallNet()

        def setup(self, stage):
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
            load_start(self.net, self.global_rank, a.fault, a.rank)
            self.ds = Shard(self.global_rank, a.fault, a.rank)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.ds, batch_size=None, num_workers=nw)

        def training_step(self, batch, batch_idx):
            return recall_step(self.net, table, batch, self.global_rank, batch_idx, a.fault, a.rank, self.group)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), f"{WORK}/export_corvid.pt")
                print(f"rank 0 exported {WORK}/export_corvid.pt", flush=True)

    trainer = L.Trainer(accelerator="cpu", devices=a.devices, num_nodes=1,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=startup),
                        max_epochs=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(Lit())


if __name__ == "__main__":
    main()
