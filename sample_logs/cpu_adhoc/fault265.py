"""A two-hundred-and-sixty-fifth hand-run batch: LINK PREDICTION WITH GRAPHSAGE.

A synthetic graph of 2000 nodes with random 16-wide features (edges/part-RRR.tsv and feats.pt, written by
`--export`, which also writes the pretrained encoder ckpt/sage_pretrain.pt), a two-layer mean-aggregator
GraphSAGE written with index_select / index_add_, positive edges scored against sampled negative edges with a
binary cross-entropy, DDP on gloo (`--ddp 0` all_reduces gradients by hand), loss all_reduced per step, then
AUC and hits@20 on held-out edges, all_reduced, with the negative scores all_gathered for the hits@20 cut.

Faults:
  nbr       - rank N maps neighbour ids through the v2 id space (+64); some indices pass the node count (IndexError)
  nopos     - rank N splits with val_every larger than its edge count; no positive val edge, AUC is NaN (check)
  negcount  - rank N samples 8 more eval negatives; the negative scores are all_gathered with another length
  noedges   - rank N reads the edge list of the v2 export, which was never written (FileNotFoundError)
  rel       - rank N reads relations with the v2 vocabulary; 'mentions' is not in the relation map (KeyError)
  featdim   - every rank appends 8 positional-encoding columns; 24-wide features into the 16-wide layer
  ckpt      - rank N builds hidden width 64 and loads the hidden-32 pretrained checkpoint (size mismatch)
  sampleloop- rank N samples neighbours for every node in a Python loop before eval; reaches the all_reduce late
  denseadj  - rank N builds the dense adjacency with scale 1000 (2e6 x 2e6 floats; CPU allocator failure)
  segv      - rank N gets SIGSEGV at step 2
  exit4     - rank N prints an error about its edge shard and calls os._exit(4)
  none      - control

What happened (filled in after the runs):
  nbr       - IndexError: index out of range in self (index_select) on rank N at step 0; peers Connection closed
  nopos     - FloatingPointError: rank N: AUC is nan over 0 positive and 256 negative val edges; peers closed
  negcount  - rank N: ProcessGroupGloo::allgather: invalid tensor size (expected (264), got (256)); DETAIL: mismatch
  noedges   - FileNotFoundError for edges/v2/part-00N.tsv on rank N; peers SIGTERMed
  rel       - KeyError: 'mentions' on rank N in load_edges; peers SIGTERMed
  featdim   - RuntimeError: mat1 and mat2 shapes cannot be multiplied (2000x24 and 16x32) on every rank
  ckpt      - RuntimeError: Error(s) in loading state_dict for SAGE: size mismatch for self1.weight on rank N
  sampleloop- peers `Timed out waiting 12000ms`; with --pg-timeout 300 the run hung until timeout 60 (124)
  denseadj  - DefaultCPUAllocator: can't allocate memory: you tried to allocate 16000000000000 bytes on rank N
  segv      - rank N exitcode -11 (SIGSEGV), no traceback; peers Connection closed/reset by peer
  exit4     - `ERROR rank N: part-00N.tsv: ... aborting`, exitcode 4; peers Connection closed/reset by peer
  none      - exit 0, `rank 0 done: 5 steps, AUC 0.494 hits@20 0.033 over 450 val edges`
"""
import argparse, math, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

WORK = "/tmp/fault265_work"
REL_WEIGHT = {"cites": 1.0, "follows": 0.5, "likes": 0.25}


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--nodes", type=int, default=2000)
    p.add_argument("--feat-dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--negatives", type=int, default=256)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--stall", type=float, default=40)
    p.add_argument("--export", action="store_true")
    return p.parse_args()


class SAGE(nn.Module):
    def __init__(self, d_in, hidden):
        super().__init__()
        self.self1, self.nbr1 = nn.Linear(d_in, hidden), nn.Linear(d_in, hidden, bias=False)
        self.self2, self.nbr2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden, bias=False)

    @staticmethod
    def mean_agg(x, src, dst, w):
        agg = torch.zeros_like(x).index_add_(0, dst, x.index_select(0, src) * w.unsqueeze(1))
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, w).clamp(min=1)
        return agg / deg.unsqueeze(1)

    def forward(self, x, src, dst, w):
        h = F.relu(self.self1(x) + self.nbr1(self.mean_agg(x, src, dst, w)))
        return self.self2(h) + self.nbr2(self.mean_agg(h, src, dst, w))


