"""Grebe courtship-dance phase classifier: a small distributed CPU training job (gloo).

Each rank reads its own shard of synthetic pose features from paired great crested grebes
(head-shake, weed dance, penguin rush, ...), maps the species name of every clip through a
lookup table, starts from a shared checkpoint, trains 6 steps with gradients all_reduced by
hand, and rank 0 saves an export at the end.

  python fault588.py --prepare            # writes shards, lookup table and checkpoints
  torchrun --nproc-per-node W fault588.py --fault NAME --rank N [--pg-timeout S]

Faults (ONE is planted, on rank N unless said otherwise):
  none          control, nothing planted
  keyerror      rank N meets a clip whose species ("hooded_grebe") is not in the lookup table -> KeyError
  missing_shard rank N opens a shard file that does not exist -> FileNotFoundError
  ckpt_size     rank N builds the model with 40 hidden units, the checkpoint has 32 -> load_state_dict size mismatch
  weights_only  rank N loads the dance-annotated checkpoint (a pickled DanceMeta object) with weights_only=True
  wrong_size    rank N all_reduces a gradient buffer one element longer than its peers' at step 3
  slow          rank N does pure-Python pairing-score work at step 2 longer than the PG timeout; peers time out
                (with --pg-timeout 300 the job hangs until the outer `timeout` ends it)
  nan           rank N's loss becomes NaN at step 3; the script's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line (courtship sequence out of order) and calls sys.exit(4)
  shape_all     every rank flattens the pose window wrongly at step 2 -> matmul shape error on all ranks

What happened (see .scratch/readme_588.md):
  none          np3 plain, np8 prefix: all ranks finish 6 steps, rank 0 saves the export; exit 0
  keyerror      rank N raises KeyError: 'hooded_grebe'; peers fail in all_reduce (gloo connection closed); with --max-restarts 1 the restart dies in Gloo connectFullMesh; exit 1
  missing_shard rank N raises FileNotFoundError in torch.load before step 0; peers SIGTERMed; exit 1
  ckpt_size     rank N raises RuntimeError size mismatch in load_state_dict (hidden by --local-ranks-filter in np7 r6); exit 1
  weights_only  rank N raises _pickle.UnpicklingError (Unsupported global __main__.DanceMeta); peers connection closed; exit 1 (pdsh2 wrapper: 0)
  wrong_size    DETAIL: every rank "Detected mismatch between collectives" (shape 1270 vs 1269); plain gloo: rank 0 aborts on EnforceNotMet size mismatch; exit 1
  slow          peers raise gloo "Timed out waiting 12000ms" in all_reduce; with --pg-timeout 300 the output stops until timeout SIGTERMs torchrun, exit 124
  nan           rank N raises FloatingPointError (non-finite loss); peers connection closed; exit 1
  sigsegv       rank N dies with exitcode -11 (SIGSEGV); peers connection reset; exit 1
  exit4         rank N prints ERROR and exits 4 (under DETAIL: terminate called, -6 SIGABRT, rank 0 reports monitoredBarrier failure); exit 1
  shape_all     every rank raises RuntimeError mat1 and mat2 shapes cannot be multiplied (8x56 and 32x32); exit 1 (pdsh2 wrapper: 0)
"""
import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault588_work"
SPECIES = ["great_crested_grebe", "horned_grebe", "red_necked_grebe", "western_grebe", "clarks_grebe", "little_grebe"]
PHASES = 5  # discovery, head-shake, weed-dance, penguin-rush, rushing
FEAT = 24
HIDDEN = 32


class DanceMeta:
    def __init__(self, site, season):
        self.site = site
        self.season = season


class DanceNet(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(len(SPECIES), 8)
        self.fc1 = nn.Linear(FEAT + 8, hidden)
        self.fc2 = nn.Linear(hidden, PHASES)

    def forward(self, x, sp):
        h = torch.cat([x, self.emb(sp)], dim=1)
        return self.fc2(torch.relu(self.fc1(h)))


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(588)
    for r in range(8):
        feats = torch.randn(64, FEAT, generator=g)
        species = [SPECIES[i % len(SPECIES)] for i in range(64)]
        phases = torch.randint(0, PHASES, (64,), generator=g)
        torch.save({"pose": feats, "species": species, "phase": phases}, f"{WORK}/shards/pairs_rank{r}.pt")
    with open(f"{WORK}/species_lookup.json", "w") as f:
        json.dump({s: i for i, s in enumerate(SPECIES)}, f)
    torch.manual_seed(0)
    m = DanceNet()
    torch.save(m.state_dict(), f"{WORK}/dance_init.pt")
    torch.save({"model": m.state_dict(), "meta": DanceMeta("Lake Tegernsee", 2026)}, f"{WORK}/dance_annotated.pt")
    print("prepared", WORK)


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

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    torch.manual_seed(rank)

    shard = f"{WORK}/shards/pairs_rank{rank % 8}.pt"
    if a.fault == "missing_shard" and me:
        shard = f"{WORK}/shards/pairs_rank{rank}_season2.pt"
    data = torch.load(shard)
    with open(f"{WORK}/species_lookup.json") as f:
        lookup = json.load(f)
    if a.fault == "keyerror" and me:
        data["species"][17] = "hooded_grebe"

    model = DanceNet(40 if (a.fault == "ckpt_size" and me) else HIDDEN)
    if a.fault == "weights_only" and me:
        ck = torch.load(f"{WORK}/dance_annotated.pt", weights_only=True)
        model.load_state_dict(ck["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/dance_init.pt", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    print(f"rank {rank}/{world} loaded {shard} ({len(data['species'])} courtship clips)", flush=True)

    for step in range(a.steps):
        lo = (step * 16) % 64
        x = data["pose"][lo:lo + 16]
        sp = torch.tensor([lookup[s] for s in data["species"][lo:lo + 16]])
        y = data["phase"][lo:lo + 16]
        if a.fault == "shape_all" and step == 2:
            x = x.reshape(8, -1)  # pose window flattened across pairs: wrong
            sp = sp[:8]
        if a.fault == "slow" and me and step == 2:
            t0 = time.time()
            score = 0
            while time.time() - t0 < a.pg_timeout * 2.5:
                for i in range(20000):
                    score += (i * 7919) % 13
        if a.fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "exit4" and me and step == 3:
            print(f"ERROR rank {rank}: courtship sequence out of order (weed dance before head-shake) in clip {lo + 5}", flush=True)
            sys.exit(4)
        out = model(x, sp)
        loss = nn.functional.cross_entropy(out, y)
        if a.fault == "nan" and me and step == 3:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} in dance-phase head")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if a.fault == "wrong_size" and me and step == 3:
            flat = torch.cat([flat, torch.zeros(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        opt.step()
        acc = (out.argmax(1) == y).float().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} phase_acc {acc:.3f}", flush=True)

    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/dance_export.pt")
        print("rank 0 saved export", f"{WORK}/dance_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
