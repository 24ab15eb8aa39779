"""Shrike larders: a small data-parallel job that learns which prey a shrike impales on which thorn.

Each rank reads its own shard of larder records (prey species, thorn height, prey mass) from
/tmp/fault576_work, maps species to ids with a lookup table, starts from a checkpoint and trains a
tiny embedding+MLP model with gradients all_reduced by hand over gloo (CPU only). Rank 0 writes an
export at the end. `--prepare` writes the synthetic data.

Faults (--fault NAME --rank N):
  none           control, no fault
  prey_key       rank N meets a prey species missing from the lookup table (KeyError)
  missing_shard  rank N's shard file is missing (FileNotFoundError)
  ckpt_size      rank N loads a checkpoint whose embedding has another size (load_state_dict RuntimeError)
  weights_only   rank N loads a larder checkpoint holding a pickled custom object (torch.load weights_only refusal)
  wrong_size     rank N all_reduces a step metric tensor of the wrong size
  slow_rank      rank N does long pure-Python thorn counting at step 2; its peers time out in the collective
  hang           like slow_rank but endless (run with --pg-timeout 300; `timeout` ends it)
  nan            rank N's loss becomes NaN at step 3; the program's own finiteness check raises
  sigsegv        rank N sends itself SIGSEGV at step 2
  error_exit     rank N prints its own ERROR line and sys.exit(4)
  shape_all      every rank builds features one column too wide at step 1 (matmul shape error)

What happened (torch 2.13.0+cpu, gloo, 2-core box, 2026-12-07):
  none           np4 plain and np6 pdsh2: all ranks finish 6 steps, rank 0 saves the export, exit 0.
  prey_key       KeyError: 'hummingbird' on the planted rank (np4 tee); with --local-ranks-filter 0,1 (np6, rank 5) only the agent's summary shows it.
  missing_shard  FileNotFoundError for larder_shard_N_spring.jsonl (np3 pymodule; np5 redirects, traceback only in the per-rank stderr.log).
  ckpt_size      load_state_dict RuntimeError: size mismatch for emb.weight [12, 8] vs [8, 8] (np4 loglevel; np8 pdsh2, other agent's ranks get gloo connection closed).
  weights_only   UnpicklingError: Weights only load failed, __main__.LarderMeta not an allowed global (np5 tee_trainer, np3 wrapper).
  wrong_size     DETAIL: 'Detected mismatch between collectives' (shapes 4 vs 7) on every rank; without DETAIL (np6) only 12000 ms gloo send/recv timeouts and a closed connection.
  slow_rank      the slow rank prints nothing; its peers fail with 12000 ms gloo timeouts in the grad all_reduce (np4 prefix, np5 tee).
  hang           no error line; ranks stop after step 1 until `timeout` SIGTERMs torchrun at 60 s (exit 124).
  nan            FloatingPointError from the finiteness check, then 'terminate called without an active exception' (exitcode -6).
  sigsegv        exitcode -11 on the planted rank, peers see gloo connection reset/closed; with --max-restarts 1 the second attempt failed at gloo connectFullMesh.
  error_exit     the rank's own 'ERROR rank 4: ...' line, exitcode 4; peers get gloo connection closed.
  shape_all      every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (16x11 and 10x16).
"""
import argparse, json, os, random, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault576_work"
SPECIES = ["beetle", "bumblebee", "lizard", "vole", "grasshopper", "sparrow", "frog", "cricket"]


