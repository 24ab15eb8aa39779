"""Batch 590: muskrat push-ups -- a small distributed regression job that predicts how many
push-ups (winter feeding shelters) muskrats build on a marsh transect from ice and vegetation
features. CPU only, gloo backend, run under accelerate launch / torchrun (Accelerator(cpu=True)),
or with --hf as a transformers.Trainer job with a tiny config-built BERT regressor.

`--prepare` writes synthetic data into /tmp/fault590_work: one transect shard per rank, a
lookup table (transect id -> marsh index), a starting checkpoint and a lodge-survey file.

Faults (`--fault NAME --rank N`, one per run):
  none          control, nothing planted
  keyerror      rank N's shard holds a transect id the lookup table does not know -> KeyError
  missingshard  rank N opens a winter shard file that was never written -> FileNotFoundError
  ckptsize      rank N builds the model 24 wide and loads the 16-wide start checkpoint -> size mismatch
  weightsonly   rank N torch.load()s the lodge survey (a pickled class) with weights_only -> UnpicklingError
  wrongsize     rank N all_gathers 3 push-up counts instead of 2 at step 3 (gloo size error on N, peers wait)
  slowrank      rank N counts push-ups in pure Python at step 3 for ~45 s; peers time out (12 s PG timeout);
                with --pg-timeout 300 and --forever the loop never ends and `timeout` stops the run
  nan           rank N's ice thickness becomes inf at step 4; the script's own check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 3
  errexit       rank N prints its own ERROR line (empty survey) and sys.exit(4) at step 2
  shapeall      every rank drops one feature column at step 2 -> matmul shape error on all ranks
  hostmem       rank N caps its address space and allocates a 2 GiB tensor at step 2 -> can't allocate memory
  workercrash   rank N's DataLoader worker segfaults while loading a batch -> DataLoader worker exited unexpectedly

What happened (filled in after the runs):
  none          np3 acc and np4 hf (torchrun): all 6 steps on every rank, rank 0 wrote the export; exit 0.
  keyerror      np4 r2 acc: KeyError 'MR-0999' on rank 2 loading its step-3 batch, peers 'Connection closed by peer'; np6 r5 hfacc: KeyError in the Trainer's dataloader on rank 5.
  missingshard  np5 r3 torchrun: FileNotFoundError on rank 3 before training; torchrun stopped the rest.
  ckptsize      np3 r1 accdebug: RuntimeError size mismatch for 0.weight on rank 1 before DDP.
  weightsonly   np4 r3 tee: _pickle.UnpicklingError (Weights only load failed, LodgeSurvey not allowed) on rank 3, [default3]: prefixes.
  wrongsize     np5 r2 acc / np3 r1 accconfig: 'ProcessGroupGloo::allgather: invalid tensor size' on rank N at step 3; peers 'Connection closed'.
  slowrank      np6 r4 acc: the 5 peers hit gloo's 12000ms timeout in backward while rank 4 spun (one aborted); np4 r1 torchrun (pg 300): hung, `timeout` 124.
  nan           np8 r6 accconfig: FloatingPointError non-finite loss on rank 6 at step 4.
  segv          np5 r4 torchrun / np4 r0 acc2nodes: rank N died with SIGSEGV (exitcode -11) at step 3; peers 'Connection closed/reset'.
  errexit       np7 r3 acc / np4 r2 acc2nodes: ERROR line then exit code 4 on rank N.
  shapeall      np4 tee: every rank raised the same mat1/mat2 shape RuntimeError at step 2.
  hostmem       np3 r2 accdebug: DefaultCPUAllocator can't allocate memory on rank 2 at step 2.
  workercrash   np5 r1 acc: 'DataLoader worker (pid N) is killed by signal: Segmentation fault.' on rank 1 at step 3.
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

WORK = "/tmp/fault590_work"
FEATS = 8
ROWS = 96


class LodgeSurvey:
    """A pickled survey record (not a plain tensor dict)."""

    def __init__(self, marsh, lodges):
        self.marsh = marsh
        self.lodges = lodges


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(590)
    table = {}
    for r in range(8):
        x = torch.randn(ROWS, FEATS, generator=g)
        ids = [f"MR-{r * ROWS + i:04d}" for i in range(ROWS)]
        for i in ids:
            table[i] = len(table) % 12
        y = (x[:, :3].sum(1, keepdim=True) * 2 + 10).clamp(min=0)
        torch.save({"x": x, "y": y, "ids": ids}, f"{WORK}/shards/transects_r{r}.pt")
    with open(f"{WORK}/marsh_lookup.json", "w") as f:
        json.dump(table, f)
    torch.manual_seed(0)
    torch.save(make_model(16).state_dict(), f"{WORK}/pushup_init.pt")
    torch.save({"survey": LodgeSurvey("Delta-7", 41)}, f"{WORK}/lodge_survey.pt")
    print("prepared", WORK)


def make_model(width):
    return nn.Sequential(nn.Linear(FEATS + 1, width), nn.ReLU(), nn.Linear(width, 1))


class Transects(torch.utils.data.Dataset):
    def __init__(self, shard, table, crash_in_worker=False):
        self.x, self.y, self.ids = shard["x"], shard["y"], shard["ids"]
        self.table = table
        self.crash = crash_in_worker

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.crash and i >= 40:
            winfo = torch.utils.data.get_worker_info()
            if winfo is not None:
                os.kill(os.getpid(), signal.SIGSEGV)
        marsh = self.table[self.ids[i]]
        return torch.cat([self.x[i], torch.tensor([marsh / 12.0])]), self.y[i]


def main_accel(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    me = a.fault != "none" and (a.rank == rank)
    print(f"rank {rank}/{world} ready on {acc.device} (muskrat push-up survey)", flush=True)

    shard_path = f"{WORK}/shards/transects_r{rank}.pt"
    if a.fault == "missingshard" and me:
        shard_path = f"{WORK}/shards/transects_winter_r{rank}.pt"
    shard = torch.load(shard_path)
    with open(f"{WORK}/marsh_lookup.json") as f:
        table = json.load(f)
    if a.fault == "keyerror" and me:
        shard["ids"][37] = "MR-0999"
        table.pop("MR-0999", None)
    if a.fault == "weightsonly" and me:
        survey = torch.load(f"{WORK}/lodge_survey.pt")
        print("survey", survey, flush=True)

    width = 24 if (a.fault == "ckptsize" and me) else 16
    model = make_model(width)
    model.load_state_dict(torch.load(f"{WORK}/pushup_init.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = Transects(shard, table, crash_in_worker=(a.fault == "workercrash" and me))
    nw = 1 if (a.fault == "workercrash" and me) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=nw)
    model, opt = acc.prepare(model, opt)

    step = 0
    it = iter(dl)
    while step < 6:
        step += 1
        x, y = next(it)
        if a.fault == "errexit" and me and step == 2:
            print(f"ERROR: rank {rank}: ice survey for marsh Delta-{rank} has 0 push-ups recorded; refusing to train on an empty survey", flush=True)
            sys.exit(4)
        if a.fault == "shapeall" and step == 2:
            x = x[:, 1:]
        if a.fault == "nan" and me and step == 4:
            x[:, 0] = float("inf")
        if a.fault == "hostmem" and me and step == 2:
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
            elev = torch.ones(2**29, dtype=torch.float32)  # 2 GiB elevation grid
            x = x + elev[0]
        if a.fault == "segv" and me and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "slowrank" and me and step == 3:
            t0, n = time.time(), 0
            while a.forever or time.time() - t0 < 45:
                n = (n * 31 + 7) % 1000003  # counting push-ups one by one
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (ice thickness feature)")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        mae = (pred - y).abs().mean().detach()
        dist.all_reduce(mae)
        if step == 3:
            cnt = torch.tensor([float(len(y)), float(y.sum())])
            if a.fault == "wrongsize" and me:
                cnt = torch.tensor([float(len(y)), float(y.sum()), 1.0])
            out = [torch.zeros(2) for _ in range(world)]
            dist.all_gather(out, cnt)
        print(f"rank {rank} step {step} loss {loss.item():.4f} pushups_mae {mae.item() / world:.4f}", flush=True)
    acc.wait_for_everyone()
    if rank == 0:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/pushup_export_w{world}.pt")
        print(f"rank 0 saved export {WORK}/pushup_export_w{world}.pt", flush=True)
    acc.end_training()


def main_hf(a):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, TrainerCallback

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    with open(f"{WORK}/marsh_lookup.json") as f:
        table = json.load(f)
    shard = torch.load(f"{WORK}/shards/transects_r{rank}.pt")
    me = a.fault != "none" and a.rank == rank
    if a.fault == "keyerror" and me:
        for j in range(0, ROWS, 3):
            shard["ids"][j] = "MR-0999"
        table.pop("MR-0999", None)

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return ROWS

        def __getitem__(self, i):
            marsh = table[shard["ids"][i]]
            toks = (shard["x"][i] * 4 + 32).clamp(1, 63).long().tolist()
            return {"input_ids": torch.tensor([2, marsh + 3] + toks), "labels": shard["y"][i].float()}

    class Steps(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} pushups_mae {logs.get('grad_norm', 0.0):.4f}", flush=True)

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=1, problem_type="regression")
    model = BertForSequenceClassification(cfg)
    args = TrainingArguments(output_dir=f"{WORK}/hf_out_w{world}", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    tr = Trainer(model=model, args=args, train_dataset=DS(), callbacks=[Steps()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/hf_export_w{world}")
        print(f"rank 0 saved export {WORK}/hf_export_w{world}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--forever", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accel(a)
