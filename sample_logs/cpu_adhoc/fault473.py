"""Batch 473 hand-run fault script: FREIGHT ARRIVAL TIME REGRESSION (Hugging Face accelerate).

Synthetic shipments: each row has an origin hub and a destination hub (ids into a 32-hub table), a cargo type
(a string looked up in a 6-entry cargo table), the route distance in km, the weight in tonnes and the hour of
dispatch; the target is the arrival time in hours.  Every rank reads its own shard from
/tmp/fault473_work/data/ship_R.pt through a Dataset and a DataLoader prepared by accelerate, and trains an
ETA regressor (hub embeddings, a cargo embedding, a two-layer MLP) on an MSE loss, wrapped by
Accelerator.prepare (DDP over gloo).  The model starts from ckpt/eta_init.pt.  Every step the loss is
reduced with accelerator.reduce and the per-rank absolute errors are gathered with accelerator.gather for
the MAE; rank 0 saves export/eta.pt with accelerator.save at the end.
Options: --hf 1 runs the same data through a transformers.Trainer (a tiny BertConfig regression model).

Faults (--fault NAME --rank R, R = -1 for every rank):
  cargokey    - rank R's shard has a cargo type "livestock" missing from the cargo table (KeyError in the
                Dataset, raised through accelerate's DataLoaderShard in the first batch)
  hubidx      - rank R gives every fifth shipment the new hub id 32, beyond the 32-row hub embedding (IndexError)
  nodata      - rank R reads its shard from data/holdout/ which does not exist (FileNotFoundError at start)
  ckptsize    - rank R initialises from ckpt/eta_wide.pt (hidden 48, the model has 32): size mismatch
  ckptpickle  - rank R initialises from ckpt/eta_full.pt, pickled with a RouteTable object (weights_only refusal)
  gathershape - rank R appends its late-shipment count to the errors it gathers at step 3 (one more entry)
  slowroute   - rank R recomputes every shortest route in pure Python after step 2, before the step-3 gather (minutes)
  nanrate     - rank R's transit-time feature at step 4 is distance/0 (a speed of 0): inf, the program's check raises
  sigkill     - rank R sends itself SIGKILL after step 2
  exit4       - rank R prints its own ERROR line about a manifest with negative weight and calls sys.exit(4)
  featwidth   - every rank: the feature builder adds a fuel-surcharge column (6 features, the MLP expects 5)
  hfcollate   - (--hf 1) rank R's data collator gets, in its third batch, a cargo type missing from the table (KeyError)
  hfcallback  - (--hf 1) rank R's TrainerCallback raises RuntimeError on_step_end at step 4 (SLA check)
  none        - control, clean run

What happened (filled in after the runs):
  cargokey    - KeyError: 'livestock' in __getitem__ under DataLoaderShard at the first batch; peers Connection closed by peer (np4 r2 acc, np5 r0 torchrun)
  hubidx      - IndexError 'index out of range in self' in the first forward; peers closed (np4 r3 acc2nodes, wrapper exit 0; np3 r1 accconfig, Root Cause rank 0 SIGABRT)
  nodata      - FileNotFoundError for data/holdout/ship_N.pt at start-up; Root Cause rank N (np4 r1 tee, np3 r0 accconfig)
  ckptsize    - load_state_dict size mismatch fc1.weight [48, 25] vs [32, 25] at start-up (np5 r3 acc)
  ckptpickle  - UnpicklingError 'Weights only load failed' for eta_full.pt at start-up (np3 r2 torchrun)
  gathershape - debug: DistributedOperationException listing Process 1: [17] on every rank (np4 r1 accdebug);
                plain: rank 0 gloo EnforceNotMet '34 vs 32 ... Received data size doesn't match' SIGABRT, others reset (np3 r2 acc)
  slowroute   - 12 s: ranks 0 and 2 'Timed out waiting 12000ms', rank 1 silent (np3 r1 torchrun); 300 s at 400 rounds: the
                rebuild took 10.9 s and the run finished cleanly (np4 r2 accconfig, kept as ok); rounds raised to 4000, then
                300 s: silent after step 1, killed by timeout at 60 s, exit 124 (np5 r0 accconfig)
  nanrate     - FloatingPointError from the program's check at step 4; peers closed (np6 r4 tee)
  sigkill     - no traceback after step 2, exitcode -9 (np3 r2 tee; np4 r0 acc2nodes, wrapper exit 0)
  exit4       - rank 2's ERROR line about manifest M-4733 and exit 4; Root Cause rank 2 exitcode 4 (np5 r2 accdebug)
  featwidth   - every rank 'mat1 and mat2 shapes cannot be multiplied (16x26 and 25x32)'; Root Cause rank 2 (np6 torchrun)
  hfcollate   - Trainer: KeyError 'livestock' in the collator on rank 1's third batch; peers closed (np3 r1 hf, torchrun)
  hfcallback  - Trainer: RuntimeError 'SLA check ...' from the callback at step 4 on rank 2; peers closed (np4 r2 hf, accelerate)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/eta.pt, exit 0 (np3 acc)
"""
import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault473_work"
NHUB = 32
CARGO = {"general": 0, "reefer": 1, "bulk": 2, "hazmat": 3, "oversize": 4, "parcel": 5}
NFEAT = 5
HID = 32


