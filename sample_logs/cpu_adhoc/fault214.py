"""A two-hundred-and-fourteenth hand-run batch: NEURAL MACHINE TRANSLATION WITH BEAM SEARCH. A tiny encoder-decoder
transformer translates synthetic source/target sentence pairs over a shared BPE-like vocabulary file, trained with
a hand-written label-smoothed loss and DDP (or hand all-reduced gradients with --ddp 0); validation decodes greedily
and with beam search, BLEU n-gram counts are computed by hand, all_gathered and all_reduced across ranks.

Faults:
- tgtid: on --rank, one target token id equals the vocabulary size (IndexError in the decoder embedding).
- beam: the beam size in the config is larger than the vocabulary on --rank (-1 every rank): topk error.
- vocab: --rank opens a BPE vocabulary file that does not exist (FileNotFoundError).
- smooth: label smoothing 1.5 is read from the config on --rank (-1 every rank); the program raises ValueError.
- bleulen: --rank counts n-grams up to 5 instead of 4, so its all_gathered BLEU counts have another length.
- ckptemb: --rank warm-starts the decoder from a checkpoint with embedding size 24 instead of 16 (size mismatch).
- nanlog: --rank takes the log of probabilities that contain an exact zero; the program's loss check raises.
- langcode: --rank's language pair uses the code 'pt', missing from the program's map (KeyError).
- slowbeam: --rank decodes the whole validation set with a huge beam for --slow-s seconds; the others time out.
- abort: --rank sends itself SIGABRT after step 2.
- exit9: --rank logs an error about its references and exits with code 9.
- none: control.

What happened (filled in after the runs):
- tgtid: rank N IndexError 'index out of range in self' in the decoder embedding at step 0; peers Connection closed by peer (np4 r2, np3 r0).
- beam: every rank RuntimeError 'selected index k out of range' in topk during beam decoding after 6 steps (np3).
- vocab: rank N FileNotFoundError on /tmp/job_work/bpe_vocab.32k.txt before any collective; peers SIGTERMed.
- smooth: every rank ValueError 'label_smoothing must be in [0, 1), got 1.5' at step 0 (np4).
- bleulen: a peer aborts with gloo EnforceNotMet '20 vs 16 ... size mismatch' (np4 r3); DETAIL: every rank 'Detected mismatch between collectives'.
- ckptemb: rank N RuntimeError loading state_dict: size mismatch for src_emb.weight [38, 24] vs [38, 16]; peers SIGTERMed.
- nanlog: rank N FloatingPointError 'translation loss is inf at step 0' (log of zero gives inf, not NaN); peers Connection closed.
- langcode: rank N KeyError 'pt' before training (np5 r3); with --max-restarts 1 attempt 1 dies in Gloo connectFullMesh.
- slowbeam: PG 12 s: peers time out in the BLEU all_gather (gloo Timed out waiting 12000ms); PG 300 s: killed by timeout 60, exit 124.
- abort: rank N exitcode -6 (SIGABRT) after step 2; peers Connection closed/reset by peer (np4 r2 pdsh2, np3 r0).
- exit9: rank N prints 'ERROR rank N: 8 hypotheses but 0 detokenised references ...' and exits 9; peers Connection closed.
- none: exit 0; rank 0 prints 'valid BLEU 0.00 over 24 sentences (beam 4)' and saves /tmp/job_work/nmt_final.pt.
"""
import argparse
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault214_work"
SPECIAL = ["<pad>", "<s>", "</s>", "<2de>", "<2fr>", "<2es>"]
PIECES = [f"@@{c}" for c in "abcdefghijklmnop"] + [f"{c}" for c in "abcdefghijklmnop"]
LANG_TOKENS = {"de": "<2de>", "fr": "<2fr>", "es": "<2es>"}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prep", type=int, default=0)
    return p.parse_args()


class Seq2Seq(nn.Module):
    def __init__(self, vocab_size, d=16, max_len=16):
        super().__init__()
        self.src_emb = nn.Embedding(vocab_size, d)
        self.decoder_emb = nn.Embedding(vocab_size, d)
        self.pos = nn.Embedding(max_len, d)
        self.core = nn.Transformer(d, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab_size)

    def forward(self, src, tgt_in):
        ps, pt = torch.arange(src.shape[1]), torch.arange(tgt_in.shape[1])
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        h = self.core(self.src_emb(src) + self.pos(ps), self.decoder_emb(tgt_in) + self.pos(pt), tgt_mask=causal)
        return self.out(h)


def config_for(rank, here, fault):
    cfg = {"label_smoothing": 0.1, "beam_size": 4, "pair": "de-en", "max_len": 12}
    if here and fault == "smooth":
        cfg["label_smoothing"] = 1.5
    if here and fault == "beam":
        cfg["beam_size"] = 64
    if here and fault == "langcode":
        cfg["pair"] = "pt-en"
    return cfg


def make_pairs(rank, n, vocab, lang_tok, here, fault):
    rng = random.Random(200 + rank)
    ids = [vocab[p] for p in PIECES]
    out = []
    for k in range(n):
        src = [vocab[lang_tok]] + [rng.choice(ids) for _ in range(rng.randint(4, 8))]
        tgt = [vocab["<s>"]] + list(reversed(src[1:])) + [vocab["</s>"]]
        if here and fault == "tgtid" and k == 2:
            tgt[3] = len(vocab)
        out.append((src, tgt))
    return out


def pad(seqs, n):
    return torch.tensor([s + [0] * (n - len(s)) for s in seqs])


