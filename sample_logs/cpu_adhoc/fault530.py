"""Roman mosaic tile colour classification: a small distributed training job with ONE planted fault.

Each rank reads its own shard of tesserae (12 colour features per tile: RGB means, HSV means, a
6-bin hue histogram) and a lookup table mapping pigment names to classes (terracotta, ochre,
lapis, marble_white, basalt_black, verde_antico, porphyry, giallo). It starts from a checkpoint,
trains 6 steps with gloo (CPU only), prints `rank R step S loss L acc A` each step and rank 0
writes an export at the end.

Usage:
  python fault530.py --prepare                      # synthetic data into /tmp/fault530_work
  accelerate launch ... fault530.py --fault NAME --rank N [--pg-timeout 12]
  torchrun ... fault530.py --fault NAME --rank N
  torchrun ... fault530.py --hf --fault NAME --rank N   # transformers.Trainer variant

Faults (--fault NAME, planted on --rank N unless noted):
  none          control, nothing planted
  keyerror      rank N's shard holds a pigment name ("verdigris") the lookup table lacks -> KeyError
  missing_shard rank N reads its shard from a re-tiled folder that was never written -> FileNotFoundError
  ckpt_size     rank N resumes from the 10-class checkpoint of an older run -> size mismatch in load_state_dict
  weights_only  rank N loads a checkpoint that pickles a TileMeta object -> torch.load weights_only refusal
  wrong_size    rank N all_gathers a per-class count tensor with one extra class -> gloo size error
  slow          rank N re-sorts its tesserae in pure Python for a long time at step 3 -> peers time out
                (with --pg-timeout 300 the same fault is a hang that `timeout` ends)
  nan           rank N's features turn to NaN at step 3; the script's own check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line (palette checksum) and calls sys.exit(4)
  shape_all     every rank: the colour head is built for 12 features but the batch is reshaped to 4x3 -> shape error
  worker_crash  rank N's DataLoader worker dies (SIGKILL to itself) at step 2
  host_oom      rank N caps its address space at 1 GiB above its current size and builds an 8 GiB colour-distance matrix

What happened (see the runs' .expect.toml files):
  none          all 3 ranks printed steps 1-6, rank 0 saved the export; exit 0.
  keyerror      KeyError 'verdigris' in the dataset on rank N (also under transformers.Trainer); peers saw gloo
                'Connection closed by peer'; the launcher named rank N; exit 1.
  missing_shard FileNotFoundError (shards_retiled/tesserae_rankN.pt) on rank N before step 1; others SIGTERMed; exit 1.
  ckpt_size     RuntimeError size mismatch for head.weight/head.bias on rank N before step 1; exit 1.
  weights_only  _pickle.UnpicklingError (Weights only load failed, Unsupported global __main__.TileMeta) on rank N; exit 1.
  wrong_size    rank N raised ProcessGroupGloo::allgather: invalid tensor size at step 3; peers saw the connection close; exit 1.
  slow          peers raised gloo 'Timed out waiting 12000ms' after step 2; one peer then aborted (SIGABRT) and the
                summary named it; exit 1. Under transformers.Trainer the peers waited out the 40 s and the run finished (dropped).
  slow (hang)   --pg-timeout 300: output stopped after step 2, `timeout` sent SIGTERM at 60 s; exit 124.
  nan           the script's own FloatingPointError (loss is nan) on rank N at step 3; exit 1.
  sigsegv       rank N vanished at step 2 (exitcode -11 in the summary); peers saw 'Connection reset by peer'; exit 1.
  error_exit    rank N printed its ERROR line and exited 4 at step 4; the summary shows exitcode 4; exit 1.
  shape_all     every rank raised RuntimeError mat1 and mat2 shapes cannot be multiplied (8x8 and 12x32); exit 1.
  worker_crash  rank N: DataLoader worker (pid ...) is killed by signal: Killed, then 'exited unexpectedly'; exit 1.
  host_oom      rank N: DefaultCPUAllocator: can't allocate memory (8589934592 bytes) at step 3; exit 1.
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
import torch.nn.functional as F
import torch.distributed as dist

WORK = "/tmp/fault530_work"
PIGMENTS = ["terracotta", "ochre", "lapis", "marble_white", "basalt_black", "verde_antico", "porphyry", "giallo"]
NFEAT = 12
MAXRANKS = 8


class TileMeta:
    def __init__(self, site, year):
        self.site = site
        self.year = year


class TileNet(nn.Module):
    def __init__(self, nclass=len(PIGMENTS)):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(NFEAT, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, nclass)

    def forward(self, x):
        return self.head(self.body(x))


def prepare():
    os.makedirs(os.path.join(WORK, "shards"), exist_ok=True)
    g = torch.Generator().manual_seed(530)
    centres = torch.rand(len(PIGMENTS), NFEAT, generator=g)
    for r in range(MAXRANKS):
        y = torch.randint(0, len(PIGMENTS), (96,), generator=g)
        x = centres[y] + 0.08 * torch.randn(96, NFEAT, generator=g)
        torch.save({"features": x, "pigments": [PIGMENTS[i] for i in y.tolist()], "site": "Villa del Casale"},
                   os.path.join(WORK, "shards", f"tesserae_rank{r}.pt"))
    with open(os.path.join(WORK, "pigments.json"), "w") as f:
        json.dump({p: i for i, p in enumerate(PIGMENTS)}, f, indent=1)
    torch.manual_seed(0)
    torch.save(TileNet().state_dict(), os.path.join(WORK, "start.pt"))
    torch.save(TileNet(nclass=10).state_dict(), os.path.join(WORK, "start_10class.pt"))
    torch.save({"model": TileNet().state_dict(), "meta": TileMeta("Piazza Armerina", 320)},
               os.path.join(WORK, "start_with_meta.pt"))
    print("prepared", WORK)


class TileSet(torch.utils.data.Dataset):
    def __init__(self, path, table, fault, is_fault_rank):
        d = torch.load(path)
        self.x = d["features"]
        self.names = list(d["pigments"])
        self.table = table
        self.fault = fault
        self.is_fault_rank = is_fault_rank
        if fault == "keyerror" and is_fault_rank:
            self.names[8 * 2 + 3] = "verdigris"   # a batch of step 3 holds a pigment the table lacks

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.is_fault_rank and i == 8 * 1 + 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.table[self.names[i]]


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--hf", action="store_true")
    return ap


def slow_resort(names, seconds):
    # pure-Python "re-sort by hue" that takes far too long
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        names = sorted(names, key=lambda s: (len(s), s[::-1]))
        n += 1
    return names


def main_accelerate(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    me = a.fault != "none" and (rank == a.rank or a.fault == "shape_all")
    print(f"[mosaic] rank {rank}/{world} ready, backend={dist.get_backend()}, fault={a.fault}", flush=True)

    with open(os.path.join(WORK, "pigments.json")) as f:
        table = json.load(f)
    shard_dir = "shards_retiled" if (a.fault == "missing_shard" and me) else "shards"
    ds = TileSet(os.path.join(WORK, shard_dir, f"tesserae_rank{rank}.pt"), table, a.fault, me)

    model = TileNet()
    ck = "start.pt"
    if a.fault == "ckpt_size" and me:
        ck = "start_10class.pt"
    if a.fault == "weights_only" and me:
        sd = torch.load(os.path.join(WORK, "start_with_meta.pt"))["model"]
    else:
        sd = torch.load(os.path.join(WORK, ck))
    model.load_state_dict(sd)

    nw = 1 if a.fault == "worker_crash" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, num_workers=nw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)

    it = iter(dl)
    for step in range(1, 7):
        x, y = next(it)
        if a.fault == "nan" and me and step == 3:
            x = x * float("nan")
        if a.fault == "shape_all":
            x = x.reshape(-1, 4, 3)[:, :, :2].reshape(x.shape[0], -1)
        if a.fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "error_exit" and me and step == 4:
            print(f"ERROR rank {rank}: palette checksum mismatch in pigments.json (expected 8 pigments with "
                  f"verified RGB references, found 0 verified); refusing to train", flush=True)
            sys.exit(4)
        if a.fault == "host_oom" and me and step == 3:
            import resource
            vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize")][0]
            resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
            dist_matrix = torch.empty(32768, 65536)  # 8 GiB colour-distance matrix
            dist_matrix.fill_(0)
        if a.fault == "slow" and me and step == 3:
            ds.names = slow_resort(ds.names, 40 if a.pg_timeout < 60 else 400)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if a.fault == "nan" and me and not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite tile features)")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        counts = torch.bincount(logits.argmax(1), minlength=len(PIGMENTS)).float()
        if a.fault == "wrong_size" and me and step == 3:
            counts = torch.cat([counts, torch.zeros(1)])   # "tessera_gold" class only this rank knows about
        gathered = [torch.zeros(len(PIGMENTS)) for _ in range(world)]
        dist.all_gather(gathered, counts)
        acc_t = (logits.argmax(1) == y).float().mean().reshape(1)
        dist.all_reduce(acc_t)
        print(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc_t.item() / world:.3f}", flush=True)

    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(WORK, "export_mosaic.pt"))
        print("rank 0 saved export to", os.path.join(WORK, "export_mosaic.pt"), flush=True)
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


def main_hf(a):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, TrainerCallback

    rank = int(os.environ.get("RANK", 0))
    me = a.fault != "none" and rank == a.rank

    with open(os.path.join(WORK, "pigments.json")) as f:
        table = json.load(f)

    class TokenTiles(torch.utils.data.Dataset):
        def __init__(self):
            d = torch.load(os.path.join(WORK, "shards", "tesserae_rank0.pt"))
            self.ids = (d["features"].clamp(0, 0.999) * 60).long() + 2
            self.names = list(d["pigments"])

        def __len__(self):
            return 96

        def __getitem__(self, i):
            if a.fault == "keyerror" and me and i >= 40:
                name = "verdigris"
            else:
                name = self.names[i]
            return {"input_ids": self.ids[i], "attention_mask": torch.ones(NFEAT, dtype=torch.long),
                    "labels": torch.tensor(table[name])}

    class StepPrinter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} lr {logs.get('learning_rate', 0):.5f}", flush=True)

        def on_step_end(self, args, state, control, **kw):
            if a.fault == "slow" and me and state.global_step == 3:
                slow_resort(list(table), 40)

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=len(PIGMENTS))
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=a.pg_timeout, report_to=[], max_steps=6, logging_steps=1,
                              per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True,
                              dataloader_drop_last=True)
    tr = Trainer(model=model, args=targs, train_dataset=TokenTiles(), callbacks=[StepPrinter()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(os.path.join(WORK, "hf_export"))
        print("rank 0 saved export to", os.path.join(WORK, "hf_export"), flush=True)


if __name__ == "__main__":
    a = args_parser().parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)