def export(a):
    g = torch.Generator().manual_seed(7)
    os.makedirs(f"{WORK}/edges", exist_ok=True)
    for r in range(8):
        with open(f"{WORK}/edges/part-{r:03d}.tsv", "w") as f:
            for e in range(1500):
                s = int(torch.randint(0, a.nodes, (1,), generator=g))
                d = (s + int(torch.randint(1, 40, (1,), generator=g))) % a.nodes
                f.write(f"{s}\t{d}\t{(s + d) % 3}\n")
    torch.save(torch.randn(a.nodes, a.feat_dim, generator=g), f"{WORK}/feats.pt")
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    torch.manual_seed(0)
    torch.save(SAGE(a.feat_dim, a.hidden).state_dict(), f"{WORK}/ckpt/sage_pretrain.pt")
    print("exported 8 edge parts, feats.pt and ckpt/sage_pretrain.pt")


def load_edges(a, rank, bug):
    part = f"{WORK}/edges/v2/part-{rank:03d}.tsv" if bug("noedges") else f"{WORK}/edges/part-{rank:03d}.tsv"
    rows = [l.split("\t") for l in open(part)]
    names = ["cites", "follows", "likes"] + (["mentions"] if bug("rel") else [])
    src = torch.tensor([int(r[0]) + (64 if bug("nbr") else 0) for r in rows])
    dst = torch.tensor([int(r[1]) for r in rows])
    w = torch.tensor([REL_WEIGHT[names[(int(r[0]) + int(r[1])) % len(names)]] for r in rows])
    every = len(rows) + 1 if bug("nopos") else a.val_every
    val = torch.arange(len(rows)) % every == every - 1
    return src, dst, w, val


def main():
    a = args()
    if a.export:
        return export(a)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    bug = lambda name: a.fault == name and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    model = SAGE(a.feat_dim, 64 if bug("ckpt") else a.hidden)
    model.load_state_dict(torch.load(f"{WORK}/ckpt/sage_pretrain.pt"))
    x = torch.load(f"{WORK}/feats.pt")
    if bug("featdim"):
        x = torch.cat([x, torch.sin(torch.arange(a.nodes).unsqueeze(1) / (10.0 ** torch.arange(8)))], 1)
    src, dst, w, val = load_edges(a, rank, bug)
    scale = 1000 if bug("denseadj") else 1
    adj = torch.zeros(a.nodes * scale, a.nodes * scale)
    adj[src.clamp(max=a.nodes - 1), dst] = 1.0
    tr_s, tr_d, tr_w = src[~val], dst[~val], w[~val]
    ms, md, mw = torch.cat([tr_s, tr_d]), torch.cat([tr_d, tr_s]), torch.cat([tr_w, tr_w])
    print(f"rank {rank}: {int((~val).sum())} train / {int(val.sum())} val edges, {a.nodes} nodes, {x.shape[1]} features", flush=True)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        h = net(x, ms, md, mw)
        pick = torch.randint(0, len(tr_s), (256,), generator=g)
        pos = (h[tr_s[pick]] * h[tr_d[pick]]).sum(-1)
        ns, nd = torch.randint(0, a.nodes, (2, 256), generator=g)
        neg = (h[ns] * h[nd]).sum(-1)
        loss = F.binary_cross_entropy_with_logits(torch.cat([pos, neg]), torch.cat([torch.ones(256), torch.zeros(256)]))
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ws
        opt.step()
        if bug("segv") and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bug("exit4") and step == 1:
            print(f"ERROR rank {rank}: part-{rank:03d}.tsv: {int(adj.diagonal().sum())} self loops after dedup but degree table says 0; aborting", file=sys.stderr, flush=True)
            os._exit(4)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            print(f"step {step}: global loss {lt.item() / ws:.4f}", flush=True)
    model.eval()
    if bug("sampleloop"):
        print(f"rank {rank} sampling 10 neighbours for each of {a.nodes} nodes before eval", flush=True)
        nbrs = []
        for v in range(a.nodes):
            cand = md[ms == v]
            nbrs.append(cand[torch.randint(0, max(len(cand), 1), (10,), generator=g) % max(len(cand), 1)] if len(cand) else cand)
            time.sleep(a.stall / a.nodes)
    with torch.no_grad():
        h = model(x, ms, md, mw)
        pos = (h[src[val]] * h[dst[val]]).sum(-1)
        n_neg = a.negatives + (8 if bug("negcount") else 0)
        ns, nd = torch.randint(0, a.nodes, (2, n_neg), generator=g)
        neg = (h[ns] * h[nd]).sum(-1)
        auc = (pos.unsqueeze(1) > neg.unsqueeze(0)).float().mean().item()
    if not math.isfinite(auc):
        raise FloatingPointError(f"rank {rank}: AUC is {auc} over {len(pos)} positive and {len(neg)} negative val edges")
    allneg = [torch.zeros(a.negatives) for _ in range(ws)]
    dist.all_gather(allneg, neg)
    cut = torch.cat(allneg).topk(20).values[-1]
    tot = torch.tensor([auc * len(pos), float((pos > cut).sum()), float(len(pos))])
    dist.all_reduce(tot)
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, AUC {tot[0] / tot[2]:.3f} hits@20 {tot[1] / tot[2]:.3f} over {int(tot[2])} val edges", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
