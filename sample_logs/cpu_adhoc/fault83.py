"""An eighty-third hand-run batch: UNEVEN WORK ACROSS RANKS, so that somebody waits. A tiny classifier
(Linear(8,16)-ReLU-Linear(16,4), SGD lr 0.1) trained with DDP on gloo (or, with --sync manual, with a hand-written
all-reduce of each gradient after backward: the form the TORCH_DISTRIBUTED_DEBUG=DETAIL runs use, since DDP under
DETAIL crashes on this build). Each rank reads its own shard of synthetic samples (labels from a fixed teacher), made
under --workdir on first use. Batch 8, PG timeout 12 s unless --pg-timeout. A run ends with dist.barrier(), an
all-reduced mean of the last loss, and `rank R done`. Prints `rank R world W fault F samples S batches B`,
`rank R epoch E step S loss L`. The odd rank is --rank N (handsplit: always the last rank). No @record.

Faults:
  none        control: one dataset, DistributedSampler(drop_last=False) pads every rank to the same number of
              batches, 2 epochs (exit 0)
  join_ok     control: uneven per-rank shards (rank N's is shorter) trained inside `with Join([ddp]):` (exit 0)
  handsplit   a hand-rolled split instead of DistributedSampler: per = ceil(n / world), rank r takes
              [r*per, (r+1)*per): the last rank gets fewer samples and one batch less (--samples n); it leaves
              the loop and waits in the final barrier while the others all-reduce gradients
  shortshard  per-rank shard files, no DistributedSampler; rank N's shard export was cut short (40 rows, the
              others 56): one batch less, rank N waits in the final barrier
  shorteval   as shortshard, but after the loop every rank evaluates and all-reduces [val_loss_sum, count]:
              rank N's evaluation all-reduce meets the others' last gradient all-reduce
  iterable    an IterableDataset streaming the rank's CSV shard line by line (no __len__); rank N's file has
              fewer lines: its DataLoader stops early, it waits in the final barrier
  nanskip     one dataset with DistributedSampler; rank N's batch at step --at holds an inf feature; the loop
              `continue`s on a non-finite loss before backward(): rank N does one gradient all-reduce less
  badbatch    as nanskip, but the check is before forward: a batch whose labels carry the corrupt marker -1 is
              skipped (`continue`), on rank N at step --at
  accum       gradient accumulation with no_sync(); the number of micro-steps is computed from the local loader
              length (accum = len(loader) // 3, at least 1); rank N's shard is shorter (40 rows vs 56), so it
              syncs on every micro-step while the others sync every second one
  valevery    validation every len(loader)//2 steps, its metric all-reduced; rank N's shard is longer (64 rows vs
              48) so it validates at other steps than the others
  join_extra  like join_ok, but the loop also all-reduces the loss for logging each step, a collective Join
              does not know about: rank N, joined early, never matches it
  earlystop   early stopping on the rank's own (not all-reduced) validation loss, patience 1, min_delta 0.02;
              rank N's validation shard has noisy labels: it stops alone and waits in the final barrier
  earlyexit   as earlystop, but the trainer returns (and the process exits 0) without the final barrier
  timebudget  `while time.time() - t0 < --budget:`; t0 is taken after the rank's data preparation; the export
              kept a tensor cache of rank N's part only, so rank N loads it at once while the others parse 40000
              CSV lines: rank N's clock starts first, its budget runs out first and it waits in the final barrier
"""
import argparse, contextlib, datetime, math, os, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--samples", type=int, default=0)  # 0: 40 per rank
p.add_argument("--at", type=int, default=3)
p.add_argument("--budget", type=float, default=6.0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--sync", default="ddp", choices=["ddp", "manual"])
p.add_argument("--workdir", default="/tmp/fault83_work")
a = p.parse_args()
BATCH = 8
TEACHER = torch.Generator().manual_seed(7)
W_TEACHER = torch.randn(8, 4, generator=TEACHER)


def make_rows(n: int, seed: int, noisy: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ W_TEACHER).argmax(1)
    if noisy:
        y = torch.randint(0, 4, (n,), generator=g)
    return x, y


def shard_path(rank: int, ext: str) -> str:
    return f"{a.workdir}/{a.fault}-{os.environ['WORLD_SIZE']}-{a.rank}/part-{rank:05d}.{ext}"


def export_shard(rank: int, rows: int) -> None:
    """The preprocessing job's output: one CSV per rank (written by that rank if missing)."""
    os.makedirs(os.path.dirname(shard_path(rank, "csv")), exist_ok=True)
    if os.path.exists(shard_path(rank, "csv")):
        return
    x, y = make_rows(rows, 1000 + rank)
    with open(shard_path(rank, "csv") + ".tmp", "w") as fh:
        for xi, yi in zip(x.tolist(), y.tolist()):
            fh.write(",".join(f"{v:.6f}" for v in xi) + f",{yi}\n")
    os.replace(shard_path(rank, "csv") + ".tmp", shard_path(rank, "csv"))
    if a.fault == "timebudget" and rank == a.rank:
        torch.save((x, y), shard_path(rank, "pt"))  # the export kept a tensor cache of this part only


def read_shard(rank: int):
    xs, ys = [], []
    with open(shard_path(rank, "csv")) as fh:
        for line in fh:
            *f, lab = line.rstrip("\n").split(",")
            xs.append([float(v) for v in f])
            ys.append(int(lab))
    return torch.tensor(xs), torch.tensor(ys)


class CsvStream(IterableDataset):
    def __init__(self, path):
        self.path = path

    def __iter__(self):
        with open(self.path) as fh:
            for line in fh:
                *f, lab = line.rstrip("\n").split(",")
                yield torch.tensor([float(v) for v in f]), int(lab)


def rows_for(rank: int) -> int:
    # rows per shard as the export produced them
    if a.fault in ("shortshard", "shorteval", "join_ok", "join_extra", "iterable", "accum"):
        return 40 if rank == a.rank else 56
    if a.fault == "valevery":
        return 64 if rank == a.rank else 48
    return 48


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if a.sync == "ddp":
        model = nn.parallel.DistributedDataParallel(net)
    else:
        for prm in net.parameters():
            dist.broadcast(prm.data, 0)
        model = net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    t0 = None
    sampler = None
    if a.fault in ("none", "nanskip", "badbatch"):
        x, y = make_rows(a.samples or 40 * world, 1)
        bad_row = a.rank + (a.at - 1) * BATCH * world  # one corrupt row; the sampler deals it to rank --rank
        if a.fault == "nanskip":
            x[bad_row, 5] = float("inf")  # a sensor dropout logged as inf
        if a.fault == "badbatch":
            y[bad_row] = -1  # a row the annotators flagged corrupt
        ds = TensorDataset(x, y)
        sampler = DistributedSampler(ds, shuffle=False, drop_last=False)
        loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)
    elif a.fault == "handsplit":
        n = a.samples or 100
        x, y = make_rows(n, 1)
        per = math.ceil(n / world)
        lo, hi = rank * per, min(n, (rank + 1) * per)
        loader = DataLoader(TensorDataset(x[lo:hi], y[lo:hi]), batch_size=BATCH, shuffle=True)
    elif a.fault == "iterable":
        export_shard(rank, rows_for(rank))
        loader = DataLoader(CsvStream(shard_path(rank, "csv")), batch_size=BATCH)
    elif a.fault == "timebudget":
        export_shard(rank, 40000)
        cache = shard_path(rank, "pt")
        if os.path.exists(cache):
            x, y = torch.load(cache)
        else:
            x, y = read_shard(rank)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
        t0 = time.time()
    else:
        export_shard(rank, rows_for(rank))
        x, y = read_shard(rank)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    n_batches = len(loader) if not isinstance(loader.dataset, IterableDataset) else "?"
    n_samples = len(loader.dataset) if not isinstance(loader.dataset, IterableDataset) else "?"
    print(f"rank {rank} world {world} fault {a.fault} samples {n_samples} batches {n_batches}", flush=True)

    if a.fault in ("earlystop", "earlyexit"):
        vx, vy = make_rows(64, 5000 + rank, noisy=(rank == a.rank))

    def sync_grads():
        if a.sync == "manual":
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world

    def train_step(xb, yb, ctx=contextlib.nullcontext(), do_step=True):
        with ctx:
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
        if do_step:
            sync_grads()
            opt.step()
            opt.zero_grad()
        return loss

    last = torch.tensor(0.0)
    if a.fault == "timebudget":
        step = 0
        it = iter(loader)
        while time.time() - t0 < a.budget:
            try:
                xb, yb = next(it)
            except StopIteration:
                it = iter(loader)
                xb, yb = next(it)
            step += 1
            last = train_step(xb, yb).detach()
            if step % 200 == 0:
                print(f"rank {rank} step {step} loss {last.item():.4f} elapsed {time.time() - t0:.2f}s", flush=True)
        print(f"rank {rank} time budget {a.budget}s used up after {step} steps", flush=True)
    elif a.fault in ("join_ok", "join_extra"):
        with Join([model]):
            for step, (xb, yb) in enumerate(loader, 1):
                last = train_step(xb, yb).detach()
                if a.fault == "join_extra":
                    logged = last.clone()
                    dist.all_reduce(logged)  # the logger's global mean loss
                    logged /= world
                    print(f"rank {rank} epoch 1 step {step} loss {last.item():.4f} global {logged.item():.4f}",
                          flush=True)
                else:
                    print(f"rank {rank} epoch 1 step {step} loss {last.item():.4f}", flush=True)
        print(f"rank {rank} joined after {step} steps", flush=True)
    elif a.fault == "accum":
        accum = max(1, len(loader) // 3)
        print(f"rank {rank} accumulating {accum} micro-batches per optimizer step", flush=True)
        for i, (xb, yb) in enumerate(loader):
            boundary = (i + 1) % accum == 0
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            last = train_step(xb, yb, ctx=ctx, do_step=boundary).detach()
            if boundary:
                print(f"rank {rank} epoch 1 step {(i + 1) // accum} loss {last.item():.4f}", flush=True)
    elif a.fault in ("earlystop", "earlyexit"):
        best, bad_epochs = float("inf"), 0
        for epoch in range(1, 6):
            for step, (xb, yb) in enumerate(loader, 1):
                last = train_step(xb, yb).detach()
            with torch.no_grad():
                val = F.cross_entropy(model(vx), vy).item()
            print(f"rank {rank} epoch {epoch} loss {last.item():.4f} val_loss {val:.4f}", flush=True)
            if val < best - 0.02:
                best, bad_epochs = val, 0
            else:
                bad_epochs += 1
                if bad_epochs >= 1:
                    print(f"rank {rank}: early stopping at epoch {epoch}: val_loss {val:.4f} did not improve on"
                          f" {best:.4f}", flush=True)
                    break
        if a.fault == "earlyexit":
            print(f"rank {rank} done", flush=True)
            return
    else:
        val_every = max(1, len(loader) // 2) if a.fault == "valevery" else 0
        for epoch in range(1, a.epochs + 1):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for step, (xb, yb) in enumerate(loader, 1):
                if a.fault == "badbatch" and bool((yb < 0).any()):
                    print(f"rank {rank} epoch {epoch} step {step}: corrupt rows in batch, skipping", flush=True)
                    continue
                loss = F.cross_entropy(model(xb), yb)
                if not torch.isfinite(loss):
                    print(f"rank {rank} epoch {epoch} step {step}: non-finite loss {loss.item()}, skipping batch",
                          flush=True)
                    opt.zero_grad()
                    continue
                loss.backward()
                sync_grads()
                opt.step()
                opt.zero_grad()
                last = loss.detach()
                print(f"rank {rank} epoch {epoch} step {step} loss {last.item():.4f}", flush=True)
                if val_every and step % val_every == 0:
                    vx, vy = make_rows(32, 7000 + rank)
                    with torch.no_grad():
                        m = torch.tensor([F.cross_entropy(model(vx), vy, reduction="sum").item(), 32.0])
                    dist.all_reduce(m)
                    print(f"rank {rank} step {step} val_loss {m[0].item() / m[1].item():.4f}", flush=True)
        if a.fault == "shorteval":
            vx, vy = make_rows(32, 7000 + rank)
            with torch.no_grad():
                m = torch.tensor([F.cross_entropy(model(vx), vy, reduction="sum").item(), 32.0])
            dist.all_reduce(m)
            print(f"rank {rank} val_loss {m[0].item() / m[1].item():.4f}", flush=True)

    dist.barrier()
    mean = last.clone().reshape(1)
    dist.all_reduce(mean)
    if rank == 0:
        print(f"mean final loss {mean.item() / world:.4f}", flush=True)
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
