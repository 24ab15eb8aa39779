"""A hundred-and-sixtieth hand-run batch: SPEECH RECOGNITION WITH CTC LOSS OVER VARIABLE-LENGTH SEQUENCES.

A tiny acoustic model (Conv1d subsampling by 2, a GRU, a linear output over blank + 20 tokens) trained with DDP
(or a hand all-reduce of gradients with --ddp 0) on gloo with nn.CTCLoss over synthetic 40 x T log-mel features.
Each rank writes its own feature shard, a bucketing sampler groups utterances by length, the collate pads the
features and concatenates the targets with per-utterance lengths, and an evaluation does greedy CTC decoding and
all_reduces the token-error numerator and denominator to print a WER.  Rank 0 saves a checkpoint; --resume loads it.

Faults:
  ctcinf    - rank N forgets the subsampling when it trims targets; CTC gives inf and the program's check raises
  floatlen  - every rank passes input_lengths as a list of floats to the CTC loss (a code bug)
  blank     - every rank sets the blank index to the number of classes (out of range for the CTC loss)
  featfile  - rank N looks for its feature shard in a stale folder (FileNotFoundError)
  wait      - rank N waits for a feature cache before step 2; the others wait in the gradient all_reduce
  wergather - rank N all_reduces its WER stats as 3 numbers, the others as 2
  ckpt      - resume: rank N builds the GRU with a larger hidden size than the checkpoint (size mismatch)
  samplerate- rank N reads SAMPLE_RATE from the environment as "16k" (ValueError)
  audioback - rank N prints an "audio backend unavailable" error and exits with code 4
  segv      - rank N gets SIGSEGV after step 2
  none      - control, clean run (rank 0 writes the checkpoint)

What happened (filled in after the runs):
  ctcinf    - (to fill)
  floatlen  - (to fill)
  blank     - (to fill)
  featfile  - (to fill)
  wait      - (to fill)
  wergather - (to fill)
  ckpt      - (to fill)
  samplerate- (to fill)
  audioback - (to fill)
  segv      - (to fill)
  none      - (to fill)
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--n-mels", type=int, default=40)
p.add_argument("--vocab", type=int, default=20)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault160_work")
a = p.parse_args()


def hit(r):
    return a.fault != "none" and (a.rank == -1 or a.rank == r)


class AcousticModel(nn.Module):
    def __init__(self, n_mels, hidden, n_classes):
        super().__init__()
        self.conv = nn.Conv1d(n_mels, hidden, kernel_size=3, stride=2, padding=1)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, n_classes)

    def forward(self, x):  # x: B x n_mels x T
        h = torch.relu(self.conv(x)).transpose(1, 2)
        h, _ = self.gru(h)
        return self.out(h).log_softmax(-1)  # B x T' x C


def subsampled(lengths):
    return (lengths - 1) // 2 + 1


def make_shard(path, seed, n_utts=24):
    g = torch.Generator().manual_seed(seed)
    utts = []
    for _ in range(n_utts):
        T = int(torch.randint(30, 80, (1,), generator=g))
        L = int(torch.randint(3, T // 4, (1,), generator=g))
        utts.append({"feats": torch.randn(a.n_mels, T, generator=g),
                     "tokens": torch.randint(1, a.vocab + 1, (L,), generator=g)})
    torch.save(utts, path)


def bucket_batches(utts, batch):
    order = sorted(range(len(utts)), key=lambda i: utts[i]["feats"].shape[1])
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def collate(items):
    T = max(u["feats"].shape[1] for u in items)
    x = torch.zeros(len(items), a.n_mels, T)
    for i, u in enumerate(items):
        x[i, :, :u["feats"].shape[1]] = u["feats"]
    in_len = torch.tensor([u["feats"].shape[1] for u in items])
    targets = torch.cat([u["tokens"] for u in items])
    tgt_len = torch.tensor([len(u["tokens"]) for u in items])
    return x, in_len, targets, tgt_len


def greedy_decode(logp, lengths, blank):
    best = logp.argmax(-1)
    hyps = []
    for b in range(best.shape[0]):
        prev, hyp = blank, []
        for t in best[b, :lengths[b]].tolist():
            if t != prev and t != blank:
                hyp.append(t)
            prev = t
        hyps.append(hyp)
    return hyps


def edit_distance(r, h):
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            cur = d[j]
            d[j] = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
            prev = cur
    return d[len(h)]


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    sample_rate = int(os.environ.get("SAMPLE_RATE", "16000"))
    if a.fault == "samplerate" and hit(rank):
        sample_rate = int(os.environ.get("SAMPLE_RATE_OVERRIDE", "16k"))
    print(f"rank {rank}/{world} sample_rate {sample_rate} hop 160 n_mels {a.n_mels}", flush=True)
    if a.fault == "audioback" and hit(rank):
        print(f"ERROR rank {rank}: audio backend unavailable (sox_io/soundfile not found), cannot read wav headers",
              flush=True)
        sys.exit(4)

    feat_dir = os.path.join(a.workdir, "feats")
    os.makedirs(feat_dir, exist_ok=True)
    make_shard(os.path.join(feat_dir, f"train-{rank:05d}-of-{world:05d}.pt"), seed=100 + rank)
    dist.barrier()
    if a.fault == "featfile" and hit(rank):
        feat_dir = os.path.join(a.workdir, "feats_v2")
    utts = torch.load(os.path.join(feat_dir, f"train-{rank:05d}-of-{world:05d}.pt"))
    batches = bucket_batches(utts, a.batch)
    print(f"rank {rank} loaded {len(utts)} utterances in {len(batches)} length buckets", flush=True)

    hidden = a.hidden + (16 if a.fault == "ckpt" and hit(rank) else 0)
    blank = a.vocab + 1 if a.fault == "blank" and hit(rank) else 0
    model = AcousticModel(a.n_mels, hidden, a.vocab + 1)
    ckpt_path = os.path.join(a.workdir, "ckpt", "ctc_am.pt")
    if a.resume:
        state = torch.load(ckpt_path)
        model.load_state_dict(state["model"])
        print(f"rank {rank} resumed from {ckpt_path} (step {state['step']})", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=a.lr)
    ctc = nn.CTCLoss(blank=blank, zero_infinity=False)

    for step in range(a.steps):
        x, in_len, targets, tgt_len = collate([utts[i] for i in batches[step % len(batches)]])
        out_len = subsampled(in_len)
        if a.fault == "ctcinf" and hit(rank) and step == 2:
            tgt_len = in_len // 2 + 4  # trimmed against the frame count, not the subsampled one
            targets = torch.randint(1, a.vocab + 1, (int(tgt_len.sum()),))
        if a.fault == "wait" and hit(rank) and step == 2:
            print(f"rank {rank} waiting for feature cache {feat_dir}/.lock to be released", flush=True)
            time.sleep(100000)
        logp = net(x).transpose(0, 1)  # T' x B x C
        if a.fault == "floatlen" and hit(rank):
            loss = ctc(logp, targets, [float(n) for n in out_len], tgt_len.tolist())
        else:
            loss = ctc(logp, targets, out_len, tgt_len)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"CTC loss is {loss.item()} at step {step} on rank {rank} "
                                     f"(max target length {int(tgt_len.max())}, min output length {int(out_len.min())})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if a.fault == "segv" and hit(rank) and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    with torch.no_grad():
        errs, toks = 0, 0
        for b in batches[:2]:
            x, in_len, targets, tgt_len = collate([utts[i] for i in b])
            hyps = greedy_decode(model(x), subsampled(in_len), blank)
            refs = torch.split(targets, tgt_len.tolist())
            for r, h in zip(refs, hyps):
                errs += edit_distance(r.tolist(), h)
                toks += len(r)
    stats = torch.tensor([errs, toks], dtype=torch.float64)
    if a.fault == "wergather" and hit(rank):
        stats = torch.tensor([errs, toks, len(batches)], dtype=torch.float64)
    dist.all_reduce(stats)
    print(f"rank {rank} eval WER {stats[0].item() / stats[1].item():.4f} over {int(stats[1].item())} tokens", flush=True)
    if rank == 0:
        os.makedirs(os.path.dirname(ckpt_path), exist_ok=True)
        torch.save({"model": model.state_dict(), "step": a.steps}, ckpt_path)
        print(f"rank 0 saved checkpoint {ckpt_path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