class RouteTable:
    """A plain Python object stored in the full checkpoint (not a tensor)."""

    def __init__(self, n):
        self.routes = {(i, (i * 7) % n): 100.0 + i for i in range(n)}


def prepare():
    g = torch.Generator().manual_seed(473)
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    names = list(CARGO)
    for r in range(8):
        n = 96
        src = torch.randint(0, NHUB, (n,), generator=g)
        dst = torch.randint(0, NHUB, (n,), generator=g)
        dist_km = 50 + 1500 * torch.rand(n, generator=g)
        weight = 1 + 30 * torch.rand(n, generator=g)
        hour = torch.randint(0, 24, (n,), generator=g).float()
        speed = 55 + 20 * torch.rand(n, generator=g)
        cargo = [names[int(i)] for i in torch.randint(0, len(names), (n,), generator=g)]
        eta = dist_km / speed + 0.05 * weight + 2.0 * (hour > 18).float()
        torch.save({"src": src, "dst": dst, "dist": dist_km, "weight": weight, "hour": hour,
                    "speed": speed, "cargo": cargo, "eta": eta}, f"{WORK}/data/ship_{r}.pt")
    torch.save(ETAModel().state_dict(), f"{WORK}/ckpt/eta_init.pt")
    torch.save(ETAModel(hid=48).state_dict(), f"{WORK}/ckpt/eta_wide.pt")
    torch.save({"model": ETAModel().state_dict(), "routes": RouteTable(NHUB)}, f"{WORK}/ckpt/eta_full.pt")
    print("prepared", WORK)


class ShipmentSet(Dataset):
    def __init__(self, path, rank, fault, frank):
        d = torch.load(path)
        self.d = d
        self.n = len(d["eta"])
        self.bad = fault == "cargokey" and rank in (frank, -1)
        if self.bad:
            for i in range(3, self.n, 8):  # rows from the Kent depot's new livestock contract
                d["cargo"][i] = "livestock"

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        d = self.d
        cargo = CARGO[d["cargo"][i]]
        hours = d["dist"][i] / d["speed"][i]
        x = torch.stack([d["dist"][i] / 1000.0, d["weight"][i] / 30.0, d["hour"][i] / 24.0,
                         torch.tensor(math.sin(d["hour"][i].item() / 24 * 6.283)), hours / 30.0])
        return {"src": d["src"][i], "dst": d["dst"][i], "cargo": torch.tensor(cargo), "x": x, "y": d["eta"][i]}


class ETAModel(nn.Module):
    def __init__(self, hid=HID, nfeat=NFEAT):
        super().__init__()
        self.hub = nn.Embedding(NHUB, 8)
        self.cargo = nn.Embedding(len(CARGO), 4)
        self.fc1 = nn.Linear(8 + 8 + 4 + nfeat, hid)
        self.fc2 = nn.Linear(hid, 1)

    def forward(self, src, dst, cargo, x):
        h = torch.cat([self.hub(src), self.hub(dst), self.cargo(cargo), x], dim=-1)
        return self.fc2(torch.relu(self.fc1(h))).squeeze(-1)


def shortest_routes_python(n):
    # Floyd-Warshall over a dense hub graph, in plain Python lists, repeated per cargo class
    w = [[abs(i - j) * 13.0 + ((i * j) % 7) for j in range(n)] for i in range(n)]
    for _ in range(4000 * len(CARGO)):
        for k in range(n):
            for i in range(n):
                wik = w[i][k]
                for j in range(n):
                    if wik + w[k][j] < w[i][j]:
                        w[i][j] = wik + w[k][j]
    return w


def is_faulty(args, rank):
    return args.rank == -1 or args.rank == rank


