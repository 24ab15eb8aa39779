"""A two-hundred-and-eightieth hand-run batch: EDGE CLASSIFICATION ON A TRANSACTION GRAPH.

Each rank loads its shard of a synthetic payment graph (`<workdir>/edges/edges_RR.pt`, written by
`--prep 1`): 200 accounts with 8 node features and ~900 payments with 7 numeric features, an amount and
a currency code.  The amount is converted to USD with a rate table and appended as the 8th edge feature.
A two-layer message-passing network updates edges (MLP over [h_src, h_dst, e]) and nodes (messages summed
into the destination with index_add_), a linear head scores every edge as fraud or not, the loss is a
focal loss (gamma 2) over a padded edge batch, DDP (gloo) averages the gradients, per-rank flagged counts
per currency bucket are all_gathered and precision at k is all_reduced every step.  Launch with torchrun,
any env:// launcher, or `--spawn N` (torch.multiprocessing.spawn).  `--logfmt 1` logs through logging.

Faults:
- badidx: rank N builds its endpoint table with an off-by-one (dst + 1), one edge points past the last node.
- focalnan: rank N reads gamma = -0.5 from an old config; padded edges give 0 ** -0.5 = inf, loss NaN.
- cntgather: rank N counts flagged edges in 5 currency buckets ("other" too) for the all_gather of 4.
- noedges: rank N reads its edge table from `edges_v2/`, which was never written.
- fxrate: rank N's shard has payments in CHF, a currency missing from the rate table (KeyError).
- efeat: every rank builds the edge MLP for 10 edge features (two timestamp columns dropped since): 8 arrive.
- ckptwidth: with --resume 1 rank N loads the hidden-64 checkpoint into the hidden-32 model.
- twohop: at step 2 rank N walks every two-hop neighbourhood in Python for --stall seconds.
- segv: rank N gets SIGSEGV right after step 2's optimizer step.
- exit3: rank N logs an error about future timestamps in its batch and calls os._exit(3).
- none: no fault.

What happened (filled in after the runs):
- badidx: IndexError: index 200 is out of bounds for dimension 0 with size 200 on rank N at step 0; peers Connection closed by peer.
- focalnan: FloatingPointError: rank N: focal loss is nan at step 0 (the program's check); peers Connection closed by peer.
- cntgather: gloo::EnforceNotMet 'Received data size doesn't match expected size' (10 vs 8) on rank (N+1)%W (SIGABRT); others reset.
- noedges: FileNotFoundError: ... '/tmp/job_work/edges_v2/edges_0N.pt' on rank N at startup; peers Connection closed by peer.
- fxrate: KeyError: 'CHF' on rank N at startup; peers Connection closed by peer or SIGTERMed by the agent.
- efeat: RuntimeError: mat1 and mat2 shapes cannot be multiplied (9xxx72 and 74x32) on every rank at step 0.
- ckptwidth: RuntimeError: Error(s) in loading state_dict for EdgeNet: size mismatch (64 vs 32) on rank N.
- twohop: PG 12 s: peers 'Timed out waiting 12000ms'; PG 300 s under timeout 60: silence, then exit 124.
- segv: rank N killed by SIGSEGV after step 1's line (bash 139, spawn ProcessExitedException); peers closed.
- exit3: rank N prints its 'timestamped in the future; aborting' line, exits 3; Root Cause exitcode 3.
- none: exit 0, every rank 'done: 5 steps'.
"""
import argparse, logging, os, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

RATES = {"USD": 1.0, "EUR": 1.08, "GBP": 1.27, "JPY": 0.0067}
BUCKETS = ["USD", "EUR", "GBP", "JPY"]
NODES, NODE_DIM, NUM_DIM, PAD_TO = 200, 8, 7, 1024


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--resume", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prep", type=int, default=0)
    p.add_argument("--workdir", default="/tmp/fault280_work")
    return p.parse_args()


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class EdgeLayer(nn.Module):
    def __init__(self, hid, edge_in):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * hid + edge_in, hid), nn.ReLU())
        self.node_lin = nn.Linear(2 * hid, hid)

    def forward(self, h, e, src, dst):
        e = self.edge_mlp(torch.cat([h[src], h[dst], e], dim=1))
        agg = torch.zeros_like(h).index_add_(0, dst, e)
        return F.relu(self.node_lin(torch.cat([h, agg], dim=1))), e


class EdgeNet(nn.Module):
    def __init__(self, hid, edge_dim):
        super().__init__()
        self.enc = nn.Linear(NODE_DIM, hid)
        self.l1 = EdgeLayer(hid, edge_dim)
        self.l2 = EdgeLayer(hid, hid)
        self.head = nn.Linear(hid, 1)

    def forward(self, x, e, src, dst):
        h = F.relu(self.enc(x))
        h, e = self.l1(h, e, src, dst)
        h, e = self.l2(h, e, src, dst)
        return self.head(e + h[dst]).squeeze(1)


