"""A two-hundred-and-twenty-fifth hand-run batch: IMAGE CAPTION RETRIEVAL WITH A DUAL ENCODER. CNN + GRU, InfoNCE.

The program builds synthetic image/caption pairs (an image of one of ten shape/colour classes, a caption of
class words plus filler tokens), stages a caption vocabulary file on each node, and trains a dual encoder: a small
CNN image tower and an embedding + GRU text tower, both projected to a shared embedding and L2-normalised, with a
symmetric InfoNCE loss scaled by a learnable log-temperature (logit_scale, clamped like CLIP). Training runs under
DDP over gloo (or with a hand-written gradient all_reduce when --ddp 0). Afterwards each rank encodes a gallery,
the embeddings are all_gathered, and recall@K is computed by hand; rank 0 prints it and saves the model.

Faults:
- tokenid: rank N's step-1 caption holds token id 40 with a 40-word vocabulary; the embedding raises IndexError.
- embdim: every rank projects text to 48 dims and images to 64; the similarity matmul fails (RuntimeError).
- vocab: rank N's node has no staged vocab.txt; open() raises FileNotFoundError before training.
- temp: rank N's warmup sets logit_scale to 1/T=100 instead of log(1/T); exp() is inf and the program's check raises.
- topk: every rank is configured with recall cutoffs (1, 5, 64) for a smaller gallery; torch's topk raises.
- gather: rank N encodes a gallery of 9 instead of 8, so its all_gather tensor differs in size (gloo mismatch).
- ckpt: rank N's node cache holds a text tower with GRU hidden 48; load_state_dict raises size mismatch.
- caption: rank N's step-1 record has no "caption" field; the dataset raises KeyError.
- regallery: rank N finds its gallery cache stale and re-encodes (sleeps --slow-s) before the all_gather.
- segv: rank N sends itself SIGSEGV after step 1 (a crash in the image decoder).
- exit3: rank N prints an ERROR line about a corrupt image shard and calls os._exit(3) after step 1.
- none: control, no fault.

What happened (filled in after the runs):
- tokenid: IndexError `index out of range in self` at step 1 on rank 2 (np4 plain); rank 3 aborted after Connection closed (Root Cause rank 3).
- embdim: RuntimeError `mat1 and mat2 shapes cannot be multiplied (8x64 and 48x8)` on all four ranks at step 0 (np4 tee).
- vocab: FileNotFoundError for node3/coco_tiny/vocab.txt on rank 3 (np5 redirects; console holds only agent lines).
- temp: FloatingPointError `logit scale exp(100.0) = inf is not finite at step 2` on rank 1 (np4 detail, --ddp 0).
- topk: not run (the batch was cut short for time).
- gather: 9 vs 8 embeddings in all_gather on rank 2 (np4 filter): rank 3 aborted (SIGABRT), peers connection errors.
- ckpt: RuntimeError size mismatch for gru.weight_hh_l0 [144, 48] vs [96, 32] on rank 3 (np4 wrapper).
- caption: run dropped (two overlapping runs on one port; see README).
- regallery: not run (the batch was cut short for time).
- segv: run killed unfinished and dropped (the batch was cut short for time).
- exit3: not run (the batch was cut short for time).
- none: not run (only the unsaved smoke test on port 44500, exit 0).
"""
import argparse
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

NUM_CLASSES = 10
SIZE = 16
CAP_LEN = 6
WORDS = ["<pad>", "<unk>", "a", "the", "photo", "of", "picture", "small", "large", "on", "white", "background",
         "red", "green", "blue", "yellow", "purple", "orange", "black", "grey", "pink", "brown",
         "circle", "square", "triangle", "cross", "ring", "bar", "dot", "star", "stripe", "blob",
         "left", "right", "top", "bottom", "centre", "bright", "dark", "shape"]


def parse_args():
    p = argparse.ArgumentParser(description="tiny dual encoder for caption retrieval")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--gallery", type=int, default=8)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--workdir", default="/tmp/fault225_work")
    return p.parse_args()


class ImageTower(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, stride=2)
        self.proj = nn.Linear(32, dim)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return F.normalize(self.proj(x.mean(dim=(2, 3))), dim=-1)


class TextTower(nn.Module):
    def __init__(self, vocab_size, dim, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 24, padding_idx=0)
        self.gru = nn.GRU(24, hidden, batch_first=True)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, tokens):
        _, h = self.gru(self.embed(tokens))
        return F.normalize(self.proj(h[-1]), dim=-1)


class DualEncoder(nn.Module):
    def __init__(self, vocab_size, img_dim=64, txt_dim=64):
        super().__init__()
        self.image = ImageTower(img_dim)
        self.text = TextTower(vocab_size, txt_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images, tokens):
        return self.image(images), self.text(tokens)


def stage_vocab(a, rank, bad):
    node = os.path.join(a.workdir, f"node{rank}", "coco_tiny")
    os.makedirs(node, exist_ok=True)
    path = os.path.join(node, "vocab.txt")
    if bad("vocab"):
        if os.path.exists(path):
            os.remove(path)
    else:
        with open(path, "w") as f:
            f.write("\n".join(WORDS) + "\n")
    return path


