"""A forty-sixth hand-run batch: ERRORS OFF THE MAIN THREAD, and errors in odd places.

A small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, PG timeout 15 s, 6 steps, --step-time
0.2 s per step), printing `rank R step S loss L` lines (flushed). ONE fault per run, on rank --rank at step --step:

  ckpt_thread   an async checkpoint writer (threading.Thread "ckpt-writer-S") torch.save()s the state dict into a
                folder that does not exist: RuntimeError: Parent directory ... does not exist. --handling:
                  join    the thread stores its exception and re-raises it (Python prints `Exception in thread
                          ckpt-writer-S`); the main loop goes on, joins the writer one step later and raises
                          AsyncCheckpointError from the stored one (`The above exception was the direct cause`)
                  hook    threading.excepthook prints the thread's traceback and calls os._exit(1)
                  flag    the thread catches, logs an ERROR line and sets a stop flag; the main loop notices it at the
                          next step and calls sys.exit(2)
                  none    nobody notices: the thread dies, training goes on and finishes (a control)
  prefetch      a prefetcher thread feeds batches through a queue.Queue; at step S it parses a CSV row with 'n/a'
                (ValueError). --handling none: the main loop waits on queue.get() forever (the peers time out in
                their all-reduce); --handling timeout: queue.get(timeout=5) raises _queue.Empty and the script
                raises RuntimeError('prefetcher stalled') from it
  future        a ThreadPoolExecutor computes the step's eval metric; at step S the task divides by a zero token
                count (ZeroDivisionError); the script calls .result() two steps later
  pool          a multiprocessing Pool (fork) tokenizes the step's rows; one row is 'n/a' (ValueError in the child,
                multiprocessing.pool.RemoteTraceback in the parent)
  loader        a DataLoader(num_workers=1) whose __getitem__ hits a missing key at step S ('Caught KeyError in
                DataLoader worker process 0')
  tensor_hook   a gradient-logging hook (param.register_hook) reshapes the gradient to a wrong shape at step S
  comm_hook     a DDP communication hook (register_comm_hook) that views the bucket with a wrong shape at step S
  autograd_fn   a custom autograd.Function (straight-through clamp of the logits) whose backward returns two gradients
                at step S (the first version clamped the input batch, which needs no gradient: backward never ran)
  prehook       a forward pre-hook normalises the input with running stats and misses a key at step S (KeyError)
  recompute     torch.utils.checkpoint (use_reentrant=False) around a block that pops its cached mask: the
                recomputation in backward finds it gone (KeyError)
  signal        a SIGUSR1 handler (dump stats on request) writes into a missing folder; the rank signals itself at
                step S; FileNotFoundError raised in the main thread where the signal landed
  handling      a KeyError in the batch; the except block writes an emergency checkpoint into a missing folder
                (`During handling of the above exception, another exception occurred:`)
  cause         a ValueError in the batch, re-raised as DataPipelineError from it (`direct cause`)
  del_ctl       control: a ShardCache whose __del__ raises at exit (`Exception ignored in`); exit 0
  atexit_ctl    control: an atexit handler that fails to upload the final metrics (`Exception ignored in atexit
                callback`); exit 0
  warn_ctl      control: a metrics uploader thread catches ConnectionRefusedError and prints the traceback as a
                WARNING each step; exit 0
  finalize_ctl  control: a weakref.finalize callback that removes a temp file twice; exit 0
"""
import argparse, atexit, concurrent.futures, datetime, math, multiprocessing, os, queue, signal, socket, sys
import threading, time, traceback, weakref
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--step", type=int, default=3)
p.add_argument("--handling", default="join")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--step-time", type=float, default=0.2)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCH = 16
ME = RANK == a.rank
MISSING = "/tmp/fault46/out_missing"  # a folder that does not exist


def say(msg):
    print(f"rank {RANK} {msg}", flush=True)


