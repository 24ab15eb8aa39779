"""A hundred-and-tenth hand-run batch: GRAPH AND SCATTER/GATHER-INDEX OPERATIONS. A tiny one-hop graph network trained
data-parallel on gloo. Rank 0 partitions a synthetic graph (32 nodes per rank, 8 features, 4 node types, in-degree 8,
edges mostly inside a partition and some from the neighbouring partitions) and writes <workdir>/part_R.pt for every
rank (node features, targets, node types, an edge_index [2, E] padded with -1 to a common capacity, the halo plan:
send_ids per peer and the cached recv_counts); a barrier; each rank loads its own partition. Every step: DropEdge
(p 0.3) on the edge list, halo exchange (split sizes exchanged first with all_to_all_single, then the halo features
with all_to_all_single and variable split sizes), degree normalisation (index_add_ of ones, deg^-1/2), edge weights
looked up per (src type, dst type) with torch.take, messages index_select-ed, scaled and index_add_-ed, a per-type
readout (scatter_reduce amax, include_self=False) gathered back with torch.gather, a head, MSE loss, a finite-loss
check, DDP (--ddp 0: a manual all_reduce of the gradients), SGD. Prints `rank R step S loss L edges E halo H`.
--steps (6), --pg-timeout (12 s). No @record.

Faults (N = --rank):
  none       control: exit 0, `rank R done`
  allgather  control: the halo exchange done with all_gather of counts and of padded feature blocks (exit 0)
  oob        rank N's partition file is a stale one whose halo ids were numbered for 4 more local nodes: edge sources
             point past n_local + n_halo and index_select raises IndexError: index out of range in self
  negpad     rank N's partition metadata records the padded edge count, so the -1 padding sentinels survive the
             load: the degree index_add_ raises `index -1 is out of bounds for dimension 0 with size 32`
  int32      every partition written with the partitioner's --compact (all integer tensors int32): the edge weight
             lookup torch.take(type_w, src_type * 4 + dst_type) needs an int64 index
  staleplan  every rank uses the halo plan cached in its partition instead of exchanging split sizes; rank N's cached
             send plan is stale (one node more to its left neighbour): all_to_all_single sizes disagree
  dropedge   rank N's partition has 2 leaf nodes of in-degree 1 (warned at load); DropEdge isolates one at some
             step: deg^-1/2 is inf, 0*inf is nan, the finite-loss check raises FloatingPointError
  noedges    rank N's partition has no edges at all: the edge weight normalisation w / w.max() reduces an empty tensor
  featwidth  rank N's node features were exported from a newer feature store with 12 columns, the others 8
  dimsize    the aggregation helper infers its output size from index.max()+1 (no dim_size passed); rank N's last 3
             nodes have no in-edges, so its aggregate has 29 rows for 32 nodes: a shape error
  missing    the partitioner's num_parts comes from the job config (world-1): the last rank's part file is missing
  nohalo     rank N's partition is interior (no halo in or out) and an optimisation skips the halo exchange when a
             rank has nothing to send or receive: the others wait in all_to_all_single

What happened (filled in after the runs, one line each):
  none/allgather: exit 0 on every run.
  oob: IndexError `index 83 is out of bounds for dimension 0 with size 82` in ntype_full[src] on rank N (np4 r2, pdsh2 r3).
  negpad: first take exited 0 (no padding at cap 256, dropped); after the cap fix: IndexError `index out of range in self` in index_add_.
  int32: every rank `RuntimeError: take(): Expected a long tensor for index, but got Int` at step 1 (np4, np5 train.sh).
  staleplan: the receiver (rank N-1) aborts, gloo::EnforceNotMet `op.preamble.length <= op.nbytes` (SIGABRT); the others conn reset.
  dropedge: UserWarning at load, `FloatingPointError: rank 1: loss is nan at step 3, stopping`; peers Connection closed by peer.
  noedges: `RuntimeError: max(): Expected reduction dim to be specified for input.numel() == 0` on rank N (np4 r3, np5 r0 redirects).
  featwidth: receivers 1 and 3 abort (`1200 vs 800`, SIGABRT), rank N `mat1 and mat2 shapes cannot be multiplied (82x12 and 8x16)`.
  dimsize: `The size of tensor a (29) must match the size of tensor b (32) at non-singleton dimension 0` on rank N.
  missing: `wrote 3 partitions`, rank 3 FileNotFoundError part_3.pt, the others SIGTERMed.
  nohalo: every rank times out after 12 s (waiters in all_to_all_single, rank N in DDP backward); --pg-timeout 300: hang, timeout 100.
"""
import argparse, datetime, math, os, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--workdir", default="/tmp/fault110_work")
a = p.parse_args()
NL, FEAT, NTYPES, DEG, HID = 32, 8, 4, 8, 16


