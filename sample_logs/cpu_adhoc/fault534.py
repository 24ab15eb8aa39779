"""Tide pool species counts from quadrat photos: a small DDP regression job (batch 534).

Each rank reads its own shard of quadrat "photos" (16 colour-class pixel fractions per
quadrat, plus the species codes a surveyor tagged), maps codes through a species lookup
table, and learns to predict the count of 10 indicator species per quadrat. Gloo backend,
CPU only, 6 steps; every rank prints `rank R step S loss L richness_err M`; rank 0 saves
an export at the end. `--prepare` writes the synthetic data into /tmp/fault534_work.

Modes: default (Accelerate, Accelerator(cpu=True, gloo, timeout=--pg-timeout)) or
`--hf` (a transformers.Trainer with a tiny config-built BERT regression head).

Faults (`--fault NAME --rank N`):
  none          control, nothing planted
  keyerror      rank N meets a species code ("LOTGIG") missing from the lookup table -> KeyError
  missing_shard rank N opens a shard file that was never written -> FileNotFoundError
  ckpt_size     rank N builds the model with a 48-wide hidden layer and loads the 32-wide start checkpoint
  weights_only  rank N resumes from the annotated checkpoint (holds a QuadratMeta object); torch.load refuses it
  wrong_size    rank N all_gathers a 5-element richness vector where peers send 4
  slow          rank N recounts quadrat pixels in pure Python (~40 s) at step 2; peers time out in DDP's allreduce
  hang          like slow but forever; run with --pg-timeout 300 so only `timeout` ends it
  nan           rank N's photo exposure becomes inf at step 3; the script's finiteness check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 3
  error_exit    rank N prints its own ERROR line (negative species count) and sys.exit(4) at step 2
  shape_all     every rank drops the last colour channel at step 2 -> matmul shape RuntimeError
  worker_crash  rank N's DataLoader worker is SIGKILLed while reading quadrat 9

What happened (after the runs; 18 kept logs, tidepool_*):
  none          all ranks print 6 steps, rank 0 saves the export, exit 0 (acc np4; Trainer under torchrun np3)
  keyerror      KeyError: 'LOTGIG' on rank N (acc np5 r3 at step 3; Trainer np4 r1 before any step), peers get gloo "Connection closed by peer", exit 1
  missing_shard FileNotFoundError for shard_5_resurvey.pt on rank 5 before step 0 (accdebug np6), the rest SIGTERMed, exit 1
  ckpt_size     RuntimeError loading state_dict for Net, size mismatch for net.0.weight etc. on rank N (torchrun np4 r2, accconfig np7 r5), exit 1
  weights_only  _pickle.UnpicklingError "Weights only load failed ... __main__.QuadratMeta" on rank 0 (accconfig np3), exit 1
  wrong_size    RuntimeError ProcessGroupGloo::allgather: invalid tensor size on rank N at step 2 (acc np8 r6, tee np3 r0), peers see connection closed, exit 1
  slow          rank 1 silent in pure Python; peers raise gloo "Timed out waiting 12000ms" in DDP backward at step 2 (tee np5), exit 1
  hang          steps 0-1 then silence; `timeout` 60 s SIGTERMs the launcher ("Received 15 death signal"), exit 124 (acc np4 r2)
  nan           FloatingPointError "rank 4 step 3: loss is nan (non-finite)" (accconfig np6), exit 1
  segv          machine 1 summary: rank 4 exitcode -11 (SIGSEGV); machine 0 summary blames rank 2 SIGABRT (terminate called), a follow-on (acc2nodes np6), exit 1
  error_exit    rank N's own ERROR line, then launcher root cause exitcode 4 (Trainer/hfacc np3 r2, accdebug np8 r7), exit 1
  shape_all     every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (8x15 and 16x32) at step 2 (torchrun np4), exit 1
  worker_crash  rank 2: DataLoader worker (pid ...) is killed by signal: Killed / exited unexpectedly, before any step line (acc np5), exit 1
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn

WORK = "/tmp/fault534_work"
SPECIES = ["PISOCH", "MYTCAL", "ANTELE", "TEGFUN", "BALGLA", "CHTDAL", "STRPUR", "NUCEMA", "PAGSAM", "LITSCU"]
NQ = 48  # quadrats per shard


class QuadratMeta:
    def __init__(self, site, tide_ft):
        self.site = site
        self.tide_ft = tide_ft


class Net(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(534)
    with open(f"{WORK}/species_lookup.json", "w") as f:
        json.dump({c: i for i, c in enumerate(SPECIES)}, f)
    for r in range(8):
        pix = torch.rand(NQ, 16, generator=g)
        pix = pix / pix.sum(1, keepdim=True)
        codes = [[SPECIES[int(j)] for j in torch.randint(0, 10, (3,), generator=g)] for _ in range(NQ)]
        counts = (torch.rand(NQ, 10, generator=g) * 20).round()
        torch.save({"pixels": pix, "codes": codes, "counts": counts}, f"{WORK}/shard_{r}.pt")
    torch.manual_seed(0)
    sd = Net().state_dict()
    torch.save(sd, f"{WORK}/start.pt")
    torch.save({"model": sd, "meta": QuadratMeta("Pillar Point", -0.8)}, f"{WORK}/start_annotated.pt")
    print("prepared", WORK)


class QuadratDS(torch.utils.data.Dataset):
    def __init__(self, shard, crash=False):
        self.pix, self.counts = shard["pixels"], shard["counts"]
        self.crash = crash

    def __len__(self):
        return len(self.pix)

    def __getitem__(self, i):
        if self.crash and i == 9:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.pix[i], self.counts[i]


def pure_python_recount(seconds):
    t0 = time.time()
    acc = 0
    while time.time() - t0 < seconds:
        for p in range(20000):
            acc = (acc * 31 + p) % 1000003
    return acc


def main_acc(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = args.fault != "none" and (args.rank == rank)
    torch.manual_seed(rank)
    lookup = json.load(open(f"{WORK}/species_lookup.json"))
    shard_path = f"{WORK}/shard_{rank}.pt"
    if bad and args.fault == "missing_shard":
        shard_path = f"{WORK}/shard_{rank}_resurvey.pt"
    shard = torch.load(shard_path)
    model = Net(hidden=48 if (bad and args.fault == "ckpt_size") else 32)
    if bad and args.fault == "weights_only":
        ck = torch.load(f"{WORK}/start_annotated.pt")
        model.load_state_dict(ck["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    ds = QuadratDS(shard, crash=bad and args.fault == "worker_crash")
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, num_workers=1 if args.fault == "worker_crash" else 0)
    it = iter(dl)
    for step in range(6):
        x, y = next(it)
        codes = shard["codes"][step * 8:(step + 1) * 8]
        if bad and args.fault == "keyerror" and step == 3:
            codes[2] = codes[2] + ["LOTGIG"]
        idx = [[lookup[c] for c in q] for q in codes]
        richness = torch.tensor([float(len(set(q))) for q in idx])
        if bad and args.fault == "slow" and step == 2:
            pure_python_recount(40)
        if bad and args.fault == "hang" and step == 2:
            pure_python_recount(3600)
        if bad and args.fault == "nan" and step == 3:
            x = x * float("inf")
        if bad and args.fault == "error_exit" and step == 2:
            print(f"ERROR rank {rank}: quadrat Q{step*8+5:03d} in shard_{rank}.pt has a negative MYTCAL count (-3); refusing to train on corrupt survey data", flush=True)
            sys.exit(4)
        if args.fault == "shape_all" and step == 2:
            x = x[:, :15]
        if bad and args.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite) for quadrats {step*8}-{step*8+7}")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        rich_err = (out.detach().gt(0.5).sum(1).float() - richness).abs().mean()
        summary = torch.tensor([rich_err.item(), loss.item(), float(rank), 1.0])
        if bad and args.fault == "wrong_size" and step == 2:
            summary = torch.cat([summary, torch.tensor([0.0])])
        gathered = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(gathered, summary)
        m = torch.stack(gathered)[:, 0].mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} richness_err {m:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export_{args.tag}.pt")
        print(f"rank 0 saved export {WORK}/export_{args.tag}.pt", flush=True)


def main_hf(args):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    rank = int(os.environ.get("RANK", "0"))
    bad = args.fault != "none" and args.rank == rank
    lookup = json.load(open(f"{WORK}/species_lookup.json"))
    shard = torch.load(f"{WORK}/shard_0.pt")

    class HFDS(torch.utils.data.Dataset):
        def __len__(self):
            return NQ

        def __getitem__(self, i):
            codes = list(shard["codes"][i])
            if bad and args.fault == "keyerror" and i >= 24:
                codes.append("LOTGIG")
            ids = torch.tensor([lookup[c] + 2 for c in codes] + (shard["pixels"][i] * 40).long().clamp(0, 40).add(12).tolist()[:13])
            return {"input_ids": ids, "labels": shard["counts"][i]}

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=32, num_labels=10, problem_type="regression")
    model = BertForSequenceClassification(cfg)

    class T(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step
            if bad and args.fault == "error_exit" and step == 2:
                print(f"ERROR rank {rank}: quadrat batch at step {step} has a negative MYTCAL count (-3); refusing to train on corrupt survey data", flush=True)
                sys.exit(4)
            if bad and args.fault == "segv" and step == 3:
                os.kill(os.getpid(), signal.SIGSEGV)
            loss, out = super().compute_loss(model, inputs, return_outputs=True, **kw)
            err = (out.logits.detach().round() - inputs["labels"]).abs().mean().item()
            print(f"rank {rank} step {step} loss {loss.item():.4f} richness_err {err:.4f}", flush=True)
            return (loss, out) if return_outputs else loss

    targs = TrainingArguments(output_dir=f"{WORK}/hf_{args.tag}", use_cpu=True, ddp_backend="gloo", ddp_timeout=args.pg_timeout,
                              report_to=[], max_steps=6, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                              dataloader_num_workers=0, disable_tqdm=True)
    tr = T(model=model, args=targs, train_dataset=HFDS())
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/hf_{args.tag}/export")
        print(f"rank 0 saved export {WORK}/hf_{args.tag}/export", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--tag", default="run")
    a = ap.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_acc(a)
