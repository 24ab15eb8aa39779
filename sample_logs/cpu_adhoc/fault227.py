"""A two-hundred-and-twenty-seventh hand-run batch: PROTEIN SECONDARY-STRUCTURE PREDICTION. A conv + BiLSTM tagger.

The program writes synthetic amino-acid sequences (20 residue letters, lengths 24-40) with per-residue labels
(helix, strand, coil) into each node's shard, reads the residue alphabet file of its node, encodes and pads the
sequences with a padding mask, and trains a small 1-D convolution + bidirectional LSTM tagger under DDP over gloo
(or with a hand-written gradient all_reduce when --ddp 0). The loss is a class-weighted per-residue cross entropy
with a logit adjustment by the log class weights, masked over padding. The LSTM is initialised from a checkpoint
in the node cache. After training the per-residue accuracy and a hand-written Q3 score are all_reduced, the
per-class residue counts are all_gathered, and rank 0 prints Q3 and saves the model.

Faults:
- residue: rank N's shard holds a sequence with 'U' (selenocysteine), missing from the alphabet; KeyError at step 1.
- maskshape: the padding mask is built with max_len + 1 columns on every rank; the masked loss raises RuntimeError.
- alphabet: rank N's node has no residues.txt; open() raises FileNotFoundError before training.
- zeroweight: rank N reads class weights with 0.0 for coil; log(0) in the logit adjustment gives inf/NaN loss, the program's check raises FloatingPointError.
- countgather: rank N counts an extra "turn" class, so its per-class all_gather tensor has 4 elements, not 3.
- ckpt: rank N's node cache holds an LSTM checkpoint with hidden size 64; load_state_dict fails (size mismatch).
- badlabel: rank N's shard maps one residue to label 3 of 3 classes; cross_entropy raises IndexError at step 1.
- realign: rank N realigns all its sequences (sleeps --slow-s) before step 2; the others wait in the all_reduce.
- sigabrt: rank N sends itself SIGABRT after step 1.
- exit2: rank N prints an ERROR line about an empty sequence file and calls sys.exit(2) after step 1.
- seqassert: rank N's shard holds a sequence longer than max_len; the program's assert fails at step 0.
- none: control, no fault.

What happened (filled in after the runs):
- residue: KeyError: 'U' in encode() at step 1 on rank 2 (np4 plain) / rank 1 (np3 tee); rank 0 Connection closed by peer.
- maskshape: RuntimeError `The size of tensor a (40) must match the size of tensor b (41)` on all three ranks at step 0 (np3 pymodule).
- alphabet: FileNotFoundError for nodeR/residues.txt on rank 3 (np4 redirects, console only agent lines) / rank 1 (np3 tee_trainer).
- zeroweight: FloatingPointError `rank R: loss is nan at step 0` on rank 2 (np4 detail, --ddp 0, monitoredBarrier on rank 0) / rank 0 (np3 prefix).
- countgather: RuntimeError `ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4), got (3))` on rank 1 (np4 filter) / rank 2 (np3 loglevel).
- ckpt: RuntimeError size mismatch for weight_hh_l0 [256, 64] vs [128, 32] on rank 3 (np4 wrapper) / rank 1 (np3 restart, both attempts).
- badlabel: IndexError `Target 3 is out of bounds.` at step 1 on rank 2 (np4 pdsh2) / rank 0 (np3 tee); peers Connection closed by peer.
- realign: np4 loglevel (40 s): peers `Timed out waiting 12000ms`, Root Cause rank 0; np3 plain (1000 s, pg 300): killed by timeout 60, exit 124.
- sigabrt: rank 2 (np4 pymodule) Root Cause exitcode -6 (SIGABRT) after step 1; ranks 1 and 3 Connection reset by peer. One run.
- exit2: ERROR line then exit 2 after step 1 on rank 3 (np4 tee_trainer) / rank 1 (np3 wrapper); Root Cause names the exiting rank.
- seqassert: AssertionError `sequence 2 has length 30 > max_len 24` on rank 4 at step 0 (np5 plain, --max-len 24). One run kept.
- none: exit 0 (np3 tee): `Q3 0.312 over 811 residues`, model saved to ss_tagger_final.pt.
"""
import argparse
import os
import random
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

RESIDUES = "ACDEFGHIKLMNPQRSTVWY"
CLASSES = ["helix", "strand", "coil"]
WORK = os.environ.get("PROT_WORK", "/tmp/fault227_work")


def parse_args():
    p = argparse.ArgumentParser(description="conv + BiLSTM secondary-structure tagger")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=40)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    return p.parse_args()


def hit(a, name, rank):
    return a.fault == name and (a.rank == -1 or a.rank == rank)