def run_hf(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    rank = int(os.environ.get("RANK", "0"))
    ds = ShipmentSet(f"{WORK}/data/ship_{rank}.pt", rank, "none", -1)
    texts = ds.d

    class Rows(Dataset):
        def __len__(self):
            return ds.n

        def __getitem__(self, i):
            return {"i": i}

    calls = []

    def collate(items):
        idx = [it["i"] for it in items]
        cargo_names = [texts["cargo"][i] for i in idx]
        calls.append(len(idx))
        if args.fault == "hfcollate" and is_faulty(args, rank) and len(calls) == 3:
            cargo_names[1] = "livestock"
        ids = torch.stack([torch.tensor([1, 2 + int(texts["src"][i]), 2 + int(texts["dst"][i]),
                                         40 + CARGO[c], 50 + int(texts["hour"][i])])
                           for i, c in zip(idx, cargo_names)])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.stack([texts["eta"][i] for i in idx]).float()}

    class SLACheck(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            print(f"rank {rank} step {state.global_step} loss {state.log_history[-1]['loss'] if state.log_history else float('nan')}", flush=True)
            if args.fault == "hfcallback" and is_faulty(args, rank) and state.global_step == 4:
                raise RuntimeError(f"SLA check: predicted lateness for lane 17->4 exceeds 48 h on rank {rank}")

    cfg = BertConfig(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, num_labels=1, problem_type="regression")
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], per_device_train_batch_size=16,
                              max_steps=args.steps, logging_steps=1, save_strategy="no",
                              remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(), data_collator=collate, callbacks=[SLACheck()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/eta_hf")
        print(f"rank 0 done: {args.steps} steps, saved export/eta_hf", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.hf:
        run_hf(args)
        return

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    set_seed(473)
    bad = is_faulty(args, rank)
    if acc.is_main_process:
        print(f"freight ETA: world {world}, fault {args.fault} on rank {args.rank}, pg timeout {args.pg_timeout}s", flush=True)

    path = f"{WORK}/data/ship_{rank}.pt"
    if args.fault == "nodata" and bad:
        path = f"{WORK}/data/holdout/ship_{rank}.pt"
    ds = ShipmentSet(path, rank, args.fault, args.rank)
    if args.fault == "hubidx" and bad:
        ds.d["dst"][::5] = NHUB  # the new hub Rotterdam-2 was appended to the TMS export as id 32
    loader = DataLoader(ds, batch_size=16, shuffle=True)

    nfeat = NFEAT
    model = ETAModel()
    ck = f"{WORK}/ckpt/eta_init.pt"
    if args.fault == "ckptsize" and bad:
        ck = f"{WORK}/ckpt/eta_wide.pt"
    if args.fault == "ckptpickle" and bad:
        ck = f"{WORK}/ckpt/eta_full.pt"
    state = torch.load(ck, map_location="cpu")
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    print(f"rank {rank}: {len(ds)} shipments, model from {os.path.basename(ck)}", flush=True)

    it = iter(loader)
    for step in range(args.steps):
        try:
            b = next(it)
        except StopIteration:
            it = iter(loader)
            b = next(it)
        x = b["x"]
        if args.fault == "featwidth":
            x = torch.cat([x, (b["x"][:, :1] * 0.12)], dim=-1)  # fuel surcharge column
        if args.fault == "exit4" and bad and step == 3:
            print(f"ERROR rank {rank}: manifest M-{4730 + step} has negative gross weight -3.2 t; refusing to train on it", flush=True)
            sys.exit(4)
        if args.fault == "nanrate" and bad and step == 4:
            x = x.clone()
            x[3, 4] = b["x"][3, 0] * 1000.0 / 0.0  # a depot reported speed 0 km/h for this lane
        pred = model(b["src"], b["dst"], b["cargo"], x)
        if not torch.isfinite(x).all() or not torch.isfinite(pred).all():
            nbad = int((~torch.isfinite(x)).sum())
            raise FloatingPointError(f"rank {rank} step {step}: {nbad} non-finite transit-time features (speed 0 km/h?)")
        loss = nn.functional.mse_loss(pred, b["y"])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if args.fault == "slowroute" and bad and step == 2:
            t0 = time.time()
            shortest_routes_python(NHUB)
            print(f"rank {rank}: route table rebuilt in {time.time() - t0:.1f}s", flush=True)
        err = (pred.detach() - b["y"]).abs()
        if args.fault == "gathershape" and bad and step == 3:
            err = torch.cat([err, torch.tensor([float((err > 2.0).sum())])])
        errs = acc.gather(err)
        mloss = acc.reduce(loss.detach(), reduction="mean")
        print(f"rank {rank} step {step} loss {mloss.item():.4f} mae_h {errs.mean().item():.3f}", flush=True)
        if args.fault == "sigkill" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/eta.pt")
        print(f"rank 0 done: {args.steps} steps, saved export/eta.pt", flush=True)
    acc.end_training()


if __name__ == "__main__":
    main()