class AsyncCheckpointError(RuntimeError):
    pass


class DataPipelineError(RuntimeError):
    pass


def make_batch(step):
    g = torch.Generator().manual_seed(1000 * RANK + step)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def parse_row(row):
    return [float(v) for v in row]


def tokenize(row):
    return [float(v) for v in row.split(",")]


class RowSet(torch.utils.data.Dataset):
    def __init__(self, steps):
        self.n = steps * BATCH

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        step = i // BATCH + 1
        rec = {"x": torch.randn(8), "y": i % 4}
        if ME and step == a.step and i % BATCH == 5:
            rec = {"x": rec["x"], "label": rec["y"]}  # a record written with another schema
        return rec["x"], rec["y"]


class ClampSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clamp(-3, 3)

    @staticmethod
    def backward(ctx, g):
        if ME and STATE["step"] == a.step:
            return g, g * 0  # one gradient too many
        return g


class ShardCache:
    def __init__(self, path):
        self.path = path
        self.fh = None

    def __del__(self):
        self.fh.close()  # never opened


STATE = {"step": 0, "stop": False, "thread_exc": None}


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    say(f"world {WORLD}, {a.steps} steps, fault {a.fault} handling {a.handling}")

    if a.fault == "tensor_hook":
        def log_grad(gr):
            if ME and STATE["step"] == a.step:
                gr = gr.view(4, 3)  # meant for the 4x3 head of another config
            return None
        net[0].weight.register_hook(log_grad)
    if a.fault == "comm_hook":
        def hook(state, bucket):
            buf = bucket.buffer()
            if ME and STATE["step"] == a.step:
                buf = buf.view(-1, 7)
            buf.div_(WORLD)
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
        model.register_comm_hook(None, hook)
    stats = {"mean": 0.0, "std": 1.0}
    if a.fault == "prehook":
        def norm(mod, inputs):
            key = "std" if not (ME and STATE["step"] == a.step) else "layer0.std"
            return ((inputs[0] - stats["mean"]) / stats[key],)
        net.register_forward_pre_hook(norm)
    if a.fault == "signal" and ME:
        def dump(signum, frame):
            with open(f"{MISSING}/stats_rank{RANK}.json", "w") as f:
                f.write("{}")
        signal.signal(signal.SIGUSR1, dump)
    if a.fault == "ckpt_thread" and a.handling == "hook" and ME:
        def die(args):
            threading.__excepthook__(args)
            sys.stderr.flush()
            os._exit(1)
        threading.excepthook = die
    if a.fault == "del_ctl" and ME:
        STATE["cache"] = ShardCache("/tmp/fault46/shard.cache")
    if a.fault == "atexit_ctl" and ME:
        def upload_final():
            say("uploading final metrics to 127.0.0.1:9")
            socket.create_connection(("127.0.0.1", 9), timeout=1).close()
        atexit.register(upload_final)
    if a.fault == "finalize_ctl" and ME:
        tmp = f"/tmp/fault46/tmp_rank{RANK}.bin"
        open(tmp, "w").close()
        holder = type("Spill", (), {})()
        STATE["spill"] = holder
        weakref.finalize(holder, os.remove, tmp)
        os.remove(tmp)  # the loop already cleaned up after itself

    pool = None
    if a.fault == "pool":
        pool = multiprocessing.get_context("fork").Pool(2)
    ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eval") if a.fault == "future" else None
    futures = {}
    q = None
    if a.fault == "prefetch":
        q = queue.Queue(maxsize=2)

        def prefetch():
            for s in range(1, a.steps + 1):
                row = ["0.12"] * 8
                if ME and s == a.step:
                    row[7] = "n/a"
                x = torch.tensor([parse_row(row)] * BATCH)
                q.put((x + torch.randn(BATCH, 8), torch.randint(0, 4, (BATCH,))))
        threading.Thread(target=prefetch, name="prefetcher", daemon=True).start()
    loader_it = None
    if a.fault == "loader":
        loader_it = iter(torch.utils.data.DataLoader(RowSet(a.steps), batch_size=BATCH, num_workers=1))
    writer = None
    for step in range(1, a.steps + 1):
        STATE["step"] = step
        time.sleep(a.step_time)
        if STATE["stop"]:
            say(f"ERROR step {step}: checkpoint writer failed, stopping")
            sys.exit(2)
        if writer is not None:
            writer.join()
            if STATE["thread_exc"] is not None:
                raise AsyncCheckpointError(f"async checkpoint of step {step - 1} failed") from STATE["thread_exc"]
            writer = None
        x, y = make_batch(step)
        if q is not None:
            if a.handling == "timeout":
                try:
                    x, y = q.get(timeout=5)
                except queue.Empty as e:
                    raise RuntimeError(f"prefetcher stalled: no batch for step {step} after 5 s") from e
            else:
                x, y = q.get()
        if loader_it is not None:
            x, y = next(loader_it)
        if pool is not None:
            rows = [",".join(["0.5"] * 8) for _ in range(BATCH)]
            if ME and step == a.step:
                rows[9] = ",".join(["0.5"] * 7 + ["n/a"])
            x = torch.tensor(pool.map(tokenize, rows)) + x
        if ME and step == a.step and a.fault == "signal":
            say(f"step {step}: stats dump requested (SIGUSR1)")
            os.kill(os.getpid(), signal.SIGUSR1)
        if ME and step == a.step and a.fault in ("handling", "cause"):
            try:
                if a.fault == "handling":
                    rec = {"x": x, "labels": y}
                    y = rec["y"]
                else:
                    x = torch.tensor([parse_row(["0.1"] * 7 + ["n/a"])] * BATCH)
            except Exception as e:
                if a.fault == "handling":
                    say(f"ERROR step {step}: bad batch, writing an emergency checkpoint")
                    torch.save(model.state_dict(), f"{MISSING}/emergency_step{step}.pt")
                    raise
                raise DataPipelineError(f"rank {RANK}: could not build the batch of step {step}") from e
        if a.fault == "recompute":
            cache = {"mask": (torch.rand(BATCH, 8) > 0.1).float()}
            recompute = ME and step == a.step

            def block(inp):
                m = cache.pop("mask") if recompute else cache["mask"]
                return inp * m
            x = x.requires_grad_(True)
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        out = model(x)
        if a.fault == "autograd_fn":
            out = ClampSTE.apply(out)  # straight-through clamp of the logits
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"step {step} loss {loss.item():.4f}")
        if ex is not None:
            n_tok = 0 if (ME and step == a.step) else BATCH
            futures[step] = ex.submit(lambda l=loss.item(), n=n_tok: l * BATCH / n)
            if step - 2 in futures:
                say(f"step {step - 2} eval {futures.pop(step - 2).result():.4f}")
        if a.fault == "ckpt_thread" and ME and step == a.step:
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            path = f"{MISSING}/step{step}.pt"

            def write(sd=sd, path=path, step=step):
                try:
                    torch.save(sd, path)
                except Exception as e:
                    if a.handling == "flag":
                        say(f"ERROR checkpoint writer: step {step} not saved: {e}")
                        STATE["stop"] = True
                        return
                    STATE["thread_exc"] = e
                    raise
            writer = threading.Thread(target=write, name=f"ckpt-writer-{step}")
            writer.start()
            if a.handling in ("none", "hook", "flag"):
                writer = None
        if a.fault == "warn_ctl" and ME and step >= a.step:
            def upload(step=step):
                try:
                    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
                except OSError:
                    say(f"WARNING metrics uploader: step {step} not uploaded, continuing")
                    traceback.print_exc()
            threading.Thread(target=upload, name=f"metrics-{step}").start()
    dist.barrier()
    say("training finished")
    if pool is not None:
        pool.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
