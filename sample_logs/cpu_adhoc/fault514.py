"""Kitesurf wind gust forecasting: a small DDP regression job (gloo, CPU only) with one planted fault.

Each rank reads its own shard of synthetic station readings (wind speed, direction, pressure, ...),
looks up the spot's elevation/exposure in a shared lookup table, and trains a small MLP (GustNet)
that forecasts the next 10-minute peak gust, starting from a checkpoint. Every rank prints
`rank R step S loss L gust_mae M` each step; rank 0 writes an export at the end.

    python fault514.py --prepare                      # writes /tmp/fault514_work
    accelerate launch --multi_gpu --num_processes W fault514.py --fault NAME --rank N
    torchrun --nproc-per-node W fault514.py --fault NAME --rank N
    torchrun --nproc-per-node W fault514.py --hf --fault NAME --rank N   # transformers.Trainer form

Faults (--fault NAME, planted on --rank N):
  none          control, nothing planted
  keyerror      rank N's shard holds a spot id the lookup table lacks -> KeyError at step 3
  missingshard  rank N looks for a shard file that was never written -> FileNotFoundError at start
  ckptsize      rank N builds GustNet with a wider hidden layer, then loads the start checkpoint
                -> RuntimeError size mismatch in load_state_dict (before DDP is set up)
  badsize       rank N all_gathers a per-spot metric vector one element longer than its peers
                at step 3 -> gloo invalid tensor size on rank N
  slow          rank N does 45 s of pure-Python "gust climatology" work before step 3; its peers
                time out in the metric all_reduce (PG timeout 12 s)
  hang          rank N loops forever in pure Python at step 3 (run with --pg-timeout 300);
                only the outer `timeout` ends the job
  nan           rank N's anemometer reading becomes NaN at step 3; the script's own finiteness
                check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line (sensor table empty) and calls sys.exit(4) at step 2
  shapeall      every rank appends a lagged-gust feature at step 2 that the model does not expect
                -> RuntimeError mat1 and mat2 shapes cannot be multiplied, on every rank
  workercrash   rank N's DataLoader worker is SIGKILLed while loading a batch at step 3

What happened (20 runs, world sizes 3-8; see readme):
  none          every rank ran 6 steps, rank 0 saved the export, exit 0 (acc np4, Trainer under torchrun np3).
  keyerror      KeyError 'tarifa_east' on the planted rank (step 3; first batch under Trainer's sampler);
                peers failed with gloo 'Connection closed by peer'; exit 1.
  missingshard  FileNotFoundError for the w49 shard on the planted rank before DDP set-up; the rest stopped; exit 1.
  ckptsize      RuntimeError size mismatch for net.0.weight/net.0.bias/net.2.weight on the planted rank; exit 1.
  badsize       planted rank: 'ProcessGroupGloo::allgather: invalid tensor size'; peers: connection closed; exit 1.
  slow          peers raised gloo 'Timed out waiting 12000ms' in backward; the planted rank only got SIGTERM; exit 1.
  hang          no error line; output stopped after step 2, `timeout` TERM then KILL ended it: exit 137.
  nan           FloatingPointError from the script's own check on the planted rank at step 3; exit 1.
  segv          the planted rank died silently (exitcode -11 SIGSEGV); peers: connection reset; exit 1.
  exit4         the planted rank's ERROR line, then exitcode 4 in the launcher's summary; exit 1.
  shapeall      every rank raised the same mat1/mat2 RuntimeError (4x9 and 8x32) at step 2; exit 1.
  workercrash   'DataLoader worker (pid N) is killed by signal: Killed.' on the planted rank in step 1; exit 1.
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
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault514_work"
FEATS = 8
HIDDEN = 32
SPOTS = ["tarifa_west", "leucate", "cabarete", "dakhla", "le_morne", "hood_river", "cumbuco", "jeri"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--steps", type=int, default=6)
    return p.parse_known_args()[0]


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(514)
    for r in range(8):
        x = torch.randn(64, FEATS, generator=g)
        y = (x[:, 0] * 1.7 + x[:, 3].abs() * 0.6 + 0.1 * torch.randn(64, generator=g)).unsqueeze(1)
        spots = [SPOTS[(r + i) % len(SPOTS)] for i in range(64)]
        torch.save({"x": x, "y": y, "spots": spots}, f"{WORK}/shards/gusts_rank{r}_2026w48.pt")
    table = {s: {"elevation_m": 3 + i, "exposure": 0.5 + 0.05 * i} for i, s in enumerate(SPOTS)}
    with open(f"{WORK}/spot_lookup.json", "w") as f:
        json.dump(table, f)
    torch.manual_seed(514)
    torch.save(GustNet().state_dict(), f"{WORK}/gustnet_start.pt")
    print(f"prepared {WORK}: 8 shards, spot_lookup.json, gustnet_start.pt")


class GustNet(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATS, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


class GustShard(Dataset):
    def __init__(self, rank, args, lookup):
        name = f"gusts_rank{rank}_2026w48.pt"
        if args.fault == "missingshard" and rank == args.rank:
            name = f"gusts_rank{rank}_2026w49.pt"  # the week's shard that was never exported
        self.d = torch.load(f"{WORK}/shards/{name}")
        self.lookup = lookup
        self.rank = rank
        self.args = args
        if args.fault == "keyerror" and rank == args.rank:
            self.d["spots"] = ["tarifa_east"] * len(self.d["spots"])

    def __len__(self):
        return len(self.d["y"])

    def __getitem__(self, i):
        a = self.args
        if a.fault == "workercrash" and self.rank == a.rank and i >= 8 and torch.utils.data.get_worker_info():
            os.kill(os.getpid(), signal.SIGKILL)
        x = self.d["x"][i].clone()
        if a.fault == "keyerror" and self.rank == a.rank and i < 8:
            spot = SPOTS[0]
        else:
            spot = self.d["spots"][i]
        x[FEATS - 1] = self.lookup[spot]["exposure"]
        return x, self.d["y"][i]


def plant(args, rank, step, x):
    f = args.fault
    if f == "shapeall" and step == 2:
        x = torch.cat([x, x[:, :1]], dim=1)
    if rank != args.rank:
        return x
    if f == "segv" and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if f == "exit4" and step == 2:
        print(f"ERROR: rank {rank}: gust sensor table for spot {SPOTS[rank % 8]} has 0 rows after QC; aborting", flush=True)
        sys.exit(4)
    if f == "slow" and step == 3:
        t0, n = time.time(), 0
        while time.time() - t0 < 45:  # recomputing the gust climatology in pure Python
            n += sum(i * i for i in range(2000)) % 7
    if f == "hang" and step == 3:
        n = 0
        while True:  # a climatology loop that never converges
            n = (n * 31 + 7) % 1000003
    if f == "nan" and step == 3:
        x = x.clone()
        x[0, 0] = float("nan")
    return x


def check_finite(loss, rank, step):
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: gust loss is not finite ({loss.item()}); anemometer feed corrupt?")


def main_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    with open(f"{WORK}/spot_lookup.json") as f:
        lookup = json.load(f)
    ds = GustShard(rank, args, lookup)
    workers = 1 if args.fault == "workercrash" and rank == args.rank else 0
    dl = DataLoader(ds, batch_size=4, shuffle=False, num_workers=workers)
    hidden = 48 if args.fault == "ckptsize" and rank == args.rank else HIDDEN
    model = GustNet(hidden)
    model.load_state_dict(torch.load(f"{WORK}/gustnet_start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(1, args.steps + 1):
        x, y = next(it)
        x = plant(args, rank, step, x)
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        check_finite(loss, rank, step)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        mae = (out.detach() - y).abs().mean().reshape(1)
        if args.fault == "badsize" and step == 3:
            per_spot = torch.zeros(4 + (1 if rank == args.rank else 0))
            bufs = [torch.zeros(4) for _ in range(world)]
            dist.all_gather(bufs, per_spot)
        dist.all_reduce(mae)
        print(f"rank {rank} step {step} loss {loss.item():.4f} gust_mae {mae.item() / world:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/gustnet_export.pt")
        print(f"rank 0 saved export {WORK}/gustnet_export.pt", flush=True)


def main_hf(args):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    rank = int(os.environ.get("RANK", "0"))
    with open(f"{WORK}/spot_lookup.json") as f:
        lookup = json.load(f)

    class TokShard(Dataset):
        def __init__(self):
            self.base = GustShard(rank, args, lookup)

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            x, y = self.base[i]
            ids = ((x.clamp(-3, 3) + 3) * 10).long()
            return {"input_ids": ids, "labels": y}

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=1)
    torch.manual_seed(514)
    model = BertForSequenceClassification(cfg)

    class GustTrainer(Trainer):
        step = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.step += 1
            inputs["input_ids"] = plant(args, rank, self.step, inputs["input_ids"].float()).long()
            loss, out = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
            check_finite(loss, rank, self.step)
            mae = (out.logits.detach() - inputs["labels"]).abs().mean()
            print(f"rank {rank} step {self.step} loss {loss.item():.4f} gust_mae {mae.item():.4f}", flush=True)
            return (loss, out) if return_outputs else loss

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=args.pg_timeout,
                              report_to=[], max_steps=args.steps, per_device_train_batch_size=4, save_strategy="no",
                              logging_steps=3, dataloader_num_workers=0, disable_tqdm=True)
    tr = GustTrainer(model=model, args=targs, train_dataset=TokShard())
    tr.train()
    tr.save_model(f"{WORK}/gustnet_hf_export")
    if tr.is_world_process_zero():
        print(f"rank 0 saved export {WORK}/gustnet_hf_export", flush=True)


if __name__ == "__main__":
    a = parse()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)
