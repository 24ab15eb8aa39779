"""Caribou migration routes: a small distributed training job with one planted fault.

Each rank reads its shard of synthetic GPS fixes (collar tracks of caribou herds),
maps every herd to its calving ground through a lookup table, starts a small route
model from a checkpoint and trains it for 6 steps (gloo, CPU only). Every rank prints
`rank R step S loss L route_err M`; rank 0 writes an export at the end.

    python fault594.py --prepare                       # write the synthetic data
    accelerate launch ... fault594.py --fault NAME --rank N [--pg-timeout S] [--hf]

Faults (--fault NAME plants one, on rank --rank N unless it says every rank):
  none          control: nothing planted
  keyerror      rank N meets a herd id its lookup table does not have (KeyError)
  missing_shard rank N's GPS shard file is missing (FileNotFoundError)
  ckpt_size     rank N builds a wider route model than the checkpoint (size mismatch in load_state_dict)
  weights_only  rank N loads a checkpoint that pickles a custom class (torch.load weights_only refusal)
  wrong_size    rank N all_gathers a route summary of the wrong length (collective size mismatch)
  slow          rank N does pure-Python route smoothing for a long time; its peers time out
                (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan           rank N's loss turns NaN; the script's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 3
  exit4         rank N prints its own ERROR line and calls sys.exit(4)
  shape_all     every rank: the heading features are concatenated with the wrong width (matmul shape error)
  hostmem       rank N caps its address space and tries to allocate a large track buffer (host memory)
  worker_crash  rank N's DataLoader worker is killed by SIGKILL

--hf runs the job as a transformers.Trainer run (tiny GPT-2 built from a config);
keyerror, exit4 and nan are planted there.

What happened (filled in after the runs):
  none          all ranks ran 6 steps, rank 0 wrote the export, exit 0 (np3, accelerate).
  keyerror      rank N raised KeyError: 'herd_9999'; peers saw gloo 'Connection closed by peer' (exit 1; 3 runs, one hf).
  missing_shard rank N raised FileNotFoundError for its shard before step 1 (exit 1).
  ckpt_size     rank N raised RuntimeError "size mismatch for enc.weight" from load_state_dict (exit 1).
  weights_only  rank N raised _pickle.UnpicklingError "Weights only load failed" (exit 1).
  wrong_size    rank N raised 'ProcessGroupGloo::allgather: invalid tensor size'; peers saw 'Connection closed' (exit 1).
  slow          peers raised gloo timeouts after 12 s while rank N was still busy (exit 1); with
                --pg-timeout 300 the output stopped and `timeout` ended the job (exit 124).
  nan           rank N raised FloatingPointError from the script's own check (exit 1).
  sigsegv       rank N died by SIGSEGV with no message; the launcher reported exitcode -11 (exit 1).
  exit4         rank N printed its ERROR line and exited 4; the launcher stopped the others (exit 1).
  shape_all     every rank raised RuntimeError (mat1 and mat2 shapes cannot be multiplied) (exit 1).
  hostmem       rank N raised RuntimeError DefaultCPUAllocator: can't allocate memory, then aborted (exit 1).
  worker_crash  rank N raised RuntimeError "DataLoader worker (pid X) is killed by signal: Killed" (exit 1).
"""
import argparse
import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn

WORK = "/tmp/fault594_work"
HERDS = ["porcupine", "bathurst", "qamanirjuaq", "george_river", "leaf_river", "beverly",
         "western_arctic", "teshekpuk", "central_arctic", "fortymile"]
FEAT = 8


class RouteNet(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.enc = nn.Linear(FEAT, hidden)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x)))


class HerdMeta:  # a custom class: torch.load(weights_only=True) refuses it
    def __init__(self, name):
        self.name = name


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(594)
    for r in range(8):
        x = torch.randn(64, FEAT, generator=g)
        herd = [HERDS[i % len(HERDS)] for i in range(64)]
        torch.save({"fixes": x, "herd": herd}, f"{WORK}/gps_shard_{r}.pt")
    with open(f"{WORK}/calving_grounds.json", "w") as f:
        json.dump({h: i % 4 for i, h in enumerate(HERDS)}, f)
    torch.save(RouteNet().state_dict(), f"{WORK}/routenet_init.pt")
    torch.save({"state": RouteNet().state_dict(), "meta": HerdMeta("porcupine")}, f"{WORK}/routenet_meta.pt")
    print("prepared", WORK)