def smoothed_loss(logits, gold, eps, here, fault):
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {eps}")
    v = logits.shape[-1]
    if here and fault == "nanlog":
        probs = torch.softmax(logits.masked_fill(torch.arange(v) == 0, float("-inf")), -1)
        logp = torch.log(probs)
    else:
        logp = torch.log_softmax(logits, -1)
    dist_t = torch.full_like(logp, eps / (v - 1)).scatter_(-1, gold.unsqueeze(-1), 1.0 - eps)
    keep = gold.ne(0)
    return -(dist_t * logp).sum(-1)[keep].mean()


@torch.no_grad()
def beam_decode(model, src, beam, max_len, bos, eos):
    hyps = [([bos], 0.0)]
    for _ in range(max_len):
        cand = []
        for seq, sc in hyps:
            if seq[-1] == eos:
                cand.append((seq, sc))
                continue
            logp = torch.log_softmax(model(src.unsqueeze(0), torch.tensor([seq]))[0, -1], -1)
            top = torch.topk(logp, beam)
            cand += [(seq + [int(i)], sc + float(s)) for s, i in zip(top.values, top.indices)]
        hyps = sorted(cand, key=lambda h: h[1] / len(h[0]), reverse=True)[:beam]
        if all(h[0][-1] == eos for h in hyps):
            break
    return hyps[0][0]


def ngram_counts(hyp, ref, max_n):
    row = []
    for n in range(1, max_n + 1):
        h = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
        r = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
        row += [sum(min(c, r[g]) for g, c in h.items()), max(0, len(hyp) - n + 1)]
    return row


def prep():
    os.makedirs(WORK, exist_ok=True)
    with open(os.path.join(WORK, "bpe_vocab.txt"), "w") as f:
        f.write("\n".join(SPECIAL + PIECES) + "\n")
    torch.manual_seed(0)
    v = len(SPECIAL) + len(PIECES)
    torch.save(Seq2Seq(v).state_dict(), os.path.join(WORK, "nmt_init.pt"))
    torch.save(Seq2Seq(v, d=24).state_dict(), os.path.join(WORK, "nmt_init_d24.pt"))
    print("wrote bpe_vocab.txt, nmt_init.pt, nmt_init_d24.pt to", WORK)


def main():
    a = parse()
    if a.prep:
        return prep()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    here = a.rank == -1 or a.rank == rank
    torch.manual_seed(0)
    cfg = config_for(rank, here, a.fault)
    vocab_name = "bpe_vocab.32k.txt" if a.fault == "vocab" and here else "bpe_vocab.txt"
    with open(os.path.join(WORK, vocab_name)) as f:
        vocab = {w.strip(): i for i, w in enumerate(f) if w.strip()}
    src_lang = cfg["pair"].split("-")[0]
    lang_tok = LANG_TOKENS[src_lang]
    print(f"rank {rank}/{world} pair {cfg['pair']} vocab {len(vocab)} beam {cfg['beam_size']} "
          f"label_smoothing {cfg['label_smoothing']}", flush=True)
    pairs = make_pairs(rank, 40, vocab, lang_tok, here, a.fault)
    train, valid = pairs[:32], pairs[32:]
    model = Seq2Seq(len(vocab))
    ckpt = "nmt_init_d24.pt" if a.fault == "ckptemb" and here else "nmt_init.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, ckpt), map_location="cpu"))
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    bs = 8
    for step in range(a.steps):
        batch = train[(step * bs) % len(train):][:bs]
        src = pad([s for s, _ in batch], 10)
        tgt = pad([t for _, t in batch], 11)
        logits = net(src, tgt[:, :-1])
        loss = smoothed_loss(logits, tgt[:, 1:], cfg["label_smoothing"], here, a.fault)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: translation loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if a.fault == "abort" and here and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
    model.eval()
    bos, eos = vocab["<s>"], vocab["</s>"]
    max_n = 5 if a.fault == "bleulen" and here else 4
    rows = []
    for k, (s, t) in enumerate(valid):
        if k == 0:
            with torch.no_grad():
                greedy = model(torch.tensor([s]), torch.tensor([[bos]]))[0, -1].argmax().item()
            print(f"rank {rank} valid greedy first token {greedy}", flush=True)
        hyp = beam_decode(model, torch.tensor(s), cfg["beam_size"], cfg["max_len"], bos, eos)
        rows.append(ngram_counts(hyp[1:-1] if hyp[-1] == eos else hyp[1:], t[1:-1], max_n))
    if a.fault == "slowbeam" and here:
        print(f"rank {rank}: re-decoding the full validation set with beam 256 for the length-penalty sweep", flush=True)
        time.sleep(a.slow_s)
    counts = torch.tensor(rows, dtype=torch.float).sum(0)
    if a.fault == "exit9" and here:
        print(f"ERROR rank {rank}: {len(valid)} hypotheses but 0 detokenised references found for {cfg['pair']}; "
              f"cannot score BLEU", flush=True)
        sys.exit(9)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    tot = torch.stack(gathered).sum(0)
    dist.all_reduce(counts)
    if rank == 0:
        prec = [max(tot[2 * i].item(), 1e-9) / max(tot[2 * i + 1].item(), 1.0) for i in range(4)]
        bleu = 100 * math.exp(sum(math.log(p) for p in prec) / 4)
        print(f"valid BLEU {bleu:.2f} over {len(valid) * world} sentences (beam {cfg['beam_size']})", flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "nmt_final.pt"))
        print(f"saved translation model to {WORK}/nmt_final.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
