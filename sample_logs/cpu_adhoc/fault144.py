"""A hundred-and-forty-fourth hand-run batch: TEXT CLASSIFICATION WITH A SMALL TRANSFORMER ENCODER (BERT STYLE).

A tiny BERT-style classifier (Embedding(100,32) + 2-layer nn.TransformerEncoder, 4 heads, batch_first) over
synthetic token ids with padding (id 0) and a key-padding mask, a [CLS]+masked-mean pooled head Linear(32,4), trained
with DDP (`--ddp 0`: rank 0's weights broadcast and the gradients all-reduced by hand). Rank 0 writes vocab.txt
and labels.json at start; every rank reads them, builds its shard, optionally loads a pretrained encoder
(`--pretrained 1`), trains `--steps` steps with class weights in the loss printing `rank R step S loss L`,
then evaluates: per-class tp/fp/fn all_reduced and macro-F1 printed by rank 0, destroy_process_group.

Faults:
- labelmap: rank N's label map is built from LABELS[:-1] (an off-by-one): KeyError on 'scitech'.
- mask: rank N's padding mask is built over max_len + 1 columns: the attention rejects its shape.
- vocab: rank N draws token ids up to VOCAB + 8: IndexError in the embedding.
- weights: every rank's class weights come from the 3 non-empty classes of the first batch: cross_entropy error.
- allmask: rank N's mask pads every token of row 5 at step 2: the masked mean is 0/0, NaN; the loss check raises.
- skipeval: rank N skips the eval all_reduce and waits for rank 0's metrics file; the others time out.
- vocabfile: rank N reads vocab.txt from a node-local dir that does not exist: FileNotFoundError.
- collate: every rank's collate returns a list of lists instead of a tensor: AttributeError.
- segv: rank N is killed by SIGSEGV at step 3.
- ckpt: with --pretrained 1 rank 0 saved the encoder with 3 layers; loading into 2 layers: unexpected keys.
- shape: (--ddp 0) rank N's eval stats vector has 5 classes (15 entries) against 12: all_reduce mismatch.
What happened (filled in after the runs):
- labelmap: KeyError 'scitech' (line 113) on rank N before step 0; the others SIGTERMed.
- mask: AssertionError 'Expected key_padded_mask.shape[1] to be 12, but got 13' (line 82) on rank N at step 0.
- vocab: IndexError 'index out of range in self' in the embedding (line 81) on rank N; peers Connection closed.
- weights: every rank RuntimeError 'weight tensor should be defined either for all 4 classes ...[3]' (line 172).
- allmask: FloatingPointError 'rank N step 2: loss is nan (check the padding mask)' (line 174); peers closed.
- skipeval: PG 12 s: ranks waiting in the eval all_reduce time out (12000ms); PG 300 s: killed by timeout 60.
- vocabfile: FileNotFoundError .../nodeN_cache/<tag>_vocab.txt (line 91) on rank N; the others SIGTERMed.
- collate: every rank AttributeError 'list' object has no attribute 'eq' (line 171) at step 0.
- segv: rank N exitcode -11 (SIGSEGV) at step 3; peers Connection reset by peer; restart: connectFullMesh.
- ckpt: every rank RuntimeError Unexpected key(s) in state_dict: "layers.2.self_attn..." (line 150).
- shape: DETAIL: every rank 'Detected mismatch between collectives', TensorShape=[15] on rank N vs [12].
"""
import argparse
import json
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pretrained", type=int, default=0)
p.add_argument("--tag", default="run")
p.add_argument("--out", default="/tmp/fault144_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
VOCAB, PAD, MAXLEN, D = 100, 0, 12, 32
LABELS = ["world", "sports", "business", "scitech"]
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


class Classifier(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.pos = nn.Parameter(torch.zeros(MAXLEN + 1, D))
        block = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(D, len(LABELS))

    def forward(self, ids, pad_mask):
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        h = self.encoder(h, src_key_padding_mask=pad_mask)
        keep = (~pad_mask[:, : ids.shape[1]]).unsqueeze(-1).float()
        return self.head(0.5 * h[:, 0] + 0.5 * (h * keep).sum(1) / keep.sum(1))


def read_vocab():
    root = a.out
    if a.fault == "vocabfile" and hit():
        root = os.path.join("/tmp/fault144_work", f"node{RANK}_cache")
    with open(os.path.join(root, f"{a.tag}_vocab.txt")) as f:
        return [w.strip() for w in f]


def label_map():
    names = json.load(open(os.path.join(a.out, f"{a.tag}_labels.json")))["labels"]
    if a.fault == "labelmap" and hit():
        names = names[:-1]
    return {n: i for i, n in enumerate(names)}


def make_shard(lmap):
    g = torch.Generator().manual_seed(500 + RANK)
    n = 96
    hi = VOCAB + 8 if (a.fault == "vocab" and hit()) else VOCAB
    lens = torch.randint(4, MAXLEN, (n,), generator=g)
    seqs, names = [], []
    for i in range(n):
        toks = torch.randint(2, hi, (int(lens[i]),), generator=g).tolist()
        k = int(torch.randint(0, len(LABELS), (1,), generator=g))
        seqs.append([1] + toks)
        names.append(LABELS[k])
    ys = torch.tensor([lmap[nm] for nm in names])
    return seqs, ys


def collate(seqs, step):
    width = max(len(s) for s in seqs)
    ids = [s + [PAD] * (width - len(s)) for s in seqs]
    if a.fault == "collate":
        return ids, None
    ids = torch.tensor(ids)
    cols = width + 1 if (a.fault == "mask" and hit()) else width
    mask = torch.ones(len(seqs), cols, dtype=torch.bool)
    mask[:, :width] = ids.eq(PAD)
    if a.fault == "allmask" and hit() and step == 2:
        mask[5, :] = True
    return ids, mask


def main():
    print(f"rank {RANK} world {WORLD} pid {os.getpid()}", flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    if RANK == 0:
        with open(os.path.join(a.out, f"{a.tag}_vocab.txt"), "w") as f:
            f.write("\n".join(["[PAD]", "[CLS]"] + [f"tok{i}" for i in range(2, VOCAB)]) + "\n")
        json.dump({"labels": LABELS}, open(os.path.join(a.out, f"{a.tag}_labels.json"), "w"))
        if a.pretrained:
            enc = Classifier(3 if a.fault == "ckpt" else 2).encoder
            torch.save(enc.state_dict(), os.path.join(a.out, f"{a.tag}_encoder_pre.pt"))
    dist.barrier()
    vocab = read_vocab()
    lmap = label_map()
    seqs, ys = make_shard(lmap)
    print(f"rank {RANK} vocab {len(vocab)} classes {len(lmap)} examples {len(seqs)}", flush=True)
    torch.manual_seed(0)
    net = Classifier()
    if a.pretrained:
        sd = torch.load(os.path.join(a.out, f"{a.tag}_encoder_pre.pt"), map_location="cpu")
        net.encoder.load_state_dict(sd)
        print(f"rank {RANK} loaded pretrained encoder", flush=True)
    if a.ddp:
        model = DDP(net)
    else:
        model = net
        for prm in net.parameters():
            dist.broadcast(prm.data, src=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    bs = 16
    for s in range(a.steps):
        lo = (s * bs) % len(seqs)
        ids, mask = collate(seqs[lo:lo + bs], s)
        y = ys[lo:lo + bs]
        if s == 0:
            present = torch.bincount(y, minlength=len(LABELS))
            if a.fault == "weights":
                present = present[present > 0][:3]
            cw = present.sum() / (len(present) * present.clamp(min=1).float())
        if a.fault == "segv" and hit() and s == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        logits = model(ids, ids.eq(PAD) if mask is None else mask)
        loss = F.cross_entropy(logits, y, weight=cw)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {RANK} step {s}: loss is {loss.item()} (check the padding mask)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        print(f"rank {RANK} step {s} loss {loss.item():.4f}", flush=True)
        time.sleep(0.2)
    net.eval()
    with torch.no_grad():
        ids, mask = collate(seqs[:48], -1)
        pred = net(ids, mask).argmax(dim=1)
    y = ys[:48]
    ncls = len(LABELS) + 1 if (a.fault == "shape" and hit()) else len(LABELS)
    stats = torch.zeros(3, ncls)
    for c in range(len(LABELS)):
        stats[0, c] = ((pred == c) & (y == c)).sum()
        stats[1, c] = ((pred == c) & (y != c)).sum()
        stats[2, c] = ((pred != c) & (y == c)).sum()
    stats = stats.flatten()
    if a.fault == "skipeval" and hit():
        metrics = os.path.join(a.out, f"{a.tag}_metrics.json")
        while not os.path.exists(metrics):
            time.sleep(1.0)
    else:
        dist.all_reduce(stats)
    if RANK == 0:
        tp, fp, fn = stats.view(3, -1)
        f1 = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).mean().item()
        json.dump({"macro_f1": f1}, open(os.path.join(a.out, f"{a.tag}_metrics.json"), "w"))
        print(f"eval macro-F1 {f1:.4f} over {int(tp.sum() + fn.sum())} examples", flush=True)
    dist.barrier()
    print(f"rank {RANK} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
