"""Batch 548 fault script: gorse heathland fire-scar severity classifier (gloo, CPU only).

Each rank reads its own shard of synthetic multispectral pixels (dNBR, NBR, NDVI, SWIR, NIR, slope) over burnt
gorse/heather heathland, maps the fire-scar class names through a lookup table, starts from a shared checkpoint,
trains a small MLP for 6 steps with gradients all_reduced by hand (no DDP wrapper), all_reduces a scar-area
statistic, prints `rank R step S loss L scar_iou M`, and rank 0 saves an export at the end.

Usage: python fault548.py --prepare            (writes shards, lookup table, checkpoints into /tmp/fault548_work)
       torchrun ... fault548.py --fault NAME --rank N [--pg-timeout 12]

Faults (one per run, planted on --rank N unless said otherwise):
  none            control, nothing planted
  keyerror        rank N's shard holds a scar class ("peat_smoulder") the lookup table lacks -> KeyError
  missing_shard   rank N opens a re-tiled shard file that was never written -> FileNotFoundError
  ckpt_size       rank N builds the model with 48 hidden units, the checkpoint has 32 -> load_state_dict size mismatch
  weights_only    rank N loads the checkpoint that carries a pickled FireScarMeta object with weights_only=True
  allreduce_size  rank N all_reduces a scar-area statistic of 5 values, its peers of 4 (collective size mismatch)
  slow            rank N does pure-Python work (~45 s) before step 3's all_reduce; peers hit the PG timeout
                  (with --pg-timeout 300 the job hangs instead and an outer `timeout` ends it)
  nan             rank N's step-2 batch gets a NaN band; the script's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 2
  exit4           rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_all       every rank appends a 7th band at step 1 (shape bug on all ranks) -> matmul shape error
  worker_crash    rank N reads its batches through a DataLoader worker that SIGKILLs itself at step 2
                  (the worker prefetches, so in practice it dies before step 0 ends)

What happened (batch 548 runs, torch 2.13.0+cpu, gloo, 2-core host):
  none            np4 plain: steps 0-5 on every rank, rank 0 saved the export, exit 0.
  keyerror        np5 tee / np3 wrapper: KeyError 'peat_smoulder' on the planted rank before step 0; torchrun names it.
  missing_shard   np6 redirects / np4 pdsh2: FileNotFoundError for retiled/shard_rN_v2.pt; in pdsh2 the other agent lost the c10d store.
  ckpt_size       np4 pymodule / np6 prefix: load_state_dict size mismatch (32 vs 48 hidden) on the planted rank.
  weights_only    np5 loglevel: UnpicklingError (Unsupported global __main__.FireScarMeta) on rank 4.
  allreduce_size  np4 detail: DETAIL's fingerprint check raised 'Detected mismatch between collectives' on every rank (rank 2 shape [5]);
                  np6 plain: no size error, every rank timed out (gloo 12000ms), rank 3 stuck in the step-0 statistic all_reduce.
  slow            np4 tee_trainer: ranks 0-2 gloo-timed out after 12 s at step 3 while rank 3 spun; np3 pg300: output stopped after
                  step 2 and `timeout 60` SIGTERMed torchrun (exit 124).
  nan             np8 prefix / np3 restart: FloatingPointError from the script's own check at step 2; the restart attempt died at
                  gloo start-up (connectFullMesh refused, stale addresses).
  sigsegv         np5 filter / np6 tee: rank exits -11 (SIGSEGV) at step 2, peers get 'Connection closed by peer'.
  exit4           np8 filter (ERROR line filtered out) / np4 wrapper: ERROR line then exit 4; peers get 'Connection closed by peer'.
  shape_all       np6 pymodule: every rank 'mat1 and mat2 shapes cannot be multiplied (32x7 and 6x32)' at step 1.
  worker_crash    np3 redirects / np4 restart: 'DataLoader worker (pid N) is killed by signal: Killed.' before step 0 ends;
                  the restart attempt died at gloo start-up and the final summary blames rank 0.
"""
import argparse, json, os, signal, sys, time

import torch
import torch.distributed as dist
import torch.nn as nn
from datetime import timedelta

WORK = "/tmp/fault548_work"
CLASSES = {"unburnt": 0, "low": 1, "moderate": 2, "high": 3}
BANDS = 6
HIDDEN = 32


