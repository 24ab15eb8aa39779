"""A two-hundred-and-fifth hand-run batch: EXTRACTIVE QUESTION ANSWERING. A tiny transformer encoder predicts
answer start and end positions over synthetic context/question pairs. A hand-written whitespace tokenizer reads a
vocabulary file, long contexts are cut into doc-stride windows ([CLS] question [SEP] window [SEP]), the model is
warm-started from a checkpoint, trained with DDP (or hand all-reduced gradients with --ddp 0), and exact match /
F1 are computed by hand and all_reduced / all_gathered across ranks.

Faults:
- spanwin: on --rank, an off-by-one in the window offsets puts an answer end one past the window (nll_loss IndexError).
- logitlen: start and end logits sliced to different lengths on --rank (-1 every rank): torch.stack shape error.
- vocab: --rank reads a vocabulary file that does not exist (FileNotFoundError).
- maskrow: --rank builds a window with an empty context part; the masked softmax is NaN; the loss check raises.
- stride: the doc stride is configured larger than the max sequence length; the windowing raises ValueError.
- emlen: --rank slices its EM/F1 eval head one window too long, so the all_gathered tensor has another length.
- ckptlayers: --rank warm-starts from a checkpoint with 3 encoder layers instead of 2 (unexpected keys).
- oov: --rank's split holds a token missing from the vocabulary (KeyError in the tokenizer).
- retok: --rank re-tokenises its whole split for --retok-s seconds before the first step; the others time out.
- segv: --rank sends itself SIGSEGV after step 2.
- exit3: --rank logs an error about its answer coverage and exits with code 3.
- none: control.

What happened (filled in after the runs):
- spanwin: rank N raised IndexError 'Target 32 is out of bounds.' in nll_loss at step 0; peers Connection closed by peer (np4 r2).
- logitlen: every rank RuntimeError 'stack expects each tensor to be equal size, but got [8, 32] ... [8, 31]' at step 0.
- vocab: rank 1 FileNotFoundError on /tmp/job_work/vocab-uncased.txt before any collective; peers SIGTERMed.
- maskrow: rank N FloatingPointError 'non-finite QA loss nan at step 0'; with DETAIL rank 0 reports a monitoredBarrier failure.
- stride: every rank ValueError 'doc_stride (48) must be smaller than max_seq_length (32)' before training.
- emlen: after 6 steps a peer aborts with gloo EnforceNotMet '... Received data size doesn't match expected size'.
- ckptlayers: rank 2 RuntimeError loading state_dict: Unexpected key(s) encoder.layers.2.*; peers SIGTERMed.
- oov: rank N KeyError 'Zürich' in the tokenizer before training (np5 r3, np3 r0).
- retok: PG 12 s: peers time out in the DDP constructor (gloo Timed out waiting 12000ms); PG 300 s: killed by timeout 60, exit 124.
- segv: rank N exitcode -11 (SIGSEGV) after step 2; peers Connection reset/closed by peer (np4 r2 pdsh2, np5 r4).
- exit3: rank N prints 'ERROR rank N: only ... windows contain an answer ...' and exits 3; peers Connection closed by peer.
- none: exit 0; rank 0 prints the EM/F1 line and saves /tmp/job_work/qa_final.pt.
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

WORK = "/tmp/fault205_work"
SPECIAL = ["[PAD]", "[CLS]", "[SEP]"]
WORDS = [f"w{i}" for i in range(60)] + ["who", "what", "when", "where"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--doc-stride", type=int, default=16)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--retok-s", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prep", type=int, default=0)
    return p.parse_args()


class QAModel(nn.Module):
    def __init__(self, vocab_size, d=32, layers=2, max_len=32):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.qa = nn.Linear(d, 2)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        h = self.encoder(self.tok(ids) + self.pos(pos), src_key_padding_mask=ids.eq(0))
        return self.qa(h)


def load_vocab(path):
    with open(path) as f:
        return {w.strip(): i for i, w in enumerate(f) if w.strip()}


def make_examples(rank, n, fault_here, fault):
    rng = random.Random(100 + rank)
    out = []
    for k in range(n):
        ctx = [rng.choice(WORDS[:60]) for _ in range(rng.randint(20, 50))]
        if fault_here and fault == "oov" and k == 3:
            ctx[7] = "Zürich"
        s = rng.randint(0, len(ctx) - 3)
        e = s + rng.randint(0, 2)
        q = [rng.choice(WORDS[60:])] + ctx[max(0, s - 2):s]
        out.append((q, ctx, s, e))
    return out


def featurize(examples, vocab, max_len, stride, fault_here, fault):
    if stride >= max_len:
        raise ValueError(f"doc_stride ({stride}) must be smaller than max_seq_length ({max_len})")
    feats = []
    for q, ctx, s, e in examples:
        qi = [vocab[w] for w in q]
        room = max_len - len(qi) - 3
        start = 0
        while True:
            win = ctx[start:start + room]
            ids = [vocab["[CLS]"]] + qi + [vocab["[SEP]"]] + [vocab[w] for w in win] + [vocab["[SEP]"]]
            off = len(qi) + 2
            cmask = [0] * off + [1] * len(win) + [0]
            if fault_here and fault == "maskrow" and len(feats) == 5:
                cmask = [0] * len(ids)
            if start <= s and e < start + len(win):
                sp, ep = off + s - start, off + e - start
            else:
                sp = ep = 0
            if fault_here and fault == "spanwin" and len(feats) == 4:
                ep = off + room + 1
            pad = max_len - len(ids)
            feats.append((ids + [0] * pad, cmask + [0] * pad, sp, ep, s, e, start))
            if start + room >= len(ctx):
                break
            start += stride
    return feats


def prep():
    os.makedirs(WORK, exist_ok=True)
    with open(os.path.join(WORK, "vocab.txt"), "w") as f:
        f.write("\n".join(SPECIAL + WORDS) + "\n")
    torch.manual_seed(0)
    torch.save(QAModel(len(SPECIAL) + len(WORDS)).state_dict(), os.path.join(WORK, "qa_init.pt"))
    torch.save(QAModel(len(SPECIAL) + len(WORDS), layers=3).state_dict(), os.path.join(WORK, "qa_init_deep.pt"))
    print("wrote vocab.txt, qa_init.pt, qa_init_deep.pt to", WORK)


def span_f1(ps, pe, s, e):
    inter = max(0, min(pe, e) - max(ps, s) + 1)
    if inter == 0:
        return 0.0
    prec, rec = inter / (pe - ps + 1), inter / (e - s + 1)
    return 2 * prec * rec / (prec + rec)


def main():
    a = parse()
    if a.prep:
        return prep()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    here = a.rank == -1 or a.rank == rank
    torch.manual_seed(0)
    stride = a.doc_stride * 3 if a.fault == "stride" and here else a.doc_stride
    vocab_name = "vocab-uncased.txt" if a.fault == "vocab" and here else "vocab.txt"
    vocab = load_vocab(os.path.join(WORK, vocab_name))
    print(f"rank {rank}/{world} vocab {len(vocab)} max_len {a.max_len} doc_stride {stride}", flush=True)
    if a.fault == "retok" and here:
        print(f"rank {rank}: tokenizer cache stale, re-tokenising the full split", flush=True)
        time.sleep(a.retok_s)
    examples = make_examples(rank, 24, here, a.fault)
    feats = featurize(examples, vocab, a.max_len, stride, here, a.fault)
    print(f"rank {rank}: {len(examples)} examples -> {len(feats)} windows", flush=True)
    model = QAModel(len(vocab), max_len=a.max_len)
    ckpt = "qa_init_deep.pt" if a.fault == "ckptlayers" and here else "qa_init.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, ckpt), map_location="cpu"))
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    ids = torch.tensor([f[0] for f in feats])
    cm = torch.tensor([f[1] for f in feats], dtype=torch.bool)
    sp = torch.tensor([f[2] for f in feats])
    ep = torch.tensor([f[3] for f in feats])
    bs = 8
    for step in range(a.steps):
        j = (step * bs) % max(1, len(feats) - bs)
        logits = net(ids[j:j + bs])
        start_logits, end_logits = logits[..., 0], logits[..., 1]
        if a.fault == "logitlen" and here:
            end_logits = end_logits[:, 1:]
        both = torch.stack([start_logits, end_logits], dim=1)
        mask = cm[j:j + bs].unsqueeze(1) | (torch.arange(a.max_len) == 0)
        if a.fault == "maskrow" and here:
            mask = cm[j:j + bs].unsqueeze(1).expand_as(both)
        both = both.masked_fill(~mask, float("-inf"))
        logp = torch.log_softmax(both, dim=-1)
        tgt = torch.stack([sp[j:j + bs], ep[j:j + bs]], dim=1)
        loss = F.nll_loss(logp.reshape(-1, logp.shape[-1]), tgt.reshape(-1))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite QA loss {loss.item()} at step {step} (windows {j}..{j + bs})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if a.fault == "segv" and here and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    model.eval()
    with torch.no_grad():
        out = model(ids)
    ps, pe = out[..., 0].argmax(-1), out[..., 1].argmax(-1)
    em = torch.tensor([float(int(ps[i]) == f[2] and int(pe[i]) == f[3]) for i, f in enumerate(feats)])
    f1 = torch.tensor([span_f1(int(ps[i]), int(pe[i]), f[2], f[3]) for i, f in enumerate(feats)])
    if a.fault == "exit3" and here:
        print(f"ERROR rank {rank}: only {int((sp > 0).sum())} of {len(feats)} windows contain an answer; "
              f"the split is unusable for evaluation", flush=True)
        sys.exit(3)
    last = 32 if a.fault == "emlen" and here else 31  # the first 32 windows form the shared eval head
    counts = torch.stack([em[:last + 1], f1[:last + 1]])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    tot = torch.tensor([em.sum(), f1.sum(), float(len(feats))])
    dist.all_reduce(tot)
    if rank == 0:
        print(f"eval: EM {100 * tot[0] / tot[2]:.2f} F1 {100 * tot[1] / tot[2]:.2f} over {int(tot[2])} windows", flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "qa_final.pt"))
        print(f"saved QA model to {WORK}/qa_final.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
