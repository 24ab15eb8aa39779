"""Batch 572 fault script, theme "gannet dives".

A small data-parallel regressor predicts a gannet's dive depth (m) from dive
features (height, speed, angle, wind, colony id). `--prepare` writes synthetic
shards per rank, a colony lookup table and a start checkpoint into the work
dir. Training: gloo, CPU only, gradients all_reduced by hand, 6 steps, every
rank prints `rank R step S loss L dive_depth_mae M`; rank 0 saves an export.

Faults (`--fault NAME --rank N`):
  none            control, no fault
  colony_key      rank N's shard names a colony missing from the lookup table (KeyError)
  missing_shard   rank N's shard file does not exist (FileNotFoundError)
  ckpt_size       rank N loads a start checkpoint with a wider head (size mismatch in load_state_dict)
  weights_only    rank N loads a checkpoint holding a pickled DiveLogMeta object (weights_only refusal)
  grad_size       rank N all_reduces a gradient buffer one element short (gloo size mismatch)
  slow_rank       rank N does pure-Python dive-profile smoothing for ages; peers time out in all_reduce
                  (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan_depth       rank N's batch has a NaN depth; the program's own finite check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 2
  error_exit      rank N logs its own ERROR line (sonar calibration) and sys.exit(4)
  shape_all       every rank builds the head with the wrong input width (matmul shape error)
  worker_crash    a DataLoader worker on rank N dies (os._exit in the worker)

What happened (batch 572 runs, torch 2.13.0+cpu, gloo, PG timeout 12 s):
  none            np4 plain and np6 redirects finish all 6 steps, rank 0 saves the export, exit 0.
  colony_key      rank 2 (np4 tee) / rank 5 (np8 pdsh2) raise KeyError 'colony_ailsa_craig'; peers get gloo connection closed.
  missing_shard   rank 1 (np3 pymodule) FileNotFoundError; rank 4 (np6 filter) hidden, summary shows exitcode 1 only.
  ckpt_size       rank 3 (np5 loglevel) load_state_dict size mismatch for 2.weight/2.bias.
  weights_only    rank 1 (np4 tee_trainer) / rank 5 (np6 wrapper) UnpicklingError: DiveLogMeta not an allowed global.
  grad_size       DETAIL (np4, rank 3): 'Detected mismatch between collectives' on all ranks; plain gloo (np6 prefix, rank 2): EnforceNotMet size mismatch, SIGABRT.
  slow_rank       np4 plain rank 1: peers 'Timed out waiting 12000ms', summary blames rank 2; np3 tee rank 2 with --pg-timeout 300: hang, timeout exit 124.
  nan_depth       rank 2 (np5 redirects, only in stderr.log) / rank 7 (np8 tee) FloatingPointError non-finite loss at step 3.
  sigsegv         rank 1 (np6 pymodule) exitcode -11; rank 3 (np4 restart) -11, then attempt 2 fails in Gloo connectFullMesh.
  error_exit      rank 0 (np3 wrapper) prints its ERROR line, exit 4; rank 4 (np5 filter) hidden, summary exitcode 4.
  shape_all       np4 loglevel: every rank 'mat1 and mat2 shapes cannot be multiplied (8x5 and 7x16)'.
  worker_crash    rank 1 (np4 prefix) / rank 6 (np7 detail) 'DataLoader worker ... exited unexpectedly'; DETAIL adds a monitoredBarrier error on rank 0.
"""
import argparse, json, os, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault572_work"
NFEAT = 5


class DiveLogMeta:  # a non-tensor object in a checkpoint
    def __init__(self, site):
        self.site = site


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(572)
    table = {f"colony_{i}": i for i in range(6)}
    with open(f"{WORK}/colonies.json", "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = torch.randn(64, NFEAT - 1, generator=g)
        colonies = [f"colony_{(r + i) % 6}" for i in range(64)]
        y = (x @ torch.tensor([3.0, -1.5, 2.0, 0.5])).unsqueeze(1) + 8.0
        torch.save({"x": x, "colony": colonies, "depth": y}, f"{WORK}/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(make_model(NFEAT).state_dict(), f"{WORK}/start.pt")
    torch.save(make_model(NFEAT, head=2).state_dict(), f"{WORK}/start_wide.pt")
    torch.save({"model": make_model(NFEAT).state_dict(), "meta": DiveLogMeta("Bass Rock")},
               f"{WORK}/start_meta.pt")
    print(f"prepared {world} shards in {WORK}")


def make_model(nin, head=1):
    return nn.Sequential(nn.Linear(nin, 16), nn.Tanh(), nn.Linear(16, head))


class Dives(Dataset):
    def __init__(self, shard, table, crash=False):
        self.x, self.c, self.y = shard["x"], shard["colony"], shard["depth"]
        self.table, self.crash = table, crash

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash and i >= 20:
            os._exit(1)
        cid = float(self.table[self.c[i]])
        return torch.cat([self.x[i], torch.tensor([cid / 6])]), self.y[i]


def smooth_profile(n):
    acc = 0.0
    for i in range(n):
        acc = (acc * 0.999 + (i % 97) * 0.001) % 1000.0
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=int, default=0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare(a.prepare)
        return
    torch.set_num_threads(1)
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    f = a.fault
    print(f"rank {rank}/{world} gannet dive trainer up, fault={f if me or f == 'shape_all' else 'none'}", flush=True)

    with open(f"{WORK}/colonies.json") as fh:
        table = json.load(fh)
    shard_path = f"{WORK}/shard_{rank}.pt"
    if f == "missing_shard" and me:
        shard_path = f"{WORK}/shard_{rank}_missing.pt"
    shard = torch.load(shard_path)
    if f == "colony_key" and me:
        shard["colony"][3] = "colony_ailsa_craig"

    model = make_model(NFEAT if f != "shape_all" else NFEAT + 2)
    ck = f"{WORK}/start.pt"
    if f == "ckpt_size" and me:
        ck = f"{WORK}/start_wide.pt"
    if f == "weights_only" and me:
        sd = torch.load(f"{WORK}/start_meta.pt")["model"]
    else:
        sd = torch.load(ck)
    if f == "shape_all":
        sd = {k: v for k, v in sd.items() if not k.startswith("0.")}
        model.load_state_dict(sd, strict=False)
    else:
        model.load_state_dict(sd)

    ds = Dives(shard, table, crash=(f == "worker_crash" and me))
    dl = DataLoader(ds, batch_size=8, shuffle=False, num_workers=1 if (f == "worker_crash" and me) else 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    it = iter(dl)
    for step in range(a.steps):
        x, y = next(it)
        if f == "nan_depth" and me and step == 3:
            y = y.clone(); y[2, 0] = float("nan")
        if f == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "error_exit" and me and step == 2:
            print(f"ERROR rank {rank}: sonar depth calibration drifted 4.2 m beyond tolerance, aborting", flush=True)
            sys.exit(4)
        if f == "slow_rank" and me and step == 1:
            smooth_profile(10**9)
        opt.zero_grad()
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (dive depth batch)")
        loss.backward()
        for p in model.parameters():
            g = p.grad.view(-1)
            if f == "grad_size" and me and step == 2:
                g = g[:-1].clone()
            dist.all_reduce(g)
            p.grad.div_(world) if g.numel() == p.grad.numel() else None
        opt.step()
        mae = (pred - y).abs().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} dive_depth_mae {mae:.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_gannet.pt")
        print("rank 0 saved export to", f"{WORK}/export_gannet.pt", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
