"""A hundred-and-sixty-sixth hand-run batch: MOLECULE PROPERTY PREDICTION FROM SMILES-LIKE STRINGS.

A tiny message-passing network over small molecular graphs that the script parses itself from SMILES-like strings
(atoms as letters, Cl/Br as two letters, bonds implied by order, branches in parentheses).  Each rank reads its
shard data/mols_shard<rank>.csv (smiles,logp), a batch concatenates the node features of its molecules with a
batch-index vector, --rounds message-passing rounds scatter messages along the bonds with index_add_, a sum-pool by
the batch index feeds a linear head, and the regression (MSE) trains under DDP on gloo (or --ddp 0: gradients
all-reduced by hand).  The MAE is all_reduced every step; rank 0 saves mol.pt at the end and --resume loads it.
The number of rounds can be overridden by MOL_MP_ROUNDS.

Faults:
  unkatom     - rank N's shard holds a molecule with a selenium atom 'Se' not in the atom vocabulary (KeyError)
  parens      - rank N's step-2 batch gets a string with an unclosed branch; the parser raises ValueError
  batchidx    - every rank builds the batch-index vector one element too long (index_add_ RuntimeError)
  nantarget   - rank N's step-2 targets hold NaN (empty logp cells); the program's finite-loss check raises
  csvmissing  - rank N reads its shard from a node-local scratch dir that was never staged (FileNotFoundError)
  vocabsize   - rank N's atom vocabulary adds 'Se' (embedding 9 rows instead of 8): DDP construction fails
  conformer   - rank N runs a 'conformer generation' step only it runs before step 3; the others time out
  ckptrename  - every rank resumes mol.pt after the layers were renamed mp.* -> conv.* (missing/unexpected keys)
  roundsenv   - rank N reads MOL_MP_ROUNDS='3.5' from its node profile (ValueError in int())
  invalidmol  - rank N prints an 'invalid molecule' error line and exits with code 3 (os._exit)
  sigabrt     - rank N is killed by SIGABRT after step 2
  none        - control, clean run

What happened (filled in after the runs):
  unkatom     - rank N KeyError: 'Se' in parse_smiles at startup; Root Cause rank N
  parens      - rank N ValueError 'unbalanced parentheses in 'CC(C(=O)N': 1 branch(es) never closed' at step 2
  batchidx    - every rank RuntimeError 'index_add_(): Number of indices (74) should be equal to source.size(dim): (73)'
  nantarget   - rank N FloatingPointError 'loss is not finite at step 2: loss=nan'; DETAIL: rank 0 monitoredBarrier error
  csvmissing  - rank N FileNotFoundError for scratch/shards/mols_shardN.csv at startup; Root Cause rank N
  vocabsize   - rank N DDP RuntimeError 'params[0] ... sizes [9, 16] appears not to match ... process 0'
  conformer   - pg 12 s: peers 'Timed out waiting 12000ms', Root Cause rank 0; pg 300 s under timeout 60: hung, exit 124
  ckptrename  - every rank missing mp.* / unexpected conv.* keys; the restart died in Gloo connectFullMesh
  roundsenv   - rank N ValueError: invalid literal for int() with base 10: '3.5' at startup
  invalidmol  - rank N prints 'ERROR rank N: invalid molecule ...' and exits 3; Root Cause rank N exitcode 3
  sigabrt     - not run: both planned runs were dropped for lack of time (see README)
  none        - all ranks ran 6 steps, rank 0 saved mol.pt
"""
import argparse
import csv
import os
import re
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

ATOMS = ["C", "N", "O", "S", "F", "Cl", "Br", "P"]
TOKEN = re.compile(r"Cl|Br|Se|[A-Z]|\(|\)|\d")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data-dir", default="/tmp/fault166/data")
    p.add_argument("--work", default="/tmp/fault166_work")
    p.add_argument("--resume", default="")
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    return p.parse_args()


def parse_smiles(s, vocab):
    """Return (atom ids, bond list) of a SMILES-like string: bonds by order, branches by parentheses."""
    atoms, bonds, stack, prev = [], [], [], None
    for tok in TOKEN.findall(s):
        if tok == "(":
            if prev is None:
                raise ValueError(f"branch opened before any atom in {s!r}")
            stack.append(prev)
        elif tok == ")":
            if not stack:
                raise ValueError(f"unbalanced parentheses in {s!r}: ')' without '('")
            prev = stack.pop()
        elif tok.isdigit():
            continue
        else:
            atoms.append(vocab[tok])
            if prev is not None:
                bonds.append((prev, len(atoms) - 1))
            prev = len(atoms) - 1
    if stack:
        raise ValueError(f"unbalanced parentheses in {s!r}: {len(stack)} branch(es) never closed")
    return atoms, bonds


