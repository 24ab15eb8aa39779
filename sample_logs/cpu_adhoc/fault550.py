"""Batch 550 fault script: "fumarole gas venting" (prefix fumar_).

A small regression job that learns the gas flux of fumarole vents from survey readings
(SO2, H2S, CO2, temperature, pressure).  `--prepare` writes synthetic data into
/tmp/fault550_work: one survey shard per rank (shard_R.json), a lookup table of vents
(vents.json: vent id -> field code and altitude), and a starting checkpoint (init.pt).
Training runs 6 steps on CPU with gloo (Accelerator(cpu=True) or, with --hf, a
transformers.Trainer over a tiny config-built GPT-2); every rank prints
`rank R step S loss L flux_rmse M`, and rank 0 saves an export at the end.

Faults (`--fault NAME --rank N`, planted on rank N at step 3 unless said otherwise):
  none         control run, nothing planted
  keyerror     rank N meets a reading from a vent id the lookup table lacks -> KeyError
  missingshard rank N opens a resampled shard file that was never written -> FileNotFoundError
  ckptsize     rank N loads a starting checkpoint of a wider vent encoder -> size mismatch in load_state_dict
  wrongsize    rank N all-gathers a vent-pressure vector of 5 values where peers send 4 (collective size mismatch)
  slow         rank N spends ~35 s in pure-Python plume re-integration; peers' collective times out (12 s)
  hang         rank N waits forever for a sampler flag file (run with --pg-timeout 300; `timeout` ends it)
  nan          rank N's sensor reading drops to NaN; the program's own finiteness check raises FloatingPointError
  segv         rank N sends itself SIGSEGV
  errexit      rank N prints its own ERROR line (analyser calibration drift) and calls sys.exit(4)
  shapebug     every rank appends an extra feature column at step 2 -> matmul shape error on all ranks
  workercrash  the DataLoader worker of rank N is killed by SIGKILL while loading a batch

What happened (filled in after the runs):
  none         all ranks ran 6 steps and rank 0 saved the export; exit 0 (acc np4, Trainer np3).
  keyerror     rank N raised KeyError 'FV-99' at step 3; peers failed with gloo "Connection closed by peer"; exit 1, root cause rank N.
  missingshard rank N raised FileNotFoundError on shard_N.resampled.json before step 1; peers were SIGTERMed (acc) or lost their connection (Trainer).
  ckptsize     rank N raised RuntimeError "size mismatch for enc.weight" in load_state_dict before training; the rest were SIGTERMed.
  wrongsize    rank N raised "ProcessGroupGloo::allgather: invalid tensor size"; peers failed with gloo connection closed.
  slow         peers raised gloo "Timed out waiting 12000ms" after 12 s; the slow rank was SIGTERMed silently and the summary blamed a peer.
  hang         no error: output stopped after step 2; timeout's SIGTERM at 60 s, then SIGKILL 5 s later (exit 137).
  nan          rank N raised FloatingPointError (non-finite loss) at step 3; peers lost their connection.
  segv         rank N died of SIGSEGV (exitcode -11, no traceback); peers lost their connection.
  errexit      rank N printed its ERROR line and exited 4 (no traceback); peers lost their connection.
  shapebug     every rank raised RuntimeError "mat1 and mat2 shapes cannot be multiplied (8x7 and 6x16)" at step 2.
  workercrash  rank N raised RuntimeError "DataLoader worker (pid ...) is killed by signal: Killed." at step 3.
"""
import argparse
import json
import math
import os
import random
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault550_work"
FEATURES = ["so2", "h2s", "co2", "temp_c", "pressure_kpa"]


def prepare():
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(550)
    vents = {f"FV-{i:02d}": {"field": f"solfatara-{i % 4}", "altitude_m": 800 + 37 * i} for i in range(24)}
    with open(os.path.join(WORK, "vents.json"), "w") as f:
        json.dump(vents, f)
    for r in range(8):
        rows = []
        for k in range(64):
            vid = f"FV-{rng.randrange(24):02d}"
            row = {"vent": vid, "so2": rng.uniform(0, 5), "h2s": rng.uniform(0, 3), "co2": rng.uniform(1, 9),
                   "temp_c": rng.uniform(90, 400), "pressure_kpa": rng.uniform(95, 130)}
            row["flux"] = 0.3 * row["so2"] + 0.2 * row["co2"] + row["temp_c"] / 400.0
            rows.append(row)
        with open(os.path.join(WORK, f"shard_{r}.json"), "w") as f:
            json.dump(rows, f)
    torch.manual_seed(550)
    torch.save(VentNet(16).state_dict(), os.path.join(WORK, "init.pt"))
    torch.save(VentNet(24).state_dict(), os.path.join(WORK, "init_wide.pt"))
    print("prepared", WORK)


