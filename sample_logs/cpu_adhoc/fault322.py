"""Hand-run batch 322: PETRI-NET PROCESS MINING WITH A SEQUENCE MODEL.

An order-to-cash workflow net (10 transitions = activities, 9 places, an AND-split after "register") is played
out to synthetic event logs, one per rank, written by --prepare to /tmp/fault322_work/eventlog/cases_R.pt.
Each rank encodes its cases (activity names looked up in the activity table), replays them token by token on
the net to get the marking after every prefix, and trains a next-activity GRU (activity embedding + marking
vector in, next activity or END out) with cross-entropy, wrapped in DDP (gloo) or, with --ddp 0, averaging
gradients by hand.  The model starts from ckpt/miner_a10.pt.  Per-rank case counts are all_gathered at
start-up, the accuracy is all_reduced every step, the final-marking histograms are all_gathered at the end,
and rank 0 saves export/miner.pt.  Options: --spawn N --port P (torch.multiprocessing.spawn), --logfmt 1.

Faults (--fault NAME --rank R, -1 = every rank):
  unkact     - rank R's log holds an event "reopen_case" missing from the activity table (KeyError, start-up)
  noeventlog - rank R reads eventlog/filtered/cases_R.pt, which was never written (FileNotFoundError)
  ckptsize   - rank R starts from ckpt/miner_a12.pt, mined with 12 activities (size mismatch, before step 0)
  ckptpickle - rank R starts from ckpt/miner_full.pt, which pickles the PetriNet object (weights_only refusal)
  transidx   - rank R's conformance metric forgets to drop the END class from step 1 (IndexError on pre[])
  markgather - rank R all_gathers its final-marking histogram with an extra "unfinished" bin (10 vs 9, at the end)
  replay     - rank R token-replays every case in Python before step 3's all_reduce (slow; 12 s PG timeout)
  variantinf - rank R reweights variants at step 3 with a zero count: inf weight, the loss check raises
  sigsegv    - rank R sends itself SIGSEGV after step 3
  unsound    - rank R finds a dead transition at the end, prints its own ERROR line and sys.exit(5)
  markwidth  - every rank: the marking vector gets an extra source place (GRU input 26 vs 25, first forward)
  none       - control, clean run

What happened (filled in after the runs):
  unkact     - KeyError: 'reopen_case' in encode at start-up; peers Connection closed in all_gather (np4 r2 ranklabel); np3 r0 spawn shows only process 1's Connection closed
  noeventlog - FileNotFoundError eventlog/filtered/cases_R.pt before the first all_gather (np5 r3 srunlabel, np3 r1 files)
  ckptsize   - load_state_dict size mismatch (12-activity checkpoint); peers closed at DDP construction (np4 r1 mpitag, np4 r3 pdsh2)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' on miner_full.pt; launcher SIGTERMs the rest (np3 r2 legacy, np5 r0 tee)
  transidx   - IndexError 'index 10 is out of bounds for dimension 0 with size 10' in step 1; Root Cause rank 3 (np4 r3 legacy)
  markgather - after 6 steps 'allgather: invalid tensor size at index 0 (expected (10), got (9))' (np4 r1 logfmt, np3 r2 bashloop --ddp 0)
  replay     - 12 s: peers 'Timed out waiting 12000ms' after step 2 (np3 r1 bashloop); 300 s: silent, killed at 60 s, exit 124 (np4 r2 tee)
  variantinf - 'non-finite loss inf at step 3' then FloatingPointError (np3 r1 logfmt, np5 r4 ranklabel --ddp 0)
  sigsegv    - silent after step 3, bash 'Segmentation fault', peers Connection closed, exit 139 (np4 r2 mpitag, np3 r0 srunlabel)
  unsound    - rank 1's ERROR soundness line after 6 steps, exit 5; ProcessExitedException exit code 5 (np3 r1 spawn)
  markwidth  - caught earlier than meant: every rank's load_state_dict size mismatch gru.weight_ih_l0 [96,25] vs [96,26] (np4 pdsh2)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/miner.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault322_work"
ACTS = ["register", "check_credit", "check_stock", "decide", "approve", "reject",
        "escalate", "notify", "invoice", "archive"]
ACT = {a: i for i, a in enumerate(ACTS)}
NACT = len(ACTS)
END = NACT          # target class "case ends"; also the input padding index
NPLACE = 9
MAXLEN = 12
DIM = 16
HID = 32
log = None

# transition -> (input places, output places)
NET = {"register": ([0], [1, 2]), "check_credit": ([1], [3]), "check_stock": ([2], [4]),
       "decide": ([3, 4], [5]), "approve": ([5], [6]), "reject": ([5], [6]), "escalate": ([6], [6]),
       "notify": ([6], [7]), "invoice": ([7], [8]), "archive": ([8], [])}


class PetriNet:
    def __init__(self):
        self.pre = torch.zeros(NACT, NPLACE)
        self.post = torch.zeros(NACT, NPLACE)
        for t, (ins, outs) in NET.items():
            self.pre[ACT[t], ins] = 1.0
            self.post[ACT[t], outs] = 1.0

    def initial(self):
        m = torch.zeros(NPLACE)
        m[0] = 1.0
        return m


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("pnet")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class NextActivityGRU(nn.Module):
    def __init__(self, nact=NACT, nplace=NPLACE):
        super().__init__()
        self.emb = nn.Embedding(nact + 1, DIM, padding_idx=nact)
        self.gru = nn.GRU(DIM + nplace, HID, batch_first=True)
        self.head = nn.Linear(HID, nact + 1)

    def forward(self, acts, marks):
        h, _ = self.gru(torch.cat([self.emb(acts), marks], -1))
        return self.head(h)


def playout(net, g):
    m = net.initial()
    trace = []
    while len(trace) < MAXLEN - 1:
        enabled = [t for t in range(NACT) if bool((m >= net.pre[t]).all()) and net.pre[t].sum() > 0]
        if not enabled:
            break
        t = enabled[int(torch.randint(len(enabled), (1,), generator=g))]
        if ACTS[t] == "escalate" and torch.rand(1, generator=g) < 0.6:
            t = ACT["notify"]
        m = m - net.pre[t] + net.post[t]
        trace.append(ACTS[t])
    return trace


def prepare():
    net = PetriNet()
    for d in ("eventlog", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(300 + r)
        cases = [{"case": f"o{r}-{i:04d}", "events": [(a, 60.0 * k) for k, a in enumerate(playout(net, g))]}
                 for i in range(96)]
        torch.save(cases, f"{WORK}/eventlog/cases_{r}.pt")
    torch.manual_seed(0)
    torch.save(NextActivityGRU().state_dict(), f"{WORK}/ckpt/miner_a10.pt")
    torch.save(NextActivityGRU(12).state_dict(), f"{WORK}/ckpt/miner_a12.pt")
    torch.save({"model": NextActivityGRU().state_dict(), "net": net}, f"{WORK}/ckpt/miner_full.pt")
    print("prepared", WORK)


def token_replay(net, names, extra_place=False):
    m = net.initial()
    marks, missing = [], 0
    for a in names:
        t = ACT[a]
        missing += int((net.pre[t] - m).clamp(min=0).sum())
        m = (m - net.pre[t]).clamp(min=0) + net.post[t]
        marks.append(m.clone())
    if extra_place:
        marks = [torch.cat([x, torch.zeros(1)]) for x in marks]
    return marks, missing, m


def encode(cases, net, bad, fault):
    n = len(cases)
    width = NPLACE + (1 if fault == "markwidth" else 0)
    acts = torch.full((n, MAXLEN), END, dtype=torch.long)
    tgt = torch.full((n, MAXLEN), -100, dtype=torch.long)
    marks = torch.zeros(n, MAXLEN, width)
    final = torch.zeros(NPLACE)
    for i, c in enumerate(cases):
        names = [a for a, _ in c["events"]]
        ids = [ACT[a] for a in names]
        mk, _, last = token_replay(net, names, extra_place=fault == "markwidth")
        final += last
        L = len(ids)
        acts[i, :L] = torch.tensor(ids)
        tgt[i, :L] = torch.tensor(ids[1:] + [END])
        marks[i, :L] = torch.stack(mk)
    return acts, tgt, marks, final


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    f = a.fault if bad else "none"
    torch.manual_seed(77 + rank)
    net = PetriNet()
    say(f"rank {rank}/{world} up, reading event log")
    sub = "filtered/" if f == "noeventlog" else ""
    cases = torch.load(f"{WORK}/eventlog/{sub}cases_{rank}.pt")
    if f == "unkact":
        cases[7]["events"].insert(3, ("reopen_case", 125.0))
    acts, tgt, marks, final = encode(cases, net, bad, a.fault)
    ncase = torch.tensor([float(len(cases))])
    allc = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allc, ncase)
    say(f"rank {rank} cases {len(cases)} global {int(sum(c.item() for c in allc))}")
    model = NextActivityGRU(nplace=marks.shape[-1])
    ck = {"ckptsize": "miner_a12.pt", "ckptpickle": "miner_full.pt"}.get(f, "miner_a10.pt")
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net_model = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net_model.parameters(), lr=5e-3)
    weights = torch.ones(len(cases))
    for step in range(a.steps):
        logits = net_model(acts, marks)
        ce = nn.functional.cross_entropy(logits.reshape(-1, NACT + 1), tgt.reshape(-1), reduction="none")
        ce = ce.reshape(len(cases), MAXLEN)
        if f == "variantinf" and step == 3:
            counts = torch.tensor([float(len(c["events"]) != 9) * 3.0 for c in cases])
            weights = 1.0 / counts  # inverse variant frequency
        loss = ((ce * (tgt != -100)).sum(1) * weights).sum() / (tgt != -100).sum()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(weights)).sum())} variant weights are inf)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        valid = (tgt != -100) if (f == "transidx" and step >= 1) else (tgt != -100) & (tgt != END)
        fired = tgt[valid]
        consumed = net.pre[fired].sum()
        if f == "replay" and step == 3:
            t0, n = time.time(), 0
            while time.time() - t0 < a.replay_budget:
                for c in cases:
                    n += token_replay(net, [x for x, _ in c["events"]])[1]
            say(f"rank {rank} full token replay: {n} missing tokens")
        acc = ((logits.argmax(-1) == tgt) & (tgt != -100)).sum().float() / (tgt != -100).sum()
        acc = acc.reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.4f} "
            f"consumed {int(consumed)}")
        if f == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if f == "unsound":
        say(f"rank {rank}: ERROR soundness check failed: transition 'escalate' can fire forever on place p6 "
            f"and case o{rank}-0041 never reaches the sink place; refusing to export a model of an unsound net",
            err=True)
        sys.exit(5)
    if f == "markgather":
        final = torch.cat([final, torch.tensor([3.0])])  # extra bin: unfinished cases
    hist = [torch.zeros(NPLACE) for _ in range(world)]
    dist.all_gather(hist, final)
    say(f"rank {rank} final marking in sink place p8/empty: {float(sum(h.sum() for h in hist)):.0f} tokens")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/miner.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/miner.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(rank))
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--replay-budget", type=int, default=30)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()