def partition_graph(world: int, num_parts: int, bad: int, out: str) -> None:
    g = torch.Generator().manual_seed(110)
    n = world * NL
    src_all, dst_all = [], []
    for v in range(n):
        r, lv = divmod(v, NL)
        k = DEG
        if a.fault == "dropedge" and r == bad and lv < 2:
            k = 1  # leaf nodes
        if a.fault == "noedges" and r == bad:
            k = 0
        if a.fault == "dimsize" and r == bad and lv >= NL - 3:
            k = 0
        for _ in range(k):
            if a.fault == "nohalo" and r == bad:
                owner = r
            elif torch.rand(1, generator=g).item() < 0.7:
                owner = r
            else:
                owner = (r + (1 if torch.rand(1, generator=g).item() < 0.5 else -1)) % world
                if a.fault == "nohalo" and owner == bad:
                    owner = r
            src_all.append(owner * NL + int(torch.randint(0, NL, (1,), generator=g)))
            dst_all.append(v)
    src_all, dst_all = torch.tensor(src_all, dtype=torch.long), torch.tensor(dst_all, dtype=torch.long)
    ntype_all = torch.randint(0, NTYPES, (n,), generator=g)
    x_all = torch.randn(n, FEAT, generator=g)
    y_all = x_all[:, :2].sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    halos, eis = [], []
    for r in range(world):
        m = (dst_all // NL) == r
        s, d = src_all[m], dst_all[m] - r * NL
        remote = torch.unique(s[(s // NL) != r])  # sorted by global id, hence by owner
        halos.append(remote)
        loc = torch.where((s // NL) == r, s - r * NL, torch.zeros_like(s))
        if len(remote):
            pos = torch.searchsorted(remote, s)
            loc = torch.where((s // NL) == r, loc, NL + pos)
        eis.append(torch.stack([loc, d]))
    cap = (max(e.shape[1] for e in eis) // 64 + 1) * 64  # room for at least one pad column
    for r in range(num_parts):
        ei = eis[r].clone()
        if a.fault == "oob" and r == bad:
            ei[0] = torch.where(ei[0] >= NL, ei[0] + 4, ei[0])  # stale halo numbering
        num_edges = ei.shape[1]
        padded = torch.full((2, cap), -1, dtype=torch.long)
        padded[:, :num_edges] = ei
        if a.fault == "negpad" and r == bad:
            num_edges = cap  # metadata written after padding
        recv_counts = torch.bincount(halos[r] // NL, minlength=world)
        send_ids = [halos[j][(halos[j] // NL) == r] - r * NL for j in range(world)]
        if a.fault == "staleplan" and r == bad:  # send plan cached before an edge was removed
            send_ids[(r - 1) % world] = torch.cat([send_ids[(r - 1) % world], torch.tensor([NL - 1])])
        x = x_all[r * NL:(r + 1) * NL]
        if a.fault == "featwidth" and r == bad:
            x = torch.cat([x, torch.randn(NL, 4, generator=g)], 1)  # feature store v2
        part = {"x": x, "y": y_all[r * NL:(r + 1) * NL], "ntype": ntype_all[r * NL:(r + 1) * NL],
                "halo_ntype": ntype_all[halos[r]], "edge_index": padded, "num_edges": num_edges,
                "recv_counts": recv_counts, "send_ids": send_ids}
        if a.fault == "int32":  # --compact
            part = {k: (v.int() if torch.is_tensor(v) and not v.is_floating_point() else
                        [t.int() for t in v] if isinstance(v, list) else v) for k, v in part.items()}
        torch.save(part, f"{out}/part_{r}.pt")
    print(f"partitioner: wrote {num_parts} partitions of {n} nodes, {len(src_all)} edges, cap {cap}", flush=True)


def scatter_sum(src, index, dim_size=None):
    size = int(index.max()) + 1 if dim_size is None else dim_size
    idx = index.view(-1, 1).expand(-1, src.shape[1])
    return torch.zeros(size, src.shape[1]).scatter_reduce(0, idx, src, reduce="sum", include_self=False)


class GNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin_in, self.lin_self = nn.Linear(FEAT, HID), nn.Linear(FEAT, HID)
        self.type_w = nn.Parameter(torch.ones(NTYPES * NTYPES))
        self.head = nn.Linear(2 * HID, 1)

    def forward(self, x, x_full, ei, ntype, ntype_full):
        src, dst = ei[0], ei[1]
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        dinv = deg.pow(-0.5)
        w = torch.take(self.type_w, ntype_full[src] * NTYPES + ntype[dst])
        w = w / w.max()
        msg = self.lin_in(x_full).index_select(0, src) * w.unsqueeze(1)
        if a.fault == "dimsize":
            agg = scatter_sum(msg, dst)
        else:
            agg = scatter_sum(msg, dst, dim_size=x.shape[0])
        h = F.relu(agg * dinv.unsqueeze(1) + self.lin_self(x))
        t = ntype.long().view(-1, 1).expand(-1, HID)
        pooled = torch.zeros(NTYPES, HID).scatter_reduce(0, t, h, reduce="amax", include_self=False)
        return self.head(torch.cat([h, torch.gather(pooled, 0, t)], 1))


def halo_exchange(feats, part, world, rank):
    send_ids = part["send_ids"]
    send_counts = torch.tensor([len(s) for s in send_ids], dtype=torch.long)
    if a.fault == "staleplan":
        recv_counts = part["recv_counts"].long()  # cached halo plan
    elif a.fault == "allgather":
        counts = [torch.zeros(world, dtype=torch.long) for _ in range(world)]
        dist.all_gather(counts, send_counts)
        recv_counts = torch.stack([c[rank] for c in counts])
    else:
        recv_counts = torch.empty(world, dtype=torch.long)
        dist.all_to_all_single(recv_counts, send_counts)
    send = feats.index_select(0, torch.cat(send_ids))
    if a.fault == "allgather":
        mx = int(max(int(c.max()) for c in counts))
        blocks = [torch.zeros(world * mx, feats.shape[1]) for _ in range(world)]
        mine = torch.zeros(world * mx, feats.shape[1])
        off = 0
        for j, c in enumerate(send_counts.tolist()):
            mine[j * mx: j * mx + c] = send[off: off + c]
            off += c
        dist.all_gather(blocks, mine)
        return torch.cat([blocks[j][rank * mx: rank * mx + int(recv_counts[j])] for j in range(world)])
    recv = torch.empty(int(recv_counts.sum()), feats.shape[1])
    dist.all_to_all_single(recv, send, recv_counts.tolist(), send_counts.tolist())
    return recv


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    os.makedirs(a.workdir, exist_ok=True)
    bad = world - 1 if a.fault == "missing" else a.rank
    if rank == 0:
        num_parts = world - 1 if a.fault == "missing" else world  # job config: num_parts
        partition_graph(world, num_parts, bad, a.workdir)
    dist.barrier()
    part = torch.load(f"{a.workdir}/part_{rank}.pt")
    ei = part["edge_index"][:, :part["num_edges"]]
    x, y, ntype = part["x"], part["y"], part["ntype"]
    deg_in = torch.bincount(ei[1][ei[1] >= 0], minlength=NL)
    if int((deg_in == 1).sum()) > 0:
        warnings.warn(f"rank {rank}: {int((deg_in == 1).sum())} nodes have in-degree 1; DropEdge may isolate them")
    halo = int(sum(len(s) for s in part["send_ids"])) + int(part["recv_counts"].sum())
    if a.fault == "nohalo" and halo == 0:
        print(f"rank {rank}: interior partition, halo exchange skipped", flush=True)
    print(f"rank {rank} world {world} partition nodes {x.shape[0]} feat {x.shape[1]} edges {ei.shape[1]} "
          f"halo {int(part['recv_counts'].sum())} dtype {ei.dtype}", flush=True)
    torch.manual_seed(0)
    net = GNN()
    model = nn.parallel.DistributedDataParallel(net) if a.ddp else net
    if not a.ddp:
        for prm in net.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7 + rank)
    ntype_full = torch.cat([ntype, part["halo_ntype"]])
    for step in range(1, a.steps + 1):
        time.sleep(0.2)
        keep = torch.rand(ei.shape[1], generator=gen) >= 0.3  # DropEdge
        e = ei[:, keep]
        xs = x + 0.05 * torch.randn(x.shape, generator=gen)
        if a.fault == "nohalo" and halo == 0:
            recv = torch.empty(0, x.shape[1])
        else:
            recv = halo_exchange(xs, part, world, rank)
        x_full = torch.cat([xs, recv])
        opt.zero_grad()
        loss = F.mse_loss(model(xs, x_full, e, ntype, ntype_full), y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}, stopping")
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad.div_(world)
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} edges {e.shape[1]} halo {recv.shape[0]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
