"""A hundred-and-eightieth hand-run batch: IMAGE CAPTIONING.

Rank 0 writes the vocabulary file (data/vocab.txt); every rank writes and reads back its shard of synthetic 3x16x16
images (data/images_rR/*.npy) with token captions (data/captions_rR.json).  The model is a small CNN encoder (two
convs, pooling, a linear to the decoder's hidden size, optionally initialised from --encoder-ckpt) and a GRU decoder
with token and learned positional embeddings (max_len 12), trained with teacher forcing on padded captions through
pack_padded_sequence.  Training runs under DDP on gloo (or --ddp 0: gradients all-reduced by hand); the loss is
all_reduced each step.  Validation decodes a few images greedily or with beam search, all_gathers the per-rank
n-gram match counts for a BLEU-like score on rank 0; rank 0 saves --save.

Faults:
  toolong    - rank N's captions are not truncated to max_len (positional embedding index out of range)
  unktok     - rank N's caption shard holds a word missing from the vocabulary file (KeyError)
  unsorted   - every rank's config sets enforce_sorted=True with unsorted caption lengths (pack_padded_sequence)
  beamwide   - rank N's validation uses a beam width larger than the vocabulary (topk k out of range)
  slowval    - rank N decodes the whole validation set for --busy seconds before the BLEU all_gather
  bleulen    - rank N all_gathers BLEU counts for 5 n-gram orders against 4 on the others
  encckpt    - rank N initialises the encoder from a 1-channel (grayscale) checkpoint (size mismatch)
  imgmissing - rank N reads its images from a validation folder that was never written (FileNotFoundError)
  nanloss    - rank N's shard holds blank images; per-image std normalisation gives 0/0, the loss check raises
  segv       - rank N gets SIGSEGV (sent to itself) at step 2
  exit9      - rank N prints its own caption-filter error line and exits with code 9
  none       - control, clean run

What happened (filled in after the runs):
  toolong    - rank N: IndexError: index out of range in self (positional embedding) at step 0; peers Connection closed
  unktok     - rank N: KeyError: 'giraffe' in encode(); restart run dies in connectFullMesh (Connection refused)
  unsorted   - every rank: RuntimeError `lengths` array must be sorted in decreasing order when `enforce_sorted` is True
  beamwide   - rank N: RuntimeError: selected index k out of range (topk in beam_decode) after step 4
  slowval    - busy 40 s: peers gloo timeout 12000ms in all_gather; busy 1000 s / PG 300 s: killed by timeout 60, exit 124
  bleulen    - a peer aborts on gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT); injected rank reset
  encckpt    - rank N: RuntimeError loading state_dict for Encoder: size mismatch for conv1.weight [8, 1, 3, 3] vs [8, 3, 3, 3]
  imgmissing - rank N: FileNotFoundError [Errno 2] No such file or directory: 'data/images_rN_val'
  nanloss    - rank N: FloatingPointError loss is nan at step 0 on rank N (check image normalisation)
  segv       - rank N: exitcode -11 (SIGSEGV) after step 2; peers Connection reset by peer
  exit9      - rank N: prints its ERROR caption shard line, exitcode 9 (no traceback)
  none       - clean, exit 0, rank 0 BLEU-like 0.0354 and saved ckpt/captioner.pt
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

WORDS = ["<pad>", "<bos>", "<eos>", "a", "red", "blue", "green", "square", "circle", "on", "the", "left", "right",
         "small", "big", "dog", "cat", "sits", "near", "tree"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--max-len", type=int, default=12)
    p.add_argument("--beam", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault180_work")
    p.add_argument("--encoder-ckpt", default="ckpt/encoder_rgb.pt")
    p.add_argument("--save", default="ckpt/captioner.pt")
    return p.parse_args()


class Encoder(nn.Module):
    def __init__(self, ch, hidden):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, hidden)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return torch.tanh(self.fc(x.flatten(1)))


class Captioner(nn.Module):
    def __init__(self, vocab_size, hidden, max_len):
        super().__init__()
        self.encoder = Encoder(3, hidden)
        self.tok = nn.Embedding(vocab_size, hidden, padding_idx=0)
        self.pos = nn.Embedding(max_len, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, img, tokens, lengths, enforce_sorted=False):
        h0 = self.encoder(img).unsqueeze(0)
        pos = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
        x = self.tok(tokens) + self.pos(pos)
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
        y, _ = self.gru(packed, h0)
        y, _ = pad_packed_sequence(y, batch_first=True, total_length=tokens.size(1))
        return self.out(y)

    def step(self, tok, t, h):
        x = self.tok(tok) + self.pos(torch.full_like(tok, t))
        y, h = self.gru(x.unsqueeze(1), h)
        return F.log_softmax(self.out(y[:, 0]), -1), h


def make_shard(rank, n, max_len, fault, is_fault, rng):
    caps = []
    for i in range(n):
        ln = int(rng.integers(3, max_len - 2))
        if fault == "toolong" and is_fault and i == 5:
            ln = max_len + 4
        ws = [WORDS[int(k)] for k in rng.integers(3, len(WORDS), ln)]
        if fault == "unktok" and is_fault and i == 3:
            ws[1] = "giraffe"
        caps.append(" ".join(ws))
    imgs = rng.normal(size=(n, 3, 16, 16)).astype(np.float32)
    if fault == "nanloss" and is_fault:
        imgs[2:4] = 0.0
    return imgs, caps


def encode(caps, vocab, max_len, truncate):
    seqs = []
    for c in caps:
        ids = [vocab["<bos>"]] + [vocab[w] for w in c.split()] + [vocab["<eos>"]]
        seqs.append(ids[:max_len] if truncate else ids)
    lengths = [len(s) for s in seqs]
    out = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s)
    return out, torch.tensor(lengths)


def beam_decode(model, img, beam, max_len, vocab_size):
    h = model.encoder(img).unsqueeze(0)
    tok = torch.full((1,), 1, dtype=torch.long)
    lp, h = model.step(tok, 0, h)
    scores, idx = lp[0].topk(beam)
    seqs = [[int(i)] for i in idx]
    hs = h.expand(1, beam, h.size(2)).contiguous()
    for t in range(1, max_len - 1):
        lp, hs = model.step(idx, t, hs)
        tot = (scores.unsqueeze(1) + lp).view(-1)
        scores, flat = tot.topk(beam)
        prev, idx = flat // vocab_size, flat % vocab_size
        seqs = [seqs[int(p)] + [int(i)] for p, i in zip(prev, idx)]
        hs = hs[:, prev]
    return seqs[0]


def main():
    a = parse()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    is_fault = a.rank in (-1, rank)
    os.chdir(a.workdir)
    os.makedirs("data", exist_ok=True)
    os.makedirs("ckpt", exist_ok=True)
    torch.manual_seed(0)
    rng = np.random.default_rng(100 + rank)
    if rank == 0:
        with open("data/vocab.txt", "w") as f:
            f.write("\n".join(WORDS) + "\n")
        if not os.path.exists(a.encoder_ckpt):
            torch.save(Encoder(3, a.hidden).state_dict(), a.encoder_ckpt)
    imgs, caps = make_shard(rank, 64, a.max_len, a.fault, is_fault, rng)
    img_dir = f"data/images_r{rank}"
    os.makedirs(img_dir, exist_ok=True)
    for i, im in enumerate(imgs):
        np.save(f"{img_dir}/{i:04d}.npy", im)
    with open(f"data/captions_r{rank}.json", "w") as f:
        json.dump(caps, f)
    dist.barrier()
    with open("data/vocab.txt") as f:
        vocab = {w: i for i, w in enumerate(f.read().split())}
    print(f"rank {rank}: vocab {len(vocab)} words, {len(caps)} captions, max_len {a.max_len}", flush=True)
    if a.fault == "imgmissing" and is_fault:
        img_dir = f"data/images_r{rank}_val"
    files = sorted(os.listdir(img_dir))
    imgs = torch.from_numpy(np.stack([np.load(os.path.join(img_dir, fn)) for fn in files]))
    imgs = (imgs - imgs.mean(dim=(1, 2, 3), keepdim=True)) / imgs.std(dim=(1, 2, 3), keepdim=True)
    with open(f"data/captions_r{rank}.json") as f:
        caps = json.load(f)
    if a.fault == "exit9" and is_fault:
        print(f"ERROR rank {rank}: caption shard data/captions_r{rank}.json has 0 usable captions after "
              f"filtering (min_len 20, max_len {a.max_len}); refusing to train on an empty shard", flush=True)
        sys.exit(9)
    tokens, lengths = encode(caps, vocab, a.max_len, truncate=not (a.fault == "toolong" and is_fault))
    model = Captioner(len(vocab), a.hidden, a.max_len)
    ck = a.encoder_ckpt
    if a.fault == "encckpt" and is_fault:
        ck = "ckpt/encoder_gray.pt"
    model.encoder.load_state_dict(torch.load(ck))
    print(f"rank {rank}: encoder initialised from {ck}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=a.lr)
    enforce = a.fault == "unsorted"
    for s in range(a.steps):
        idx = torch.arange(s * a.batch, (s + 1) * a.batch) % len(caps)
        x, tk, ln = imgs[idx], tokens[idx], lengths[idx]
        logits = net(x, tk[:, :-1], (ln - 1).clamp(min=1), enforce_sorted=enforce)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tk[:, 1:].reshape(-1), ignore_index=0)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {s} on rank {rank} "
                                     f"(check image normalisation of data/images_r{rank})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {s} loss {lt.item() / world:.4f}", flush=True)
        if a.fault == "segv" and is_fault and s == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    model.eval()
    beam = len(vocab) + 4 if (a.fault == "beamwide" and is_fault) else a.beam
    orders = 5 if (a.fault == "bleulen" and is_fault) else 4
    counts = torch.zeros(2 * orders)
    with torch.no_grad():
        if a.fault == "slowval" and is_fault:
            print(f"rank {rank}: decoding the full validation set (4096 images, beam {beam})", flush=True)
            time.sleep(a.busy)
        for i in range(4):
            hyp = beam_decode(model, imgs[i:i + 1], beam, a.max_len, len(vocab))
            ref = tokens[i, 1:lengths[i]].tolist()
            for n in range(1, orders + 1):
                hg = [tuple(hyp[j:j + n]) for j in range(len(hyp) - n + 1)]
                rg = set(tuple(ref[j:j + n]) for j in range(len(ref) - n + 1))
                counts[2 * (n - 1)] += sum(g in rg for g in hg)
                counts[2 * (n - 1) + 1] += max(len(hg), 1)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        tot = torch.stack(gathered).sum(0)
        prec = (tot[0::2] + 1) / (tot[1::2] + 1)
        print(f"rank 0: validation BLEU-like {float(prec.log().mean().exp()):.4f} over {4 * world} images", flush=True)
        torch.save(model.state_dict(), a.save)
        print(f"rank 0: saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
