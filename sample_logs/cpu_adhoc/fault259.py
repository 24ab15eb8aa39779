"""A two-hundred-and-fifty-ninth hand-run batch: DIALOGUE STATE TRACKING FOR A BOOKING ASSISTANT.

Synthetic multi-turn booking dialogues (area, price, day, people slots), a small encoder
over the last turns of the dialogue history (token + position embeddings, masked mean
pooling per turn, a GRU over turns), one classifier per slot over its value set, joint
goal accuracy on a validation split with the per-slot correct counts all_reduced.
DDP over gloo by default; --ddp 0 all-reduces the gradients by hand.

Faults:
  key       one rank's dialogues carry the value "centre", missing from the ontology (KeyError)
  index     one rank's label map puts "people" values 1-based, index 8 beyond the 8-way classifier (IndexError)
  gather    one rank counts a fifth slot "parking" and all_gathers 5 counts while the others send 4
  ontofile  one rank reads the ontology from dst_ontology_v2.json, which was never written (FileNotFoundError)
  window    every rank keeps a history window of 12 turns but the position table has 10 rows
  nan       one rank's batch holds a turn with no tokens; the masked mean divides 0 by 0 (program's check)
  ckpt      one rank loads the encoder checkpoint of the hidden-48 run into the hidden-32 model
  reencode  one rank re-encodes every dialogue prefix turn by turn before step 2's all_reduce
  segv      one rank gets SIGSEGV after step 2's optimizer step
  exit3     one rank prints its own error about the day slot's value count and calls sys.exit(3)
  none      control

What happened (filled in after the runs):
  key       rank N KeyError: 'centre' in encode_labels at step 0; peers Connection closed by peer; Root Cause rank N
  index     rank N IndexError: index 8 is out of bounds for dimension 0 with size 8 at step 0; Root Cause rank N
  gather    a receiving rank aborts: gloo::EnforceNotMet op.preamble.length <= op.nbytes. 10 vs 8 (SIGABRT, Root Cause)
  ontofile  rank N FileNotFoundError: ...dst_ontology_v2.json before DDP; peers SIGTERMed; Root Cause rank N
  window    every rank RuntimeError: The size of tensor a (12) must match the size of tensor b (10) at step 0
  nan       rank N FloatingPointError: rank N: non-finite loss nan at step 1 (program's check); peers closed
  ckpt      rank N RuntimeError: Error(s) in loading state_dict for Encoder: size mismatch for pos ... [10, 48] vs [10, 32]
  reencode  PG 12 s: peers Timed out waiting 12000ms for send/recv; PG 300 s under timeout 60: no output, exit 124
  segv      rank N exitcode -11 (SIGSEGV) after step 2, no traceback; peers reset / DETAIL monitoredBarrier; Root Cause rank N
  exit3     rank N prints its ERROR line about the day slot at step 1 and exits 3; Root Cause rank N exitcode 3
  none      exit 0, rank 0 done: 5 steps, joint goal accuracy 0.0000 (first try aborted at teardown, dropped)
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

SLOTS = {
    "area": ["north", "south", "east", "west", "center"],
    "price": ["cheap", "moderate", "expensive"],
    "day": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"],
    "people": ["1", "2", "3", "4", "5", "6", "7", "8"],
}
VOCAB = 64
WORK = os.environ.get("DST_WORK", "/tmp/fault259_work")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    return p.parse_args()


class Encoder(nn.Module):
    def __init__(self, hidden, max_turns):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, hidden, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(max_turns, hidden) * 0.02)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)

    def forward(self, tokens):  # tokens [B, T, L]
        mask = (tokens != 0).float().unsqueeze(-1)
        emb = self.tok(tokens)
        turns = (emb * mask).sum(2) / mask.sum(2)  # masked mean per turn
        turns = turns + self.pos
        _, h = self.gru(turns)
        return h[-1]


class Tracker(nn.Module):
    def __init__(self, hidden, max_turns):
        super().__init__()
        self.encoder = Encoder(hidden, max_turns)
        self.heads = nn.ModuleDict({s: nn.Linear(hidden, len(v)) for s, v in SLOTS.items()})

    def forward(self, tokens):
        h = self.encoder(tokens)
        return {s: head(h) for s, head in self.heads.items()}


def make_dialogues(n, turns, gen, bad_value=False):
    dialogues = []
    for i in range(n):
        state = {s: vals[int(torch.randint(len(vals), (1,), generator=gen))] for s, vals in SLOTS.items()}
        if bad_value and i == 5:
            state["area"] = "centre"
        toks = torch.randint(1, VOCAB, (turns, 6), generator=gen)
        for j, s in enumerate(SLOTS):
            toks[-1, j] = 1 + (j * 12 + SLOTS[s].index(state[s]) if state[s] in SLOTS[s] else 11) % (VOCAB - 1)
        dialogues.append((toks, state))
    return dialogues


def encode_labels(batch, ontology, one_based=False):
    targets = {}
    for s, vals in ontology.items():
        idx = torch.tensor([vals[st[s]] + (1 if one_based and s == "people" else 0) for _, st in batch])
        onehot = torch.zeros(len(batch), len(vals))
        for b in range(len(batch)):
            onehot[b][idx[b]] = 1.0
        targets[s] = onehot
    return targets


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank == -1 or a.rank == rank
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(100 + rank)

    if rank == 0:
        os.makedirs(f"{WORK}/ontology", exist_ok=True)
        os.makedirs(f"{WORK}/ckpt", exist_ok=True)
        with open(f"{WORK}/ontology/dst_ontology_v1.json", "w") as f:
            json.dump(SLOTS, f)
        for h in (32, 48):
            torch.save(Encoder(h, a.window).state_dict(), f"{WORK}/ckpt/encoder_h{h}.pt")
    dist.barrier()

    version = "v2" if (a.fault == "ontofile" and bad) else "v1"
    onto_path = f"{WORK}/ontology/dst_ontology_{version}.json"
    print(f"rank {rank} loading ontology from {onto_path}", flush=True)
    with open(onto_path) as f:
        ontology = {s: {v: i for i, v in enumerate(vals)} for s, vals in json.load(f).items()}
    # validation also counts the slots this rank's config lists (the old config adds "parking")
    val_slots = list(SLOTS) + (["parking"] if a.fault == "gather" and bad else [])

    window = 12 if a.fault == "window" else a.window
    model = Tracker(a.hidden, a.window)
    ckpt_h = 48 if (a.fault == "ckpt" and bad) else a.hidden
    ckpt_path = f"{WORK}/ckpt/encoder_h{ckpt_h}.pt"
    print(f"rank {rank} warm-starting encoder from {ckpt_path}", flush=True)
    model.encoder.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    if a.ddp:
        model = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    train = make_dialogues(64, window, gen, bad_value=(a.fault == "key" and bad))
    val = make_dialogues(32, window, gen)
    if a.fault == "nan" and bad:
        train[19][0][3] = 0  # a turn whose tokens were all dropped by the tokenizer
    print(f"rank {rank}/{world}: {len(train)} train dialogues, {len(val)} val, window {window} turns", flush=True)

    bs = 16
    for step in range(a.steps):
        batch = train[(step * bs) % len(train):(step * bs) % len(train) + bs]
        tokens = torch.stack([t for t, _ in batch])
        targets = encode_labels(batch, ontology, one_based=(a.fault == "index" and bad))
        if a.fault == "exit3" and bad and step == 1:
            days = 9
            print(f"ERROR rank {rank}: slot 'day' has {days} distinct values in shard batch {step} "
                  f"but the ontology lists {len(ontology['day'])}; refusing to train on a stale ontology",
                  file=sys.stderr, flush=True)
            sys.exit(3)
        if a.fault == "reencode" and bad and step == 2:
            print(f"rank {rank} re-encoding every dialogue prefix turn by turn for the state cache "
                  f"({len(train)} dialogues x {window} prefixes)", flush=True)
            time.sleep(a.stall)
        logits = model(tokens)
        loss = sum(F.cross_entropy(logits[s], targets[s].argmax(1)) for s in SLOTS)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                     f"(dialogue turn representations contain NaN)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if a.fault == "segv" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    # validation: joint goal accuracy, per-slot correct counts summed over ranks
    net = model.module if a.ddp else model
    with torch.no_grad():
        tokens = torch.stack([t for t, _ in val])
        vt = encode_labels(val, ontology)
        out = net(tokens)
        correct = torch.zeros(len(val_slots))
        joint = torch.ones(len(val), dtype=torch.bool)
        for i, s in enumerate(val_slots):
            hit = out[s].argmax(1) == vt[s].argmax(1) if s in out else torch.ones(len(val), dtype=torch.bool)
            correct[i] = hit.sum()
            joint &= hit
    gathered = [torch.zeros(len(val_slots)) for _ in range(world)]
    dist.all_gather(gathered, correct)
    jga = torch.tensor([joint.float().sum().item(), float(len(val))])
    dist.all_reduce(jga)
    if rank == 0:
        per_slot = torch.stack(gathered).sum(0) / (len(val) * world)
        print("rank 0 per-slot accuracy " + " ".join(f"{s}={v:.3f}" for s, v in zip(SLOTS, per_slot.tolist())))
        print(f"rank 0 done: {a.steps} steps, joint goal accuracy {jga[0].item() / jga[1].item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
