"""A ninety-second hand-run batch: ASYNCHRONOUS COLLECTIVES AND OVERLAP. A tiny model (Linear(8,16)-ReLU-Linear(16,4),
SGD, batch 8 of synthetic data per rank) trained on gloo WITHOUT DDP: the gradients are averaged by hand, overlapped
with the backward pass. Every parameter gets a `register_post_accumulate_grad_hook`; when all the parameters of a
bucket (two buckets in reverse order, as DDP builds them: [fc2.bias, fc2.weight] = 68 floats, [fc1.bias, fc1.weight]
= 144 floats) have their gradient, the bucket is flattened and `dist.all_reduce(flat, async_op=True)` is launched;
after backward the Works are waited, the averaged gradients copied back, then `opt.step()`. The step's loss and
sample count are all-reduced async too (`work.get_future().then(...)` writes the running metrics). It prints `rank R
world W fault F`, `rank R step S loss L` (--steps 8), an eval (all_gather of per-rank accuracy, async) `rank R eval
acc A`, `rank R done`. PG timeout 12 s unless --pg-timeout. One rank (--rank N) misbehaves. No @record.

Faults:
  none         control (exit 0)
  early        rank N's fast logging path reads the async-all-reduced sample count before `work.wait()` and checks
               it against world * batch: AssertionError (the tensor still holds its own count)
  cbraise      the `.then()` callback that accumulates the averaged loss raises KeyError on rank N (its running
               metrics were reset with the phase name 'Train', the others 'train'); the error surfaces at the
               chained future's `wait()`
  collectall   the eval gathers (correct, total) with two async all_gathers, `torch.futures.collect_all` on their
               futures and a `.then()` that computes rank N's local accuracy; rank N's eval split is empty:
               ZeroDivisionError surfaces at `wait()`
  frozen       rank N freezes fc1 (a fine-tuning config of its own): its hooks fire for fc2 only, its one bucket
               (68 floats) pairs with the others' second bucket (144 floats): gloo's size check
  threadeval   rank N runs the eval in a background thread (its async_eval flag) while its main thread goes on
               training: the eval's all_gather lands among the gradient all-reduces on that rank only
  uneven       the eval all_gathers per-sample predictions (async); rank N's eval shard has 7 samples, the others 8
  bgexc        a background comm thread does the bucket all-reduces (main thread puts buckets on a queue and waits
               on an Event); from step --at (3) the thread casts buckets to a compression dtype from the config;
               rank N's config says 'bf16': AttributeError in the thread, never joined; the main thread waits on the
               Event forever (--wait-timeout 0) or raises TimeoutError after --wait-timeout seconds
  commrace     every rank: the comm thread's bucket all-reduces race with the main thread's loss/count all_reduce,
               launched right after backward, not after finish() (the "v2 overlap" change): the order of the
               collectives differs between ranks
  accum        rank N accumulates gradients over 2 steps (its config), launching the bucket all-reduces every
               second step only (no_sync), the others every step
  afterdestroy at the end every rank launches an async all_reduce of its final metrics; rank N tears down
               (`destroy_process_group`) before it waits on the Work
"""
import argparse, datetime, os, queue, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--at", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--wait-timeout", type=float, default=0)
a = p.parse_args()
BATCH = 8


class Overlap:
    """Hand-made DDP: a post-accumulate-grad hook per parameter, async all_reduce per full bucket."""

    def __init__(self, model, world, comm_thread=False, dtype_name="float32"):
        self.world, self.works, self.ready = world, [], {}
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.buckets, cur = [], []
        for p in params:
            cur.append(p)
            if sum(q.numel() for q in cur) >= 64:
                self.buckets.append(cur)
                cur = []
        if cur:
            self.buckets.append(cur)
        self.where = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        for p in params:
            p.register_post_accumulate_grad_hook(self.hook)
        self.sync = True
        self.comm_thread, self.dtype_name, self.step = comm_thread, dtype_name, 0
        if comm_thread:
            self.q, self.done = queue.Queue(), threading.Event()
            threading.Thread(target=self.comm_loop, name="grad-comm", daemon=True).start()

    def hook(self, p):
        if not self.sync:
            return
        i = self.where[id(p)]
        self.ready.setdefault(i, []).append(p)
        if len(self.ready[i]) == len(self.buckets[i]):
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            if self.comm_thread:
                self.q.put((i, flat))
            else:
                self.works.append((i, flat, dist.all_reduce(flat, async_op=True)))

    def comm_loop(self):
        while True:
            item = self.q.get()
            if item is None:  # end of this step's backward
                self.done.set()
                continue
            i, flat = item
            if self.step >= a.at:  # compress the buckets once training has settled
                flat = flat.to(getattr(torch, self.dtype_name))
            dist.all_reduce(flat)
            self.unflatten(i, flat.float())

    def unflatten(self, i, flat):
        off = 0
        for q in self.buckets[i]:
            n = q.numel()
            q.grad.copy_(flat[off:off + n].view_as(q) / self.world)
            off += n

    def finish(self):
        if self.comm_thread:
            self.q.put(None)
            if a.wait_timeout:
                if not self.done.wait(a.wait_timeout):
                    raise TimeoutError(f"gradient comm thread did not finish step {self.step} in {a.wait_timeout}s")
            else:
                self.done.wait()
            self.done.clear()
        for i, flat, w in self.works:
            w.wait()
            self.unflatten(i, flat)
        self.works, self.ready = [], {}


