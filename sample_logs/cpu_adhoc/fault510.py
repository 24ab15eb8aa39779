"""Bonsai watering schedule from soil moisture: a tiny distributed regression job (batch 510).

Each rank reads its own shard of soil-moisture readings (/tmp/fault510_work/shard_R.pt),
maps species names through a lookup table (species.json), starts from a checkpoint
(start.pt), trains a small MLP that predicts millilitres of water for 6 steps (gloo, CPU),
all-reduces a "dry_pots" metric each step, and rank 0 saves an export at the end.

Modes: default uses accelerate's Accelerator(cpu=True, gloo, timeout=--pg-timeout);
--hf runs a transformers.Trainer with a tiny config-built model instead.

Faults (--fault NAME --rank N):
  none          control, nothing planted
  keyerror      rank N's shard names a species missing from the lookup table (KeyError)
  missing_shard rank N's shard file is deleted before it is read (FileNotFoundError)
  ckpt_size     rank N loads a start checkpoint whose hidden layer has another width (size mismatch)
  weights_only  rank N loads a checkpoint holding a pickled custom object (weights_only refusal)
  wrong_size    rank N all-reduces a metric tensor of the wrong length (gloo size mismatch)
  slow          rank N does pure-Python "sensor calibration" for long; peers time out in all_reduce
  hang          like slow but much longer; run with --pg-timeout 300 so `timeout` ends it
  nan           rank N gets a NaN moisture reading; the script's own finiteness check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line and sys.exit(4)
  shape_all     every rank builds the feature tensor with one column too few (matmul shape error)
  worker_crash  rank N's DataLoader worker dies (SIGKILL to itself) while loading a batch

What happened (2026-12-06 runs, logs bonsai_*):
  none          clean, exit 0 under accelerate (np3) and transformers.Trainer/torchrun (np4)
  keyerror      KeyError: 'wisteria' on the planted rank before step 0; others SIGTERMed, summary names it
  missing_shard FileNotFoundError for shard_3_2026-12-06.pt on rank 3; summary names rank 3
  ckpt_size     load_state_dict size mismatch (24 vs 16) on rank 1; summary names rank 1
  weights_only  UnpicklingError "Weights only load failed ... __main__.Calib" on rank 4
  wrong_size    no size error at all: the streams desync, peers print corrupt sums (np8) and every rank
                fails with gloo "Timed out waiting 12000ms"; np5 summary blames rank 1 (SIGABRT), np8 rank 7
  slow          peers time out after 12 s in gloo, rank 3 SIGTERMed without traceback; summary blames rank 1.
                Under transformers.Trainer (np6) the run just waited and finished (exit 0): dropped
  hang          no error; timeout 60 ends it, the agent says "Received 15 death signal" (exit 124)
  nan           the script's FloatingPointError on the planted rank at step 1; peers "Connection closed by peer"
  sigsegv       planted rank exits -11 (SIGSEGV) with no traceback; peers connection closed/reset
  error_exit    "ERROR rank N: moisture sensor feed ..." then exitcode 4; acc2nodes node 1 blames rank 3
  shape_all     every rank: mat1 and mat2 shapes cannot be multiplied (8x4 and 5x16)
  worker_crash  "DataLoader worker (pid N) is killed by signal: Killed." on the planted rank at batch 3
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault510_work"
SPECIES = ["juniper", "ficus", "maple", "elm", "pine", "azalea"]
FEAT = 5


def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(510)
    json.dump({s: i for i, s in enumerate(SPECIES)}, open(f"{WORK}/species.json", "w"))
    for r in range(world):
        moist = torch.rand(64, 4, generator=g)
        sp = [SPECIES[i % len(SPECIES)] for i in range(64)]
        torch.save({"moisture": moist, "species": sp}, f"{WORK}/shard_{r}.pt")
    m = make_model(16)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    torch.save(make_model(24).state_dict(), f"{WORK}/start_wide.pt")
    print("prepared", WORK)


class Calib:  # a custom object that weights_only refuses
    def __init__(self):
        self.offset = 0.1


def make_model(h=16):
    return nn.Sequential(nn.Linear(FEAT, h), nn.ReLU(), nn.Linear(h, 1))


def load_shard(rank, fault, frank, table):
    path = f"{WORK}/shard_{rank}.pt"
    if fault == "missing_shard" and rank == frank:
        path = f"{WORK}/shard_{rank}_2026-12-06.pt"
    d = torch.load(path)
    sp = list(d["species"])
    if fault == "keyerror" and rank == frank:
        sp[17] = "wisteria"
    moist = d["moisture"]
    if fault == "nan" and rank == frank:
        moist[9, 2] = float("nan")
    ncol = FEAT - 1 if fault == "shape_all" else FEAT
    sid = torch.tensor([table[s] for s in sp], dtype=torch.float32).unsqueeze(1) / len(SPECIES)
    x = torch.cat([moist, sid], dim=1)[:, :ncol]
    y = (1.0 - moist.mean(1, keepdim=True)) * 250.0 / 100.0
    return x, y


class Pots(torch.utils.data.Dataset):
    def __init__(self, x, y, crash):
        self.x, self.y, self.crash = x, y, crash

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.crash and i >= 24:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def calibrate(seconds):
    t0 = time.time(); acc = 0
    while time.time() - t0 < seconds:
        for k in range(10000):
            acc += (k * k) % 7
    return acc


def run_acc(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    print(f"rank {rank}/{world} bonsai watering job up (backend={dist.get_backend()})", flush=True)
    table = json.load(open(f"{WORK}/species.json"))
    x, y = load_shard(rank, a.fault, a.rank, table)
    model = make_model(16)
    ck = f"{WORK}/start.pt"
    if a.fault == "ckpt_size" and rank == a.rank:
        ck = f"{WORK}/start_wide.pt"
    if a.fault == "weights_only" and rank == a.rank:
        ck = f"{WORK}/start_calib.pt"
        sd = torch.load(f"{WORK}/start.pt"); sd["calib"] = Calib(); torch.save(sd, ck)
        model.load_state_dict(torch.load(ck))
    else:
        model.load_state_dict(torch.load(ck))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dl = torch.utils.data.DataLoader(Pots(x, y, a.fault == "worker_crash" and rank == a.rank), batch_size=8,
                                     num_workers=1 if (a.fault == "worker_crash") else 0)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(6):
        xb, yb = next(it)
        if a.fault == "sigsegv" and rank == a.rank and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "error_exit" and rank == a.rank and step == 3:
            print(f"ERROR rank {rank}: moisture sensor feed for bench 3 returned 0 readings, refusing to schedule watering", flush=True)
            sys.exit(4)
        if a.fault in ("slow", "hang") and rank == a.rank and step == 2:
            calibrate(40 if a.fault == "slow" else 1000)
        if not torch.isfinite(xb).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite soil moisture reading in batch")
        pred = model(xb)
        loss = nn.functional.mse_loss(pred, yb)
        acc.backward(loss)
        opt.step(); opt.zero_grad()
        dry = torch.tensor([float((xb[:, :4].mean(1) < 0.35).sum())])
        if a.fault == "wrong_size" and rank == a.rank and step == 1:
            dry = torch.tensor([dry.item(), 0.0, 0.0])
        dist.all_reduce(dry)
        print(f"rank {rank} step {step} loss {loss.item():.4f} dry_pots {dry.item():.0f}", flush=True)
    acc.wait_for_everyone()
    if rank == 0:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export_watering.pt")
        print("rank 0 saved export", f"{WORK}/export_watering.pt", flush=True)
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_hf(a):
    from transformers import Trainer, TrainingArguments, BertConfig, BertForSequenceClassification, TrainerCallback
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], per_device_train_batch_size=8, max_steps=6, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    rank = args.process_index
    table = json.load(open(f"{WORK}/species.json"))
    x, y = load_shard(rank, a.fault, a.rank, table)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     num_labels=1, max_position_embeddings=16)
    model = BertForSequenceClassification(cfg)
    ids = (x * 10).long().clamp(0, 63)

    class DS(torch.utils.data.Dataset):
        def __len__(self): return len(ids)
        def __getitem__(self, i): return {"input_ids": ids[i], "labels": y[i]}

    class CB(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            if a.fault == "slow" and rank == a.rank and state.global_step == 2:
                calibrate(40)
            if a.fault == "sigsegv" and rank == a.rank and state.global_step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} dry_pots n/a", flush=True)

    tr = Trainer(model=model, args=args, train_dataset=DS(), callbacks=[CB()])
    tr.train()
    if rank == 0:
        tr.save_model(f"{WORK}/export_hf")
        print("rank 0 saved export", f"{WORK}/export_hf", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--hf", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare(); sys.exit(0)
    run_hf(a) if a.hf else run_acc(a)