def prep(a):
    g = torch.Generator().manual_seed(280)
    os.makedirs(f"{a.workdir}/edges", exist_ok=True)
    for r in range(8):
        ne = 900 + 7 * r
        t = {"x": torch.randn(NODES, NODE_DIM, generator=g),
             "src": torch.randint(0, NODES, (ne,), generator=g), "dst": torch.randint(0, NODES, (ne,), generator=g),
             "num": torch.randn(ne, NUM_DIM, generator=g), "amount": torch.rand(ne, generator=g) * 5000,
             "currency": [BUCKETS[i % 4] for i in range(ne)], "label": (torch.rand(ne, generator=g) < 0.08).float()}
        torch.save(t, f"{a.workdir}/edges/edges_{r:02d}.pt")
    os.makedirs(f"{a.workdir}/ckpt", exist_ok=True)
    for hid in (32, 64):
        torch.manual_seed(hid)
        torch.save(EdgeNet(hid, NUM_DIM + 1).state_dict(), f"{a.workdir}/ckpt/edgc_h{hid}.pt")
    print("wrote 8 edge shards and 2 checkpoints under", a.workdir)


def focal_loss(logit, label, weight, gamma):
    p = torch.sigmoid(logit)
    pt = torch.where(label > 0, p, 1 - p)
    pt = torch.where(weight > 0, pt, torch.ones_like(pt))
    loss = -((1 - pt) ** gamma) * torch.log(pt.clamp_min(1e-8)) * weight
    return loss.sum() / weight.sum()


def train(a, rank, world, log, err):
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    sub = "edges_v2" if bad and a.fault == "noedges" else "edges"
    t = torch.load(f"{a.workdir}/{sub}/edges_{rank:02d}.pt")
    if bad and a.fault == "fxrate":
        t["currency"][len(t["currency"]) // 3] = "CHF"
    usd = torch.tensor([RATES[c] for c in t["currency"]]) * t["amount"]
    efeat = torch.cat([t["num"], torch.log1p(usd).unsqueeze(1)], dim=1)
    src, dst = t["src"], t["dst"]
    if bad and a.fault == "badidx":
        dst = dst.clone(); dst[dst.argmax()] += 1  # endpoints are stored 0-based
    edge_dim = 10 if bad and a.fault == "efeat" else efeat.shape[1]
    gamma = -0.5 if bad and a.fault == "focalnan" else 2.0
    torch.manual_seed(0)
    model = EdgeNet(a.hidden, edge_dim)
    if a.resume:
        ck_hidden = 64 if bad and a.fault == "ckptwidth" else a.hidden
        path = f"{a.workdir}/ckpt/edgc_h{ck_hidden}.pt"
        log(f"rank {rank} resuming from {path}")
        model.load_state_dict(torch.load(path))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    ne = src.shape[0]
    label = F.pad(t["label"], (0, PAD_TO - ne))
    weight = F.pad(torch.ones(ne), (0, PAD_TO - ne))
    log(f"rank {rank}/{world} loaded {ne} edges, {NODES} nodes, edge dim {efeat.shape[1]}")
    for step in range(a.steps):
        if bad and a.fault == "exit3" and step == 1:
            err(f"rank {rank}: edge batch {step} has 3 payments timestamped in the future; aborting")
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(3)
        logit = F.pad(ddp(t["x"], efeat, src, dst), (0, PAD_TO - ne))
        loss = focal_loss(logit, label, weight, gamma)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: focal loss is {loss.item()} at step {step}")
        if bad and a.fault == "twohop" and step == 2:
            log(f"rank {rank}: refreshing two-hop neighbourhood features")
            adj = [[] for _ in range(NODES)]
            for s, d in zip(src.tolist(), dst.tolist()):
                adj[s].append(d)
            deadline, walked = time.time() + a.stall, 0
            while time.time() < deadline:
                for n in range(NODES):
                    walked += sum(len(adj[m]) for m in adj[n])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        with torch.no_grad():
            score = torch.sigmoid(logit[:ne])
            flagged = score > 0.5
            nb = 5 if bad and a.fault == "cntgather" else 4
            cnt = torch.zeros(nb)
            for i, c in enumerate(t["currency"]):
                if flagged[i]:
                    cnt[BUCKETS.index(c) if c in BUCKETS else 4] += 1
            outs = [torch.zeros(nb) for _ in range(world)]
            dist.all_gather(outs, cnt)
            k = 50
            hits = torch.tensor([t["label"][score.topk(k).indices].sum().item(), float(k)])
            dist.all_reduce(hits)
        log(f"rank {rank} step {step} loss {loss.item():.4f} p@{k} {hits[0] / hits[1]:.3f} "
            f"flagged {int(sum(o.sum() for o in outs))}")
    dist.barrier()
    log(f"rank {rank} done: {a.steps} steps")


def worker(rank, a, world):
    if a.spawn:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.pg_timeout))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.logfmt:
        logging.basicConfig(format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s", level=logging.INFO)
        lg = logging.getLogger("edgeclf")
        [h.addFilter(RankFilter(rank)) for h in logging.root.handlers]
        log, err = lg.info, lg.error
    else:
        log = lambda m: print(m, flush=True)
        err = lambda m: print(m, file=sys.stderr, flush=True)
    try:
        train(a, rank, world, log, err)
    except Exception as e:
        if a.logfmt:
            err(f"training failed: {type(e).__name__}: {e}")
        raise
    dist.destroy_process_group()


def main():
    a = parse()
    if a.prep:
        return prep(a)
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(a.port)
        mp.spawn(worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        worker(int(os.environ["RANK"]), a, int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()
