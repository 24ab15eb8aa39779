"""Batch 581 fault script: "wombat burrows".

A small burrow-occupancy model: each rank reads its own shard of burrow survey
records (tunnel depth, entrance width, soil moisture, a burrow-site id), maps the
site id through a lookup table of sites to a site embedding, and trains a tiny
MLP that predicts occupancy. Gloo backend, CPU only, 6 steps, all_reduce of the
gradients every step, rank 0 exports the model at the end.

Faults (--fault NAME --rank N):
  none          control: nothing planted.
  site_key      rank N's shard holds a burrow-site id the site table lacks (KeyError).
  shard_missing rank N's shard file was never written (FileNotFoundError at open).
  ckpt_size     rank N loads a starting checkpoint whose tunnel layer has another width
                (load_state_dict size mismatch, RuntimeError).
  grad_size     rank N all_reduces a gradient buffer one element too long (gloo size mismatch).
  slow_dig      rank N does pure-Python "digging" for a long time at step 3; its peers
                time out in the gradient all_reduce (--pg-timeout, default 12 s).
  hang          like slow_dig, but rank N digs for ever; run with --pg-timeout 300 and
                ended by `timeout`.
  nan_depth     rank N's batch holds a NaN depth; the script's own finiteness check raises
                FloatingPointError.
  segv          rank N sends itself SIGSEGV at step 2.
  census_exit   rank N logs its own ERROR line (burrow census mismatch) and sys.exit(4).
  shape_all     every rank builds the head with the wrong input width (mat1/mat2 shape error).
  worker_crash  rank N's DataLoader worker dies (os._exit in the worker) at its 3rd batch.

What happened (21 runs, 2026-12-07, torch 2.13.0+cpu, gloo, machine heavily loaded):
  none          tee np4: 6 steps on all ranks, export written, exit 0.
  site_key      KeyError 'site_hairy_nosed_07' on the planted rank at step 2; peers get gloo
                "Connection closed by peer" (bashloop np4 r2, legacy np6 r5).
  shard_missing FileNotFoundError for burrow_shardN_surveyed.pt before step 0; peers get connection
                closed or 12000ms send/recv timeouts (srunlabel np5 r3, spawn np3 r1).
  ckpt_size     load_state_dict size mismatch (24 vs 16) on the planted rank; peers connection closed
                (mpitag np4 r1, pdsh2 np6 r4 where worker-0's summary blames rank 2).
  grad_size     a peer aborts with gloo EnforceNotMet "Received data size doesn't match" (SIGABRT);
                torchrun blames the aborting rank, not the planted one (tee np3 r0, ranklabel np5 r2).
  slow_dig      peers time out after 12000ms in all_reduce; the digging rank later sees connection closed
                (files np4 r3) or is still digging when timeout 100 fires (logfmt np6 r1, exit 124).
  hang          output stops after step 2 on all ranks, no error; timeout 60 ends it (bashloop np3 r2, exit 124).
  nan_depth     FloatingPointError from the script's own check at step 3 (legacy np5 r4, files np3 r2).
  segv          rank stops silently (srunlabel np6 r3, exit 139) / spawn reports "terminated with
                signal SIGSEGV" (spawn np4 r0).
  census_exit   ERROR line then sys.exit(4); once the exit ended in "terminate called without an active
                exception" (logfmt np4 r3, exit 134), once plain exit 4 (mpitag np8 r6).
  shape_all     every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (ranklabel np5).
  worker_crash  RuntimeError "DataLoader worker (pid N) exited unexpectedly with exit code 3" on the
                planted rank (tee np4 r1, bashloop np8 r5).
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault581_work"
FEATS = 3
EMB = 4
N_SITES = 32
ROWS = 64
BATCH = 8

LOG = None
LABEL = ""


def out(msg, err=False, level="info"):
    if LOG is not None:
        getattr(LOG, level)(msg)
        return
    stream = sys.stderr if err else sys.stdout
    print(f"{LABEL}{msg}", file=stream, flush=True)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(581)
    table = {f"site{i:03d}": torch.randn(EMB, generator=g) for i in range(N_SITES)}
    torch.save(table, f"{WORK}/site_table.pt")
    for r in range(world):
        feats = torch.rand(ROWS, FEATS, generator=g)
        sites = [f"site{int(i):03d}" for i in torch.randint(0, N_SITES, (ROWS,), generator=g)]
        occ = (torch.rand(ROWS, generator=g) > 0.5).float()
        torch.save({"feats": feats, "sites": sites, "occ": occ}, f"{WORK}/burrow_shard{r}.pt")
    m = BurrowNet(FEATS + EMB)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    m2 = BurrowNet(FEATS + EMB, hidden=24)
    torch.save(m2.state_dict(), f"{WORK}/start_wide.pt")
    print(f"prepared {world} shards, site table and checkpoints in {WORK}", flush=True)


class BurrowNet(nn.Module):
    def __init__(self, inp, hidden=16):
        super().__init__()
        self.tunnel = nn.Linear(inp, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(torch.relu(self.tunnel(x))).squeeze(-1)


class BurrowShard(torch.utils.data.Dataset):
    def __init__(self, rank, fault, fault_rank):
        path = f"{WORK}/burrow_shard{rank}.pt"
        if fault == "shard_missing" and rank == fault_rank:
            path = f"{WORK}/burrow_shard{rank}_surveyed.pt"
        with open(path, "rb") as f:
            d = torch.load(f)
        self.feats, self.sites, self.occ = d["feats"], list(d["sites"]), d["occ"]
        if fault == "site_key" and rank == fault_rank:
            self.sites[2 * BATCH + 3] = "site_hairy_nosed_07"
        if fault == "nan_depth" and rank == fault_rank:
            self.feats[3 * BATCH + 1, 0] = float("nan")
        self.table = torch.load(f"{WORK}/site_table.pt")
        self.crash = fault == "worker_crash" and rank == fault_rank

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        if self.crash and i == 2 * BATCH + 2:
            os._exit(3)
        emb = self.table[self.sites[i]]
        return torch.cat([self.feats[i], emb]), self.occ[i]


def main_worker(rank, world, args):
    global LOG, LABEL
    torch.set_num_threads(1)
    if args.label:
        LABEL = f"rank {rank}: "
    if args.logfmt:
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
            stream=sys.stdout,
        )
        LOG = logging.getLogger("wombat")
    fault, fr = args.fault, args.rank
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.pg_timeout))
    out(f"burrow survey rank {rank}/{world} up, fault={fault}")
    ds = BurrowShard(rank, fault, fr)
    workers = 1 if fault == "worker_crash" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=workers)
    inp = FEATS + EMB
    model = BurrowNet(inp)
    ck = f"{WORK}/start_wide.pt" if (fault == "ckpt_size" and rank == fr) else f"{WORK}/start.pt"
    model.load_state_dict(torch.load(ck))
    if fault == "shape_all":
        model.head = nn.Linear(12, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lossf = nn.BCEWithLogitsLoss()
    it = iter(dl)
    for step in range(args.steps):
        x, y = next(it)
        if step == 2 and fault == "segv" and rank == fr:
            os.kill(os.getpid(), signal.SIGSEGV)
        if step == 3 and fault in ("slow_dig", "hang") and rank == fr:
            dug = 0
            end = time.time() + (args.pg_timeout * 3 if fault == "slow_dig" else 10**9)
            while time.time() < end:
                for k in range(20000):
                    dug += (k * k) % 7
        if step == 3 and fault == "nan_depth" and rank == fr:
            pass
        if not torch.isfinite(x).all():
            raise FloatingPointError(
                f"non-finite burrow depth in batch at step {step} on rank {rank}")
        if step == 4 and fault == "census_exit" and rank == fr:
            out(f"ERROR: burrow census mismatch on rank {rank}: 17 wombats counted, 12 burrows occupied; aborting",
                err=True, level="error")
            sys.exit(4)
        opt.zero_grad()
        pred = model(x)
        loss = lossf(pred, y)
        loss.backward()
        for p in model.parameters():
            g = p.grad
            if fault == "grad_size" and rank == fr and step == 2:
                g = torch.cat([g.flatten(), torch.zeros(1)])
            dist.all_reduce(g)
            if g is p.grad:
                p.grad /= world
        opt.step()
        acc = ((pred > 0).float() == y).float().mean().item()
        out(f"rank {rank} step {step} loss {loss.item():.4f} occupancy_acc {acc:.3f}")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/burrow_export.pt")
        out("rank 0 exported burrow model")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=int, default=0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--label", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(main_worker, args=(args.spawn, args), nprocs=args.spawn)
        return
    main_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
