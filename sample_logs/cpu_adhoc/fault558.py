"""Sedge meadow carbon flux: a small distributed regression of chamber CO2/CH4 flux.

Each rank reads its own shard of chamber measurements (soil temperature, water table,
PAR, sedge cover, ...), maps the plot's site id to a species coefficient from a lookup
table, and trains a small MLP that predicts net ecosystem exchange. The model starts from
a checkpoint, is wrapped by Hugging Face accelerate (forced onto CPU, gloo backend, short
process-group timeout), runs 6 steps and rank 0 exports the weights. `--hf` runs the same
idea through a transformers.Trainer with a tiny config-built model.

Usage:
  python fault558.py --prepare                      # synthetic data into /tmp/fault558_work
  accelerate launch --multi_gpu --num_processes W fault558.py --fault NAME --rank N
  torchrun --nproc-per-node W fault558.py --hf --fault NAME --rank N

Faults (--fault NAME --rank N plants one):
  none          control, nothing planted
  keyerror      rank N's shard names a site id ("SM-99") the lookup table lacks -> KeyError
  missing_shard rank N looks for a shard file that was never written -> FileNotFoundError
  ckpt_size     rank N loads a checkpoint whose first layer has 12 inputs, not 8 -> size mismatch
  weights_only  rank N loads a checkpoint holding a pickled custom object with weights_only=True
  wrong_size    rank N all-reduces a flux tally of 7 values where the others send 4
  slow          rank N does 40 s of pure-Python gap filling before step 2; peers time out (12 s)
  hang          as slow, but endless; run with --pg-timeout 300 so `timeout` ends it
  nan           rank N's water-table column holds NaN at step 3; the script's own check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line (flux out of range) and sys.exit(4)
  shape_all     every rank concatenates an extra covariate column at step 1 -> matmul shape error
  hostmem       rank N caps its address space and keeps buffering half-hourly flux grids -> out of memory
  worker_crash  rank N's DataLoader worker is SIGKILLed at its 3rd sample

What happened (one line per fault, from the runs; see README):
  none:          all ranks ran steps 0-5 and rank 0 saved the export (accelerate and Trainer paths); exit 0.
  keyerror:      rank N raised KeyError: 'SM-99' at start-up; the agent SIGTERMed the rest and named rank N.
  missing_shard: rank N raised FileNotFoundError (chamber_N_2026-07.pt) before step 0; the rest were SIGTERMed.
  ckpt_size:     rank N raised RuntimeError: size mismatch for net.0.weight ([32, 12] vs [32, 8]).
  weights_only:  rank N raised _pickle.UnpicklingError: Weights only load failed (__main__.SiteNote).
  wrong_size:    no size message: ranks timed out after 12 s in gloo (send/recv) or saw 'Connection closed'; summary blamed a peer.
  slow:          peers raised gloo 'Timed out waiting 12000ms'; rank N was SIGTERMed; summary blamed rank 3.
  hang:          output stopped after step 1; `timeout` ended the launcher after 60 s (exit 137).
  nan:           rank N raised FloatingPointError from the script's own finiteness check at step 3.
  sigsegv:       rank N died of SIGSEGV (exitcode -11); peers saw gloo connection reset/closed.
  exit4:         rank N printed its ERROR line and exited 4; peers saw gloo 'Connection closed by peer'.
  shape_all:     every rank raised RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x9 and 8x32).
  hostmem:       rank N raised RuntimeError: DefaultCPUAllocator: can't allocate memory (Error code 12).
  worker_crash:  rank N raised RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed.
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn

WORK = "/tmp/fault558_work"
NFEAT = 8
NSHARDS = 8


class FluxNet(nn.Module):
    def __init__(self, nin=NFEAT):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(nin, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)


class SiteNote:  # a custom object: weights_only=True refuses it
    def __init__(self, site):
        self.site = site


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(558)
    table = {f"SM-{i:02d}": round(0.5 + 0.1 * i, 3) for i in range(NSHARDS)}
    with open(f"{WORK}/sedge_species_table.json", "w") as f:
        json.dump(table, f)
    for r in range(NSHARDS):
        x = torch.randn(96, NFEAT, generator=g)
        y = (x[:, :3].sum(1, keepdim=True) * 0.3 + 0.1 * torch.randn(96, 1, generator=g))
        sites = [f"SM-{(r + k) % NSHARDS:02d}" for k in range(96)]
        torch.save({"x": x, "y": y, "sites": sites}, f"{WORK}/shards/chamber_{r}.pt")
    torch.save(FluxNet().state_dict(), f"{WORK}/fluxnet_init.pt")
    torch.save(FluxNet(12).state_dict(), f"{WORK}/fluxnet_init_12cov.pt")
    torch.save({"state": FluxNet().state_dict(), "note": SiteNote("SM-03")}, f"{WORK}/fluxnet_init_annotated.pt")
    print("prepared", WORK)


def planted(args, rank, name):
    return args.fault == name and (args.rank == rank or args.rank < 0)


def load_shard(args, rank):
    path = f"{WORK}/shards/chamber_{rank}.pt"
    if planted(args, rank, "missing_shard"):
        path = f"{WORK}/shards/chamber_{rank}_2026-07.pt"
    shard = torch.load(path)
    with open(f"{WORK}/sedge_species_table.json") as f:
        table = json.load(f)
    sites = shard["sites"]
    if planted(args, rank, "keyerror"):
        sites = sites[:10] + ["SM-99"] + sites[11:]
    coef = torch.tensor([table[s] for s in sites]).unsqueeze(1)
    return shard["x"], shard["y"] * coef


class ChamberSet(torch.utils.data.Dataset):
    def __init__(self, x, y, kill=False):
        self.x, self.y, self.kill = x, y, kill

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.kill and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def gap_fill_python(seconds):
    t0 = time.time()
    acc = 0.0
    while seconds <= 0 or time.time() - t0 < seconds:
        for k in range(20000):
            acc += (k % 7) * 1e-9
    return acc


def main_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(rank)
    x, y = load_shard(args, rank)
    model = FluxNet()
    ckpt = f"{WORK}/fluxnet_init.pt"
    if planted(args, rank, "ckpt_size"):
        ckpt = f"{WORK}/fluxnet_init_12cov.pt"
    if planted(args, rank, "weights_only"):
        state = torch.load(f"{WORK}/fluxnet_init_annotated.pt", weights_only=True)["state"]
    else:
        state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    nw = 1 if args.fault == "worker_crash" else 0
    dl = torch.utils.data.DataLoader(ChamberSet(x, y, kill=planted(args, rank, "worker_crash")), batch_size=16, num_workers=nw)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(6):
        xb, yb = next(it)
        if planted(args, rank, "slow") and step == 2:
            gap_fill_python(40)
        if planted(args, rank, "hang") and step == 2:
            gap_fill_python(0)
        if planted(args, rank, "sigsegv") and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if planted(args, rank, "nan") and step == 3:
            xb = xb.clone(); xb[5, 1] = float("nan")
        if planted(args, rank, "shape_all") and step == 1:
            xb = torch.cat([xb, torch.ones(xb.shape[0], 1)], 1)
        if planted(args, rank, "hostmem") and step == 2:
            import resource
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + 400 * 2**20, resource.RLIM_INFINITY))
            grids = []
            while True:
                grids.append(torch.ones(48, 1024, 1024))  # one day of half-hourly 1 Mi-cell flux grids
        pred = model(xb)
        loss = nn.functional.mse_loss(pred, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite NEE loss {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        tally = torch.tensor([loss.item(), float(len(xb)), yb.mean().item(), 1.0])
        if planted(args, rank, "wrong_size"):
            tally = torch.cat([tally, torch.zeros(3)])
        dist.all_reduce(tally)
        rmse = (tally[0] / world).sqrt().item()
        if planted(args, rank, "exit4") and step == 3:
            print(f"ERROR rank {rank}: chamber flux {yb.max().item()*900:.1f} umol m-2 s-1 out of plausible range at step {step}; stopping", flush=True)
            sys.exit(4)
        print(f"rank {rank} step {step} loss {loss.item():.4f} flux_rmse {rmse:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/fluxnet_export.pt")
        print(f"rank 0 saved export {WORK}/fluxnet_export.pt", flush=True)


def main_hf(args):
    from transformers import Trainer, TrainingArguments, TrainerCallback, GPT2Config, GPT2LMHeadModel
    rank = int(os.environ.get("RANK", "0"))
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(cfg)
    x, y = load_shard(args, rank)
    # flux readings binned into 64 tokens, 16-token windows
    tok = ((x[:, :4].flatten() + 3) * 10).clamp(0, 63).long()

    class FluxTokens(torch.utils.data.Dataset):
        def __len__(self):
            return 96

        def __getitem__(self, i):
            ids = tok[(i * 4) % (len(tok) - 16):][:16]
            return {"input_ids": ids, "labels": ids}

    class Report(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            s = state.global_step - 1
            if planted(args, rank, "exit4") and s == 3:
                print(f"ERROR rank {rank}: chamber flux out of plausible range at step {s}; stopping", flush=True)
                sys.exit(4)
            print(f"rank {rank} step {s} loss {state.log_history[-1]['loss'] if state.log_history else float('nan')} flux_rmse n/a", flush=True)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=args.pg_timeout,
                              report_to=[], max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                              save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    tr = Trainer(model=model, args=targs, train_dataset=FluxTokens(), callbacks=[Report()])
    tr.train()
    if rank == 0:
        tr.save_model(f"{WORK}/hf_export")
        print(f"rank 0 saved export {WORK}/hf_export", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)
