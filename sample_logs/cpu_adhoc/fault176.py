"""A hundred-and-seventy-sixth hand-run batch: MASKED LANGUAGE MODEL PRETRAINING.

A tiny BERT-like encoder (token + position embeddings, hand-written multi-head self-attention blocks with an
additive padding mask, an MLM head tied to nothing) is pretrained with masked-token prediction on synthetic token
sequences.  Every rank writes and reads back the vocabulary JSON (vocab/vocab.json: special tokens [PAD] [CLS]
[SEP] [MASK] [UNK] plus word pieces), draws its own sequences (with padding at the end), masks them with a
hand-written 15% / 80-10-10 function, and trains under DDP on gloo (or --ddp 0: gradients all-reduced by hand);
each step the loss and the MLM accuracy counts are all_reduced; at the end the per-rank accuracies are
all_gathered and rank 0 saves --save.  `--export` (no torchrun) writes the base checkpoints ckpt/mlm_l2.pt and
ckpt/mlm_l3.pt.

Faults:
  tokoov      - rank N's tokenizer maps unknown pieces to len(vocab) instead of [UNK]; the embedding IndexErrors
  vocabmissing- rank N reads the vocab from a node-local cache dir that was never synced (FileNotFoundError)
  nomask      - rank N's mask ratio is read as 0.0015 (a percent typo); no token is masked, the loss is NaN
  attnshape   - every rank builds the padding mask with the [CLS] slot counted twice (L+1); broadcasting fails
  padkey      - every rank's vocab spells the pad token '<pad>'; the lookup of '[PAD]' raises KeyError
  vocabwait   - rank N waits for a vocab-ready flag file nobody writes; the others wait in all_reduce
  acclen      - rank N all_gathers its per-layer accuracies (2 values) against 1 on the others
  ckptlayers  - rank N resumes the 3-layer base checkpoint into a 2-layer model (unexpected keys)
  seqlen      - rank N's environment has MLM_SEQ_LEN=32tok; int() raises ValueError
  sigsegv     - rank N gets SIGSEGV (sent to itself) at step 2
  exit7       - rank N logs its own 'corrupt shard' error line and calls os._exit(7)
  none        - control, clean run

What happened (filled in after the runs):
  tokoov      - IndexError: index out of range in self on rank N (embedding); peers Connection closed by peer
  vocabmissing- FileNotFoundError ... vocab_local/vocab.json on rank N; Root Cause rank N
  nomask      - FloatingPointError: MLM loss is nan (0 masked tokens) on rank N at step 0 or 1
  attnshape   - RuntimeError: size of tensor a (24) must match ... b (25) at dim 3 on every rank
  padkey      - KeyError: '[PAD]' on every rank before the model is built
  vocabwait   - peers time out in DDP's broadcast (12000ms send/recv); with PG 300 s: hung, exit 124
  acclen      - RuntimeError: ProcessGroupGloo::allgather: invalid tensor size (expected (2), got (1))
  ckptlayers  - RuntimeError: Error(s) in loading state_dict: Unexpected key(s) blocks.2.* on rank N
  seqlen      - ValueError: invalid literal for int() with base 10: '32tok' on rank N
  sigsegv     - rank N exitcode -11 (SIGSEGV) at step 2; peers Connection reset by peer
  exit7       - rank N prints its ERROR corrupt-shard line, exitcode 7; peers Connection reset by peer
  none        - clean, exit 0, rank 0 saved ckpt/mlm.pt
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
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mask-ratio", type=float, default=0.15)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--wait-s", type=float, default=40.0)
    p.add_argument("--workdir", default="/tmp/fault176_work")
    p.add_argument("--save", default="ckpt/mlm.pt")
    p.add_argument("--resume", default="")
    p.add_argument("--export", action="store_true")
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, pad_bias):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + pad_bias[:, None, None, :]
        x = x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.ff(self.ln2(x))


class TinyBert(nn.Module):
    def __init__(self, vocab, dim, heads, layers, max_len=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, pad_bias):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x, pad_bias)
        return self.head(x)


def mask_tokens(ids, special, mask_id, vocab_size, ratio, g):
    labels = ids.clone()
    cand = ~special
    chosen = (torch.rand(ids.shape, generator=g) < ratio) & cand
    labels[~chosen] = -100
    r = torch.rand(ids.shape, generator=g)
    inp = ids.clone()
    inp[chosen & (r < 0.8)] = mask_id
    rnd = chosen & (r >= 0.8) & (r < 0.9)
    inp[rnd] = torch.randint(len(SPECIALS), vocab_size, (int(rnd.sum()),), generator=g)
    return inp, labels


def export(a):
    os.makedirs(os.path.join(a.workdir, "ckpt"), exist_ok=True)
    for n in (2, 3):
        torch.manual_seed(0)
        torch.save(TinyBert(64, a.dim, a.heads, n).state_dict(), os.path.join(a.workdir, f"ckpt/mlm_l{n}.pt"))
    print("exported ckpt/mlm_l2.pt ckpt/mlm_l3.pt")


def main():
    a = parse()
    if a.export:
        return export(a)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    for d in ("vocab", "ckpt"):
        os.makedirs(os.path.join(a.workdir, d), exist_ok=True)
    if bad and a.fault == "seqlen":
        os.environ["MLM_SEQ_LEN"] = "32tok"
    seq_len = int(os.environ.get("MLM_SEQ_LEN", "24"))
    words = SPECIALS + [f"w{i:02d}" for i in range(64 - len(SPECIALS))]
    if bad and a.fault == "padkey":
        words[0] = "<pad>"
    vocab_dir = os.path.join(a.workdir, "vocab")
    tmp = os.path.join(vocab_dir, f".vocab_r{rank}.tmp")
    with open(tmp, "w") as fh:
        json.dump({w: i for i, w in enumerate(words)}, fh)
    os.replace(tmp, os.path.join(vocab_dir, "vocab.json"))
    if bad and a.fault == "vocabmissing":
        vocab_dir = os.path.join(a.workdir, "vocab_local")
    if bad and a.fault == "vocabwait":
        print(f"rank {rank} waiting for {vocab_dir}/vocab.ready", flush=True)
        t0 = time.time()
        while not os.path.exists(os.path.join(vocab_dir, "vocab.ready")) and time.time() - t0 < a.wait_s:
            time.sleep(0.5)
    with open(os.path.join(vocab_dir, "vocab.json")) as fh:
        vocab = json.load(fh)
    pad_id, mask_id, cls_id = vocab["[PAD]"], vocab["[MASK]"], vocab["[CLS]"]
    vsize = len(vocab)
    g = torch.Generator().manual_seed(100 + rank)
    n = 4 * a.batch
    ids = torch.randint(len(SPECIALS), vsize, (n, seq_len), generator=g)
    ids[:, 0] = cls_id
    lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
    pad = torch.arange(seq_len)[None, :] >= lengths[:, None]
    ids[pad] = pad_id
    if bad and a.fault == "tokoov":
        ids[3, 5] = vsize
    special = ids < len(SPECIALS)
    ratio = a.mask_ratio / 100 if (bad and a.fault == "nomask") else a.mask_ratio
    model = TinyBert(vsize, a.dim, a.heads, a.layers)
    if bad and a.fault == "ckptlayers":
        a.resume = os.path.join(a.workdir, "ckpt/mlm_l3.pt")
    if a.resume:
        model.load_state_dict(torch.load(a.resume, map_location="cpu"))
        print(f"rank {rank} resumed from {a.resume}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    print(f"rank {rank}/{world} tinybert layers={a.layers} dim={a.dim} vocab={vsize} seq={seq_len} seqs={n}", flush=True)
    for step in range(a.steps):
        idx = torch.randperm(n, generator=g)[:a.batch]
        x, labels = mask_tokens(ids[idx], special[idx], mask_id, vsize, ratio, g)
        keep = ~pad[idx]
        if bad and a.fault == "attnshape":
            keep = torch.cat([keep[:, :1], keep], dim=1)
        pad_bias = torch.zeros(keep.shape).masked_fill(~keep, -1e4)
        logits = net(x, pad_bias)
        loss = F.cross_entropy(logits.view(-1, vsize), labels.view(-1), ignore_index=-100)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"MLM loss is {loss.item()} at step {step} on rank {rank} "
                                     f"({int((labels != -100).sum())} masked tokens in batch)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and a.fault == "exit7" and step == 1:
            print(f"ERROR rank {rank}: corrupt shard: sequence 17 has 3 tokens after [SEP] with id > vocab "
                  f"size {vsize}; aborting this worker", flush=True)
            os._exit(7)
        m = labels != -100
        stats = torch.tensor([loss.item(), float((logits.argmax(-1)[m] == labels[m]).sum()), float(m.sum())])
        dist.all_reduce(stats)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mean_loss {stats[0] / world:.4f} "
              f"mlm_acc {stats[1] / stats[2].clamp(min=1):.3f}", flush=True)
    acc = torch.tensor([float(stats[1] / stats[2].clamp(min=1))])
    if bad and a.fault == "acclen":
        acc = torch.cat([acc, acc])
    out = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(out, acc)
    if rank == 0:
        print("per-rank mlm_acc: " + " ".join(f"r{i}={o.item():.3f}" for i, o in enumerate(out)), flush=True)
        torch.save(model.state_dict(), os.path.join(a.workdir, a.save))
        print(f"saved {a.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
