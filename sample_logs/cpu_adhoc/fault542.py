"""Batch 542 fault script: puffin burrow occupancy.

A small distributed training job: each rank reads its own shard of burrow survey
records (colony code, burrow depth, entrance width, vegetation cover, soil
moisture, occupied yes/no), maps colony codes through a lookup table to colony
indices, starts from a checkpoint and trains an occupancy classifier for 6 steps
on CPU with gloo. Every rank prints `rank R step S loss L occ_acc M` each step;
rank 0 saves an export at the end.

Modes: default (accelerate Accelerator(cpu=True), works under accelerate launch
and torchrun) and `--mode hf` (a transformers.Trainer run with a tiny
config-built BERT classifier over binned survey tokens; there only the
data faults, nan_check, sigsegv and error_exit act).

`python fault542.py --prepare` writes the synthetic data into /tmp/fault542_work.

Faults (`--fault NAME --rank N`):
  none          control, nothing planted
  colony_key    rank N's shard holds a colony code the lookup table lacks -> KeyError
  shard_missing rank N opens the 2025 survey shard, which was never written -> FileNotFoundError
  ckpt_size     rank N starts from the wide checkpoint (48 colonies, model has 32) -> size mismatch
  weights_only  rank N loads a checkpoint that pickles a SurveyMeta object -> torch.load weights_only refusal
  gather_size   rank N all_gathers a 3-value occupancy tally where the others send 2 -> collective size mismatch
  slow_rank     rank N recounts burrows in pure Python before step 3's metric all_gather;
                the peers time out after --pg-timeout s (with --pg-timeout 300: a hang that `timeout` ends)
  nan_check     rank N gets an inf soil-moisture reading at step 2; the script's own check raises FloatingPointError
                (in --mode hf the loss is scaled by inf at step 2 instead)
  sigsegv       rank N sends itself SIGSEGV at step 3
  error_exit    rank N prints its own ERROR line (transect count mismatch) and sys.exit(4) at step 2
  shape_all     every rank builds step 2's batch with 6 features instead of 5 -> matmul shape error on all ranks
  worker_crash  rank N's DataLoader worker (num_workers=1) SIGKILLs itself on its 20th record
  host_oom      rank N caps its address space and allocates a 6 GiB occupancy grid -> can't allocate memory

What happened (batch 542 runs, see the README section):
  none          4 ranks (acc) ran steps 1-6, rank 0 saved the export, exit 0.
  colony_key    KeyError: 'SKOMER-X9' in the colony lookup on rank N while fetching its second batch (acc --debug np6 r4; Trainer np3 r1); peers got gloo 'Connection closed by peer'.
  shard_missing FileNotFoundError for shard_rN_2025.json on rank N before step 1 (tee np5 r3; accconfig np3 r0); the launcher SIGTERMed the rest.
  ckpt_size     RuntimeError: Error(s) in loading state_dict ... size mismatch for colony_emb.weight ([48, 4] vs [32, 4]) on rank N before step 1.
  weights_only  _pickle.UnpicklingError: Weights only load failed ... Unsupported global: GLOBAL __main__.SurveyMeta on rank N.
  gather_size   rank N raised 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3), got (2))' at step 1; peers lost the connection.
  slow_rank     pg-timeout 12: peers raised gloo 'Timed out waiting 12000ms' in step 3 and torchrun blamed rank 0; pg-timeout 300: no error, output stopped after step 2 until `timeout` ended it (137).
  nan_check     FloatingPointError: non-finite loss at step 2 on rank N (nan in the acc run; inf in the Trainer run, where the planted fault scales the loss by inf).
  sigsegv       rank N died of SIGSEGV at step 3 (exitcode -11, Signal 11); peers got 'Connection reset by peer'.
  error_exit    rank N printed 'ERROR rank N: transect count mismatch ...' and exited 4; torchrun reported exitcode 4, the launcher exited 1.
  shape_all     RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x10 and 9x16) on every rank at step 2.
  worker_crash  RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed. on rank N before any step printed.
  host_oom      RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 6442450944 bytes on rank N at step 2.
"""
import argparse
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
import torch.distributed as dist

