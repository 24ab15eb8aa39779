"""A two-hundred-and-twenty-first hand-run batch: TEXT-TO-SPEECH MEL PREDICTION.

A small Tacotron-like model trained on synthetic text/mel pairs: characters (and a speaker id) are embedded,
encoded by a conv + GRU encoder, and a hand-written decoder with location-sensitive attention predicts
`reduction` mel frames per step plus a stop token.  Texts go through a phoneme lexicon that rank 0 writes
to /tmp/fault221_work/lexicon/ and every rank reads.  The decoder starts from ckpt/decoder_init.pt.  The
loss is mel L1 + stop BCE + a guided attention loss; the model is wrapped in DDP (gloo), or with --ddp 0
the gradients are all_reduced by hand.  Losses are all_reduced for the log; at the end the per-rank stop
token counts are all_gathered and rank 0 saves the model to tts_final.pt.

Faults:
  symbol    - rank N's transcripts contain an accented character missing from the symbol table (KeyError)
  nmels     - every rank: the data has 80 mel bins while the decoder is built for 64 (shape error)
  lexicon   - rank N reads the lexicon from a locale-suffixed file that does not exist (FileNotFoundError)
  attnnan   - rank N masks its text with lengths 0: softmax over an all -inf row, the program's NaN check
  reduction - every rank: reduction factor 3 does not divide the 40-frame mels (the program's ValueError)
  stopgather- rank N all_gathers its stop-token counts with one extra element (gloo size mismatch)
  ckpt      - rank N loads the decoder from ckpt/decoder_init_h48.pt, saved with GRU size 48 (size mismatch)
  listen    - rank N synthesises a long listening sample for --stall seconds before step 2's backward
  abort     - rank N sends itself SIGABRT after step 2
  exit8     - rank N prints its own error line about an empty mel file and exits with code 8
  speaker   - rank N uses a speaker id one past the speaker table (IndexError)
  none      - control, clean run

What happened (filled in after the runs):
  symbol    - rank N: KeyError 'é' in text_to_ids at step 1; rank 0 gloo Connection closed by peer
  nmels     - every rank: RuntimeError shape '[4, 12, 128]' is invalid for input of size 7680
  lexicon   - rank N: FileNotFoundError .../lexicon/phones-en_US.txt; peers SIGTERMed
  attnnan   - rank N: FloatingPointError attention weights not finite (DETAIL: monitoredBarrier)
  reduction - every rank: ValueError mel length 40 is not divisible by the reduction factor 3
  stopgather- another rank aborted: gloo EnforceNotMet 6 vs 4 size mismatch; others reset
  ckpt      - rank N: RuntimeError size mismatch for cell.weight_hh [144, 48] vs [96, 32]
  listen    - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  abort     - rank N: exitcode -6 (SIGABRT) after step 2; peers reset/closed; restart: connectFullMesh
  exit8     - rank N logs its ERROR line about an empty mel file, exitcode 8; peers closed by peer
  speaker   - rank N: IndexError index out of range in self at the speaker embedding, step 1
  none      - clean, exit 0, rank 0 saved tts_final.pt
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

SYMBOLS = "_ abcdefghijklmnopqrstuvwxyz.,?'"
SYM2ID = {s: i for i, s in enumerate(SYMBOLS)}
WORDS = ["the", "quick", "brown", "fox", "speech", "model", "reads", "a", "short", "line", "of", "text"]
WORK = "/tmp/fault221_work"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    return p.parse_args()


def text_to_ids(text):
    return [SYM2ID[c] for c in text]


class Encoder(nn.Module):
    def __init__(self, nsym, nspk, dim):
        super().__init__()
        self.emb = nn.Embedding(nsym, dim)
        self.spk = nn.Embedding(nspk, dim)
        self.conv = nn.Conv1d(dim, dim, 5, padding=2)
        self.gru = nn.GRU(dim, dim, batch_first=True)

    def forward(self, ids, spk):
        x = self.emb(ids) + self.spk(spk)[:, None, :]
        x = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.gru(x)[0]


class Decoder(nn.Module):
    def __init__(self, n_mels, r, dim, hidden):
        super().__init__()
        self.n_mels, self.r, self.hidden = n_mels, r, hidden
        self.prenet = nn.Linear(n_mels * r, dim)
        self.cell = nn.GRUCell(dim + dim, hidden)
        self.q = nn.Linear(hidden, dim, bias=False)
        self.m = nn.Linear(dim, dim, bias=False)
        self.loc = nn.Conv1d(1, 8, 7, padding=3)
        self.loc_proj = nn.Linear(8, dim, bias=False)
        self.v = nn.Linear(dim, 1, bias=False)
        self.out = nn.Linear(hidden + dim, n_mels * r)
        self.stop = nn.Linear(hidden + dim, r)

    def forward(self, memory, mask, mels, check):
        B, T, D = memory.shape
        frames = mels.reshape(B, mels.shape[1] // self.r, self.n_mels * self.r)
        h = memory.new_zeros(B, self.hidden)
        ctx = memory.new_zeros(B, D)
        cum = memory.new_zeros(B, T)
        prev = memory.new_zeros(B, self.n_mels * self.r)
        pm = self.m(memory)
        outs, stops, attns = [], [], []
        for t in range(frames.shape[1]):
            h = self.cell(torch.cat([F.relu(self.prenet(prev)), ctx], -1), h)
            loc = self.loc_proj(self.loc(cum[:, None, :]).transpose(1, 2))
            e = self.v(torch.tanh(self.q(h)[:, None, :] + pm + loc)).squeeze(-1)
            e = e.masked_fill(~mask, float("-inf"))
            a = torch.softmax(e, -1)
            if check and not torch.isfinite(a).all():
                raise FloatingPointError(f"attention weights are not finite at decoder step {t} "
                                         f"({int(torch.isnan(a).sum())} NaN of {a.numel()})")
            cum = cum + a
            ctx = torch.bmm(a[:, None, :], memory).squeeze(1)
            hc = torch.cat([h, ctx], -1)
            outs.append(self.out(hc))
            stops.append(self.stop(hc))
            attns.append(a)
            prev = frames[:, t]
        mel_out = torch.stack(outs, 1).reshape(B, -1, self.n_mels)
        return mel_out, torch.cat(stops, 1), torch.stack(attns, 1)


class TTS(nn.Module):
    def __init__(self, n_mels, r, nspk=4, dim=32, hidden=32):
        super().__init__()
        self.enc = Encoder(len(SYMBOLS), nspk, dim)
        self.dec = Decoder(n_mels, r, dim, hidden)

    def forward(self, ids, spk, mask, mels):
        return self.dec(self.enc(ids, spk), mask, mels, True)


def guided_attention(attn, g=0.2):
    B, Td, Te = attn.shape
    n = torch.arange(Td, dtype=torch.float32)[:, None] / Td
    t = torch.arange(Te, dtype=torch.float32)[None, :] / Te
    w = 1.0 - torch.exp(-((n - t) ** 2) / (2 * g * g))
    return (attn * w).mean()


def make_batch(a, rank, step, g, n_mels, mel_len, lexicon):
    B = 4
    texts = [" ".join(WORDS[(rank * 7 + step * 3 + i * 5 + k) % len(WORDS)] for k in range(3)) for i in range(B)]
    if a.fault == "symbol" and rank == a.rank and step == 1:
        texts[2] = "the caf\u00e9 reads"
    texts = [" ".join(lexicon.get(w, w) for w in t.split()) for t in texts]
    seqs = [text_to_ids(t) for t in texts]
    L = max(len(s) for s in seqs)
    ids = torch.zeros(B, L, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs])
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    if a.fault == "attnnan" and rank == a.rank and step == 2:
        lengths = lengths * 0
    mask = torch.arange(L)[None, :] < lengths[:, None]
    spk = torch.randint(0, 4, (B,), generator=g)
    if a.fault == "speaker" and rank == a.rank and step == 1:
        spk[1] = 4
    mels = torch.randn(B, mel_len, n_mels, generator=g) * 0.5
    stop = torch.zeros(B, mel_len)
    stop[:, -3:] = 1.0
    return ids, spk, mask, mels, stop


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    n_mels, r, mel_len = 64, 2, 24
    data_mels = 80 if a.fault == "nmels" else n_mels
    if a.fault == "reduction":
        r, mel_len = 3, 40
    print(f"rank {rank}/{world}: tts n_mels={n_mels} reduction={r} mel_len={mel_len} ddp={a.ddp}", flush=True)

    os.makedirs(f"{WORK}/lexicon", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    if rank == 0:
        with open(f"{WORK}/lexicon/phones.txt", "w") as f:
            f.write("speech s p iy ch\nquick k w ih k\nreads r iy d z\n")
        torch.save(Decoder(n_mels, r, 32, 32).state_dict(), f"{WORK}/ckpt/decoder_init.pt")
        torch.save(Decoder(n_mels, r, 32, 48).state_dict(), f"{WORK}/ckpt/decoder_init_h48.pt")
    dist.barrier()
    lex_path = f"{WORK}/lexicon/phones.txt"
    if a.fault == "lexicon" and rank == a.rank:
        lex_path = f"{WORK}/lexicon/phones-en_US.txt"
    with open(lex_path) as f:
        lexicon = {ln.split()[0]: "".join(ln.split()[1:]) for ln in f if ln.strip()}
    print(f"rank {rank}: lexicon {lex_path} has {len(lexicon)} entries", flush=True)

    model = TTS(n_mels, r)
    ck = f"{WORK}/ckpt/decoder_init.pt"
    if a.fault == "ckpt" and rank == a.rank:
        ck = f"{WORK}/ckpt/decoder_init_h48.pt"
    model.dec.load_state_dict(torch.load(ck))
    print(f"rank {rank}: loaded decoder from {ck}", flush=True)
    if mel_len % r != 0:
        raise ValueError(f"mel length {mel_len} is not divisible by the reduction factor {r}")
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    stop_count = torch.zeros(2)
    for step in range(a.steps):
        if a.fault == "exit8" and rank == a.rank and step == 1:
            print(f"ERROR rank {rank}: mel file {WORK}/mels/utt_{rank:03d}_0117.npy has 0 frames; "
                  f"cannot align transcript", flush=True)
            sys.exit(8)
        ids, spk, mask, mels, stop = make_batch(a, rank, step, g, data_mels, mel_len, lexicon)
        mel_out, stop_logits, attn = net(ids, spk, mask, mels)
        loss = (F.l1_loss(mel_out, mels) + F.binary_cross_entropy_with_logits(stop_logits, stop)
                + guided_attention(attn))
        if a.fault == "listen" and rank == a.rank and step == 2:
            print(f"rank {rank}: synthesising listening sample for speaker 0 (griffin-lim, 600 iters)", flush=True)
            time.sleep(a.stall)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        stop_count += torch.tensor([(stop_logits > 0).sum().item(), stop.sum().item()])
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f}", flush=True)
        if a.fault == "abort" and rank == a.rank and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
    counts = stop_count.clone()
    if a.fault == "stopgather" and rank == a.rank:
        counts = torch.cat([counts, torch.tensor([float(a.steps)])])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        pred = sum(c[0].item() for c in gathered)
        true = sum(c[1].item() for c in gathered)
        print(f"stop tokens predicted {pred:.0f} of {true:.0f} over {world} ranks", flush=True)
        torch.save(model.state_dict(), f"{WORK}/tts_final.pt")
        print(f"saved model to {WORK}/tts_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
