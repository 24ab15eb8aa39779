"""Batch 586 fault script, theme "nautilus chambers".

A small chamber-buoyancy regressor: every rank reads its own shard of synthetic
nautilus shell measurements (chamber volumes, septum thickness, siphuncle id),
maps the siphuncle id through a lookup table, starts from a checkpoint, trains
6 steps with gloo (CPU only, PG timeout 12 s by default) and prints
`rank R step S loss L buoyancy M` every step.  Rank 0 saves an export at the end.

  --prepare            write shards, lookup table and start checkpoint to /tmp/fault586_work
  --hf                 run the same data through a transformers.Trainer (tiny config-built model)
  --fault NAME --rank N   plant one fault (N = -1 for "every rank")

Faults:
  none           control, nothing planted
  siphuncle_key  rank N meets a siphuncle id missing from the lookup table (KeyError)
  missing_shard  rank N's shard file is missing (FileNotFoundError)
  ckpt_size      rank N loads a start checkpoint whose chamber layer has another width (size mismatch)
  weights_only   rank N loads a checkpoint holding a pickled ChamberMeta object with weights_only=True
  gather_size    rank N contributes a chamber tensor of a wrong length to all_gather
  slow_rank      rank N recomputes chamber spirals in pure Python for 60 s; the peers' collective times out
  hang           like slow_rank, but with --pg-timeout 300, so nothing times out and `timeout` ends it
  nan_buoyancy   rank N's buoyancy becomes NaN; the program's own check raises FloatingPointError
  sigsegv        rank N sends itself SIGSEGV at step 2
  error_exit     rank N logs its own ERROR line (septum count out of range) and sys.exit(4)
  shape_all      every rank builds the chamber head with the wrong input width (matmul shape error)
  host_mem       rank N caps its address space (RLIMIT_AS) and builds a huge chamber mesh: MemoryError
  worker_crash   rank N's DataLoader worker kills itself with SIGKILL

What happened (batch 586 runs, logs nautilus_*):
  none           3-rank accelerate run and 3-rank transformers.Trainer run both finish cleanly, exit 0
  siphuncle_key  KeyError: 47 on the planted rank (Trainer under torchrun, rank 1; accelerate, rank 4), peers get gloo
                 "Connection closed by peer"; in the accelerate run torchelastic blames rank 3 (SIGABRT) instead
  missing_shard  FileNotFoundError for shard_3_chambers.pt on rank 3 before any step
  ckpt_size      load_state_dict size mismatch (24 vs 16) on rank 2 (torchrun) and rank 3 (accelerate, 8 ranks)
  weights_only   UnpicklingError "Unsupported global: __main__.ChamberMeta" on rank 1
  gather_size    "ProcessGroupGloo::allgather: invalid tensor size" on rank 3 (4 ranks) and rank 5 (7 ranks, --tee 3)
  slow_rank      the peers' all_reduce fails with gloo "Timed out waiting 12000ms"; the slow rank never raises
  hang           with --pg-timeout 300 the output stops after "rank 1 recomputing chamber spirals"; timeout 60 ends it (124)
  nan_buoyancy   the NaN planted on rank 6 spreads through all_reduce; all 8 ranks raise FloatingPointError
  sigsegv        rank 5 (torchrun) and rank 2 (--tee 3) die with exitcode -11 (SIGSEGV), no traceback
  error_exit     rank 7 (8 ranks) and rank 1 (two accelerate machines) print their ERROR line and exit 4
  shape_all      all 4 ranks: "mat1 and mat2 shapes cannot be multiplied (16x8 and 9x16)"
  host_mem       bare MemoryError on rank 2 under a 3 GiB RLIMIT_AS
  worker_crash   "DataLoader worker (pid N) is killed by signal: Killed." on rank 4
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault586_work"
FEAT = 8


class ChamberMeta:
    def __init__(self, n):
        self.n = n


class ChamberNet(nn.Module):
    def __init__(self, width=16, in_feat=FEAT):
        super().__init__()
        self.chamber = nn.Linear(in_feat, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.chamber(x)))


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(586)
    table = {i: float(i) / 10.0 for i in range(20)}
    torch.save(table, f"{WORK}/siphuncle_table.pt")
    for r in range(world):
        x = torch.randn(96, FEAT, generator=g)
        ids = torch.randint(0, 20, (96,), generator=g)
        y = x[:, :3].sum(1, keepdim=True) * 0.3
        torch.save({"x": x, "ids": ids, "y": y}, f"{WORK}/shard_{r}.pt")
    torch.save(ChamberNet().state_dict(), f"{WORK}/start.pt")
    torch.save(ChamberNet(width=24).state_dict(), f"{WORK}/start_wide.pt")
    torch.save({"state": ChamberNet().state_dict(), "meta": ChamberMeta(6)}, f"{WORK}/start_meta.pt")
    print(f"prepared {world} shards in {WORK}")


class ShardSet(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        path = f"{WORK}/shard_{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shard_{rank}_chambers.pt"
        d = torch.load(path)
        self.x, self.ids, self.y = d["x"], d["ids"], d["y"]
        self.table = torch.load(f"{WORK}/siphuncle_table.pt")
        self.rank, self.fault, self.frank = rank, fault, frank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        sid = int(self.ids[i])
        if self.fault == "siphuncle_key" and self.rank == self.frank and i == 37:
            sid = 47
        if self.fault == "worker_crash" and self.rank == self.frank and i == 50:
            os.kill(os.getpid(), signal.SIGKILL)
        off = self.table[sid]
        return self.x[i] + off, self.y[i]


def spiral(n):
    # pure-Python logarithmic spiral, deliberately slow
    s = 0.0
    for k in range(n):
        s += (k % 7) * 1.0001 ** (k % 50)
    return s


def main_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    f, fr = args.fault, args.rank
    mine = fr == rank or fr == -1
    if rank == 0:
        print(f"nautilus chambers: world {world}, fault {f} on rank {fr}", flush=True)

    if f == "host_mem" and mine:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 * 1024 ** 3, 3 * 1024 ** 3))

    ds = ShardSet(rank, f, fr)
    nw = 1 if f == "worker_crash" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=nw)

    width = 16
    model = ChamberNet(in_feat=FEAT + 1 if f == "shape_all" else FEAT)
    if f == "ckpt_size" and mine:
        model.load_state_dict(torch.load(f"{WORK}/start_wide.pt"))
    elif f == "weights_only" and mine:
        model.load_state_dict(torch.load(f"{WORK}/start_meta.pt", weights_only=True)["state"])
    elif f != "shape_all":
        model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)  # each rank reads its own shard, the loader stays unsharded

    it = iter(dl)
    for step in range(6):
        x, y = next(it)
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        buoy = loss.detach().clone()
        if f == "nan_buoyancy" and mine and step == 3:
            buoy = buoy * float("nan")
        if step == 2 and mine:
            if f in ("slow_rank", "hang"):
                print(f"rank {rank} recomputing chamber spirals", flush=True)
                t0 = time.time()
                while time.time() - t0 < 60:
                    spiral(200000)
            elif f == "sigsegv":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif f == "error_exit":
                print(f"ERROR rank {rank}: septum count 41 out of range (max 36) in shard_{rank}.pt, giving up", flush=True)
                sys.exit(4)
            elif f == "host_mem":
                mesh = []
                for _ in range(200):
                    mesh.append(bytearray(256 * 1024 * 1024))
        if f == "gather_size" and step == 3:
            n = 5 if mine else 4
            mine_t = torch.full((n,), float(rank))
            outs = [torch.zeros(4) for _ in range(world)]
            dist.all_gather(outs, mine_t)
        dist.all_reduce(buoy)
        buoy = buoy / world
        if not torch.isfinite(buoy):
            raise FloatingPointError(f"buoyancy became non-finite at step {step} on rank {rank}: {buoy.item()}")
        print(f"rank {rank} step {step} loss {loss.item():.4f} buoyancy {buoy.item():.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export_chambers.pt")
        print(f"rank 0 saved export to {WORK}/export_chambers.pt", flush=True)
    acc.end_training()


def main_hf(args):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    class HFSet(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(5860)
            self.ids = torch.randint(0, 20, (64, 8), generator=g)
            self.table = torch.load(f"{WORK}/siphuncle_table.pt")

        def __len__(self):
            return 64

        def __getitem__(self, i):
            rank = int(os.environ.get("RANK", 0))
            ids = self.ids[i].clone()
            if args.fault == "siphuncle_key" and rank == args.rank and i >= 8:
                self.table[47]
            lab = int(self.table[int(ids[0])] > 1.0)
            return {"input_ids": ids, "labels": torch.tensor(lab)}

    cfg = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(cfg)
    ta = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=12,
                           report_to=[], per_device_train_batch_size=4, max_steps=6, logging_steps=1,
                           save_strategy="no", disable_tqdm=True)
    tr = Trainer(model=model, args=ta, train_dataset=HFSet())
    tr.train()
    if int(os.environ.get("RANK", 0)) == 0:
        print("rank 0 finished chamber classifier", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--hf", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare(a.world)
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)
