"""A two-hundred-and-tenth hand-run batch: MUSIC TRANSFORMER ON SYMBOLIC EVENTS. A small decoder-only transformer
over synthetic MIDI-like event tokens (note-on, note-off, time-shift, velocity). The vocabulary is built from an
event table file, attention uses a hand-written relative-position bias per head, the model is warm-started from a
checkpoint, trained with DDP (or hand all-reduced gradients with --ddp 0), a sampling preview is drawn, and the
average loss, token accuracy and per-type token counts are all_reduced / all_gathered across ranks.

Faults:
- evid: --rank's event stream holds an id one past the vocabulary (IndexError in the embedding).
- rellen: the relative-position index is built one position too long on every rank (shape error in attention).
- table: --rank reads an event table file that does not exist (FileNotFoundError).
- temp0: --rank uses temperature 0 in the sampling preview; the program's finiteness check raises.
- seqenv: the sequence length comes from MIDI_SEQ_LEN, set to a non-integer for every rank (ValueError).
- countlen: --rank counts one extra event type, so its all_gathered count tensor has another length.
- heads: --rank warm-starts from a checkpoint saved with 4 heads instead of 2 (size mismatch).
- instr: --rank's track names an instrument missing from the program map (KeyError).
- render: --rank renders a long preview for --render-s seconds before the metrics all_reduce; the others wait.
- abort: --rank sends itself SIGABRT after step 2.
- exit4: --rank logs an error about its token coverage and exits with code 4.
- none: control.

What happened (filled in after the runs):
- evid: rank N IndexError 'index out of range in self' in the embedding at step 2; peers Connection closed by peer (np4 r2, np3 r0).
- rellen: every rank IndexError 'index 127 is out of bounds for dimension 0 with size 127' at step 0 (not the shape error meant).
- table: rank 1 FileNotFoundError on /tmp/job_work/events_v2.txt before any step; peers SIGTERMed.
- temp0: rank N FloatingPointError 'sampling preview logits not finite at temperature 0.0'; with DETAIL rank 0 a monitoredBarrier error.
- seqenv: every rank ValueError "invalid literal for int() with base 10: '64.0'" (MIDI_SEQ_LEN=64.0 from train.sh).
- countlen: after 6 steps a peer aborts with gloo EnforceNotMet '... Received data size doesn't match expected size'.
- heads: rank N RuntimeError loading state_dict: size mismatch for attn.rel [4, 127] vs [2, 127]; peers SIGTERMed.
- instr: rank N KeyError 'harpsichord' before DDP (np5 r2; np3 r1 with --max-restarts 1: attempt 1 connectFullMesh failures).
- render: PG 12 s: peers gloo 'Timed out waiting 12000ms' in the all_gather; PG 300 s: killed by timeout 60, exit 124.
- abort: rank N exitcode -6 (SIGABRT) after step 2; peers Connection closed/reset by peer (np4 r2 pdsh2, np3 r1).
- exit4: rank N prints 'ERROR rank N: pitch coverage too low ...' and exits 4; peers Connection closed by peer.
- none: exit 0; rank 0 prints 'eval: avg loss 4.5263 token acc 1.73% ...' and saves /tmp/job_work/music_final.pt.
"""
import argparse
import math
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

WORK = "/tmp/fault210_work"
PROGRAMS = {"piano": 0, "organ": 19, "guitar": 24, "bass": 33, "strings": 48, "flute": 73}
TYPES = ["note_on", "note_off", "time_shift", "velocity"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--render-s", type=float, default=40.0)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prep", type=int, default=0)
    return p.parse_args()


class RelAttention(nn.Module):
    def __init__(self, d, heads, max_len):
        super().__init__()
        self.h, self.dh, self.max_len = heads, d // heads, max_len
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.rel = nn.Parameter(torch.zeros(heads, 2 * max_len - 1))

    def forward(self, x, rel_extra=0):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        content = q @ k.transpose(-1, -2) / math.sqrt(self.dh)
        n = L + rel_extra
        idx = torch.arange(n).unsqueeze(1) - torch.arange(n).unsqueeze(0) + self.max_len - 1
        logits = content + self.rel[:, idx].unsqueeze(0)
        causal = torch.ones(L, L, dtype=torch.bool).triu(1)
        att = logits.masked_fill(causal, float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(B, L, D))


class MusicTransformer(nn.Module):
    def __init__(self, vocab_size, d=32, heads=2, max_len=64):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)
        self.attn = RelAttention(d, heads, max_len)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab_size)

    def forward(self, ids, rel_extra=0):
        h = self.emb(ids)
        h = h + self.attn(self.ln1(h), rel_extra)
        h = h + self.ff(self.ln2(h))
        return self.head(h)