def load_vocab(path):
    with open(path) as f:
        return {w: i for i, w in enumerate(line.strip() for line in f if line.strip())}


def make_record(label, gen, idx):
    colours, shapes = WORDS[12:22], WORDS[22:32]
    words = ["a", "photo", "of", colours[label], shapes[(label * 3) % 10], WORDS[32 + int(torch.randint(0, 8, (1,), generator=gen))]]
    return {"image_id": f"img_{idx:06d}", "label": label, "caption": " ".join(words)}


def make_image(label, gen):
    img = torch.rand(3, SIZE, SIZE, generator=gen) * 0.2
    img[label % 3, 2 + label // 2: 8 + label // 2, 4:10] += 1.0
    img[(label + 1) % 3, :, label:label + 3] += 0.5
    return img


def tokenize(caption, vocab):
    ids = [vocab.get(w, 1) for w in caption.split()][:CAP_LEN]
    return ids + [0] * (CAP_LEN - len(ids))


def info_nce(img, txt, scale):
    logits = scale * img @ txt.t()
    target = torch.arange(img.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def main():
    a = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = lambda name: a.fault == name and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(200 + rank)

    vocab = load_vocab(stage_vocab(a, rank, bad))
    txt_dim = 48 if bad("embdim") else 64
    print(f"rank {rank}/{world}: vocab {len(vocab)} words, embed dims image 64 text {txt_dim}", flush=True)
    model = DualEncoder(len(vocab), 64, txt_dim)
    cache = os.path.join(a.workdir, f"node{rank}", "cache")
    os.makedirs(cache, exist_ok=True)
    ckpt_path = os.path.join(cache, "text_tower_pretrained.pt")
    torch.save(TextTower(len(vocab), txt_dim, hidden=48 if bad("ckpt") else 32).state_dict(), ckpt_path)
    model.text.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    print(f"rank {rank}: loaded text tower from {ckpt_path}", flush=True)

    net = DDP(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        records, images, tokens = [], [], []
        for i in range(a.batch):
            label = int(torch.randint(0, NUM_CLASSES, (1,), generator=gen))
            rec = make_record(label, gen, rank * 1000 + step * a.batch + i)
            if step == 1 and i == 5 and bad("caption"):
                rec = {"image_id": rec["image_id"], "label": label, "captions": [rec["caption"]]}
            records.append(rec)
            images.append(make_image(label, gen))
            ids = tokenize(rec["caption"], vocab)
            if step == 1 and i == 2 and bad("tokenid"):
                ids[4] = len(vocab)
            tokens.append(ids)
        if step == 2 and bad("temp"):
            with torch.no_grad():
                model.logit_scale.fill_(1 / 0.01)
        img_emb, txt_emb = net(torch.stack(images), torch.tensor(tokens))
        scale = model.logit_scale.exp()
        if not torch.isfinite(scale):
            raise FloatingPointError(f"rank {rank}: logit scale exp({model.logit_scale.item():.1f}) = {scale.item()} is not finite at step {step}")
        loss = info_nce(img_emb, txt_emb, scale)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        print(f"rank {rank} step {step} loss {loss.item():.4f} scale {scale.item():.2f}", flush=True)
        if step == 1 and bad("segv"):
            os.kill(os.getpid(), signal.SIGSEGV)
        if step == 1 and bad("exit3"):
            print(f"ERROR rank {rank}: image shard /tmp/fault225_work/node{rank}/coco_tiny/images-0000{rank}.tar is truncated at member 412; cannot continue", flush=True)
            os._exit(3)

    model.eval()
    n_gal = a.gallery + (1 if bad("gather") else 0)
    with torch.no_grad():
        labels = [(rank + i) % NUM_CLASSES for i in range(n_gal)]
        imgs = torch.stack([make_image(l, gen) for l in labels])
        toks = torch.tensor([tokenize(make_record(l, gen, i)["caption"], vocab) for i, l in enumerate(labels)])
        img_emb, txt_emb = model(imgs, toks)
    if bad("regallery"):
        print(f"rank {rank}: gallery cache index stale (built for 4 epochs ago), re-encoding all 5000 gallery images", flush=True)
        time.sleep(a.slow_s)
    all_img = [torch.zeros_like(img_emb) for _ in range(world)]
    all_txt = [torch.zeros_like(txt_emb) for _ in range(world)]
    dist.all_gather(all_img, img_emb)
    dist.all_gather(all_txt, txt_emb)
    gi, gt = torch.cat(all_img), torch.cat(all_txt)
    sim = gi @ gt.t()
    ks = (1, 5, 64) if bad("topk") else (1, 5)
    hits = {}
    for k in ks:
        top = sim.topk(k, dim=1).indices
        hits[k] = float((top == torch.arange(sim.shape[0]).unsqueeze(1)).any(dim=1).float().mean())
    if rank == 0:
        print("image->text recall " + " ".join(f"R@{k} {v:.3f}" for k, v in hits.items()) + f" over a gallery of {sim.shape[0]}", flush=True)
        torch.save(model.state_dict(), os.path.join(a.workdir, "dual_final.pt"))
        print(f"saved model to {os.path.join(a.workdir, 'dual_final.pt')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