class Tracks(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        path = f"{WORK}/gps_shard_{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/gps_shard_{rank}_autumn.pt"
        d = torch.load(path)
        with open(f"{WORK}/calving_grounds.json") as f:
            self.lookup = json.load(f)
        self.x, self.herd = d["fixes"], d["herd"]
        if fault == "keyerror" and rank == frank:
            self.herd[21] = "herd_9999"
        self.rank, self.fault, self.frank = rank, fault, frank

    def __len__(self):
        return len(self.herd)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.frank and i >= 24:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.lookup[self.herd[i]]


def smooth_route(n):  # pure-Python work
    acc = 0.0
    for i in range(n):
        acc += (i % 7) * 0.5 - (i % 3)
    return acc


def run_accelerate(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    import torch.distributed as dist
    rank, world = acc.process_index, acc.num_processes
    f, fr = a.fault, a.rank
    mine = (rank == fr)
    torch.manual_seed(rank)
    hidden = 32 if (f == "ckpt_size" and mine) else 16
    model = RouteNet(hidden)
    if f == "weights_only" and mine:
        sd = torch.load(f"{WORK}/routenet_meta.pt")["state"]
    else:
        sd = torch.load(f"{WORK}/routenet_init.pt")
    model.load_state_dict(sd)
    ds = Tracks(rank, f, fr)
    workers = 1 if (f == "worker_crash" and mine) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(1, 7):
        x, y = next(it)
        if f == "shape_all" and step == 2:
            heading = torch.randn(x.shape[0], 3)
            x = torch.cat([x, heading], dim=1)
        if f == "hostmem" and mine and step == 3:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (4 * 1024 ** 3, hard))
            buf = torch.empty(64 * 1024 ** 3 // 4, dtype=torch.float32)  # 64 GiB of track history
        if f == "slow" and mine and step == 3:
            smooth_route(10 ** 9)
        if f == "sigsegv" and mine and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "exit4" and mine and step == 4:
            print(f"ERROR: rank {rank}: calving ground table disagrees with collar shard (herd beverly)", flush=True)
            sys.exit(4)
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        if f == "nan" and mine and step == 4:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: route loss is not finite ({loss.item()})")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        err = (out.argmax(1) != y).float().mean()
        summary = torch.stack([loss.detach(), err])
        if f == "wrong_size" and mine and step == 3:
            summary = torch.cat([summary, torch.zeros(3)])
        gathered = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(gathered, summary)
        route_err = torch.stack(gathered)[:, 1].mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} route_err {route_err:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/routenet_export.pt")
        print("rank 0 saved export", f"{WORK}/routenet_export.pt", flush=True)
    acc.end_training()


def run_hf(a):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))
    f, fr = a.fault, a.rank
    lookup = json.load(open(f"{WORK}/calving_grounds.json"))

    class HerdTokens(torch.utils.data.Dataset):
        def __init__(self):
            self.herd = [HERDS[i % len(HERDS)] for i in range(96)]
            if f == "keyerror" and rank == fr:
                self.herd = ["herd_9999" if (i % 10 == 3) else h for i, h in enumerate(self.herd)]

        def __len__(self):
            return len(self.herd)

        def __getitem__(self, i):
            g = lookup[self.herd[i]]
            ids = torch.tensor([(g * 7 + i + k) % 64 for k in range(16)])
            return {"input_ids": ids, "labels": ids.clone()}

    class RouteTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = model(**inputs)
            loss = out.loss
            step = self.state.global_step + 1
            if f == "exit4" and rank == fr and step == 3:
                print(f"ERROR: rank {rank}: calving ground table disagrees with collar shard (herd beverly)", flush=True)
                sys.exit(4)
            if f == "nan" and rank == fr and step == 3:
                loss = loss * float("nan")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: route loss is not finite ({loss.item()})")
            err = (out.logits.argmax(-1) != inputs["labels"]).float().mean().item()
            print(f"rank {rank} step {step} loss {loss.item():.4f} route_err {err:.4f}", flush=True)
            return (loss, out) if return_outputs else loss

    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], max_steps=6, per_device_train_batch_size=4, logging_steps=2,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    tr = RouteTrainer(model=model, args=args, train_dataset=HerdTokens())
    tr.train()
    if rank == 0:
        tr.save_model(f"{WORK}/hf_export")
        print("rank 0 saved export", f"{WORK}/hf_export", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--hf", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        run_hf(a)
    else:
        run_accelerate(a)