class Shrike(nn.Module):
    def __init__(self, n_species=len(SPECIES), dim=8):
        super().__init__()
        self.emb = nn.Embedding(n_species, dim)
        self.mlp = nn.Sequential(nn.Linear(dim + 2, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, sp, feats):
        return self.mlp(torch.cat([self.emb(sp), feats], dim=1)).squeeze(1)


class LarderMeta:
    def __init__(self, season):
        self.season = season


def prepare(world_max=8):
    os.makedirs(WORK, exist_ok=True)
    rnd = random.Random(576)
    for r in range(world_max):
        with open(f"{WORK}/larder_shard_{r}.jsonl", "w") as f:
            for i in range(96):
                f.write(json.dumps({"prey": rnd.choice(SPECIES), "thorn_cm": rnd.uniform(20, 180),
                                    "mass_g": rnd.uniform(0.5, 40)}) + "\n")
        with open(f"{WORK}/larder_shard_{r}_bad.jsonl", "w") as f:
            for i in range(96):
                prey = "hummingbird" if i == 40 else rnd.choice(SPECIES)
                f.write(json.dumps({"prey": prey, "thorn_cm": rnd.uniform(20, 180),
                                    "mass_g": rnd.uniform(0.5, 40)}) + "\n")
    with open(f"{WORK}/prey_lookup.json", "w") as f:
        json.dump({s: i for i, s in enumerate(SPECIES)}, f)
    torch.manual_seed(0)
    torch.save(Shrike().state_dict(), f"{WORK}/larder_start.pt")
    torch.save(Shrike(n_species=12).state_dict(), f"{WORK}/larder_start_wide.pt")
    torch.save({"model": Shrike().state_dict(), "meta": LarderMeta("autumn")}, f"{WORK}/larder_start_meta.pt")
    print("prepared", WORK)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare(); return
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (a.fault != "none" and rank == a.rank)

    shard = f"{WORK}/larder_shard_{rank}.jsonl"
    if me and a.fault == "prey_key":
        shard = f"{WORK}/larder_shard_{rank}_bad.jsonl"
    if me and a.fault == "missing_shard":
        shard = f"{WORK}/larder_shard_{rank}_spring.jsonl"
    with open(shard) as f:
        recs = [json.loads(l) for l in f]
    with open(f"{WORK}/prey_lookup.json") as f:
        lookup = json.load(f)
    sp = torch.tensor([lookup[r["prey"]] for r in recs])
    feats = torch.tensor([[r["thorn_cm"] / 100.0, r["mass_g"] / 20.0] for r in recs])
    target = feats[:, 0] * 0.5 + feats[:, 1] * 0.3 + sp.float() * 0.05

    model = Shrike()
    ck = f"{WORK}/larder_start.pt"
    if me and a.fault == "ckpt_size":
        ck = f"{WORK}/larder_start_wide.pt"
    if me and a.fault == "weights_only":
        state = torch.load(f"{WORK}/larder_start_meta.pt")["model"]
    else:
        state = torch.load(ck)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    print(f"rank {rank}/{world} larder of {len(recs)} prey from {os.path.basename(shard)}", flush=True)

    for step in range(a.steps):
        idx = torch.arange(step * 16, step * 16 + 16) % len(recs)
        x = feats[idx]
        if a.fault == "shape_all" and step == 1:
            x = torch.cat([x, torch.ones(len(idx), 1)], dim=1)
            out = model.mlp(torch.cat([model.emb(sp[idx]), x], dim=1))
        else:
            out = model(sp[idx], x)
        loss = ((out - target[idx]) ** 2).mean()
        if me and a.fault == "nan" and step == 3:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: larder loss is not finite ({loss.item()})")
        opt.zero_grad()
        loss.backward()
        if me and a.fault == "slow_rank" and step == 2:
            t0, n = time.time(), 0
            while time.time() - t0 < 35:
                n += sum(i * i for i in range(2000)) % 7
        if me and a.fault == "hang" and step == 2:
            n = 0
            while True:
                n += sum(i * i for i in range(2000)) % 7
        if me and a.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if me and a.fault == "error_exit" and step == 2:
            print(f"ERROR rank {rank}: thorn index of larder shard {rank} points past the hedge (thorn 412 of 96); giving up", flush=True)
            sys.exit(4)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        impaled = (out.detach() > target[idx].mean()).float().mean()
        m = torch.tensor([loss.item(), impaled.item(), float(step), 1.0])
        if me and a.fault == "wrong_size" and step == 2:
            m = torch.tensor([loss.item(), impaled.item(), float(step), 1.0, 0.0, 0.0, 0.0])
        dist.all_reduce(m)
        print(f"rank {rank} step {step} loss {loss.item():.4f} impaled {m[1].item() / world:.3f}", flush=True)

    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/larder_export.pt")
        print("rank 0 saved export", f"{WORK}/larder_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