def write_shard(a, rank):
    node = os.path.join(WORK, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    alpha = os.path.join(node, "residues.txt")
    if hit(a, "alphabet", rank):
        if os.path.exists(alpha):
            os.remove(alpha)
    else:
        with open(alpha, "w") as f:
            f.write("\n".join(RESIDUES) + "\n")
    rng = random.Random(1000 + rank)
    seqs = []
    for i in range(a.batch * (a.steps + 1)):
        n = rng.randint(24, a.max_len)
        s = [rng.choice(RESIDUES) for _ in range(n)]
        y = [rng.randrange(3) for _ in range(n)]
        seqs.append(("".join(s), y))
    if hit(a, "residue", rank):
        s, y = seqs[a.batch + 3]
        seqs[a.batch + 3] = (s[:11] + "U" + s[12:], y)
    if hit(a, "badlabel", rank):
        s, y = seqs[a.batch + 5]
        y = list(y)
        y[7] = 3
        seqs[a.batch + 5] = (s, y)
    if hit(a, "seqassert", rank):
        s, y = seqs[2]
        seqs[2] = (s + "GSGSGS", y + [2] * 6)
    weights = "0.8,1.3,0.0" if hit(a, "zeroweight", rank) else "0.8,1.3,0.9"
    with open(os.path.join(node, "class_weights.txt"), "w") as f:
        f.write(weights + "\n")
    return node, seqs


def read_alphabet(node):
    with open(os.path.join(node, "residues.txt")) as f:
        letters = [ln.strip() for ln in f if ln.strip()]
    return {c: i + 1 for i, c in enumerate(letters)}  # 0 = padding


class Tagger(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16, padding_idx=0)
        self.conv = nn.Conv1d(16, 32, 5, padding=2)
        self.lstm = nn.LSTM(32, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, 3)

    def forward(self, x):
        h = F.relu(self.conv(self.emb(x).transpose(1, 2))).transpose(1, 2)
        h, _ = self.lstm(h)
        return self.out(h)


def encode(batch, alphabet, max_len, mask_len):
    x = torch.zeros(len(batch), max_len, dtype=torch.long)
    y = torch.zeros(len(batch), max_len, dtype=torch.long)
    m = torch.zeros(len(batch), mask_len)
    for i, (s, lab) in enumerate(batch):
        assert len(s) <= max_len, f"sequence {i} has length {len(s)} > max_len {max_len}"
        x[i, : len(s)] = torch.tensor([alphabet[c] for c in s])
        y[i, : len(s)] = torch.tensor(lab)
        m[i, : len(s)] = 1.0
    return x, y, m


def main():
    a = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    node, seqs = write_shard(a, rank)
    alphabet = read_alphabet(node)
    with open(os.path.join(node, "class_weights.txt")) as f:
        cw = torch.tensor([float(v) for v in f.read().strip().split(",")])
    print(f"rank {rank}: {len(seqs)} sequences, alphabet of {len(alphabet)} residues, class weights {cw.tolist()}", flush=True)

    model = Tagger(len(RESIDUES) + 1, a.hidden)
    cache = os.path.join(node, "cache")
    os.makedirs(cache, exist_ok=True)
    ck_hidden = 64 if hit(a, "ckpt", rank) else a.hidden
    ck = os.path.join(cache, "lstm_init.pt")
    torch.save(nn.LSTM(32, ck_hidden, batch_first=True, bidirectional=True).state_dict(), ck)
    model.lstm.load_state_dict(torch.load(ck))
    if a.ddp:
        model = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    mask_len = a.max_len + 1 if hit(a, "maskshape", rank) else a.max_len

    for step in range(a.steps):
        batch = seqs[step * a.batch:(step + 1) * a.batch]
        if step == 2 and hit(a, "realign", rank):
            print(f"rank {rank}: template alignment cache stale, realigning {len(seqs)} sequences", flush=True)
            time.sleep(a.slow_s)
        x, y, m = encode(batch, alphabet, a.max_len, mask_len)
        logits = model(x) + torch.log(cw)
        nll = F.cross_entropy(logits.reshape(-1, 3), y.reshape(-1), weight=cw, reduction="none").view_as(y)
        loss = (nll * m).sum() / m.sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f}", flush=True)
        if step == 1 and hit(a, "sigabrt", rank):
            os.kill(os.getpid(), signal.SIGABRT)
        if step == 1 and hit(a, "exit2", rank):
            print(f"ERROR rank {rank}: sequence file {node}/seqs_0007.fasta is empty; cannot build batch 2", flush=True)
            sys.exit(2)

    model.eval()
    correct = torch.zeros(1)
    total = torch.zeros(1)
    counts = torch.zeros(4 if hit(a, "countgather", rank) else 3)
    with torch.no_grad():
        x, y, m = encode(seqs[-a.batch:], alphabet, a.max_len, a.max_len)
        pred = model(x).argmax(-1)
        correct += ((pred == y).float() * m).sum()
        total += m.sum()
        for c in range(3):
            counts[c] = ((y == c).float() * m).sum()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    gathered = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(gathered, counts)
    q3 = correct.item() / total.item()
    if rank == 0:
        per_class = torch.stack(gathered).sum(0).tolist()
        print(f"Q3 {q3:.3f} over {int(total.item())} residues; per-class residues {per_class}", flush=True)
        sd = model.module.state_dict() if a.ddp else model.state_dict()
        torch.save(sd, os.path.join(WORK, "ss_tagger_final.pt"))
        print(f"saved model to {WORK}/ss_tagger_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
