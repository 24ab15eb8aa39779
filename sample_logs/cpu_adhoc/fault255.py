"""A two-hundred-and-fifty-fifth hand-run batch: IMAGE CAPTION RETRIEVAL WITH HARD-NEGATIVE MINING (VSE-LIKE).

A VSE-style retrieval model on synthetic data: every rank owns a shard of 16x16 shape images (square, cross,
bar, ring at a position) and their captions ("a big square at the top left"); a small conv image encoder and a
GRU text encoder (vocabulary from /tmp/fault255_work/vocab/vocab.txt, captions from captions/index.json, the
text encoder initialised from ckpt/text_enc.pt) map both into an l2-normalised joint space.  Both towers sit
in one module wrapped in DDP (gloo) or, with --ddp 0, gradients are all_reduced by hand.  Each step the image
embeddings of every rank are all_gathered (detached) as extra negatives, the loss is the max-of-hinges triplet
loss over the hardest negative of another shape class, and the loss is all_reduced for the log.  At the end the
embeddings are all_gathered for recall@K and the per-rank recall counts are all_gathered to rank 0.

Faults:
  noneg    - rank N labels classes by shard group, not shape: no negatives, max over nothing (RuntimeError)
  recalllen- rank N counts recall at K=1,5,10,20: all_gathers 4 counts against 3 (gloo size mismatch)
  vocab    - rank N reads vocab/vocab_v2.txt which does not exist (FileNotFoundError)
  imgid    - rank N takes one image id past its shard end: id missing from the caption index (KeyError)
  wordid   - rank N shifts word ids by the pad offset twice: an id beyond the embedding (IndexError)
  jointdim - every rank: config text_proj 48 against joint 32, similarity matmul fails (RuntimeError)
  nan      - rank N draws some shapes off the canvas: a zero image embedding, l2norm NaN, program's check
  ckpt     - rank N loads ckpt/text_enc_v120.pt saved with vocabulary 120 (size mismatch)
  mine     - rank N re-mines hard negatives over its whole shard for --stall seconds before the step-2 all_gather
  segv     - rank N sends itself SIGSEGV after step 2
  exit3    - rank N prints its own error line about empty captions and calls os._exit(3) at step 1
  none     - control, clean run

What happened (filled in after the runs):
  noneg    - rank N: IndexError max(): Expected reduction dim 1 to have non-zero size, step 0; peers closed
  recalllen- rank N: RuntimeError ProcessGroupGloo::allgather invalid tensor size (expected (4), got (3))
  vocab    - rank N: FileNotFoundError .../vocab/vocab_v2.txt before DDP; peers SIGTERMed
  imgid    - rank N: KeyError 'img_00NNN' at the caption index lookup before DDP; peers SIGTERMed
  wordid   - rank N: IndexError index out of range in self (nn.Embedding), step 0; peers closed
  jointdim - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (8x32 and 48x8)
  nan      - rank N: FloatingPointError similarity matrix has 16 non-finite entries (step 0 or 2)
  ckpt     - rank N: RuntimeError size mismatch for emb.weight [120, 32] vs [14, 32]; peers SIGTERMed
  mine     - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  segv     - rank N: exitcode -11 (SIGSEGV) after step 2; peers closed/reset in the next all_gather
  exit3    - rank N logs its ERROR empty-captions line, exitcode 3; peers reset in backward
  none     - clean, exit 0, rank 0 printed recall@1/5/10
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

WORK = "/tmp/fault255_work"
SHAPES = ["square", "cross", "bar", "ring"]
WHERE = ["top left", "top right", "bottom left", "bottom right"]
SIZES = ["small", "big"]
PER_RANK = 24
MAX_RANKS = 8


def draw(shape, where, size, shift=0):
    img = torch.zeros(1, 16, 16)
    s = 3 if size == "small" else 5
    y0 = 1 if where.startswith("top") else 9
    x0 = (1 if where.endswith("left") else 9) + shift
    if shape == "square":
        img[0, y0:y0 + s, x0:x0 + s] = 1.0
    elif shape == "cross":
        img[0, y0 + s // 2, x0:x0 + s] = 1.0
        img[0, y0:y0 + s, x0 + s // 2] = 1.0
    elif shape == "bar":
        img[0, y0:y0 + s, x0:x0 + 1] = 1.0
    else:
        img[0, y0:y0 + s, x0:x0 + s] = 1.0
        img[0, y0 + 1:y0 + s - 1, x0 + 1:x0 + s - 1] = 0.0
    return img


def words():
    return ["<pad>", "a", "at", "the"] + SIZES + SHAPES + ["top", "bottom", "left", "right"]


def prepare():
    os.makedirs(f"{WORK}/vocab", exist_ok=True)
    os.makedirs(f"{WORK}/captions", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    with open(f"{WORK}/vocab/vocab.txt", "w") as f:
        f.write("\n".join(words()) + "\n")
    index = {}
    for i in range(PER_RANK * MAX_RANKS):
        index[f"img_{i:05d}"] = {"shape": SHAPES[i % 4], "where": WHERE[(i // 4) % 4], "size": SIZES[(i // 16) % 2]}
    with open(f"{WORK}/captions/index.json", "w") as f:
        json.dump(index, f)
    torch.manual_seed(0)
    torch.save(TextEnc(len(words()), 32, 32).state_dict(), f"{WORK}/ckpt/text_enc.pt")
    torch.save(TextEnc(120, 32, 32).state_dict(), f"{WORK}/ckpt/text_enc_v120.pt")
    print("prepared", WORK)


class ImageEnc(nn.Module):
    def __init__(self, joint):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, stride=2, padding=1, bias=False)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.proj = nn.Linear(16, joint, bias=False)

    def forward(self, x):
        h = F.relu(self.c2(F.relu(self.c1(x))))
        return self.proj(h.mean(dim=(2, 3)))


class TextEnc(nn.Module):
    def __init__(self, vocab, hid, joint):
        super().__init__()
        self.emb = nn.Embedding(vocab, hid, padding_idx=0)
        self.gru = nn.GRU(hid, hid, batch_first=True)
        self.proj = nn.Linear(hid, joint)

    def forward(self, ids):
        _, h = self.gru(self.emb(ids))
        return self.proj(h[-1])


class VSE(nn.Module):
    def __init__(self, vocab, joint, text_proj):
        super().__init__()
        self.img = ImageEnc(joint)
        self.txt = TextEnc(vocab, 32, text_proj)

    def forward(self, imgs, ids):
        return l2norm(self.img(imgs)), l2norm(self.txt(ids))


def l2norm(x):
    return x / x.norm(dim=1, keepdim=True)


def hinge_hardest(sim, cls, extra, margin=0.2):
    pos = sim.diag().view(-1, 1)
    neg = cls.view(1, -1) != cls.view(-1, 1)
    cols = torch.nonzero(neg.any(dim=0)).flatten()
    cost = (margin + sim - pos).clamp(min=0).masked_fill(~neg, 0)[:, cols]
    hard = cost.max(dim=1)[0]
    if extra is not None:
        hard = torch.maximum(hard, (margin + extra - pos).clamp(min=0).max(dim=1)[0])
    return hard.mean()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    r, w = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and a.rank in (-1, r)
    torch.manual_seed(r)
    cfg = {"joint": 32, "text_proj": 48 if a.fault == "jointdim" else 32, "margin": 0.2}
    vocab_path = f"{WORK}/vocab/vocab_v2.txt" if bad and a.fault == "vocab" else f"{WORK}/vocab/vocab.txt"
    with open(vocab_path) as f:
        vocab = {wd: i for i, wd in enumerate(f.read().split())}
    with open(f"{WORK}/captions/index.json") as f:
        index = json.load(f)
    start, end = r * PER_RANK, (r + 1) * PER_RANK
    ids = [f"img_{i:05d}" for i in range(start, end)]
    if bad and a.fault == "imgid":
        ids[-1] = f"img_{end - 1 + MAX_RANKS * PER_RANK:05d}"
    imgs, caps, cls = [], [], []
    off = 2 if bad and a.fault == "wordid" else 1
    for j, iid in enumerate(ids):
        c = index[iid]
        shift = 16 if (bad and a.fault == "nan" and j % 7 == 3 and c["shape"] != "cross") else 0
        imgs.append(draw(c["shape"], c["where"], c["size"], shift))
        toks = ["a", c["size"], c["shape"], "at", "the"] + c["where"].split()
        caps.append([vocab[t] + off - 1 for t in toks])
        cls.append(int(iid[4:]) // PER_RANK if bad and a.fault == "noneg" else SHAPES.index(c["shape"]))
    imgs, caps, cls = torch.stack(imgs), torch.tensor(caps), torch.tensor(cls)
    if bad and a.fault == "noneg":
        order = torch.argsort(cls, stable=True)
        imgs, caps, cls = imgs[order], caps[order], cls[order]
    else:
        perm = torch.randperm(len(ids))
        imgs, caps, cls = imgs[perm], caps[perm], cls[perm]
    model = VSE(len(vocab), cfg["joint"], cfg["text_proj"])
    ck = f"{WORK}/ckpt/text_enc_v120.pt" if bad and a.fault == "ckpt" else f"{WORK}/ckpt/text_enc.pt"
    if cfg["text_proj"] == 32:
        model.txt.load_state_dict(torch.load(ck))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    print(f"rank {r}/{w}: {len(ids)} images, vocab {len(vocab)}, joint {cfg['joint']}, ddp {a.ddp}", flush=True)
    bs = a.batch
    nb = len(ids) // bs
    for step in range(a.steps):
        b = step % nb
        sl = slice(b * bs, (b + 1) * bs)
        ie, te = net(imgs[sl], caps[sl])
        sim = ie @ te.t()
        if not torch.isfinite(sim).all():
            n = int((~torch.isfinite(sim)).sum())
            raise FloatingPointError(f"rank {r}: similarity matrix has {n} non-finite entries at step {step}")
        if bad and a.fault == "mine" and step == 2:
            print(f"rank {r} re-mining hard negatives over all {len(ids)} shard images before step {step}", flush=True)
            time.sleep(a.stall)
        bank = [torch.zeros_like(ie) for _ in range(w)]
        dist.all_gather(bank, ie.detach())
        extra = torch.cat([bk for k, bk in enumerate(bank) if k != r]) @ te.t()
        loss = hinge_hardest(sim, cls[sl], extra.t(), cfg["margin"])
        if bad and a.fault == "exit3" and step == 1:
            print(f"ERROR rank {r}: caption shard {WORK}/captions/index.json gave 3 captions with no tokens "
                  f"after filtering for images {ids[0]}..{ids[-1]}; refusing to train on empty captions",
                  file=sys.stderr, flush=True)
            os._exit(3)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= w
        opt.step()
        g = loss.detach().clone()
        dist.all_reduce(g)
        print(f"rank {r} step {step} loss {loss.item():.4f} global {g.item() / w:.4f}", flush=True)
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        ie, te = model(imgs, caps)
    gi = [torch.zeros_like(ie) for _ in range(w)]
    dist.all_gather(gi, ie)
    gallery = torch.cat(gi)
    rank_of = (te @ gallery.t()).argsort(dim=1, descending=True)
    target = torch.arange(len(ids)) + r * len(ids)
    ks = (1, 5, 10, 20) if bad and a.fault == "recalllen" else (1, 5, 10)
    counts = torch.tensor([float((rank_of[:, :k] == target.view(-1, 1)).any(1).sum()) for k in ks])
    allc = [torch.zeros(3) for _ in range(w)]
    dist.all_gather(allc, counts)
    if r == 0:
        tot = torch.stack(allc).sum(0) / (w * len(ids))
        print(f"rank 0 done: {a.steps} steps, text->image recall@1 {tot[0]:.3f} @5 {tot[1]:.3f} @10 {tot[2]:.3f}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
