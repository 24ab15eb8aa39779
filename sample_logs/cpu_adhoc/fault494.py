"""Batch 494 fault script: code review comment classification (distributed, gloo, CPU).

A small bag-of-tokens classifier assigns code review comments to categories
(nit, bug, style, docs, perf, security, question, praise). `--prepare` writes synthetic
token shards per rank, a label lookup table and a start checkpoint into the work dir.
Every rank prints `rank R step S loss L acc A` each step; rank 0 saves an export.
`--hf` runs the same data through a transformers.Trainer with a tiny config-built model.

Faults (`--fault NAME --rank N`):
  none            control, nothing planted
  label_key       rank N's shard holds a label name missing from the lookup table (KeyError)
  token_index     rank N feeds a token id past the vocabulary to the embedding (IndexError)
  missing_shard   rank N's shard file is not there (FileNotFoundError)
  ckpt_size       rank N loads a start checkpoint with a wider classifier head (size mismatch)
  gather_size     rank N all_gathers a confusion row of the wrong length (gloo size error)
  slow_rank       rank N does minutes of pure-Python work before its all_gather (peers time out)
  hang            the same slow rank N, run with --pg-timeout 300: nothing fails until `timeout` ends it
  nan_loss        rank N's loss turns NaN and the script's own finiteness check raises
  segv            rank N sends itself SIGSEGV at step 2
  error_exit      rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       every rank builds the head with the wrong input width (mat1/mat2 mismatch)
  worker_crash    a DataLoader worker on rank N exits abruptly (os._exit) mid-epoch

What happened:
  none          np4 acc and np3 hfacc (Trainer): all steps printed, export saved / 'hf training done', exit 0
  label_key     np5 r3 accdebug, np3 r1 hf (Trainer): KeyError 'needs-discussion' on the planted rank, peers gloo connection closed, exit 1
  token_index   np3 r1 torchrun, np8 r7 acc: RuntimeError 'Index 197 of input takes value 517 ... [0, 500)' at step 2 (not IndexError), exit 1
  missing_shard np6 r4 accconfig: FileNotFoundError shard_4_dedup.pt before training, launcher SIGTERMs the rest, exit 1
  ckpt_size     np4 r2 tee: load_state_dict size mismatch for head.weight/head.bias, [default2] prefixes, exit 1
  gather_size   np6 r5 acc, np4 r1 tee: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (8))', exit 1
  slow_rank     np5 r2 acc: peers time out after 12000 ms in gloo send/recv; summary blames rank 1; exit 1
  hang          np4 r1 torchrun --pg-timeout 300: output stops after step 1, timeout 60 SIGTERMs torchrun, killed, exit 137
  nan_loss      np8 r6 acc2nodes: FloatingPointError 'rank 6 step 3: loss is nan (non-finite)', both launchers fail, exit 1
  segv          np7 r3 acc: rank 3 exitcode -11 with no traceback, peers connection closed/reset, exit 1
  error_exit    np5 r4 torchrun: ERROR line then 'terminate called without an active exception', rank 4 recorded as -6 SIGABRT;
                np4 r2 acc2nodes: ERROR line, exitcode 4; exit 1 both
  shape_all     np3 accdebug: every rank 'mat1 and mat2 shapes cannot be multiplied (16x32 and 40x8)', exit 1
  worker_crash  np4 r2 acc: 'DataLoader worker (pid N) exited unexpectedly with exit code 3' on rank 2, exit 1
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault494_work"
LABELS = ["nit", "bug", "style", "docs", "perf", "security", "question", "praise"]
VOCAB, SEQ, HID = 500, 24, 32


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with open(f"{WORK}/labels.json", "w") as f:
        json.dump({n: i for i, n in enumerate(LABELS)}, f)
    for r in range(world):
        toks = torch.randint(0, VOCAB, (96, SEQ), generator=g)
        labs = [LABELS[int(i)] for i in torch.randint(0, len(LABELS), (96,), generator=g)]
        torch.save({"tokens": toks, "labels": labs}, f"{WORK}/shard_{r}.pt")
    m = Model(HID)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    m2 = Model(HID); m2.head = nn.Linear(HID, len(LABELS) + 2)
    torch.save(m2.state_dict(), f"{WORK}/start_wide.pt")
    print(f"prepared {world} shards in {WORK}")


class Model(nn.Module):
    def __init__(self, head_in):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, HID, mode="mean")
        self.head = nn.Linear(head_in, len(LABELS))

    def forward(self, x):
        return self.head(self.emb(x))


class ShardSet(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        path = f"{WORK}/shard_{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shard_{rank}_dedup.pt"
        d = torch.load(path)
        with open(f"{WORK}/labels.json") as f:
            self.table = json.load(f)
        self.toks, self.labs = d["tokens"], d["labels"]
        if fault == "label_key" and rank == frank:
            for i in range(30, len(self.labs), 3):
                self.labs[i] = "needs-discussion"
        if fault == "token_index" and rank == frank:
            self.toks[40, 5] = VOCAB + 17
        self.crash = fault == "worker_crash" and rank == frank

    def __len__(self):
        return len(self.labs)

    def __getitem__(self, i):
        if self.crash and i == 50:
            os._exit(3)
        return self.toks[i], self.table[self.labs[i]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=int, default=0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--hf", action="store_true")
    a = ap.parse_args()
    if a.prepare:
        return prepare(a.prepare)
    if a.hf:
        return hf_main(a)
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(rank)
    ds = ShardSet(rank, a.fault, a.rank)
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False,
                                     num_workers=1 if a.fault == "worker_crash" else 0)
    model = Model(HID + 8 if a.fault == "shape_all" else HID)
    ck = f"{WORK}/start_wide.pt" if (a.fault == "ckpt_size" and rank == a.rank) else f"{WORK}/start.pt"
    if a.fault != "shape_all":
        model.load_state_dict(torch.load(ck))
    if a.fault == "shape_all":
        model.head = nn.Linear(HID + 8, len(LABELS))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    lossf = nn.CrossEntropyLoss()
    it = iter(dl)
    for step in range(6):
        x, y = next(it)
        if a.fault == "segv" and rank == a.rank and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "error_exit" and rank == a.rank and step == 3:
            print(f"ERROR: rank {rank}: review-comment shard {rank} has 0 labelled 'security' rows after dedup; refusing to train", flush=True)
            sys.exit(4)
        out = model(x)
        loss = lossf(out, y)
        if a.fault == "nan_loss" and rank == a.rank and step == 3:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite)")
        opt.zero_grad(); acc.backward(loss); opt.step()
        accu = (out.argmax(1) == y).float().mean()
        if a.fault in ("slow_rank", "hang") and rank == a.rank and step == 2:
            s = 0
            for i in range(400_000_000):
                s += i * i % 7
        row = torch.bincount(out.argmax(1), minlength=len(LABELS)).float()
        if a.fault == "gather_size" and rank == a.rank and step == 3:
            row = torch.cat([row, torch.zeros(3)])
        rows = [torch.zeros(len(LABELS)) for _ in range(world)]
        dist.all_gather(rows, row)
        dist.all_reduce(accu)
        print(f"rank {rank} step {step} loss {loss.item():.4f} acc {accu.item() / world:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export_review_clf.pt")
        print(f"rank 0 saved export {WORK}/export_review_clf.pt", flush=True)


def hf_main(a):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))
    ds = ShardSet(rank, a.fault, a.rank)

    class HFSet(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            x, y = ds[i]
            return {"input_ids": x, "labels": torch.tensor(y)}

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=len(LABELS))
    model = BertForSequenceClassification(cfg)
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], per_device_train_batch_size=16, max_steps=6, logging_steps=1,
                             save_strategy="no", dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=HFSet()).train()
    print(f"rank {rank} hf training done", flush=True)


if __name__ == "__main__":
    main()