def collate(mols, vocab, extra_index=False):
    xs, src, dst, batch = [], [], [], []
    off = 0
    for i, s in enumerate(mols):
        atoms, bonds = parse_smiles(s, vocab)
        xs += atoms
        for a, b in bonds:
            src += [off + a, off + b]
            dst += [off + b, off + a]
        batch += [i] * len(atoms)
        off += len(atoms)
    if extra_index:
        batch.append(len(mols) - 1)
    return (torch.tensor(xs), torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long),
            torch.tensor(batch, dtype=torch.long))


class MPNN(nn.Module):
    def __init__(self, n_atoms, hidden, rounds):
        super().__init__()
        self.embed = nn.Embedding(n_atoms, hidden)
        self.mp = nn.ModuleList([nn.Linear(2 * hidden, hidden) for _ in range(rounds)])
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, src, dst, batch, n_mols):
        h = self.embed(x)
        for lin in self.mp:
            msg = torch.zeros_like(h).index_add_(0, dst, h[src])
            h = torch.relu(lin(torch.cat([h, msg], dim=1))) + h
        pooled = torch.zeros(n_mols, h.shape[1]).index_add_(0, batch, h)
        return self.head(pooled).squeeze(1)


def main():
    a = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and a.rank in (-1, rank)
    torch.manual_seed(0)
    atoms = ATOMS + ["Se"] if (bad and a.fault == "vocabsize") else ATOMS
    vocab = {s: i for i, s in enumerate(atoms)}
    rounds_str = "3.5" if (bad and a.fault == "roundsenv") else os.environ.get("MOL_MP_ROUNDS", str(a.rounds))
    rounds = int(rounds_str)
    shard_dir = "/tmp/fault166/scratch/shards" if (bad and a.fault == "csvmissing") else a.data_dir
    with open(os.path.join(shard_dir, f"mols_shard{rank}.csv")) as f:
        rows = list(csv.DictReader(f))
    if bad and a.fault == "unkatom":
        rows[17]["smiles"] = "CC(Se)CO"
    smiles = [r["smiles"] for r in rows]
    targets = torch.tensor([float(r["logp"]) for r in rows])
    n_atoms_seen = sum(len(parse_smiles(s, vocab)[0]) for s in smiles)
    if bad and a.fault == "invalidmol":
        print(f"ERROR rank {rank}: invalid molecule at line 31 of mols_shard{rank}.csv: 'CC(C)(C)(C)(C)C' "
              f"(carbon valence 6 > 4), refusing to train on a corrupt shard", flush=True)
        os._exit(3)
    model = MPNN(len(atoms), a.hidden, rounds)
    if a.resume:
        sd = torch.load(a.resume, map_location="cpu")
        if bad and a.fault == "ckptrename":
            sd = {k.replace("mp.", "conv."): v for k, v in sd.items()}
        model.load_state_dict(sd)
        print(f"rank {rank} resumed from {a.resume}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    print(f"rank {rank}/{world} mpnn ready: {len(smiles)} molecules ({n_atoms_seen} atoms), "
          f"vocab {len(atoms)}, rounds {rounds}", flush=True)
    g = torch.Generator().manual_seed(4321 + rank)
    for step in range(a.steps):
        idx = torch.randperm(len(smiles), generator=g)[:a.batch]
        mols = [smiles[i] for i in idx]
        y = targets[idx].clone()
        if step == 2 and bad and a.fault == "parens":
            mols[5] = "CC(C(=O)N"
        if step == 2 and bad and a.fault == "nantarget":
            y[1] = float("nan")
            y[6] = float("nan")
        if step == 3 and bad and a.fault == "conformer":
            print(f"rank {rank} generating conformers for {len(smiles)} molecules", flush=True)
            time.sleep(a.pg_timeout * 4)
        x, src, dst, batch = collate(mols, vocab, extra_index=(bad and a.fault == "batchidx"))
        pred = net(x, src, dst, batch, len(mols))
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is not finite at step {step}: loss={loss.item()} "
                                     f"({int(torch.isnan(y).sum())} NaN targets in batch)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        mae = (pred.detach() - y).abs().mean().reshape(1)
        dist.all_reduce(mae)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}", flush=True)
        if step == 2 and bad and a.fault == "sigabrt":
            os.kill(os.getpid(), signal.SIGABRT)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.work, "mol.pt"))
        print(f"rank 0 saved {os.path.join(a.work, 'mol.pt')}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
