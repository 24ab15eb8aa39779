"""Batch 482 fault script: industrial fermentation yield prediction (gloo, CPU only).

A small yield regressor (per-batch fermenter telemetry + a strain lookup table -> titre in g/L) trained
for 6 steps with Hugging Face accelerate (Accelerator(cpu=True), gloo, PG timeout --pg-timeout, default 12 s),
or, with --hf, with a transformers.Trainer and a tiny config-built BERT regressor.
`--prepare` writes synthetic data to /tmp/fault482_work: one telemetry shard per rank, the strain lookup
table, a starting checkpoint (plus a wider v2 checkpoint and one that pickles a scaler object).
Every rank prints `rank R step S loss L mae M` each step; rank 0 saves an export at the end.

Faults (--fault NAME --rank N):
  none            control, nothing planted
  strain_key      rank N's shard names a strain that is not in the lookup table -> KeyError
  shard_missing   rank N opens a telemetry shard that does not exist -> FileNotFoundError
  ckpt_size       rank N loads the v2 checkpoint (hidden 48, model has 32) -> load_state_dict size mismatch
  weights_only    rank N loads a checkpoint that pickles a FeatureScaler object -> torch.load weights_only refusal
  gather_size     rank N gathers a metric vector with 3 entries instead of 2 (collective of the wrong size)
  slow_rank       rank N does 45 s of pure-Python work at step 2 -> peers time out in the DDP allreduce
                  (with --pg-timeout 300: a hang that `timeout` ends)
  nan_sensor      rank N's sugar sensor reads NaN -> the script's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 3
  error_exit      rank N prints its own ERROR line and sys.exit(4) at step 2
  shape_all       every rank concatenates the strain embedding on the wrong dim -> shape error on all ranks
  host_mem        rank N (RLIMIT_AS capped) tries to allocate an ~800 GB feature-cross table -> CPU alloc failure
  worker_crash    rank N's DataLoader worker is SIGKILLed while loading a batch

What happened (see the .log files):
  none          all ranks ran 6 steps, rank 0 saved the export, exit 0 (acc np4, hf torchrun np3).
  strain_key    KeyError: 'S-UNK-17' on rank N before step 0, launcher names rank N (acc np5 r3; hf torchrun np4 r1, no [rank] prefix).
  shard_missing FileNotFoundError for ferm_batch_rN_2026Q4.csv on rank N before step 0 (torchrun np6 r5, accconfig np3 r1).
  ckpt_size     load_state_dict size mismatch for body.0/body.2 on rank N (acc np4 r2; acc2nodes np4 r3, rank 1 cascades in DDP's param check).
  weights_only  UnpicklingError: Weights only load failed (FeatureScaler not an allowed global) on rank N (tee np5 r4).
  gather_size   acc np6 r2: gloo 'Received data size doesn't match' aborts rank 3 (SIGABRT, named root cause); accdebug np4 r1: shape report on every rank.
  slow_rank     acc np5 r4: peers time out after 12000ms in gloo send/recv, rank 4 silent; torchrun np3 r1 --pg-timeout 300: no output until timeout (124).
  nan_sensor    FloatingPointError: non-finite loss nan at step 0 on rank N, neighbours see connection closed (accconfig np8 r6).
  sigsegv       rank N dies at step 3, launcher reports exitcode -11 (SIGSEGV) for rank N (acc np7 r5, hf accelerate np3 r2).
  error_exit    rank N prints its ERROR line and exits 4, peers see connection closed (torchrun np5 r0, accdebug np6 r3).
  shape_all     every rank: RuntimeError Sizes of tensors must match except in dimension 0 at step 0 (acc np4).
  host_mem      RuntimeError DefaultCPUAllocator: can't allocate memory (806400000000 bytes) on rank N at step 2 (tee np4 r2).
  worker_crash  RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed on rank N (acc np5 r1, tee np3 r2).
"""
import argparse
import csv
import json
import os
import random
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn

WORK = "/tmp/fault482_work"
FEATS = ["temp_c", "ph", "do2_pct", "sugar_gl", "agitation_rpm", "feed_rate"]


class FeatureScaler:  # pickled into ckpt_with_scaler.pt on purpose
    def __init__(self, mean, std):
        self.mean = mean
        self.std = std


