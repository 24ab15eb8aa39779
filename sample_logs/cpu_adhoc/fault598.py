"""Lemming population cycles: a small distributed fit of a density-dependent growth model (gloo, CPU).

Each rank reads its own census shard (trapping-plot counts from a tundra site), looks up the site's
carrying capacity in a shared table, starts from a common checkpoint and fits a small network that
predicts next year's log-density. 6 steps; every rank prints `rank R step S loss L cycle_amp M`;
rank 0 writes an export at the end.  `--prepare` writes the synthetic data into /tmp/fault598_work.
`--hf` runs the same theme as a transformers.Trainer job (tiny config-built GPT-2 on binned densities).

Faults (`--fault NAME --rank N`, one per run):
  none           control, nothing planted
  keyerror       rank N meets a census plot whose site is not in the carrying-capacity table (KeyError)
  missing_shard  rank N opens a census shard for a season that was never written (FileNotFoundError)
  ckpt_size      rank N loads the wide (hidden 24) checkpoint into the hidden-16 model (size mismatch)
  weights_only   rank N torch.load()s a checkpoint holding a pickled CensusMeta object (weights_only refusal)
  wrong_size     rank N all_reduces a 5-element site summary while its peers send 4 (collective size mismatch)
  slow           rank N recounts the census in pure Python for ~45 s; its peers time out (PG timeout 12 s)
                 (with --pg-timeout 300 and --slow-seconds 400 this becomes a hang that `timeout` ends)
  nan            rank N's density goes to NaN; the script's own finiteness check raises FloatingPointError
  segv           rank N sends itself SIGSEGV at step 2
  exit4          rank N prints its own ERROR line (negative trap counts) and calls sys.exit(4)
  shape_all      every rank reshapes its feature batch to a wrong width (RuntimeError on all ranks)
  host_oom       rank N caps its address space (RLIMIT_AS) and allocates a 4 GiB density grid (host OOM)
  worker_crash   rank N's DataLoader worker is SIGKILLed while reading the census (worker died)
What happened (batch 598 runs, see the lemming_* logs):
  none           acc np3 and hf/torchrun np3: all ranks print steps 0-5, rank 0 saves its export, exit 0
  keyerror       acc np4 r2, torchrun np6 r5, hf/accelerate np4 r1: KeyError 'svalbard_plot_13' on the planted rank, peers get gloo "Connection closed by peer"
  missing_shard  accdebug np5 r3: FileNotFoundError for census_r3_season2.pt before step 0; the others are SIGTERMed
  ckpt_size      accconfig np3 r1: load_state_dict "size mismatch for 0.weight" on rank 1 before step 0
  weights_only   tee np4 r0: UnpicklingError "Weights only load failed ... __main__.CensusMeta" on rank 0
  wrong_size     acc np5 r2, acc2nodes np4 r3: no size error; the peers pass the all_reduce and time out (12 s) in the next backward, the planted rank times out inside all_reduce
  slow           acc np6 r4: rank 4 goes quiet after step 2, the five others raise gloo "Timed out waiting 12000ms"
  slow (hang)    torchrun np4 r1, --pg-timeout 300: output stops after step 2; timeout 60 SIGTERMs torchrun (SignalException), exit 137
  nan            acc np8 r6: FloatingPointError "rank 6: non-finite loss nan at step 4"
  segv           torchrun np5 r4, tee np8 r7: rank dies silently, summary shows exitcode -11 (SIGSEGV); in np8 rank 6 also aborts (-6)
  exit4          accconfig np4 r1: ERROR line then rank 0 aborts (SIGABRT) and the summary blames rank 0; hf/torchrun np3 r2: summary names rank 2 exitcode 4
  shape_all      acc np3: RuntimeError "shape '[-1, 9]' is invalid for input of size 64" on all three ranks
  host_oom       torchrun np4 r2: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes"
  worker_crash   accdebug np4 r3: "DataLoader worker (pid N) is killed by signal: Killed." on rank 3
"""
import argparse
import json
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault598_work"
SITES = ["finse", "abisko", "kilpisjarvi", "varanger", "wrangel", "bylot", "barrow", "taimyr"]


@dataclass
class CensusMeta:
    site: str
    season: int


def make_model(hidden=16):
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(598)
    table = {s: float(50 + 10 * i) for i, s in enumerate(SITES)}
    with open(os.path.join(WORK, "carrying_capacity.json"), "w") as f:
        json.dump(table, f)
    for r in range(8):
        t = torch.arange(64, dtype=torch.float32)
        phase = torch.rand(1, generator=g) * 6.28
        dens = 1.5 + torch.sin(t * 6.28 / 4.0 + phase)  # ~4-year cycle
        x = torch.stack([dens.roll(k) for k in range(8)], dim=1)
        y = dens.roll(-1).unsqueeze(1)
        plots = [SITES[r] for _ in range(64)]
        if r == 0:
            pass
        torch.save({"x": x, "y": y}, os.path.join(WORK, f"census_r{r}_season1.pt"))
        with open(os.path.join(WORK, f"plots_r{r}.json"), "w") as f:
            json.dump(plots, f)
    torch.manual_seed(598)
    torch.save(make_model().state_dict(), os.path.join(WORK, "init.pt"))
    torch.save(make_model(24).state_dict(), os.path.join(WORK, "init_wide.pt"))
    torch.save({"state": make_model().state_dict(), "meta": CensusMeta("varanger", 1)},
               os.path.join(WORK, "init_with_meta.pt"))
    print("prepared", WORK)


