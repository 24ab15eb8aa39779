"""A ninety-first hand-run batch: SUBGROUPS AND HIERARCHICAL COLLECTIVES on gloo. The world is cut into "nodes" of
--local-size ranks (2 unless told): per-pair groups for a metric exchange (made first), intra-node groups from
`dist.new_subgroups(group_size)`, a leaders' group `dist.new_group([0, L, 2L, ...])` of each node's first rank. A tiny
model (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16 of synthetic data per rank) is trained for --steps (6) with a
hand-written hierarchical gradient all-reduce: all_reduce in the node group, all_reduce of the node sums in the
leaders' group, broadcast from the leader back into the node group; then each pair exchanges its loss. It prints
`rank R node K local J groups ...`, `rank R step S loss L`, `rank R done`. Every group gets the job's PG timeout
(--pg-timeout, 12 s) unless --no-sub-timeout (then c10d's default 30 minutes). No @record.

Faults (rank N = --rank):
  none        control: every step, `rank R done` (exit 0)
  order       rank N creates the leaders' group before the node groups (its copy of the set-up code builds them
              in another order): its groups' names do not line up with its peers'
  skipcreate  rank N creates the pair groups only for the pairs it belongs to (`if rank in pair: new_group(pair)`):
              every later group it makes is numbered differently from its peers'
  localsize   rank N reads a local size of 4 from its node's hostfile entry (--bad-local-size), the others 2: it
              calls new_subgroups with another group size, its group lists and count differ
  nonmember   rank N (not a leader) gathers the node sums over the leaders' group as if it were one: the
              all_gather is skipped with a warning on a non-member and the list sized get_world_size(leaders) = -1
              is empty: torch.cat of an empty list
  negrank     rank N takes its node index from dist.get_rank(leaders) (a leader-only helper): -1 on a non-leader,
              its node's slice of the data is empty: IndexError
  srcgroup    the broadcast from the leader into the node group passes src=0 (the leader's rank in the group, not
              its global rank): the ranks of every node but node 0 raise (ValueError / invalid rank)
  srcone      the same wrong src on rank N alone (its copy of the code)
  destroy     rank N destroys its node group after step --at's evaluation (a cleanup meant for the end) and uses it
              again at the next step
  shape       rank N flattens its gradients with an extra buffer (a running mean it registered) into the node
              all_reduce: sizes differ in the node group (with TORCH_DISTRIBUTED_DEBUG=DETAIL: a mismatch report)
  slowleader  rank N (a leader) writes its node's stats file each step and sleeps --delay s there from step --at:
              the other leaders time out in the leaders' all_reduce
  split       the node groups from dist.split_group(split_ranks=...) instead of new_subgroups (every rank; the
              default group was made without a device_id)
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--local-size", type=int, default=2)
p.add_argument("--bad-local-size", type=int, default=4)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--delay", type=float, default=30.0)
p.add_argument("--no-sub-timeout", action="store_true")
p.add_argument("--workdir", default="/tmp/fault91_work")
a = p.parse_args()
BATCH = 16


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    pg_to = datetime.timedelta(seconds=a.pg_timeout)
    dist.init_process_group("gloo", timeout=pg_to)
    sub_to = None if a.no_sub_timeout else pg_to
    L = a.bad_local_size if (a.fault == "localsize" and me) else a.local_size
    leader_ranks = list(range(0, world, L))
    pairs = [[r, r + 1] for r in range(0, world - 1, 2)]

    def make_pairs():
        mine = None
        for pr in pairs:
            if a.fault == "skipcreate" and me and rank not in pr:
                continue  # "only the groups this rank is in"
            g = dist.new_group(pr, timeout=sub_to)
            if rank in pr:
                mine = g
        return mine

    pair_group = make_pairs()  # the metric pairs first, then the node groups and the leaders' group
    if a.fault == "order" and me:
        leaders = dist.new_group(leader_ranks, timeout=sub_to)
        node_group, _ = dist.new_subgroups(group_size=L, timeout=sub_to)
    elif a.fault == "split":
        node_group = dist.split_group(split_ranks=[list(range(s, s + L)) for s in range(0, world, L)], timeout=sub_to)
        leaders = dist.new_group(leader_ranks, timeout=sub_to)
    else:
        node_group, _ = dist.new_subgroups(group_size=L, timeout=sub_to)
        leaders = dist.new_group(leader_ranks, timeout=sub_to)
    node, local = rank // L, dist.get_rank(node_group)
    if a.fault == "negrank" and me:
        node = dist.get_rank(leaders)  # the leaders' helper: a node's index is its leader's rank in `leaders`
    print(f"rank {rank} node {node} local {local} groups node={dist.get_process_group_ranks(node_group)} "
          f"leaders={leader_ranks} pair={dist.get_process_group_ranks(pair_group) if pair_group else None}",
          flush=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("run_mean", torch.zeros(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # the data: one batch per rank, grouped by node; a rank takes its node's slice, then its local one
    samples = [batch(1000 + i) for i in range(world)]
    node_samples = samples[node * L:(node + 1) * L]
    x0, y = node_samples[local]
    for step in range(1, a.steps + 1):
        x = x0 + 0.01 * step
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        flat = torch.cat([q.grad.flatten() for q in model.parameters()])
        if a.fault == "shape" and me:
            model.run_mean.mul_(0.9).add_(0.1 * x.mean(0)[:3])
            flat = torch.cat([flat, model.run_mean])  # "sync the running stats with the gradients"
        # hierarchical all-reduce: node, then leaders, then back down from the leader
        dist.all_reduce(flat, group=node_group)
        if rank in leader_ranks:
            if a.fault == "slowleader" and me and step >= a.at:
                os.makedirs(a.workdir, exist_ok=True)
                with open(os.path.join(a.workdir, f"node{node}_stats.txt"), "a") as fh:
                    fh.write(f"{step} {loss.item():.4f}\n")
                    time.sleep(a.delay)  # the node's file system is slow
            dist.all_reduce(flat, group=leaders)
        if a.fault == "nonmember" and me:
            parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(leaders))]
            dist.all_gather(parts, flat, group=leaders)
            flat = torch.cat(parts).view(-1, flat.numel()).sum(0)
        src = 0 if (a.fault == "srcgroup" or (a.fault == "srcone" and me)) else node * L
        dist.broadcast(flat, src=src, group=node_group)
        flat.div_(world)
        off = 0
        for q in model.parameters():
            q.grad.copy_(flat[off:off + q.numel()].view_as(q))
            off += q.numel()
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt, group=pair_group)
        print(f"rank {rank} step {step} loss {loss.item():.4f} pair {lt.item() / 2:.4f}", flush=True)
        if a.fault == "destroy" and me and step == a.at:
            dist.destroy_process_group(node_group)  # "free the eval group" (the node group it was given)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
