"""Kauri gum resin tapping: a small distributed job (plain torch.distributed, gloo, CPU) that learns
to grade tapped kauri gum (resin grade per tapping cut) from per-rank shards of (tree id, bark feature).

Prepare the data once:   python fault560.py --prepare
Run under torchrun:      torchrun --nproc-per-node W fault560.py [--fault NAME --rank N] [--pg-timeout S]

Every rank loads its shard, the grove table (tree id -> grade slot) and the starting checkpoint, then
runs 6 steps; each step all_reduces the per-grade resin tally and (by hand, no DDP wrapper) the
gradients on a gloo group whose timeout is --pg-timeout (12 s by default; the default group gets
120 s for start-up) and prints `rank R step S loss L yield M`. Rank 0 saves an export at the end.

Faults (--fault NAME, planted on --rank N only unless said otherwise):
  none          control, nothing planted
  keyerror      rank N looks up a felled tree id 'kauri_T913' at step 2 -> KeyError
  missing_shard rank N opens a tapping shard that does not exist -> FileNotFoundError (before step 0)
  ckpt_size     rank N loads an older checkpoint built for 40 grades -> load_state_dict size mismatch
  weights_only  rank N loads a checkpoint holding a pickled TappingLog object with weights_only=True
  wrong_size    rank N all_reduces a resin tally 6 grades longer at step 2 (gloo size mismatch)
  slow_rank     rank N does pure-Python work before the step-2 all_reduce; peers time out
                (with --pg-timeout 300 the job hangs until the outer `timeout` ends it)
  nan           rank N's bark features become NaN at step 3; the script's own check raises FloatingPointError
  sigabrt       rank N sends itself SIGABRT at step 2
  exit4         rank N prints its own ERROR line and calls sys.exit(4) at step 3
  shape_all     every rank feeds 11-wide features into the 12-wide projection at step 1 (shape bug)
  host_oom      rank N builds a resin-density histogram with a runaway bin count at step 2
                (a ~1 TiB torch.zeros; the allocator refuses it, nothing is really allocated)

What happened (one line per fault, from the kept logs):
  none          np4 torchrun: 6 steps on every rank, export saved, exit 0
  keyerror      np5 --tee 3, rank 3 and np4 pdsh2-style two agents, rank 1: KeyError 'kauri_T913'; peers gloo 'Connection closed by peer'; exit 1 (pdsh2 shell: 0)
  missing_shard np6 LOGLEVEL=INFO, rank 4: FileNotFoundError before step 0; peers SIGTERMed in the first all_reduce; exit 1
  ckpt_size     np5 --redirects 3, rank 2 and np8 train.sh, rank 7: load_state_dict size mismatch (40 vs 48 grades); exit 1
  weights_only  np4 --tee 3 --role trainer, rank 1: UnpicklingError (Unsupported global __main__.TappingLog); exit 1
  wrong_size    np3 torchrun, rank 2: rank 1 aborts on gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT, blamed by torchrun); exit 1.
                np4 DETAIL, rank 3: every rank 'Detected mismatch between collectives' (shapes 48 vs 54, names rank 3); exit 1
  slow_rank     np5 prefix template, rank 2: peers 'Timed out waiting 12000ms', rank 0 blamed by torchrun; exit 1.
                np4 --pg-timeout 300, rank 1: steps 0-1 then silence until `timeout` (hang, 124)
  nan           np3 train.sh, rank 1: FloatingPointError from the script's check at step 3; exit 1.
                np6 --local-ranks-filter 0,1, rank 5: only ranks 0-1 shown (Connection closed), summary names rank 5; exit 1
  sigabrt       np5 python -m torch.distributed.run, rank 2 and np8 --tee 3, rank 6: no message, peers 'Connection reset by peer', summary exitcode -6 (SIGABRT); exit 1
  exit4         np7 torchrun, rank 4: own ERROR line, exitcode 4 in the summary; exit 1.
                np4 --max-restarts 1, rank 3: same in attempt 0, then the restart fails in init (Gloo connectFullMesh refused, rank 0 blamed); exit 1
  shape_all     np3 LOGLEVEL=INFO: every rank 'mat1 and mat2 shapes cannot be multiplied (8x11 and 12x12)'; exit 1
  host_oom      np4 --tee 3, rank 2 and np6 pdsh2-style, rank 1: DefaultCPUAllocator: can't allocate memory (1099511627776 bytes); exit 1
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

WORK = "/tmp/fault560_work"
NGRADES, DIM, STEPS, BATCH = 48, 12, 6, 8


class TappingLog:
    def __init__(self, grove, ngrades):
        self.grove, self.ngrades = grove, ngrades


class GradeNet(nn.Module):
    def __init__(self, ngrades=NGRADES):
        super().__init__()
        self.emb = nn.Embedding(ngrades, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, ngrades)

    def forward(self, idx, feats):
        return self.head(torch.tanh(self.emb(idx) + self.proj(feats)))


def prepare(maxw=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(560)
    json.dump({f"kauri_T{i:03d}": i for i in range(NGRADES)}, open(f"{WORK}/grove_table.json", "w"))
    for r in range(maxw):
        ids = [f"kauri_T{int(k):03d}" for k in torch.randint(0, NGRADES, (STEPS * BATCH,), generator=g)]
        torch.save({"ids": ids, "feats": torch.randn(STEPS * BATCH, DIM, generator=g)}, f"{WORK}/tapping_{r}.pt")
    torch.manual_seed(0)
    m = GradeNet()
    torch.save(m.state_dict(), f"{WORK}/init.pt")
    torch.save(GradeNet(ngrades=40).state_dict(), f"{WORK}/init_v1.pt")
    torch.save({"state": m.state_dict(), "log": TappingLog("waipoua", NGRADES)}, f"{WORK}/init_log.pt")
    print("prepared", WORK)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(120.0, a.pg_timeout)))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    f, fr = a.fault, a.rank
    table = json.load(open(f"{WORK}/grove_table.json"))
    path = f"{WORK}/tapping_{rank}.pt"
    if f == "missing_shard" and rank == fr:
        path = f"{WORK}/season_2026/tapping_{rank:02d}.pt"
    shard = torch.load(path)
    model = GradeNet()
    if f == "ckpt_size" and rank == fr:
        model.load_state_dict(torch.load(f"{WORK}/init_v1.pt", weights_only=True))
    elif f == "weights_only" and rank == fr:
        model.load_state_dict(torch.load(f"{WORK}/init_log.pt", weights_only=True)["state"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/init.pt", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        s = slice(step * BATCH, (step + 1) * BATCH)
        ids, feats = list(shard["ids"][s]), shard["feats"][s]
        if f == "keyerror" and rank == fr and step == 2:
            ids[5] = "kauri_T913"  # a felled tree, no longer in the grove table
        idx = torch.tensor([table[k] for k in ids])
        if f == "shape_all" and step == 1:
            feats = feats[:, : DIM - 1]
        if f == "nan" and rank == fr and step == 3:
            feats = feats * float("nan")
        tally = torch.bincount(idx, minlength=NGRADES).float()
        if f == "wrong_size" and rank == fr and step == 2:
            tally = torch.cat([tally, torch.zeros(6)])
        if f == "slow_rank" and rank == fr and step == 2:
            t0, acc = time.time(), 0
            while time.time() - t0 < 400:
                acc = (acc * 31 + 7) % 1000003  # re-scoring every tapping cut in pure Python
        if f == "sigabrt" and rank == fr and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if f == "exit4" and rank == fr and step == 3:
            print(f"ERROR rank {rank}: tapping ledger checksum mismatch at step {step}; refusing to grade resin", flush=True)
            sys.exit(4)
        if f == "host_oom" and rank == fr and step == 2:
            nbins = int(tally.sum().item()) << 35  # runaway density bins
            hist = torch.zeros(nbins, dtype=torch.float32)
            tally = tally + hist[:NGRADES]
        dist.all_reduce(tally, group=group)
        logits = model(idx, feats)
        loss = nn.functional.cross_entropy(logits, idx)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: resin grade loss is {loss.item()} (non-finite)")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
        opt.step()
        yld = (logits.argmax(-1) == idx).float().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} yield {yld:.3f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_kauri.pt")
        print(f"rank 0 exported {WORK}/export_kauri.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