WORK = "/tmp/fault542_work"
N_COLONIES = 32
N_FEAT = 5
STEPS = 6
BATCH = 8


class SurveyMeta:
    def __init__(self, season, observer):
        self.season = season
        self.observer = observer


class OccupancyNet(nn.Module):
    def __init__(self, n_colonies=N_COLONIES):
        super().__init__()
        self.colony_emb = nn.Embedding(n_colonies, 4)
        self.mlp = nn.Sequential(nn.Linear(N_FEAT + 4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, colony, feat):
        return self.mlp(torch.cat([feat, self.colony_emb(colony)], dim=1))


def colony_codes():
    return [f"{site}-{i:02d}" for site in ("SKOMER", "LUNDY", "FARNE", "MAY") for i in range(8)]


def prepare(max_ranks=8):
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(542)
    codes = colony_codes()
    with open(f"{WORK}/colony_lookup.json", "w") as f:
        json.dump({c: i for i, c in enumerate(codes)}, f)
    for r in range(max_ranks):
        recs = []
        for _ in range(64):
            depth, width, veg, moist = rng.uniform(20, 120), rng.uniform(8, 18), rng.random(), rng.random()
            occ = int(depth > 60 and veg > 0.3)
            recs.append({"colony": rng.choice(codes), "feat": [depth / 100, width / 20, veg, moist, 1.0], "occ": occ})
        with open(f"{WORK}/shard_r{r}_2024.json", "w") as f:
            json.dump(recs, f)
        bad = [dict(x) for x in recs]
        bad[13]["colony"] = "SKOMER-X9"
        with open(f"{WORK}/shard_r{r}_2024_unverified.json", "w") as f:
            json.dump(bad, f)
    torch.manual_seed(542)
    torch.save(OccupancyNet().state_dict(), f"{WORK}/start_ckpt.pt")
    torch.save(OccupancyNet(48).state_dict(), f"{WORK}/start_ckpt_wide.pt")
    torch.save({"model": OccupancyNet().state_dict(), "meta": SurveyMeta("2024", "rangers")}, f"{WORK}/start_ckpt_meta.pt")
    print(f"prepared {WORK}")


class BurrowDataset(torch.utils.data.Dataset):
    def __init__(self, rank, fault, fault_rank):
        self.rank, self.fault, self.fault_rank = rank, fault, fault_rank
        mine = fault_rank == rank
        name = f"shard_r{rank}_2024.json"
        if fault == "colony_key" and mine:
            name = f"shard_r{rank}_2024_unverified.json"
        if fault == "shard_missing" and mine:
            name = f"shard_r{rank}_2025.json"
        with open(os.path.join(WORK, name)) as f:
            self.recs = json.load(f)
        with open(os.path.join(WORK, "colony_lookup.json")) as f:
            self.lookup = json.load(f)

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        rec = self.recs[i]
        if self.fault == "worker_crash" and self.fault_rank == self.rank and i == 19:
            os.kill(os.getpid(), signal.SIGKILL)
        colony = self.lookup[rec["colony"]]
        return torch.tensor(colony), torch.tensor(rec["feat"]), torch.tensor(rec["occ"])


def load_start(model, rank, fault, fault_rank):
    mine = fault_rank == rank
    if fault == "ckpt_size" and mine:
        sd = torch.load(f"{WORK}/start_ckpt_wide.pt")
    elif fault == "weights_only" and mine:
        sd = torch.load(f"{WORK}/start_ckpt_meta.pt")["model"]
    else:
        sd = torch.load(f"{WORK}/start_ckpt.pt")
    model.load_state_dict(sd)


def pure_python_recount(seconds):
    end = time.time() + seconds
    n = 0
    while time.time() < end:
        for k in range(20000):
            n += k % 7
    return n


def step_faults(args, rank, step, feat):
    mine = args.rank == rank
    if args.fault == "nan_check" and mine and step == 2:
        feat = feat.clone()
        feat[0, 3] = float("inf")
    if args.fault == "shape_all" and step == 2:
        feat = torch.cat([feat, feat[:, :1]], dim=1)
    if args.fault == "sigsegv" and mine and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "error_exit" and mine and step == 2:
        print(f"ERROR rank {rank}: transect count mismatch in burrow survey (expected 64 burrows, tallied 61); aborting", flush=True)
        sys.exit(4)
    if args.fault == "host_oom" and mine and step == 2:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, hard))
        grid = torch.zeros(6 * 2**30 // 4, dtype=torch.float32)  # 6 GiB occupancy grid
        feat = feat + grid[: feat.numel()].view_as(feat)
    return feat


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(rank)
    ds = BurrowDataset(rank, args.fault, args.rank)
    workers = 1 if (args.fault == "worker_crash" and args.rank == rank) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=workers)
    model = OccupancyNet()
    load_start(model, rank, args.fault, args.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    lossf = nn.CrossEntropyLoss()
    it = iter(dl)
    for step in range(1, STEPS + 1):
        colony, feat, occ = next(it)
        feat = step_faults(args, rank, step, feat)
        logits = model(colony, feat)
        loss = lossf(logits, occ)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (burrow features not finite)")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        tally = torch.tensor([(logits.argmax(1) == occ).sum().item(), occ.numel()], dtype=torch.float32)
        if args.fault == "gather_size" and args.rank == rank:
            tally = torch.cat([tally, torch.tensor([float(occ.sum())])])
        if args.fault == "slow_rank" and args.rank == rank and step == 3:
            pure_python_recount(1000 if args.pg_timeout > 60 else 45)
        gathered = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(gathered, tally)
        g = torch.stack(gathered).sum(0)
        dist.all_reduce(g)
        occ_acc = (g[0] / g[1]).item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} occ_acc {occ_acc:.3f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/occupancy_export.pt")
        print(f"rank 0 saved export {WORK}/occupancy_export.pt", flush=True)
    acc.end_training()


def run_hf(args):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, TrainerCallback

    rank = int(os.environ.get("RANK", "0"))

    class TokenDataset(torch.utils.data.Dataset):
        def __init__(self):
            self.base = BurrowDataset(rank, args.fault, args.rank)

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            colony, feat, occ = self.base[i]
            bins = (feat[:4].clamp(0, 1.19) * 5).long() + 2 + 6 * torch.arange(4)
            ids = torch.cat([torch.tensor([1, 30 + int(colony)]), bins])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": occ}

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(542)
    model = BertForSequenceClassification(cfg)

    class PuffinTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step + 1
            if args.fault == "nan_check" and args.rank == rank and step == 2:
                inputs["input_ids"] = inputs["input_ids"].clone()
            loss, out = super().compute_loss(model, inputs, return_outputs=True, **kw)
            if args.fault == "nan_check" and args.rank == rank and step == 2:
                loss = loss * float("inf")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (burrow features not finite)")
            acc = (out.logits.argmax(-1) == inputs["labels"]).float().mean().item()
            print(f"rank {rank} step {step} loss {loss.item():.4f} occ_acc {acc:.3f}", flush=True)
            return (loss, out) if return_outputs else loss

    class FaultCallback(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            step = state.global_step + 1
            if args.fault in ("sigsegv", "error_exit"):
                step_faults(args, rank, step, torch.zeros(1, N_FEAT))

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=args.pg_timeout,
                              report_to=[], max_steps=STEPS, per_device_train_batch_size=BATCH, logging_steps=1,
                              save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-3)
    tr = PuffinTrainer(model=model, args=targs, train_dataset=TokenDataset(), callbacks=[FaultCallback()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/hf_export")
        print(f"rank 0 saved export {WORK}/hf_export", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="acc", choices=["acc", "hf"])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.mode == "hf":
        run_hf(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()
