"""A hundred-and-fifty-first hand-run batch: SEQUENCE-TO-SEQUENCE TRANSLATION WITH TEACHER FORCING AND BEAM SEARCH.

A tiny GRU encoder-decoder with dot-product attention learns a toy "copy with offset" task over synthetic token
ids (target = source + 3 mod the content vocabulary, ids 3..V-1; 0 = PAD, 1 = BOS, 2 = EOS). Each rank builds
padded batches of variable-length sequences with a source mask, trains with teacher forcing (ratio --tf),
CrossEntropyLoss with label smoothing and ignore_index=PAD, wrapped in DDP (or, with --ddp 0, gradients
all_reduced by hand). Every --val-every steps each rank decodes a validation batch (greedy, or beam search with
--beam > 1), computes an exact-match rate and all_reduces it. Prints `rank R step S loss L`. Rank 0 saves
s2s.pt at the end; --init 1 loads it into the whole model first.
Faults:
- vocab: rank N's target offset wraps modulo V+1 instead of V: a target id equals V, out of range in the embedding.
- padidx: the target padding value is -1 on every rank while the loss ignores PAD=0 (CrossEntropyLoss target -1).
- beam: rank N's beam search never stops (EOS never ends a hypothesis, no length cap): it never joins the metric.
- hidden: the decoder's initial hidden state is built batch-first (B, 1, H) on every rank; the GRU wants (1, B, H).
- maskf: rank N builds its additive attention mask as pad.float() * -inf: 0 * -inf = NaN; the logits check fires.
- maxlen: rank N reads max_len from its node-local decode.cfg as text ("12"): range() gets a str.
- vocabfile: rank N reads vocab.txt from a node-local data dir that was never synced.
- gather: rank N drops the last validation example, so the all_gathered per-example match vector is shorter.
- ckpt: the save path writes model.decoder.state_dict() only; with --init 1 every rank loads it into the model.
- exit: rank N's early-stop branch calls os._exit(4) at step 3.
- sigterm: rank N sends itself SIGTERM at step 2.
What happened (filled in after the runs):
- vocab: rank N IndexError 'index out of range in self' in the decoder embedding (line 131) at step 0; peers closed.
- padidx: every rank IndexError 'Target -1 is out of bounds.' in CrossEntropyLoss (line 205) at step 0.
- beam: PG 12 s: peers 'Timed out waiting 12000ms' recv/send in all_gather (line 231); PG 300 s: timeout 60, exit 124.
- hidden: every rank RuntimeError 'Expected hidden size (1, 8, 32), got [8, 1, 32]' in the decoder GRU (line 135).
- maskf: rank N FloatingPointError 'non-finite decoder logits (1280 of 1280)' (line 203) at step 0; peers closed.
- maxlen: rank N TypeError "'>' not supported between instances of 'int' and 'str'" in beam_search (line 160).
- vocabfile: rank N FileNotFoundError '/tmp/job_work/nodeN_data/vocab.txt' (line 77); restart: connectFullMesh refused.
- gather: plain: gloo EnforceNotMet '12 vs 10' size mismatch, SIGABRT; DETAIL: 'Detected mismatch' [5] vs [6].
- ckpt: every rank RuntimeError loading state_dict: Missing key(s) src_emb.weight ..., Unexpected emb.weight (line 191).
- exit: rank N exitcode 4 after step 3, no traceback; peers 'Connection reset by peer' in all_gather (line 231).
- sigterm: rank N exitcode -15 (SIGTERM) after step 2; peers 'Connection reset by peer' in DDP backward (line 207).
"""
import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--vocab", type=int, default=20)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--tf", type=float, default=0.7)
p.add_argument("--beam", type=int, default=2)
p.add_argument("--val-every", type=int, default=2)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--init", type=int, default=0)
p.add_argument("--out", default="/tmp/fault151_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)
PAD, BOS, EOS = 0, 1, 2
OFFSET = 3


def hit(name):
    return a.fault == name and (a.rank == -1 or a.rank == RANK)


def load_vocab():
    path = os.path.join(a.out, "vocab.txt")
    if hit("vocabfile"):
        path = os.path.join(a.out, f"node{RANK}_data", "vocab.txt")
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def load_max_len():
    path = os.path.join(a.out, "decode.cfg")
    with open(path) as f:
        cfg = dict(line.strip().split("=", 1) for line in f if "=" in line)
    if hit("maxlen"):
        return cfg["max_len"]
    return int(cfg["max_len"])


def make_batch(g, n):
    V = a.vocab
    lens = torch.randint(3, 8, (n,), generator=g)
    T = int(lens.max())
    src = torch.full((n, T), PAD, dtype=torch.long)
    tgt_in = torch.full((n, T + 1), PAD, dtype=torch.long)
    tgt_out = torch.full((n, T + 1), -1 if hit("padidx") else PAD, dtype=torch.long)
    mod = V + 1 - OFFSET if hit("vocab") else V - OFFSET
    for i in range(n):
        L = int(lens[i])
        s = torch.randint(OFFSET, V, (L,), generator=g)
        t = (s - OFFSET + 3) % mod + OFFSET
        src[i, :L] = s
        tgt_in[i, 0] = BOS
        tgt_in[i, 1:L + 1] = t
        tgt_out[i, :L] = t
        tgt_out[i, L] = EOS
    return src, tgt_in, tgt_out


class Seq2Seq(nn.Module):
    def __init__(self, V, H):
        super().__init__()
        self.src_emb = nn.Embedding(V, H, padding_idx=PAD)
        self.encoder = nn.GRU(H, H, batch_first=True)
        self.decoder = nn.ModuleDict({"emb": nn.Embedding(V, H, padding_idx=PAD),
                                      "gru": nn.GRU(2 * H, H, batch_first=True),
                                      "out": nn.Linear(2 * H, V)})

    def encode(self, src):
        enc, h = self.encoder(self.src_emb(src))
        pad = src == PAD
        if hit("maskf"):
            mask = pad.float() * float("-inf")
        else:
            mask = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))
        if hit("hidden"):
            h = h.transpose(0, 1)
        return enc, h, mask

    def step(self, tok, h, enc, mask):
        e = self.decoder["emb"](tok).unsqueeze(1)
        q = h[-1].unsqueeze(1)
        scores = (q @ enc.transpose(1, 2)).squeeze(1) + mask
        ctx = (F.softmax(scores, dim=-1).unsqueeze(1) @ enc)
        o, h = self.decoder["gru"](torch.cat([e, ctx], -1), h)
        return self.decoder["out"](torch.cat([o, ctx], -1)).squeeze(1), h

    def forward(self, src, tgt_in, tf, g):
        enc, h, mask = self.encode(src)
        tok = tgt_in[:, 0]
        logits = []
        for t in range(tgt_in.size(1)):
            lo, h = self.step(tok, h, enc, mask)
            logits.append(lo)
            if t + 1 < tgt_in.size(1):
                use_gold = torch.rand((), generator=g).item() < tf
                tok = tgt_in[:, t + 1] if use_gold else lo.argmax(-1)
        return torch.stack(logits, 1)