class FireScarMeta:
    def __init__(self, site, season):
        self.site, self.season = site, season


def make_model(hidden=HIDDEN):
    return nn.Sequential(nn.Linear(BANDS, hidden), nn.ReLU(), nn.Linear(hidden, len(CLASSES)))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(548)
    names = list(CLASSES)
    for r in range(8):
        bands = torch.randn(6 * 32, BANDS, generator=g)
        scar = [names[int(i)] for i in torch.randint(0, 4, (6 * 32,), generator=g)]
        torch.save({"bands": bands, "scar": scar}, f"{WORK}/shard_r{r}.pt")
    with open(f"{WORK}/scar_lookup.json", "w") as f:
        json.dump(CLASSES, f)
    torch.manual_seed(0)
    sd = make_model().state_dict()
    torch.save(sd, f"{WORK}/init.pt")
    torch.save({"model": sd, "meta": FireScarMeta("Dorset heath", "2026-spring")}, f"{WORK}/init_meta.pt")
    print("prepared", WORK)


class ShardSet(torch.utils.data.Dataset):
    def __init__(self, x, y, die_at=None):
        self.x, self.y, self.die_at = x, y, die_at

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        if self.die_at is not None and i >= self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    r, w = dist.get_rank(), dist.get_world_size()
    mine = a.rank == r
    f = a.fault

    shard = f"{WORK}/shard_r{r}.pt"
    if f == "missing_shard" and mine:
        shard = f"{WORK}/retiled/shard_r{r}_v2.pt"
    data = torch.load(shard, weights_only=True)
    with open(f"{WORK}/scar_lookup.json") as fh:
        lookup = json.load(fh)
    if f == "keyerror" and mine:
        data["scar"][17] = "peat_smoulder"
    labels = torch.tensor([lookup[s] for s in data["scar"]])
    x = data["bands"]

    hidden = 48 if (f == "ckpt_size" and mine) else HIDDEN
    model = make_model(hidden)
    if f == "weights_only" and mine:
        sd = torch.load(f"{WORK}/init_meta.pt", weights_only=True)["model"]
    else:
        sd = torch.load(f"{WORK}/init.pt", weights_only=True)
    model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()

    if f == "worker_crash" and mine:
        loader = torch.utils.data.DataLoader(ShardSet(x, labels, die_at=2 * 32), batch_size=32, num_workers=1)
    else:
        loader = torch.utils.data.DataLoader(ShardSet(x, labels), batch_size=32, num_workers=0)
    it = iter(loader)

    for step in range(a.steps):
        xb, yb = next(it)
        if f == "shape_all" and step == 1:
            xb = torch.cat([xb, xb[:, :1]], dim=1)
        if f == "nan" and mine and step == 2:
            xb = xb.clone()
            xb[5, 0] = float("nan")
        if f == "sigsegv" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "exit4" and mine and step == 2:
            print(f"ERROR rank {r}: burn-scar tile 14/27 has no pre-fire reference mosaic, giving up", flush=True)
            sys.exit(4)
        out = model(xb)
        loss = loss_fn(out, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {r} step {step}: loss is {loss.item()} (non-finite), stopping")
        opt.zero_grad()
        loss.backward()
        if f == "slow" and mine and step == 3:
            t_end = time.time() + (200 if a.pg_timeout > 60 else 45)
            acc = 0
            while time.time() < t_end:
                acc = sum(i * i for i in range(20000)) + acc % 7
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= w
        opt.step()
        pred = out.argmax(1)
        inter = ((pred > 0) & (yb > 0)).sum().item()
        union = ((pred > 0) | (yb > 0)).sum().item()
        area = torch.tensor([float(inter), float(union), float((yb > 0).sum()), 1.0])
        if f == "allreduce_size" and mine:
            area = torch.cat([area, torch.tensor([0.0])])
        dist.all_reduce(area)
        iou = area[0] / max(area[1].item(), 1.0)
        print(f"rank {r} step {step} loss {loss.item():.4f} scar_iou {iou.item():.4f}", flush=True)

    if r == 0:
        path = f"{WORK}/export_{os.getpid()}.pt"
        torch.save(model.state_dict(), path)
        print(f"rank 0 saved export {path}", flush=True)
    dist.barrier()
    del it, loader
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
