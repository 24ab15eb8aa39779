"""A ninety-seventh hand-run batch: RANDOMNESS THAT MAKES RANKS DIVERGE. A tiny DDP loop on gloo
(Linear(8,16)-ReLU-[block: Linear(16,16)-ReLU]-Linear(16,4), SGD, batch 16, synthetic per-rank data, PG timeout 12 s
unless --pg-timeout) that runs --steps steps and prints `rank R step S loss L` every step. The random choices come from
generators seeded with `--seed + rank` (the bug: a per-rank seed for a choice that must agree across ranks), or with
`--seed` alone under --shared-seed (the fix). Which rank diverges first follows from --seed (the seeds of the kept runs
are listed in README.md); --log-choices prints each rank's seed and its choice every step, as many training scripts
do; without it the log shows nothing of the choices. --rank N only matters where a fault names one rank.

Faults:
  none        control: no random choice, every rank ends with `rank R done` (exit 0)
  droppath    stochastic depth: every step each rank drops the block with probability --p (0.2) from its own
              generator; DDP has find_unused_parameters=False, so the rank that drops it while the others do not
              gets no gradient for the block and raises DDP's `Expected to have finished reduction` at its next
              forward; with --shared-seed every rank drops it at the same step and every rank raises
              (--find-unused: DDP reduces what it gets, the run passes)
  evalrand    after each step a rank evaluates with probability --p (0.15), and the evaluation all_reduces its
              val loss; the rank that evaluates is one all_reduce ahead of the others' next DDP bucket all-reduce
              (--shared-seed: all ranks evaluate together, the run passes)
  crop        random crop: each step a rank cuts its 24-long sequences to a length drawn from (24, 24, 24, 18);
              DDP is fine with that, but the per-step metric all_gather of predictions uses empty_like outputs,
              so the first step where one rank's length differs aborts in gloo
  randbreak   a random early stop ("patience" drawn at random): a rank leaves the loop with probability --p (0.1)
              per step and goes to the final dist.barrier(); the others go on into the next DDP all-reduce
  dropbatch   a random dropout of whole micro-batches: a rank skips a step (no forward/backward) with probability
              --p (0.1); at the end every rank all_reduces its summed loss, the skipping rank one collective early
  randckpt    a checkpoint drawn at random (--p, 0.15): the save does dist.barrier() and rank 0 writes, so a rank
              that draws a save sits in a barrier while the others are in DDP's all-reduce
  initseed    every rank seeds torch with --seed + rank before building the model (to get different data), and the
              script's own check that the replicas start identical (an all_gather of a parameter checksum before
              DDP wraps the model) fails: AssertionError on every rank but 0 (each compares with rank 0's)
  initpeek    every rank seeds torch with --seed, but rank N draws a random "preview" augmentation batch before
              building the model: its init differs and only rank N's check raises AssertionError
  randperm    the sampler shuffles with torch.randperm from the global generator seeded --seed + rank and takes
              perm[rank::world]; rank 0's data audit all_gathers the shards' indices once and raises ValueError on
              the duplicates (--shared-seed: the shards are disjoint, the run passes)
"""
import argparse, datetime, os, random, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--seed", type=int, default=1234)
p.add_argument("--shared-seed", action="store_true")
p.add_argument("--find-unused", action="store_true")
p.add_argument("--log-choices", action="store_true")
p.add_argument("--p", type=float, default=None)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault97_work")
a = p.parse_args()
BATCH, N_DATA = 16, 256
P_DEFAULT = {"droppath": 0.2, "evalrand": 0.15, "randbreak": 0.1, "dropbatch": 0.1, "randckpt": 0.15}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, drop_block=False):
        h = F.relu(self.stem(x))
        if not drop_block:
            h = h + F.relu(self.block(h))
        return self.head(h)