class CensusSet(torch.utils.data.Dataset):
    def __init__(self, x, y, kill_at=None):
        self.x, self.y, self.kill_at = x, y, kill_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.kill_at is not None and i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def main_acc(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    hit = args.fault != "none" and (args.rank == rank or args.fault == "shape_all")
    torch.manual_seed(598 + rank)

    with open(os.path.join(WORK, "carrying_capacity.json")) as f:
        capacity = json.load(f)
    with open(os.path.join(WORK, f"plots_r{rank}.json")) as f:
        plots = json.load(f)
    if hit and args.fault == "keyerror":
        plots[17] = "svalbard_plot_13"

    season = 2 if (hit and args.fault == "missing_shard") else 1
    shard = torch.load(os.path.join(WORK, f"census_r{rank}_season{season}.pt"))

    model = make_model()
    if hit and args.fault == "ckpt_size":
        model.load_state_dict(torch.load(os.path.join(WORK, "init_wide.pt")))
    elif hit and args.fault == "weights_only":
        model.load_state_dict(torch.load(os.path.join(WORK, "init_with_meta.pt"))["state"])
    else:
        model.load_state_dict(torch.load(os.path.join(WORK, "init.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    ds = CensusSet(shard["x"], shard["y"], kill_at=20 if (hit and args.fault == "worker_crash") else None)
    nw = 1 if (hit and args.fault == "worker_crash") else 0
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, num_workers=nw)
    model, opt = acc.prepare(model, opt)

    it = iter(loader)
    for step in range(6):
        x, y = next(it)
        cap = torch.tensor([capacity[p] for p in plots[step * 8 + 1:(step + 1) * 8 + 1]]).unsqueeze(1)
        x = x * (cap / 100.0)
        if hit and args.fault == "shape_all" and step == 1:
            x = x.reshape(-1, 9)
        if hit and args.fault == "nan" and step == 4:
            x = x * float("nan")
        if hit and args.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if hit and args.fault == "exit4" and step == 3:
            print(f"ERROR rank {rank}: census for site {SITES[rank]} has negative trap counts "
                  f"(plot 27: -4 lemmings); refusing to fit", flush=True)
            sys.exit(4)
        if hit and args.fault == "host_oom" and step == 2:
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))
            grid = torch.empty(1 << 30, dtype=torch.float32)  # 4 GiB density grid
            grid.zero_()
        if hit and args.fault == "slow" and step == 3:
            t0, n = time.time(), 0
            while time.time() - t0 < args.slow_seconds:
                n += sum(i * i for i in range(20000)) % 7
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                     f"(site {SITES[rank]})")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        summary = torch.tensor([loss.item(), float(step), float(rank), 1.0])
        if hit and args.fault == "wrong_size" and step == 3:
            summary = torch.cat([summary, torch.tensor([float(len(plots))])])
        dist.all_reduce(summary)
        amp = (pred.max() - pred.min()).item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} cycle_amp {amp:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(WORK, "export_rank0.pt"))
        print("rank 0 saved export to", os.path.join(WORK, "export_rank0.pt"), flush=True)
    acc.end_training()


def main_hf(args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, TrainerCallback

    rank = int(os.environ.get("RANK", "0"))
    hit = args.fault != "none" and args.rank == rank

    class BinnedCensus(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(598)
            t = torch.arange(32 + 200)
            self.dens = ((1.5 + torch.sin(t * 6.28 / 4.0)) * 20).long().clamp(0, 63)
            self.sites = [SITES[i % 8] for i in range(200)]

        def __len__(self):
            return 200

        def __getitem__(self, i):
            site = self.sites[i]
            if hit and args.fault == "keyerror" and i >= 40:
                site = "svalbard_plot_13"
            offs = {s: k for k, s in enumerate(SITES)}[site]
            ids = (self.dens[i:i + 32] + offs) % 64
            return {"input_ids": ids, "labels": ids.clone()}

    class StepPrint(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if hit and args.fault == "exit4" and state.global_step == 3:
                print(f"ERROR rank {rank}: census for site {SITES[rank]} has negative trap counts "
                      f"(plot 27: -4 lemmings); refusing to fit", flush=True)
                sys.exit(4)

    class LemmingTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            print(f"rank {rank} step {self.state.global_step} loss {loss.item():.4f} "
                  f"cycle_amp {inputs['input_ids'].float().std().item():.4f}", flush=True)
            return loss

    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(cfg)
    targs = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=6,
                              per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                              dataloader_num_workers=0, disable_tqdm=True)
    trainer = LemmingTrainer(model=model, args=targs, train_dataset=BinnedCensus(), callbacks=[StepPrint()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(os.path.join(WORK, "hf_export"))
        print("rank 0 saved export to", os.path.join(WORK, "hf_export"), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-seconds", type=float, default=45.0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_acc(a)
