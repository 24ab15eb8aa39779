"""fault610.py - sandgrouse water carrying: a tiny multi-rank CPU training job with planted faults.

Each rank models a male sandgrouse soaking belly feathers at a waterhole and flying water back to the
chicks: features (distance_km, feather_soak_s, temperature_c, wind) go through a JSON lookup table
(waterhole id -> soak factor) and a small MLP predicts millilitres of water delivered. gloo on CPU,
6 steps, every rank prints `rank R step S loss L water_ml M`; rank 0 saves an export at the end.
Modes: plain torch.distributed (torchrun), --acc (accelerate Accelerator(cpu=True)), --hf (transformers.Trainer).
--prepare writes /tmp/fault610_work: shard_rank{r}.pt, waterholes.json, start.pt (+ corrupt copies).

Faults (--fault NAME --rank N):
  none           control run
  valueerror     rank N: negative water load fails the script's own check -> ValueError
  zerodiv        rank N: divides by a chick count of zero -> ZeroDivisionError
  jsondecode     rank N reads a truncated copy of the waterhole lookup -> json.JSONDecodeError
  loaderworker   rank N's DataLoader worker (num_workers=1) indexes past its shard -> IndexError in worker
  ckpt_corrupt   rank N torch.load()s a truncated copy of start.pt
  ckpt_keys      rank N loads a start checkpoint whose keys are renamed -> load_state_dict missing/unexpected keys
  save_nodir     rank 0 saves the export into a directory that does not exist
  skip_allreduce rank N skips the step-3 all_reduce of water_ml; the others time out (pg timeout)
  exit0          rank N calls sys.exit(0) quietly at step 3
  exit3          rank N calls os._exit(3) at step 3 without printing
  sigkill        rank N sends itself SIGKILL at step 3
  sigabrt        rank N sends itself SIGABRT at step 3
  anomaly        rank N's loss goes through sqrt(-1) -> NaN, detect_anomaly raises in backward
  clipnan        rank N's gradients become inf; clip_grad_norm_(error_if_nonfinite=True) raises
  unused_param   every rank: a spare layer outside forward, DDP without find_unused_parameters
  shape_rank     rank N builds a wider hidden layer -> DDP's model check fails
  modnotfound    rank N imports a module that does not exist
  memory         rank N caps RLIMIT_AS and allocates a huge tensor
  stall          rank N sleeps 400 s at step 3; others time out (or hang with --pg-timeout 300)
  shape_all      every rank: feature width 5 against a model that takes 4 -> matmul shape error
(launch-time faults are made from outside: port held, wrong script argument)

Runs (one line per log):
sandgrouse_none_np5_rnone_acc (acc, rc=0): Control run: 5 ranks print 6 steps each and rank 0 saves the export; exit 0.
sandgrouse_none_np3_rnone_hf (hf, rc=0): Control run of the transformers.Trainer mode under torchrun: 6 steps on 3 ranks, train summary, rank 0 saves the export (step-1 lines print loss nan because no loss was logged yet).
sandgrouse_valueerror_np6_r5_torchrun (torchrun, rc=1): Rank 5 raises the script's own ValueError at step 3; the other ranks fail in backward with gloo 'Connection closed by peer'; torchrun names rank 5.
sandgrouse_jsondecode_np3_r1_accconfig (accconfig, rc=1): Rank 1 reads a truncated waterhole lookup JSON and json.load raises JSONDecodeError before training; the launcher SIGTERMs ranks 0 and 2.
sandgrouse_zerodiv_np4_r2_accdebug (accdebug, rc=1): ACCELERATE_DEBUG_MODE=1: rank 2 raises ZeroDivisionError at step 3; ranks 1 and 3 fail with gloo 'Connection closed by peer'.
sandgrouse_loaderworker_np5_r0_tee (tee, rc=1): torchrun --tee 3: rank 0's DataLoader worker raises IndexError (Caught IndexError in DataLoader worker process 0) at step 2; the other ranks see gloo 'Connection closed by peer'.
sandgrouse_ckpt_corrupt_np6_r3_acc (acc, rc=1): Rank 3 torch.load()s a truncated start checkpoint (PytorchStreamReader failed finding central directory) before step 1; the launcher SIGTERMs the rest.
sandgrouse_skip_allreduce_np5_r2_torchrun (torchrun, rc=1): Rank 2 skips the step-3 water_ml all_reduce and enters the next DDP gradient all-reduce, so rank 1 aborts on a gloo size mismatch (40 vs 4 bytes, SIGABRT) instead of a timeout.
sandgrouse_exit3_np8_r7_torchrun (torchrun, rc=1): Rank 7 calls os._exit(3) at step 3 without a message; ranks 0 and 6 see gloo 'Connection reset by peer'; torchrun's root cause is rank 7 exitcode 3.
sandgrouse_sigkill_np5_r4_acc (acc, rc=1): Rank 4 SIGKILLs itself at step 3; ranks 0 and 3 see gloo 'Connection reset by peer'; root cause rank 4 exitcode -9 (SIGKILL).
sandgrouse_valueerror_np4_r3_hf (hf, rc=1): transformers.Trainer mode under accelerate launch: rank 3's dataset raises ValueError fetching the first batch; ranks 0-2 fail with gloo 'Connection closed by peer'.
sandgrouse_save_nodir_np4_r0_acc2nodes (acc2nodes, rc=1): Two accelerate launch 'machines' (2 ranks each) interleaved: after 6 steps rank 0's torch.save fails (parent directory does not exist); machine 1's agent then loses the store at its exit barrier. Machine exit codes 1 and 0.
sandgrouse_anomaly_np6_r2_tee (tee, rc=1): torchrun --tee 3: rank 2's loss goes through sqrt of a negative value and anomaly detection raises 'SqrtBackward0 returned nan values'; other ranks see gloo 'Connection closed by peer'.
sandgrouse_clipnan_np5_r1_accconfig (accconfig, rc=1): Rank 1's gradients are set to inf at step 3 and clip_grad_norm_(error_if_nonfinite=True) raises; ranks 0 and 2 see gloo 'Connection closed by peer'.
sandgrouse_unused_param_np4_rall_torchrun (torchrun, rc=1): All 4 ranks have a spare layer outside forward under DDP without find_unused_parameters; at step 2 every rank raises 'Expected to have finished reduction in the prior iteration'.
sandgrouse_shape_rank_np5_r3_acc (acc, rc=1): Rank 3 builds a wider hidden layer; DDP's parameter check in accelerator.prepare raises a size mismatch against process 0 on rank 3 and the others see gloo 'Connection closed by peer'.
sandgrouse_sigkill_np5_r2_hf (hf, rc=1): transformers.Trainer mode under torchrun: rank 2 SIGKILLs itself after step 3; ranks 1 and 3 see gloo 'Connection reset by peer'; root cause rank 2 exitcode -9 (SIGKILL).
sandgrouse_stall_np4_r1_torchrun (torchrun, rc=124): Rank 1 sleeps 400 s at step 3 with --pg-timeout 300: output stops after step 2 with no error, and the outer timeout 60 SIGTERMs torchrun (exit 124).
sandgrouse_memory_np3_r2_torchrun (torchrun, rc=1): Rank 2 caps RLIMIT_AS at 2 GiB and allocates 6 GiB: DefaultCPUAllocator can't allocate memory before training; torchrun SIGTERMs the rest.
sandgrouse_port_in_use_np5_rnone_torchrun (torchrun, rc=1): A python socket holds port 37519 (IPv4 and IPv6); torchrun's static rendezvous TCPStore fails with EADDRINUSE and no worker starts.
sandgrouse_exit0_np6_r3_torchrun (torchrun, rc=1): Rank 3 calls sys.exit(0) at step 3; ranks 1, 2, 4, 5 fail with gloo 'Connection closed by peer'; torchrun names rank 4 and does not list rank 3 (exit 0).
sandgrouse_shape_all_np5_rall_accdebug (accdebug, rc=1): ACCELERATE_DEBUG_MODE=1 given as env: every rank feeds 5 features to a 4-input model and all 5 raise the same matmul shape RuntimeError at step 1.
sandgrouse_modnotfound_np7_r6_torchrun (torchrun, rc=1): Rank 6 imports a missing module (ModuleNotFoundError) before training; torchrun SIGTERMs the other 6 ranks.
(24th slot unused: 23 runs)
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

WORK = "/tmp/fault610_work"
STEPS = 6


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--acc", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--export-dir", default=WORK + "/export")
    return p.parse_args()


def make_model(hidden=16):
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(WORK + "/export", exist_ok=True)
    g = torch.Generator().manual_seed(610)
    for r in range(8):
        x = torch.rand(48, 4, generator=g)
        hole = torch.randint(0, 6, (48,), generator=g)
        torch.save({"x": x, "hole": hole}, f"{WORK}/shard_rank{r}.pt")
    table = {str(i): 0.5 + 0.1 * i for i in range(6)}
    with open(f"{WORK}/waterholes.json", "w") as f:
        json.dump(table, f)
    with open(f"{WORK}/waterholes_truncated.json", "w") as f:
        f.write(json.dumps(table)[:23])
    torch.manual_seed(0)
    sd = make_model().state_dict()
    torch.save({"model": sd, "step": 0}, f"{WORK}/start.pt")
    raw = open(f"{WORK}/start.pt", "rb").read()
    open(f"{WORK}/start_truncated.pt", "wb").write(raw[: len(raw) // 2])
    torch.save({"model": {k.replace("0.", "feather.").replace("2.", "crop."): v for k, v in sd.items()},
                "step": 0}, f"{WORK}/start_renamed.pt")
    print("prepared", WORK, flush=True)


class Shard(torch.utils.data.Dataset):
    def __init__(self, rank, table, bad=False):
        d = torch.load(f"{WORK}/shard_rank{rank}.pt")
        self.x, self.hole, self.table, self.bad = d["x"], d["hole"], table, bad

    def __len__(self):
        return len(self.x) + (10 if self.bad else 0)

    def __getitem__(self, i):
        x = self.x[i]
        soak = self.table[str(int(self.hole[i]))]
        y = (x[0] * 10 + x[1] * 5) * soak
        return x, y.reshape(1).float()


class Holder(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body, self.spare = body, nn.Linear(4, 1)  # spare crop layer never used in forward

    def forward(self, x):
        return self.body(x)


def faults_before(a, rank):
    mine = a.rank == rank
    if a.fault == "modnotfound" and mine:
        import sandgrouse_belly_feathers  # noqa: F401
    if a.fault == "memory" and mine:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (2 * 1024 ** 3, 2 * 1024 ** 3))
        big = torch.empty(6 * 1024 ** 3 // 4, dtype=torch.float32)
        big.fill_(1.0)


def load_table(a, rank):
    path = f"{WORK}/waterholes.json"
    if a.fault == "jsondecode" and a.rank == rank:
        path = f"{WORK}/waterholes_truncated.json"
    with open(path) as f:
        return json.load(f)


def load_start(a, rank, model):
    path = f"{WORK}/start.pt"
    if a.fault == "ckpt_corrupt" and a.rank == rank:
        path = f"{WORK}/start_truncated.pt"
    if a.fault == "ckpt_keys" and a.rank == rank:
        path = f"{WORK}/start_renamed.pt"
    ck = torch.load(path, weights_only=True)
    if a.fault != "shape_rank":
        model.load_state_dict(ck["model"])


def step_faults(a, rank, step, loss, model):
    mine = a.rank == rank
    if step != 3 or not mine:
        return loss
    if a.fault == "valueerror":
        load = -loss.item()
        if load < 0:
            raise ValueError(f"water load must be non-negative, got {load:.3f} ml on rank {rank}")
    if a.fault == "zerodiv":
        chicks = 0
        print(f"rank {rank} water per chick {loss.item() / chicks}", flush=True)
    if a.fault == "exit0":
        sys.exit(0)
    if a.fault == "exit3":
        os._exit(3)
    if a.fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if a.fault == "sigabrt":
        os.kill(os.getpid(), signal.SIGABRT)
    if a.fault == "stall":
        time.sleep(400)
    if a.fault == "anomaly":
        loss = torch.sqrt(-loss)  # NaN: sqrt of a negative water balance
    return loss


def train_loop(a, rank, world, model, opt, loader, backward, wrapped):
    lossf = nn.MSELoss()
    it = iter(loader)
    for step in range(1, STEPS + 1):
        x, y = next(it)
        if a.fault == "shape_all":
            x = torch.cat([x, x[:, :1]], dim=1)
        out = wrapped(x)
        loss = lossf(out, y)
        loss = step_faults(a, rank, step, loss, model)
        opt.zero_grad()
        backward(loss)
        if a.fault == "clipnan" and a.rank == rank and step == 3:
            for p in model.parameters():
                p.grad.fill_(float("inf"))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0, error_if_nonfinite=True)
        opt.step()
        water = out.detach().sum().reshape(1)
        if not (a.fault == "skip_allreduce" and a.rank == rank and step == 3):
            dist.all_reduce(water)
        print(f"rank {rank} step {step} loss {loss.item():.4f} water_ml {water.item():.2f}", flush=True)
    dist.barrier()
    if rank == 0:
        d = a.export_dir
        if a.fault == "save_nodir":
            d = WORK + "/exports_missing/run610"
        torch.save(model.state_dict(), os.path.join(d, "sandgrouse_export.pt"))
        print(f"rank 0 saved export to {d}", flush=True)


def main_plain(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    faults_before(a, rank)
    if a.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    table = load_table(a, rank)
    hidden = 24 if (a.fault == "shape_rank" and a.rank == rank) else 16
    torch.manual_seed(0)
    model = make_model(hidden)
    load_start(a, rank, model)
    if a.fault == "unused_param":
        model = Holder(model)
    ds = Shard(rank, table, bad=(a.fault == "loaderworker" and a.rank == rank))
    sampler = None
    if a.fault == "loaderworker" and a.rank == rank:
        sampler = list(range(40, 58))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler,
                                         num_workers=1 if a.fault == "loaderworker" else 0)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    print(f"rank {rank}/{world} ready: {len(ds)} sandgrouse flights", flush=True)
    train_loop(a, rank, world, model, opt, loader, lambda l: l.backward(), ddp)
    dist.destroy_process_group()


def main_acc(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo",
                      timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    faults_before(a, rank)
    if a.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    table = load_table(a, rank)
    hidden = 24 if (a.fault == "shape_rank" and a.rank == rank) else 16
    torch.manual_seed(0)
    model = make_model(hidden)
    load_start(a, rank, model)
    ds = Shard(rank, table, bad=(a.fault == "loaderworker" and a.rank == rank))
    sampler = list(range(40, 58)) if (a.fault == "loaderworker" and a.rank == rank) else None
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler,
                                         num_workers=1 if a.fault == "loaderworker" else 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped, opt = acc.prepare(model, opt)
    print(f"rank {rank}/{world} ready ({acc.distributed_type}): {len(ds)} sandgrouse flights", flush=True)
    train_loop(a, rank, world, model, opt, loader, acc.backward, wrapped)
    acc.end_training()


def main_hf(a):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    rank = int(os.environ.get("RANK", 0))
    faults_before(a, rank)
    table = load_table(a, rank)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=1)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    d = torch.load(f"{WORK}/shard_rank{rank}.pt")

    class Flights(torch.utils.data.Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            if a.fault == "valueerror" and a.rank == rank and i % 2 == 1:
                raise ValueError(f"waterhole {int(d['hole'][i])} reports negative soak on rank {rank}")
            ids = (d["x"][i] * 60).long().clamp(0, 63)
            y = float(d["x"][i][0] * 10) * table[str(int(d["hole"][i]))]
            return {"input_ids": ids, "labels": torch.tensor([y])}

    class Print(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            s = state.global_step
            hist = [h["loss"] for h in state.log_history if "loss" in h]
            l = hist[-1] if hist else float("nan")
            print(f"rank {rank} step {s} loss {l:.4f} water_ml {s * 7.5:.2f}", flush=True)
            step_faults(a, rank, s, torch.tensor(l), model)

    args = TrainingArguments(output_dir=WORK + "/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=int(a.pg_timeout),
                             max_steps=STEPS, per_device_train_batch_size=8, logging_steps=1, report_to=[],
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    tr = Trainer(model=model, args=args, train_dataset=Flights(), callbacks=[Print()])
    tr.train()
    if rank == 0:
        out = a.export_dir if a.fault != "save_nodir" else WORK + "/exports_missing/run610"
        torch.save(model.state_dict(), os.path.join(out, "sandgrouse_export.pt"))
        print(f"rank 0 saved export to {out}", flush=True)


if __name__ == "__main__":
    a = parse()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    elif a.acc:
        main_acc(a)
    else:
        main_plain(a)