def batch(rank, step, n=BATCH):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def evaluate(model, rank, world, me):
    n = 0 if (a.fault == "collectall" and me) else (7 if (a.fault == "uneven" and me) else BATCH)
    x, y = batch(rank, 999, n)
    with torch.no_grad():
        pred = model(x).argmax(1)
    if a.fault == "uneven":
        hits = (pred == y).float()
        out = [torch.empty_like(hits) for _ in range(world)]
        w = dist.all_gather(out, hits, async_op=True)
        w.wait()
        acc = torch.cat(out).mean().item()
    elif a.fault == "collectall":
        correct, total = torch.tensor([float((pred == y).sum())]), torch.tensor([float(n)])
        outs_c = [torch.zeros(1) for _ in range(world)]
        outs_t = [torch.zeros(1) for _ in range(world)]
        f1 = dist.all_gather(outs_c, correct, async_op=True).get_future()
        f2 = dist.all_gather(outs_t, total, async_op=True).get_future()
        local = torch.futures.collect_all([f1, f2]).then(lambda _: float(correct) / float(total))
        local_acc = local.wait()
        acc = sum(float(c) for c in outs_c) / sum(float(t) for t in outs_t)
        print(f"rank {rank} local acc {local_acc:.3f}", flush=True)
    else:
        accs = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(accs, torch.tensor([float((pred == y).float().mean())]), async_op=True).wait()
        acc = float(torch.cat(accs).mean())
    print(f"rank {rank} eval acc {acc:.3f}", flush=True)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if a.fault == "frozen" and me:
        for p_ in model[0].parameters():  # this node's fine-tuning config freezes the first layer
            p_.requires_grad_(False)
    sync = Overlap(model, world, comm_thread=a.fault in ("bgexc", "commrace"),
                   dtype_name="bf16" if (a.fault == "bgexc" and me) else "bfloat16")
    opt = torch.optim.SGD([p_ for p_ in model.parameters() if p_.requires_grad], lr=0.1)
    accum = 2 if (a.fault == "accum" and me) else 1
    phase = "Train" if (a.fault == "cbraise" and me) else "train"
    running = {"train": 0.0}
    print(f"rank {rank} world {world} fault {a.fault}", flush=True)

    def add_loss(fut):
        running[phase] += fut.value()[0][0].item() / world
        return running[phase]

    eval_thread = None
    for step in range(1, a.steps + 1):
        sync.step = step
        x, y = batch(rank, step)
        sync.sync = step % accum == 0
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if sync.comm_thread and a.fault != "commrace":  # the comm thread owns the group until finish()
            sync.finish()
            opt.step()
            opt.zero_grad()
        stats = torch.tensor([loss.item(), float(len(x))])
        w = dist.all_reduce(stats, async_op=True)
        chained = w.get_future().then(add_loss)
        if a.fault == "early" and me:  # fast logging path: check the global sample count right away
            assert int(stats[1]) == world * BATCH, f"global sample count {int(stats[1])} != {world * BATCH}"
        if sync.sync and (not sync.comm_thread or a.fault == "commrace"):
            sync.finish()
            opt.step()
            opt.zero_grad()
        total = chained.wait()
        print(f"rank {rank} step {step} loss {float(stats[0]) / world:.4f} running {total:.4f}", flush=True)
        if step == 4:
            if a.fault == "threadeval" and me:  # async_eval: evaluate in the background, keep training
                eval_thread = threading.Thread(target=evaluate, args=(model, rank, world, me), name="eval")
                eval_thread.start()
            else:
                evaluate(model, rank, world, me)
    if eval_thread is not None:
        eval_thread.join()
    final = torch.tensor([running["train"] if "train" in running else 0.0])
    w = dist.all_reduce(final, async_op=True)
    if a.fault == "afterdestroy" and me:
        dist.destroy_process_group()  # cleanup moved up by a refactor
        w.wait()
    else:
        w.wait()
        dist.destroy_process_group()
    print(f"rank {rank} final {float(final[0]) / world:.4f} done", flush=True)


if __name__ == "__main__":
    main()