class VentNet(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.enc = nn.Linear(len(FEATURES) + 1, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(torch.relu(self.enc(x))).squeeze(-1)


class SurveyShard(torch.utils.data.Dataset):
    def __init__(self, rank, args):
        name = f"shard_{rank}.json"
        if args.fault == "missingshard" and rank == args.rank:
            name = f"shard_{rank}.resampled.json"
        with open(os.path.join(WORK, name)) as f:
            self.rows = json.load(f)
        with open(os.path.join(WORK, "vents.json")) as f:
            self.vents = json.load(f)
        self.rank, self.args = rank, args

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        a = self.args
        row = dict(self.rows[i])
        if a.fault == "workercrash" and self.rank == a.rank and i >= 16 and torch.utils.data.get_worker_info():
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault == "keyerror" and self.rank == a.rank and i >= 16:
            row["vent"] = "FV-99"  # a vent added in the field survey but not in the lookup table
        alt = self.vents[row["vent"]]["altitude_m"] / 1000.0
        x = torch.tensor([row[k] for k in FEATURES] + [alt], dtype=torch.float32)
        x[3] = x[3] / 100.0
        x[4] = x[4] / 100.0
        if a.fault == "nan" and self.rank == a.rank and i >= 16:
            x[0] = float("nan")  # SO2 sensor dropout
        return x, torch.tensor(row["flux"], dtype=torch.float32)


def plant_step_fault(args, rank, step, world):
    if args.fault == "errexit" and rank == args.rank and step == 3:
        print(f"[rank {rank}] ERROR: gas analyser calibration drift on vent line 3 (CO2 span 14% > 5%), aborting survey run", flush=True)
        sys.exit(4)
    if args.fault == "segv" and rank == args.rank and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "slow" and rank == args.rank and step == 3:
        t0, acc = time.time(), 0.0
        while time.time() - t0 < 35:  # pure-Python plume re-integration
            for k in range(20000):
                acc += math.sin(k) * 1e-9
    if args.fault == "hang" and rank == args.rank and step == 3:
        flag = os.path.join(WORK, "sampler_ready.flag")
        while not os.path.exists(flag):
            time.sleep(0.5)
    # vent-pressure summary exchanged every step
    n = 5 if (args.fault == "wrongsize" and rank == args.rank and step == 3) else 4
    local = torch.full((n,), float(rank))
    out = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(out, local)


def main_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(550 + rank)
    ds = SurveyShard(rank, args)
    nw = 1 if args.fault == "workercrash" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, num_workers=nw)
    model = VentNet(16)
    ck = "init_wide.pt" if (args.fault == "ckptsize" and rank == args.rank) else "init.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, ck), weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(1, 7):
        x, y = next(it)
        if args.fault == "shapebug" and step == 2:
            x = torch.cat([x, x[:, :1] ** 2], dim=1)  # new "so2 squared" feature, encoder not widened
        plant_step_fault(args, rank, step, world)
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (survey batch has NaN readings)")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        rmse = torch.sqrt(((pred.detach() - y) ** 2).mean()).item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} flux_rmse {rmse:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        path = os.path.join(WORK, f"export_{args.tag}.pt")
        torch.save(acc.unwrap_model(model).state_dict(), path)
        print(f"rank 0 saved export {path}", flush=True)
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


def main_hf(args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))

    class TokenShard(torch.utils.data.Dataset):
        def __init__(self):
            base = SurveyShard(rank, args)
            self.items = []
            for row in base.rows:
                ids = [int(min(63, row[k] * 6)) % 64 for k in FEATURES] + [int(row["flux"] * 10) % 64] * 3
                self.items.append(ids)

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            t = torch.tensor(self.items[i])
            return {"input_ids": t, "labels": t}

    class VentTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step + 1
            if args.fault == "errexit" and rank == args.rank and step == 3:
                print(f"[rank {rank}] ERROR: gas analyser calibration drift on vent line 3 (CO2 span 14% > 5%), aborting survey run", flush=True)
                sys.exit(4)
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
            loss = out[0] if return_outputs else out
            print(f"rank {rank} step {step} loss {loss.item():.4f} flux_rmse {math.sqrt(abs(loss.item())) / 10:.4f}", flush=True)
            return out

    torch.manual_seed(550)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    targs = TrainingArguments(output_dir=os.path.join(WORK, f"hf_{args.tag}"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=6, per_device_train_batch_size=4,
                              logging_steps=2, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = VentTrainer(model=model, args=targs, train_dataset=TokenShard())
    trainer.train()
    if trainer.is_world_process_zero():
        path = os.path.join(WORK, f"export_{args.tag}")
        trainer.save_model(path)
        print(f"rank 0 saved export {path}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--hf", action="store_true")
    p.add_argument("--tag", default="run")
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)