def beam_search(m, src, max_len, k):
    enc, h, mask = m.encode(src)
    outs = []
    for i in range(src.size(0)):
        beams = [([BOS], 0.0, h[:, i:i + 1])]
        done = []
        n = 0
        while beams:
            n += 1
            if n > max_len and not hit("beam"):
                break
            cand = []
            for seq, sc, hh in beams:
                lo, hh2 = m.step(torch.tensor([seq[-1]]), hh, enc[i:i + 1], mask[i:i + 1])
                lp = F.log_softmax(lo, -1)[0]
                top = lp.topk(k)
                for v, ix in zip(top.values.tolist(), top.indices.tolist()):
                    cand.append((seq + [ix], sc + v, hh2))
            cand.sort(key=lambda c: -c[1])
            beams = []
            for c in cand[:k]:
                if c[0][-1] == EOS and not hit("beam"):
                    done.append(c)
                else:
                    beams.append(c)
            if len(done) >= k:
                break
        best = max(done + beams, key=lambda c: c[1] / len(c[0]))
        outs.append(best[0][1:])
    return outs


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    vocab = load_vocab()
    max_len = load_max_len()
    torch.manual_seed(0)
    model = Seq2Seq(len(vocab), a.hidden)
    if a.init:
        sd = torch.load(os.path.join(a.out, "s2s.pt"))
        model.load_state_dict(sd)
        print(f"rank {RANK} loaded s2s.pt", flush=True)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    crit = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)
    g = torch.Generator().manual_seed(100 + RANK)
    vg = torch.Generator().manual_seed(7 + RANK)
    val_src, _, val_out = make_batch(vg, 6)
    for step in range(a.steps):
        src, tgt_in, tgt_out = make_batch(g, a.batch)
        logits = net(src, tgt_in, a.tf, g)
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"rank {RANK} step {step}: non-finite decoder logits "
                                     f"({int((~torch.isfinite(logits)).sum())} of {logits.numel()})")
        loss = crit(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
        if hit("sigterm") and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        if hit("exit") and step == 3:
            os._exit(4)
        if (step + 1) % a.val_every == 0:
            model.eval()
            with torch.no_grad():
                hyps = beam_search(model, val_src, max_len, a.beam)
            model.train()
            match = []
            for i, hyp in enumerate(hyps):
                ref = val_out[i][val_out[i] != PAD].tolist()
                match.append(float(hyp == ref))
            if hit("gather"):
                match = match[:-1]
            mt = torch.tensor(match)
            allm = [torch.zeros(len(match)) for _ in range(WORLD)]
            dist.all_gather(allm, mt)
            em = torch.tensor([sum(x.sum() for x in allm).item(), float(sum(x.numel() for x in allm))])
            dist.all_reduce(em)
            if RANK == 0:
                print(f"step {step} val exact-match {em[0].item() / em[1].item():.3f}", flush=True)
    if RANK == 0:
        torch.save(model.decoder.state_dict() if a.fault == "ckpt" else model.state_dict(),
                   os.path.join(a.out, "s2s.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
