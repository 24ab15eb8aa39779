"""Batch 568 fault script, theme "ibis wading".

A small wading-bird foraging model: each rank reads its own shard of wading
observations (water depth, bill probe depth, mud softness, ...), maps the
species code through a lookup table to an embedding row, and trains a tiny
MLP that predicts prey-catch success.  gloo backend, CPU only, 6 steps,
starting from a checkpoint made by --prepare.  Every rank prints
`rank R step S loss L catch_acc M` per step; rank 0 saves an export at the end.

Faults (--fault NAME --rank N):
  none          control run, nothing planted
  species_key   rank N meets a species code missing from the lookup table (KeyError)
  missing_shard rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size     rank N loads a checkpoint whose head has another width (size mismatch in load_state_dict)
  weights_only  rank N loads a checkpoint holding a pickled custom object; torch.load(weights_only=True) refuses it
  wrong_size    rank N all_reduces a tally tensor of the wrong length at step 2 (gloo size mismatch)
  slow_rank     rank N does pure-Python "flock census" work for 90 s at step 2; peers time out in the
                gradient all_reduce (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan_check     rank N's depth feature turns NaN at step 3; the script's own finiteness check raises FloatingPointError
  self_segv     rank N sends itself SIGSEGV at step 2
  logged_exit   rank N prints its own ERROR line (tide gauge offline) and calls sys.exit(4)
  shape_all     every rank builds the feature batch one column short (matmul shape error on all ranks)
  worker_crash  rank N's DataLoader worker SIGKILLs itself when it fetches batch 2

What happened (after the runs):
  none          3 and 8 ranks printed 6 steps each, rank 0 saved the export; exit 0.
  species_key   rank N raised KeyError: 'SCARLET_X' before step 0; peers were SIGTERMed or hit gloo "Connection closed by peer" in DDP's param check.
  missing_shard rank N raised FileNotFoundError for wade_shard_N_missing.pt before step 0; peers SIGTERMed; exit 1.
  ckpt_size     rank N raised RuntimeError "size mismatch for body.weight ..." in load_state_dict (visible in the redirects stderr.log); exit 1.
  weights_only  rank N raised _pickle.UnpicklingError "Weights only load failed" (Census global); with the rank filtered out only its exitcode 1 shows.
  wrong_size    under DETAIL every rank raised "Detected mismatch between collectives"; plain, a peer aborted with gloo::EnforceNotMet "Received data size doesn't match" (SIGABRT).
  slow_rank     peers raised gloo "Timed out waiting 12000ms" while rank N was busy (it printed nothing); with --pg-timeout 300 output stopped and timeout ended it (124).
  nan_check     rank N raised FloatingPointError "loss is nan" at step 3; once peers then aborted (terminate called without an active exception) and the summary blamed a peer.
  self_segv     rank N died with exitcode -11 (SIGSEGV), no traceback; with --max-restarts 1 the second attempt failed in Gloo connectFullMesh.
  logged_exit   rank N printed "ERROR rank N: tide gauge feed offline ..." and exited 4 (line hidden when the rank is filtered out).
  shape_all     every rank raised "mat1 and mat2 shapes cannot be multiplied (32x9 and 10x16)" at step 0; the restart attempt failed in Gloo connectFullMesh.
  worker_crash  rank N raised "DataLoader worker (pid ...) is killed by signal: Killed" before any step printed (the worker died prefetching batch 2).
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault568_work"
NFEAT = 6
SPECIES = ["SCARLET", "GLOSSY", "SACRED", "WHITE", "PUNA", "STRAW"]


class Census:
    """A custom object; pickling it into a checkpoint makes weights_only refuse it."""
    def __init__(self, n):
        self.n = n


class WaderNet(nn.Module):
    def __init__(self, head_width=16):
        super().__init__()
        self.emb = nn.Embedding(len(SPECIES), 4)
        self.body = nn.Linear(NFEAT + 4, head_width)
        self.head = nn.Linear(head_width, 2)

    def forward(self, x, sp):
        h = torch.cat([x, self.emb(sp)], dim=1)
        return self.head(torch.relu(self.body(h)))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(568)
    for r in range(8):
        n = 6 * 32
        feats = torch.rand(n, NFEAT, generator=g)
        sp = [SPECIES[i % len(SPECIES)] for i in torch.randint(0, 60, (n,), generator=g).tolist()]
        label = (feats[:, 0] * 0.7 + feats[:, 3] * 0.5 > 0.6).long()
        torch.save({"feats": feats, "species": sp, "label": label}, f"{WORK}/wade_shard_{r}.pt")
    with open(f"{WORK}/species_lookup.json", "w") as f:
        json.dump({s: i for i, s in enumerate(SPECIES)}, f)
    torch.manual_seed(0)
    torch.save(WaderNet().state_dict(), f"{WORK}/wader_init.pt")
    torch.save(WaderNet(head_width=24).state_dict(), f"{WORK}/wader_init_w24.pt")
    torch.save({"model": WaderNet().state_dict(), "census": Census(412)}, f"{WORK}/wader_init_census.pt")
    print("prepared", WORK)


class WadeSet(torch.utils.data.Dataset):
    def __init__(self, feats, idx, label, crash_rank, rank):
        self.feats, self.idx, self.label = feats, idx, label
        self.crash = crash_rank == rank

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        if self.crash and i >= 64:  # step 2's batch
            os.kill(os.getpid(), signal.SIGKILL)
        return self.feats[i], self.idx[i], self.label[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--no-ddp", action="store_true", help="all_reduce gradients by hand")
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    torch.set_num_threads(1)
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = rank == a.rank
    torch.manual_seed(rank)

    if a.fault == "missing_shard" and bad:
        shard = f"{WORK}/wade_shard_{rank}_missing.pt"
    else:
        shard = f"{WORK}/wade_shard_{rank}.pt"
    data = torch.load(shard)
    with open(f"{WORK}/species_lookup.json") as f:
        lookup = json.load(f)
    species = list(data["species"])
    if a.fault == "species_key" and bad:
        species[17] = "SCARLET_X"
    idx = torch.tensor([lookup[s] for s in species])
    feats = data["feats"]
    if a.fault == "shape_all":
        feats = feats[:, : NFEAT - 1]

    model = WaderNet()
    if a.fault == "ckpt_size" and bad:
        model.load_state_dict(torch.load(f"{WORK}/wader_init_w24.pt"))
    elif a.fault == "weights_only" and bad:
        model.load_state_dict(torch.load(f"{WORK}/wader_init_census.pt", weights_only=True)["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/wader_init.pt"))
    net = model if a.no_ddp else nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    ds = WadeSet(feats, idx, data["label"], a.rank if a.fault == "worker_crash" else -1, rank)
    nw = 1 if a.fault == "worker_crash" else 0
    loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=nw)
    for step, (x, sp, y) in enumerate(loader):
        if step >= 6:
            break
        if a.fault == "nan_check" and bad and step == 3:
            x = x.clone()
            x[5, 0] = float("nan")
        if a.fault == "logged_exit" and bad and step == 1:
            print(f"ERROR rank {rank}: tide gauge feed offline (depth sensor returned no reading), aborting", flush=True)
            sys.exit(4)
        if a.fault == "self_segv" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "slow_rank" and bad and step == 2:
            t0, flock = time.time(), 0
            while time.time() - t0 < 90:
                flock = (flock * 31 + 7) % 1000003
        out = net(x, sp)
        loss = nn.functional.cross_entropy(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite wading depth in batch)")
        opt.zero_grad()
        loss.backward()
        if a.no_ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        tally = torch.tensor([float((out.argmax(1) == y).sum()), float(len(y))])
        if a.fault == "wrong_size" and bad and step == 2:
            tally = torch.zeros(3 + 64 * 1024)
        dist.all_reduce(tally)
        opt.step()
        acc = (tally[0] / tally[1]).item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} catch_acc {acc:.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/wader_export.pt")
        print("rank 0 saved export to", f"{WORK}/wader_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
