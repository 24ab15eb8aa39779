"""A two-hundred-and-seventh hand-run batch: SPEECH RECOGNITION WITH A TRANSDUCER-LIKE LOSS SUBSTITUTE. A small CTC trainer.

Each rank makes synthetic filterbank features (80 utterances, 20 mel bins) and token targets over a
12-token vocabulary read from a vocab file, sorts them by length into buckets, applies SpecAugment
(frequency and time masks), runs a conformer-ish encoder (a linear front end, a depthwise conv block
and one self-attention block) and trains it with torch.nn.functional.ctc_loss under DDP (or, with
--ddp 0, with gradients all_reduced by hand). Every 2 steps the greedy-decoded WER counts are computed
by hand and all_reduced; at the end the per-rank WER counts are all_gathered and rank 0 saves the model.

Faults:
  badlen     rank N applies the conv subsampling factor 4 to its input lengths, so target lengths exceed
             input lengths; ctc_loss returns inf and the program's finiteness check raises FloatingPointError.
  lendtype   every rank builds input lengths as float32 (a code bug); ctc_loss raises RuntimeError
             "input_lengths must be integral".
  vocab      rank N reads the vocab file from a per-shard path that does not exist (FileNotFoundError).
  blank      every rank uses blank = vocab size (12) from a wrong config; ctc_loss raises RuntimeError
             "blank must be in label range".
  featdim    rank N builds 40-bin features instead of 20; the front-end Linear raises a shape RuntimeError.
  wergather  rank N all_gathers its per-utterance WER counts with one extra entry (gloo size mismatch).
  ckpt       rank N (or every rank with -1) loads an init checkpoint saved with a 13-token vocabulary;
             load_state_dict raises RuntimeError size mismatch.
  rebucket   rank N re-buckets its data before step 3 and sleeps --sleep seconds before the gradient
             all_reduce; the others time out in gloo (or, with a long --pg-timeout, the job hangs).
  sigabrt    rank N sends itself SIGABRT after step 2.
  exit5      rank N prints an ERROR line about its alignment and exits with sys.exit(5) after step 3.
  none       control, no fault.

What happened (filled in after the runs):
  badlen: FloatingPointError (CTC loss inf) on the faulty rank at step 1-2, peers Connection closed by peer (np4 r2 tee, np3 r1 restart: both attempts).
  lendtype: RuntimeError input_lengths must be integral on all 3 ranks at step 1 (np3 tee_trainer).
  vocab: FileNotFoundError .../shard0N/tokens.txt on the faulty rank before training (np4 r1 redirects, np3 r2 plain).
  blank: RuntimeError blank must be in label range on all 3 ranks at step 1 (np3 pymodule).
  featdim: RuntimeError mat1 and mat2 shapes cannot be multiplied (152x40 and 20x32) on rank 3 at step 1 (np4 loglevel).
  wergather: DETAIL: Detected mismatch between collectives on all ranks (np3 r1 detail); DDP: rank 3 gloo EnforceNotMet 10 vs 8, SIGABRT (np4 r2 tee).
  ckpt: load_state_dict size mismatch for out.weight/out.bias (13 vs 12) on the faulty rank (np4 r2 prefix, np3 r0 tee_trainer).
  rebucket: peers hit gloo's 12 s recv timeout while the faulty rank slept (np4 r1 filter); PG 300 s + timeout 60: killed, exit 124 (np3 r2 plain).
  sigabrt: the faulty rank died with exitcode -6 (SIGABRT) after step 2, peers Connection reset by peer (np3 r2 wrapper, np4 r1 tee).
  exit5: ERROR line then exit code 5 on the faulty rank after step 3, peers Connection closed by peer (np4 r3 pdsh2, np3 r1 loglevel).
  none: clean, exit 0, rank 0 saved /tmp/job_work/asr_final.pt (np3 plain).
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=float, default=12.0)
p.add_argument("--sleep", type=float, default=40.0)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--work", default="/tmp/fault207_work")
a = p.parse_args()

N_MELS, VOCAB, BLANK = 20, 12, 0


def hit(name):
    return a.fault == name and (a.rank == -1 or a.rank == dist.get_rank())


class ConvBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.dw = nn.Conv1d(d, d, kernel_size=5, padding=2, groups=d)
        self.pw = nn.Conv1d(d, d, kernel_size=1)

    def forward(self, x):  # (B, T, d)
        y = self.norm(x).transpose(1, 2)
        y = self.pw(F.silu(self.dw(y))).transpose(1, 2)
        return x + y


class Encoder(nn.Module):
    def __init__(self, n_mels, d, vocab):
        super().__init__()
        self.front = nn.Linear(n_mels, d)
        self.conv = ConvBlock(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, x, pad_mask):
        h = F.relu(self.front(x))
        h = self.conv(h)
        q = self.norm(h)
        h = h + self.attn(q, q, q, key_padding_mask=pad_mask, need_weights=False)[0]
        return self.out(h).log_softmax(-1)


def load_vocab(path):
    with open(path) as f:
        toks = [line.strip() for line in f if line.strip()]
    return {t: i for i, t in enumerate(toks)}


def make_data(rank, n_mels):
    g = torch.Generator().manual_seed(100 + rank)
    utts = []
    for _ in range(80):
        T = int(torch.randint(24, 48, (1,), generator=g))
        S = int(torch.randint(3, 9, (1,), generator=g))
        feats = torch.randn(T, n_mels, generator=g)
        tgt = torch.randint(1, VOCAB, (S,), generator=g)
        utts.append((feats, tgt))
    return utts


def buckets(utts, bs, seed):
    order = sorted(range(len(utts)), key=lambda i: utts[i][0].shape[0])
    bl = [order[i:i + bs] for i in range(0, len(order), bs)]
    g = torch.Generator().manual_seed(seed)
    return [bl[i] for i in torch.randperm(len(bl), generator=g).tolist()]


def spec_augment(x, g):
    x = x.clone()
    f0 = int(torch.randint(0, x.shape[-1] - 4, (1,), generator=g))
    x[..., f0:f0 + 4] = 0.0
    t0 = int(torch.randint(0, x.shape[1] - 6, (1,), generator=g))
    x[:, t0:t0 + 6, :] = 0.0
    return x


def collate(utts, idx, sub):
    feats = [utts[i][0] for i in idx]
    tgts = [utts[i][1] for i in idx]
    T = max(f.shape[0] for f in feats)
    S = max(t.shape[0] for t in tgts)
    x = torch.zeros(len(idx), T, feats[0].shape[1])
    y = torch.zeros(len(idx), S, dtype=torch.long)
    for j, (f, t) in enumerate(zip(feats, tgts)):
        x[j, :f.shape[0]] = f
        y[j, :t.shape[0]] = t
    in_lens = torch.tensor([f.shape[0] // sub for f in feats], dtype=torch.long)
    tg_lens = torch.tensor([t.shape[0] for t in tgts], dtype=torch.long)
    pad = torch.arange(T)[None, :] >= torch.tensor([f.shape[0] for f in feats])[:, None]
    return x, y, in_lens, tg_lens, pad


def edit_distance(r, h):
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(h)]


def greedy(lp, in_lens):
    best = lp.argmax(-1)
    hyps = []
    for b in range(best.shape[0]):
        seq, last = [], BLANK
        for t in best[b, :int(in_lens[b])].tolist():
            if t != last and t != BLANK:
                seq.append(t)
            last = t
        hyps.append(seq)
    return hyps


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    os.makedirs(a.work, exist_ok=True)
    vocab_path = os.path.join(a.work, "tokens.txt")
    if rank == 0 and not os.path.exists(vocab_path):
        with open(vocab_path, "w") as f:
            f.write("\n".join(["<blank>"] + [chr(ord("a") + i) for i in range(VOCAB - 1)]) + "\n")
    dist.barrier()
    if hit("vocab"):
        vocab_path = os.path.join(a.work, f"shard{rank:02d}", "tokens.txt")
    vocab = load_vocab(vocab_path)
    blank = len(vocab) if hit("blank") else BLANK
    n_mels = 2 * N_MELS if hit("featdim") else N_MELS
    print(f"rank {rank}/{world}: vocab {len(vocab)} tokens, blank={blank}, {n_mels} mel bins", flush=True)

    model = Encoder(N_MELS, 32, len(vocab))
    if a.fault == "ckpt":
        ck = os.path.join(a.work, "init_v13.pt" if hit("ckpt") else "init_v12.pt")
        if not os.path.exists(ck):
            torch.save(Encoder(N_MELS, 32, len(vocab) + ("v13" in ck)).state_dict(), ck)
        model.load_state_dict(torch.load(ck))
        print(f"rank {rank}: initialised encoder from {ck}", flush=True)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    utts = make_data(rank, n_mels)
    order = buckets(utts, 4, seed=rank)
    g = torch.Generator().manual_seed(7 + rank)
    sub = 4 if hit("badlen") else 1

    for step in range(1, a.steps + 1):
        if step == 3 and hit("rebucket"):
            print(f"rank {rank}: re-bucketing {len(utts)} utterances by length", flush=True)
            order = buckets(utts, 4, seed=rank + 1000)
            time.sleep(a.sleep)
        x, y, in_lens, tg_lens, pad = collate(utts, order[step % len(order)], sub)
        if hit("lendtype"):
            in_lens = in_lens.float()
        x = spec_augment(x, g)
        lp = net(x, pad)
        loss = F.ctc_loss(lp.transpose(0, 1), y, in_lens, tg_lens, blank=blank)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: CTC loss is {loss.item()} "
                                     f"(input lengths {in_lens.tolist()}, target lengths {tg_lens.tolist()})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step % 2 == 0:
            with torch.no_grad():
                hyps = greedy(lp, in_lens)
            errs = sum(edit_distance(y[b, :int(tg_lens[b])].tolist(), h) for b, h in enumerate(hyps))
            c = torch.tensor([float(errs), float(tg_lens.sum())])
            dist.all_reduce(c)
            if rank == 0:
                print(f"step {step} WER {c[0] / c[1]:.3f} over {int(c[1])} tokens", flush=True)
        if step == 2 and hit("sigabrt"):
            os.kill(os.getpid(), signal.SIGABRT)
        if step == 3 and hit("exit5"):
            print(f"ERROR rank {rank}: alignment check failed: 3 utterances decode to empty hypotheses; aborting",
                  flush=True)
            sys.exit(5)

    n = 5 if hit("wergather") else 4
    mine = torch.arange(n, dtype=torch.float32) + rank
    got = [torch.zeros(n) for _ in range(world)]
    dist.all_gather(got, mine)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.work, "asr_final.pt"))
        print(f"saved encoder to {os.path.join(a.work, 'asr_final.pt')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