def checksum(m):
    return torch.stack([q.detach().double().sum() for q in m.parameters()]).sum().reshape(1)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    prob = a.p if a.p is not None else P_DEFAULT.get(a.fault, 0.0)
    seed = a.seed if a.shared_seed else a.seed + rank
    # generators for the random choices
    choice_gen = torch.Generator().manual_seed(seed)
    choice_rng = random.Random(seed)
    if a.log_choices:
        print(f"[rank {rank}] choice seed {seed} (fault {a.fault}, p={prob})", flush=True)

    if a.fault == "initseed":
        torch.manual_seed(a.seed + rank)
    else:
        torch.manual_seed(a.seed)
    if a.fault == "initpeek" and rank == a.rank:
        preview = torch.rand(4, 8) * 2 - 1  # a look at the augmented inputs before training
        print(f"[rank {rank}] augmentation preview: mean {preview.mean():.4f} std {preview.std():.4f}", flush=True)
    net = Net()
    if a.fault in ("initseed", "initpeek"):
        mine = checksum(net)
        sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(sums, mine)
        assert torch.equal(mine, sums[0]), (
            f"rank {rank}: model replica differs from rank 0's at init: checksums {[round(float(s), 6) for s in sums]}")
    model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=a.find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    # data: a per-rank shard of a synthetic data set
    dg = torch.Generator().manual_seed(777)
    data_x, data_y = torch.randn(N_DATA, 24, 8, generator=dg), torch.randint(0, 4, (N_DATA, 24), generator=dg)
    if a.fault == "randperm":
        if not a.shared_seed:
            torch.manual_seed(a.seed + rank)
        perm = torch.randperm(N_DATA)
        shard = perm[rank::world]
        idx = [torch.zeros_like(shard) for _ in range(world)]
        dist.all_gather(idx, shard)
        if rank == 0:
            allidx = torch.cat(idx)
            dup = allidx.numel() - allidx.unique().numel()
            if dup:
                raise ValueError(f"data audit: the {world} shards hold {dup} duplicate sample indices "
                                 f"({allidx.unique().numel()} distinct of {N_DATA})")
            print(f"data audit: {world} shards, {allidx.numel()} distinct indices", flush=True)
    else:
        shard = torch.arange(rank, N_DATA, world)
    print(f"rank {rank} world {world} fault {a.fault} steps {a.steps} shard {shard.numel()} samples", flush=True)

    total, done = torch.zeros(1), 0
    for step in range(1, a.steps + 1):
        sel = shard[(step - 1) * BATCH % shard.numel():][:BATCH]
        if sel.numel() < BATCH:
            sel = shard[:BATCH]
        x, y = data_x[sel], data_y[sel]
        if a.fault == "dropbatch":
            skip = choice_rng.random() < prob
            if a.log_choices:
                print(f"[rank {rank}] step {step} drop micro-batch: {skip}", flush=True)
            if skip:
                continue
        if a.fault == "crop":
            length = choice_rng.choice((24, 24, 24, 18))
            if a.log_choices:
                print(f"[rank {rank}] step {step} crop length {length}", flush=True)
            x, y = x[:, :length], y[:, :length]
        drop = False
        if a.fault == "droppath":
            drop = bool(torch.rand((), generator=choice_gen) < prob)
            if a.log_choices:
                print(f"[rank {rank}] step {step} drop_block={drop}", flush=True)
        opt.zero_grad()
        out = model(x, drop_block=drop)
        loss = F.cross_entropy(out.reshape(-1, 4), y.reshape(-1))
        loss.backward()
        opt.step()
        total += loss.detach()
        done += 1
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if a.fault == "crop":
            pred = out.argmax(-1)
            outs = [torch.empty_like(pred) for _ in range(world)]
            dist.all_gather(outs, pred)  # predictions of every rank, for the step's accuracy
        if a.fault == "evalrand":
            ev = choice_rng.random() < prob
            if a.log_choices:
                print(f"[rank {rank}] step {step} evaluate: {ev}", flush=True)
            if ev:
                with torch.no_grad():
                    vx, vy = data_x[-32:], data_y[-32:]
                    v = F.cross_entropy(model(vx).reshape(-1, 4), vy.reshape(-1)).reshape(1)
                dist.all_reduce(v)
                print(f"rank {rank} step {step} val_loss {float(v) / world:.4f}", flush=True)
        if a.fault == "randckpt":
            save = choice_rng.random() < prob
            if a.log_choices:
                print(f"[rank {rank}] step {step} checkpoint: {save}", flush=True)
            if save:
                dist.barrier()
                if rank == 0:
                    os.makedirs(a.workdir, exist_ok=True)
                    torch.save(model.module.state_dict(), f"{a.workdir}/ckpt_step{step}.pt")
                print(f"rank {rank} step {step} checkpoint saved", flush=True)
        if a.fault == "randbreak":
            stop = choice_rng.random() < prob
            if a.log_choices:
                print(f"[rank {rank}] step {step} early stop: {stop}", flush=True)
            if stop:
                print(f"rank {rank} stopping early at step {step}", flush=True)
                break
        time.sleep(0.05)
    dist.all_reduce(total)
    dist.barrier()
    print(f"rank {rank} done: {done} steps, mean loss {float(total) / max(done, 1) / world:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
