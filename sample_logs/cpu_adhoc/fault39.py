"""A thirty-ninth hand-run batch: COLLECTIVES USED WRONGLY, and rank/world mistakes. A small DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), --steps steps, PG timeout 15 s) that after every backward all-reduces a metric
vector [loss_sum, n_samples] and prints a progress line in one of four formats (--fmt). ONE misuse, chosen by
--fault, is made by rank --rank at step --step (other ranks run the correct code):

  shape        rank R's metric vector carries a third field (size 3 against 2)
  ragged       at step K every rank all-reduces its per-sample losses; rank R's last batch is ragged (5 samples)
  dtype        rank R builds its metric vector as float64
  op           rank R broadcasts its metric vector (src=0) where the others all-reduce
  skip         rank R skips the metric all-reduce (`if rank != R`)
  extra        rank R all-reduces its gradient norm once more (a debugging line left in)
  order        the metric is two all-reduces ([loss_sum, n] then [n_correct]); rank R calls them in reverse order
  newgroup     dist.new_group(ranks=[...]) for an eval group is called only on the ranks in it (rank R is not)
  badsrc       rank R broadcasts the eval config with src=world_size (an off-by-one: the last rank is world-1)
  sendself     rank R sends its metric with dist.send(dst=rank) (itself)
  norecv       rank R sends its metric to rank 0 with dist.send, and no rank posts the recv
  scatter      rank R is scatter's src and passes a scatter_list one tensor short
  objgather    rank R's all_gather_object payload holds a lambda (unpicklable)
  redscat      rank R's reduce_scatter_tensor output is one element too long
  worldsize    rank R sets WORLD_SIZE to world+1 before init_process_group
  duprank      rank R sets RANK to (R+1) % world before init_process_group (two processes claim one rank)
  localrank    every rank calls init_process_group(rank=LOCAL_RANK) (wrong over two agents)
  doubleinit   rank R calls init_process_group again at step K (a helper that sets up evaluation)
  beforeinit   rank R calls dist.barrier() before init_process_group (the data-prep rank waits for the others)
  destroy      rank R calls dist.destroy_process_group() at step K and returns (exit 0)
  destroycont  rank R calls dist.destroy_process_group() at step K and goes on training
  okragged     control: ragged per-sample losses padded to the largest batch (all_reduce of the max size first)
  okgroup      control: new_group on every rank, the eval all-reduce only by its members
  okobj        control: all_gather_object of rank-dependent dicts
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--step", type=int, default=3)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--fmt", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--manual-grads", action="store_true",
               help="no DDP: all-reduce the gradients by hand (DDP under TORCH_DISTRIBUTED_DEBUG=DETAIL segfaults here)")
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16


def say(rank: int, step: int, msg: str) -> None:
    if a.fmt == 0:
        line = f"[rank {rank}] step {step}/{a.steps} {msg}"
    elif a.fmt == 1:
        line = f"r{rank} | step {step:02d} | {msg}"
    elif a.fmt == 2:
        line = f"step={step} rank={rank} :: {msg}"
    else:
        line = f"{time.strftime('%H:%M:%S')} [trainer {rank}] it {step} {msg}"
    print(line, flush=True)


def batch(rank: int, step: int, n: int = BATCH):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def main() -> None:
    f, R, K = a.fault, a.rank, a.step
    rank0 = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if f == "worldsize" and rank0 == R:
        os.environ["WORLD_SIZE"] = str(world + 1)  # read from a stale job config
    if f == "duprank" and rank0 == R:
        os.environ["RANK"] = str((R + 1) % world)  # read from a stale per-host env file
    if f == "beforeinit" and rank0 == R:
        print(f"[rank {rank0}] preparing data, waiting for the others", flush=True)
        dist.barrier()
    if f == "localrank":
        lr = int(os.environ["LOCAL_RANK"])
        say(rank0, 0, f"init_process_group(rank={lr}, world_size={world})")
        dist.init_process_group("gloo", rank=lr, world_size=world, timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if not a.manual_grads:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    say(rank, 0, f"world {world} model ready")
    eval_ranks = list(range(world - 1)) if world > 2 else [0]
    grp = None
    if f in ("okgroup",):
        grp = dist.new_group(ranks=eval_ranks)
    for step in range(1, a.steps + 1):
        here = rank == R and step == K
        n = 5 if (f in ("ragged", "okragged") and here) else BATCH
        x, y = batch(rank, step, n)
        out = model(x)
        losses = F.cross_entropy(out, y, reduction="none")
        loss = losses.mean()
        opt.zero_grad()
        loss.backward()
        if a.manual_grads:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        time.sleep(0.15)
        if here and f == "destroy":
            say(rank, step, "early stop: validation target reached, releasing process group")
            dist.destroy_process_group()
            return
        if here and f == "destroycont":
            say(rank, step, "eval done, destroying eval process group")
            dist.destroy_process_group()
        if here and f == "doubleinit":
            say(rank, step, "setting up evaluation")
            dist.init_process_group("gloo", timeout=TIMEOUT)
        metric = torch.tensor([float(losses.detach().sum()), float(n)])
        correct = torch.tensor([float((out.argmax(1) == y).sum())])
        if here and f == "shape":
            metric = torch.tensor([float(losses.detach().sum()), float(n), float(loss.detach())])
        if here and f == "dtype":
            metric = metric.double()
        if step == K and f in ("ragged",):
            per = losses.detach().clone()
            dist.all_reduce(per)
        if step == K and f == "okragged":
            size = torch.tensor([n])
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
            per = torch.zeros(int(size)); per[:n] = losses.detach()
            dist.all_reduce(per)
        if step == K and f == "badsrc":
            cfg = torch.tensor([float(step), 0.5])
            dist.broadcast(cfg, src=world if rank == R else world - 1)
        if step == K and f == "sendself" and rank == R:
            dist.send(metric, dst=rank)
        if step == K and f == "norecv" and rank == R:
            dist.send(metric, dst=0)
        if step == K and f == "scatter":
            out_t = torch.zeros(2)
            if rank == R:
                dist.scatter(out_t, scatter_list=[metric.clone() for _ in range(world - 1)], src=R)
            else:
                dist.scatter(out_t, src=R)
        if step == K and f == "redscat":
            inp = torch.arange(2 * world, dtype=torch.float32)
            outp = torch.zeros(3 if rank == R else 2)
            dist.reduce_scatter_tensor(outp, inp)
        if step == K and f in ("objgather", "okobj"):
            payload = {"rank": rank, "loss": float(loss.detach()), "n": n}
            if f == "objgather" and rank == R:
                payload["filter"] = lambda s: s["loss"] < 10  # a sample filter kept with the stats
            gathered = [None] * world
            dist.all_gather_object(gathered, payload)
            if rank == 0:
                say(rank, step, f"gathered stats of {len(gathered)} ranks")
        if step == K and f in ("newgroup",) and rank in eval_ranks:
            g = dist.new_group(ranks=eval_ranks)
            dist.all_reduce(correct, group=g)
        if step == K and f == "okgroup" and rank in eval_ranks:
            dist.all_reduce(correct, group=grp)
        if here and f == "extra":
            gn = torch.tensor([float(sum(p.grad.norm() ** 2 for p in model.parameters()))])
            dist.all_reduce(gn)  # debug: global grad norm
        if here and f == "op":
            dist.broadcast(metric, src=0)
        elif here and f == "skip":
            pass
        elif here and f == "order":
            dist.all_reduce(correct)
            dist.all_reduce(metric)
        elif f == "order":
            dist.all_reduce(metric)
            dist.all_reduce(correct)
        else:
            dist.all_reduce(metric)
        avg = float(metric[0]) / max(float(metric[1]), 1.0)
        say(rank, step, f"loss {loss.item():.4f} avg {avg:.4f}")
    say(rank, a.steps, "training finished")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