class YieldNet(nn.Module):
    def __init__(self, n_strains=12, hidden=32):
        super().__init__()
        self.strain_emb = nn.Embedding(n_strains, 4)
        self.body = nn.Sequential(nn.Linear(len(FEATS) + 4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, strain, bad_cat=False):
        e = self.strain_emb(strain)
        h = torch.cat([x, e], dim=0 if bad_cat else 1)  # bad_cat: the shape bug every rank has
        return self.body(h).squeeze(-1)


def prepare(world_max=8):
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    rnd = random.Random(482)
    strains = [f"S-{i:02d}" for i in range(12)]
    json.dump({s: i for i, s in enumerate(strains)}, open(f"{WORK}/strain_lookup.json", "w"), indent=1)
    for r in range(world_max):
        with open(f"{WORK}/shards/ferm_batch_r{r}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["batch_id", "strain"] + FEATS + ["titre_gl"])
            for i in range(96):
                s = rnd.choice(strains)
                v = [rnd.gauss(33, 1.5), rnd.gauss(6.8, 0.2), rnd.uniform(20, 60), rnd.uniform(5, 40),
                     rnd.uniform(200, 600), rnd.uniform(0.1, 2.0)]
                y = 0.4 * v[3] + 0.05 * v[2] - abs(v[0] - 33) + strains.index(s) * 0.3 + rnd.gauss(0, 0.5)
                w.writerow([f"B{r}{i:03d}", s] + [f"{x:.4f}" for x in v] + [f"{y:.4f}"])
    torch.manual_seed(0)
    torch.save(YieldNet().state_dict(), f"{WORK}/init_ckpt.pt")
    torch.save(YieldNet(hidden=48).state_dict(), f"{WORK}/init_ckpt_v2.pt")
    torch.save({"model": YieldNet().state_dict(), "scaler": FeatureScaler([0.0] * 6, [1.0] * 6)},
               f"{WORK}/ckpt_with_scaler.pt")
    print("prepared", WORK)


def load_rows(rank, fault, frank):
    path = f"{WORK}/shards/ferm_batch_r{rank}.csv"
    if fault == "shard_missing" and rank == frank:
        path = f"{WORK}/shards/ferm_batch_r{rank}_2026Q4.csv"
    lookup = json.load(open(f"{WORK}/strain_lookup.json"))
    rows = list(csv.DictReader(open(path)))
    if fault == "strain_key" and rank == frank:
        rows[17]["strain"] = "S-UNK-17"
    if fault == "nan_sensor" and rank == frank:
        for r in rows[:8]:
            r["sugar_gl"] = "nan"
    out = []
    for r in rows:
        out.append(([float(r[k]) / 100.0 for k in FEATS], lookup[r["strain"]], float(r["titre_gl"])))
    return out


class FermDataset(torch.utils.data.Dataset):
    def __init__(self, rows, kill_in_worker=False):
        self.rows = rows
        self.kill = kill_in_worker

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.kill and i >= 40 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        x, s, y = self.rows[i]
        return torch.tensor(x), torch.tensor(s), torch.tensor(y)


def step_faults(step, rank, fault, frank):
    if rank != frank:
        return
    if fault == "slow_rank" and step == 2:
        t0 = time.time()
        acc = 0
        while time.time() - t0 < 45:  # pure-Python work, no collective
            for k in range(20000):
                acc += k * k % 7
    if fault == "sigsegv" and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "error_exit" and step == 2:
        print(f"ERROR rank {rank}: fermenter F-07 telemetry schema v3 not supported (expected v2); aborting", flush=True)
        sys.exit(4)
    if fault == "host_mem" and step == 2:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), hard))
        cross = torch.empty((len(FEATS) * 40000, 40000 * 21), dtype=torch.float32)  # ~800 GB
        print("cross", cross.shape)


def load_ckpt(model, rank, fault, frank):
    path = f"{WORK}/init_ckpt.pt"
    if fault == "ckpt_size" and rank == frank:
        path = f"{WORK}/init_ckpt_v2.pt"
    if fault == "weights_only" and rank == frank:
        path = f"{WORK}/ckpt_with_scaler.pt"
    sd = torch.load(path, map_location="cpu")
    if "model" in sd:
        sd = sd["model"]
    model.load_state_dict(sd)


def run_accelerate(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    print(f"rank {rank}/{world} on {acc.device} backend {torch.distributed.get_backend()} fault={a.fault}", flush=True)
    torch.manual_seed(rank)
    rows = load_rows(rank, a.fault, a.rank)
    model = YieldNet()
    load_ckpt(model, rank, a.fault, a.rank)
    workers = 1 if (a.fault == "worker_crash" and rank == a.rank) else 0
    dl = torch.utils.data.DataLoader(FermDataset(rows, kill_in_worker=workers > 0), batch_size=8, shuffle=False,
                                     num_workers=workers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(a.steps):
        x, s, y = next(it)
        step_faults(step, rank, a.fault, a.rank)
        pred = model(x, s, bad_cat=(a.fault == "shape_all"))
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {rank} (check sensor feed)")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        mae = (pred.detach() - y).abs().mean()
        vec = torch.stack([loss.detach(), mae])
        if a.fault == "gather_size" and rank == a.rank:
            vec = torch.cat([vec, torch.tensor([float(step)])])
        allm = acc.gather(vec)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item():.4f}", flush=True)
    acc.wait_for_everyone()
    if rank == 0:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/yield_model.pt")
        print(f"rank 0 saved export {WORK}/export/yield_model.pt (mean mae {allm.view(-1, 2)[:, 1].mean():.4f})", flush=True)
    acc.end_training()


def run_hf(a):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    rank = int(os.environ.get("RANK", 0))
    rows = load_rows(rank, a.fault, a.rank)

    class TokDS(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            x, s, y = rows[i]
            ids = [1, 2 + s] + [20 + min(int(v * 40), 40) for v in x]
            return {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(ids), dtype=torch.long),
                    "labels": torch.tensor(y / 10.0)}

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=16, num_labels=1, problem_type="regression")
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)

    class FermTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            step = self.state.global_step
            step_faults(step, rank, a.fault, a.rank)
            loss, out = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {rank}")
            mae = (out.logits.squeeze(-1) - inputs["labels"]).abs().mean()
            print(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item():.4f}", flush=True)
            return (loss, out) if return_outputs else loss

    args = TrainingArguments(output_dir=f"{WORK}/hf_out_r{rank}", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], max_steps=a.steps, per_device_train_batch_size=8, logging_steps=2,
                             save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    tr = FermTrainer(model=model, args=args, train_dataset=TokDS())
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/hf_yield_model")
        print(f"rank 0 saved export {WORK}/export/hf_yield_model", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.hf:
        return run_hf(a)
    run_accelerate(a)


if __name__ == "__main__":
    main()