def event_table():
    rows = ["<pad>", "<bos>"]
    rows += [f"note_on {p}" for p in range(36, 68)] + [f"note_off {p}" for p in range(36, 68)]
    rows += [f"time_shift {t}" for t in range(1, 17)] + [f"velocity {v}" for v in range(1, 9)]
    return rows


def load_events(path):
    with open(path) as f:
        return {line.strip(): i for i, line in enumerate(f) if line.strip()}


def prep():
    os.makedirs(WORK, exist_ok=True)
    with open(os.path.join(WORK, "events.txt"), "w") as f:
        f.write("\n".join(event_table()) + "\n")
    torch.manual_seed(0)
    n = len(event_table())
    torch.save(MusicTransformer(n).state_dict(), os.path.join(WORK, "music_init.pt"))
    torch.save(MusicTransformer(n, heads=4).state_dict(), os.path.join(WORK, "music_init_h4.pt"))
    print("wrote events.txt, music_init.pt, music_init_h4.pt to", WORK)


def make_track(rank, events, n_seq, seq_len, here, fault):
    rng = random.Random(210 + rank)
    instrument = ["piano", "strings", "guitar", "flute"][rank % 4]
    if here and fault == "instr":
        instrument = "harpsichord"
    program = PROGRAMS[instrument]
    seqs = []
    for s in range(n_seq):
        toks = [events["<bos>"]]
        while len(toks) < seq_len + 1:
            p = rng.randint(36, 67)
            toks += [events[f"velocity {rng.randint(1, 8)}"], events[f"note_on {p}"],
                     events[f"time_shift {rng.randint(1, 16)}"], events[f"note_off {p}"]]
        seqs.append(toks[:seq_len + 1])
    if here and fault == "evid":
        seqs[9][17] = len(events)  # transposed pitch 68 mapped past the table
    return instrument, program, torch.tensor(seqs)


def main():
    a = parse()
    if a.prep:
        return prep()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    here = a.rank == -1 or a.rank == rank
    torch.manual_seed(0)
    seq_len = int(os.environ.get("MIDI_SEQ_LEN", "64"))
    table = "events_v2.txt" if a.fault == "table" and here else "events.txt"
    events = load_events(os.path.join(WORK, table))
    instrument, program, data = make_track(rank, events, 32, seq_len, here, a.fault)
    print(f"rank {rank}/{world} events {len(events)} seq_len {seq_len} track {instrument} (program {program})", flush=True)
    model = MusicTransformer(len(events), max_len=seq_len)
    ckpt = "music_init_h4.pt" if a.fault == "heads" and here else "music_init.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, ckpt), map_location="cpu"))
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    rel_extra = 1 if a.fault == "rellen" and here else 0
    bs = 4
    for step in range(a.steps):
        batch = data[(step * bs) % 32:(step * bs) % 32 + bs]
        logits = net(batch[:, :-1], rel_extra)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
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
    with torch.no_grad():
        logits = model(data[:, :-1])
        acc = (logits.argmax(-1) == data[:, 1:]).float().mean()
        temp = 0.0 if a.fault == "temp0" and here else a.temperature
        scaled = logits[0, -1] / temp
        if not torch.isfinite(scaled).all():
            raise FloatingPointError(f"rank {rank}: sampling preview logits not finite at temperature {temp} "
                                     f"({int((~torch.isfinite(scaled)).sum())} of {scaled.numel()} entries)")
        nxt = torch.multinomial(scaled.softmax(-1), 1).item()
    names = {i: e for e, i in events.items()}
    print(f"rank {rank} preview next event: {names[nxt]}", flush=True)
    if a.fault == "render" and here:
        print(f"rank {rank}: rendering preview sample (4096 events) to {WORK}/preview_{rank}.mid", flush=True)
        time.sleep(a.render_s)
    if a.fault == "exit4" and here:
        n_on = int(sum(1 for t in data.flatten().tolist() if names[t].startswith("note_on")))
        print(f"ERROR rank {rank}: pitch coverage too low ({n_on} note_on events over 1 octave); "
              f"refusing to report metrics for track {instrument}", flush=True)
        sys.exit(4)
    kinds = TYPES + ["<pad>"] if a.fault == "countlen" and here else TYPES
    counts = torch.tensor([float(sum(1 for t in data.flatten().tolist() if names[t].startswith(k))) for k in kinds])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    tot = torch.tensor([loss.item(), acc.item()])
    dist.all_reduce(tot)
    if rank == 0:
        print(f"eval: avg loss {tot[0] / world:.4f} token acc {100 * tot[1] / world:.2f}% "
              f"note_on total {int(sum(g[0] for g in gathered))}", flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "music_final.pt"))
        print(f"saved model to {WORK}/music_final.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
