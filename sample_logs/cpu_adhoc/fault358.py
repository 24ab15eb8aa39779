"""A three-hundred-and-fifty-eighth hand-run batch: FRAUD DETECTION ON TRANSACTION GRAPHS.

Synthetic card transactions as a graph: accounts are nodes (6 features: age of account, balance, country
risk, number of cards, KYC level, chargeback history), transactions are edges (amount, hour of day,
merchant category code looked up in an 8-entry MCC table) with a fraud label.  Every rank reads its shard
from /tmp/fault358_work/tx/tx_R.pt and trains an edge classifier: a one-layer GraphSAGE-style encoder
(self + mean of neighbours) over the accounts and an MLP on [h_src, h_dst, edge features, MCC embedding],
on a weighted BCE loss, in mini-batches of 128 edges per step.  The model is initialised from
ckpt/fraudgnn_h16.pt.  The loss is all_reduced every step (with the batch fraud recall), per-rank shard
statistics are all_gathered at the end, and rank 0 saves export/fraudgnn.pt.
Options: --ddp 0 (no DDP wrapper; gradients all_reduced by hand), --spawn N (torch.multiprocessing.spawn,
--port), --logfmt 1 (progress and errors through logging), --prepare (write the synthetic data once).

Faults:
  merchant   - rank N's shard has transactions at MCC "crypto_atm", missing from the MCC table (KeyError, start-up)
  nodeidx    - rank N's step-1 batch names account ids from a newer snapshot, beyond its 400 accounts (IndexError)
  noshard    - rank N reads its shard from tx/holdout/ which does not exist (FileNotFoundError, start-up)
  ckptwidth  - rank N initialises from ckpt/fraudgnn_h24.pt, saved with hidden size 24 (size mismatch)
  ckptpolicy - rank N loads ckpt/fraudgnn_policy.pt, which pickles a ThresholdPolicy object (weights_only refusal)
  gatherstat - rank N all_gathers 5 shard statistics (adds a chargeback rate) where the others send 4 (end)
  ringscan   - rank N searches every account cycle (fraud rings) in Python before the step-2 all_reduce
  refund     - rank N's step-3 batch holds refunds as amounts below -1: log1p NaN, the program's loss check
  sigsegv    - rank N sends itself SIGSEGV after step 4
  ledger     - rank N prints its own error line (shard ledger does not balance) and calls sys.exit(5)
  velocity   - every rank: edge features get a velocity column (5 wide), the edge MLP expects 4 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  merchant   - KeyError: 'crypto_atm' in the MCC lookup at start-up; peers Connection closed by peer in DDP init (np4 r1 ranklabel); torchrun SIGTERMs the rest, Root Cause rank 0 (np6 r0 logfmt)
  nodeidx    - IndexError 'index 437 is out of bounds for dimension 0 with size 400' in the step-1 forward; peers closed (np3 r2 srunlabel); ProcessRaisedException for process 1 (np4 r1 spawn)
  noshard    - FileNotFoundError for tx/holdout/tx_N.pt at start-up; peers Connection closed by peer (np4 r3 mpitag, np3 r2 files)
  ckptwidth  - load_state_dict size mismatch [24, 6] vs [16, 6] etc.; Root Cause rank N (np3 r1 legacy); pdsh2 np4: rank 2 on worker-1, worker-0's agent RendezvousConnectionError
  ckptpolicy - UnpicklingError 'Weights only load failed' on GLOBAL __main__.ThresholdPolicy; the rest SIGTERMed (np6 r4 tee)
  gatherstat - six clean steps, then 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank N; peers closed (np3 r0 bashloop --ddp 0, np6 r3 mpitag)
  ringscan   - 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_reduce, rank N later Connection closed (np3 r1 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np3 r0 srunlabel)
  refund     - rank N's check: 'non-finite loss nan at step 3', FloatingPointError; peers closed (np4 r2 tee, np3 r0 files)
  sigsegv    - no trace from rank N after step 4; peers Connection closed, loop exit 139 (np4 r3 ranklabel); ProcessExitedException SIGSEGV (np3 r1 spawn)
  ledger     - rank N's 'ERROR shard ledger does not balance' and exit 5; Root Cause rank 5 exitcode 5 (np8 r5 legacy)
  velocity   - every rank 'mat1 and mat2 shapes cannot be multiplied (128x5 and 4x8)' in the first forward; Root Cause rank 3 (np4 logfmt)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/fraudgnn.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault358_work"
MCC = {"grocery": 0, "fuel": 1, "travel": 2, "electronics": 3, "gaming": 4, "jewelry": 5, "atm": 6, "online": 7}
NACC = 400
NTX = 1024
NODE_F = 6
EDGE_F = 4
HID = 16
BATCH = 128
log = None


class ThresholdPolicy:
    def __init__(self, threshold, review_band):
        self.threshold = threshold
        self.review_band = review_band


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("fraudgnn")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base.addHandler(h)
    base.setLevel(logging.INFO)
    log = RankAdapter(base, {"rank": rank})


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class FraudGNN(nn.Module):
    def __init__(self, hid=HID):
        super().__init__()
        self.enc = nn.Linear(NODE_F, hid)
        self.self_w = nn.Linear(hid, hid)
        self.nb_w = nn.Linear(hid, hid, bias=False)
        self.mcc = nn.Embedding(len(MCC), 4)
        self.edge = nn.Linear(EDGE_F, 8)
        self.head = nn.Sequential(nn.Linear(2 * hid + 8 + 4, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, xn, src_all, dst_all, src, dst, ef, mcc):
        h = torch.relu(self.enc(xn))
        deg = torch.zeros(h.shape[0]).index_add_(0, dst_all, torch.ones(dst_all.shape[0])).clamp(min=1)
        nb = torch.zeros_like(h).index_add(0, dst_all, h[src_all]) / deg.unsqueeze(1)
        h = torch.relu(self.self_w(h) + self.nb_w(nb))
        z = torch.cat([h[src], h[dst], torch.relu(self.edge(ef)), self.mcc(mcc)], 1)
        return self.head(z).squeeze(1)


def make_shard(seed):
    g = torch.Generator().manual_seed(seed)
    xn = torch.rand(NACC, NODE_F, generator=g)
    src = torch.randint(0, NACC, (NTX,), generator=g)
    dst = torch.randint(0, NACC, (NTX,), generator=g)
    amount = torch.exp(torch.randn(NTX, generator=g) * 1.2 + 3.5)
    hour = torch.randint(0, 24, (NTX,), generator=g)
    names = list(MCC)
    mcc = [names[int(i)] for i in torch.randint(0, 8, (NTX,), generator=g)]
    risk = xn[src, 2] + (hour < 5).float() * 0.8 + (amount > 150).float() * 0.6
    label = (risk + torch.rand(NTX, generator=g) * 0.5 > 1.6).float()
    return {"xn": xn, "src": src, "dst": dst, "amount": amount, "hour": hour, "mcc": mcc, "label": label}


def prepare():
    os.makedirs(f"{WORK}/tx", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(300 + r), f"{WORK}/tx/tx_{r}.pt")
    torch.manual_seed(0)
    torch.save(FraudGNN(16).state_dict(), f"{WORK}/ckpt/fraudgnn_h16.pt")
    torch.save(FraudGNN(24).state_dict(), f"{WORK}/ckpt/fraudgnn_h24.pt")
    torch.save({"model": FraudGNN(16).state_dict(), "policy": ThresholdPolicy(0.62, 0.1)},
               f"{WORK}/ckpt/fraudgnn_policy.pt")
    print("prepared", WORK)


def edge_features(amount, hour, velocity=None):
    ang = hour.float() * (2 * math.pi / 24)
    cols = [torch.log1p(amount), torch.sin(ang), torch.cos(ang), (hour < 5).float()]
    if velocity is not None:
        cols.append(velocity)
    return torch.stack(cols, 1)


def ring_search(src, dst, budget):
    adj = {}
    for s, d in zip(src.tolist(), dst.tolist()):
        adj.setdefault(s, set()).add(d)
    t0, rings = time.time(), 0
    while time.time() - t0 < budget:
        for start in list(adj)[:50]:
            stack = [(start, (start,))]
            while stack:
                v, path = stack.pop()
                for w in adj.get(v, ()):
                    if w == start and len(path) > 2:
                        rings += 1
                    elif w not in path and len(path) < 7:
                        stack.append((w, path + (w,)))
    return rings


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, loading transaction shard")
    split = "holdout/" if bad and a.fault == "noshard" else ""
    sh = torch.load(f"{WORK}/tx/{split}tx_{rank}.pt")
    if bad and a.fault == "merchant":
        sh["mcc"][517] = "crypto_atm"
    if bad and a.fault == "ledger":
        say(f"rank {rank}: ERROR shard ledger does not balance: debits 1,204,331.17 != credits 1,203,998.02 "
            f"(diff 333.15), refusing to train on an unreconciled shard", err=True)
        sys.exit(5)
    mcc = torch.tensor([MCC[m] for m in sh["mcc"]])
    amount, hour = sh["amount"].clone(), sh["hour"]
    src, dst = sh["src"].clone(), sh["dst"].clone()
    if bad and a.fault == "nodeidx":
        src[BATCH + 7] = NACC + 37
    if bad and a.fault == "refund":
        amount[3 * BATCH + 11:3 * BATCH + 15] = torch.tensor([-25.0, -80.5, -12.0, -3.2])
    velocity = torch.rand(NTX) if a.fault == "velocity" else None
    ef = edge_features(amount, hour, velocity)
    model = FraudGNN()
    if bad and a.fault == "ckptpolicy":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/fraudgnn_policy.pt")["model"])
    else:
        ck = "fraudgnn_h24.pt" if bad and a.fault == "ckptwidth" else "fraudgnn_h16.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    y = sh["label"]
    pos_w = (1 - y.mean()) / y.mean().clamp(min=1e-3)
    say(f"rank {rank} shard: {NACC} accounts, {NTX} transactions, fraud rate {y.mean():.3f}")
    for step in range(a.steps):
        b = slice((step * BATCH) % NTX, (step * BATCH) % NTX + BATCH)
        logit = net(sh["xn"], sh["src"], sh["dst"], src[b], dst[b], ef[b], mcc[b])
        loss = F.binary_cross_entropy_with_logits(logit, y[b], pos_weight=pos_w)
        if not torch.isfinite(loss):
            bad_rows = int((~torch.isfinite(ef[b])).any(1).sum())
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step}: {bad_rows} transactions with "
                f"non-finite edge features (min amount {amount[b].min():.2f})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "ringscan" and step == 2:
            say(f"rank {rank} scanning account graph for fraud rings")
            n = ring_search(sh["src"], sh["dst"], a.ring_budget)
            say(f"rank {rank} ring scan: {n} cycles")
        pred = (logit.detach() > 0).float()
        tp = (pred * y[b]).sum()
        stats = torch.stack([loss.detach(), tp, y[b].sum()])
        dist.all_reduce(stats)
        recall = (stats[1] / stats[2].clamp(min=1)).item()
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} recall {recall:.3f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    st = [y.mean().item(), float(NTX), amount.mean().item(), float(NACC)]
    if bad and a.fault == "gatherstat":
        st.append(0.021)
    st = torch.tensor(st, dtype=torch.float32)
    allst = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allst, st)
    say(f"rank {rank} global fraud rate {sum(s[0].item() for s in allst) / world:.3f} "
        f"over {int(sum(s[1].item() for s in allst))} transactions")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/fraudgnn.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/fraudgnn.pt")
    dist.barrier()
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
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ring-budget", type=int, default=45)
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
