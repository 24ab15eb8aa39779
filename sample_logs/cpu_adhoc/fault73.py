"""A seventy-third hand-run batch: SHUTDOWN AND CLEANUP CODE, what runs when a process ends and how it muddies the
log. A tiny DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, synthetic per-rank data, PG timeout
--pg-timeout s (12), --steps steps (6), `[rank R] step S/T loss L` per step, then a final barrier,
destroy_process_group() and `[rank R] training finished`); the rank chosen with --rank N does the fault. No @record.

Faults:
  none          control: nothing special (exit 0)
  delnoise      control: every rank keeps a Prefetcher whose __del__ calls self.pool.shutdown() on a pool already
                released (None): at interpreter exit 'Exception ignored in: <function Prefetcher.__del__ ...>' and an
                AttributeError on every rank, exit 0
  atexitraise   control: rank N's atexit hook 'sync final metrics' all-reduces after destroy_process_group():
                'Exception ignored in atexit callback' and a ValueError (no default process group), exit 0
  fastexit      control: every rank keeps a spawn-context multiprocessing Lock (its prefetch lock) and ends with
                os._exit(0) after 'training finished' to skip a slow teardown (the lock's semaphore is never
                unlinked: the resource_tracker may warn of leaked semaphores), exit 0
  atexit_hang   rank N starts a metrics-upload thread fed by a queue; the thread dies on its first record (a tensor
                json.dumps cannot serialize: 'Exception in thread uploader'), and rank N's atexit hook waits for the
                queue to drain (q.join()): rank N never exits after 'training finished' (stop it with a timeout)
  atexit_coll   every rank's atexit hook all-reduces its final metrics; rank N's step-3 batch lacks 'y' (KeyError),
                and its atexit all-reduce then meets the peers' DDP backward all-reduce
  sigterm_save  every rank installs signal.signal(SIGTERM, save_and_exit): the handler logs, joins a barrier 'so all
                ranks save the same step', saves a checkpoint and sys.exit(0)s; rank N's step-3 sample holds 'n/a'
                (ValueError)
  sigterm_ckpt  every rank installs a SIGTERM handler that torch.save()s to WORK/ckpt/step{S}/rank{R}.pt, a folder
                only the periodic save (every 50 steps) would have made; rank N divides by its empty eval split at
                step 3 (ZeroDivisionError)
  sysexit3      rank N finds its shard's checksum wrong at step 3, prints why and calls sys.exit(3)
  sysexitmsg    rank N calls sys.exit('rank N: ... stopping') at step 3 (the message on stderr, exit code 1)
  osexit0       rank N runs out of samples at step 3, prints it and leaves with os._exit(0) (skipping teardown) before
                the step's all-reduce
  destroy       rank N's early-stop branch at step 3 calls dist.destroy_process_group() and goes on to the next step
                "to finish the epoch locally" (its DDP still all-reduces)
  finally_barrier the loop sits in try: ... finally: dist.barrier(); destroy_process_group(); rank N's step-3 batch
                lacks 'y' (KeyError)
  exit_raise    rank N's step runs inside `with MetricsFile(...)`, whose __exit__ writes a summary line to a file
                the step already closed (ValueError: I/O operation on closed file); the step itself raised IndexError
  daemon_print  after 'training finished' rank N starts a daemon log-forwarder thread that replays its metrics backlog
                to stdout (print(..., flush=True) in a loop); the main thread returns and the interpreter exits while
                it is still printing (CPython may abort with 'Fatal Python error:
                _enter_buffered_busy' at interpreter shutdown)
  kbint         a long run (--steps 400) every rank of which catches KeyboardInterrupt around the loop to log,
                barrier and save a checkpoint before re-raising; a SIGINT is sent to the torchrun agent from outside
"""
import argparse, atexit, datetime, json, os, queue, signal, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--step-s", type=float, default=0.2)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault73_work")
a = p.parse_args()
BATCH = 16
STATE = {"step": 0, "model": None}


def batch(rank, step, me):
    g = torch.Generator().manual_seed(1000 * rank + step)
    b = {"x": torch.randn(BATCH, 8, generator=g), "y": torch.randint(0, 4, (BATCH,), generator=g)}
    if me and step == 3 and a.fault in ("atexit_coll", "finally_barrier"):
        del b["y"]
    if me and step == 3 and a.fault == "sigterm_save":
        row = ["0.12"] * 7 + ["n/a"]  # a sample row with a missing value
        b["x"][5] = torch.tensor([float(v) for v in row])
    return b


class Prefetcher:
    def __init__(self):
        self.pool = None  # released in close()

    def __del__(self):
        self.pool.shutdown(wait=True)


class MetricsFile:
    def __init__(self, path):
        self.fh = open(path, "a")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.write(f"step {STATE['step']} end\n")
        self.fh.close()
        return False


def rotate_metrics(mf, rank):
    mf.fh.close()
    fh = open(f"{a.workdir}/metrics_rank{rank}.1.txt", "a")  # bug: never assigned back to mf.fh
    fh.write("rotated\n")
    fh.close()


def uploader(q):
    while True:
        rec = q.get()
        payload = json.dumps(rec)  # the record carries a tensor
        del payload
        q.task_done()


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    STATE["model"] = model
    os.makedirs(a.workdir, exist_ok=True)
    print(f"[rank {rank}] world {world} fault {a.fault} ready", flush=True)
    steps = a.steps

    if a.fault == "delnoise":
        globals()["_prefetch"] = Prefetcher()
    if a.fault == "fastexit":
        import multiprocessing as mp
        globals()["_lock"] = mp.get_context("spawn").Lock()
    if a.fault == "atexitraise" and me:
        def sync_final_metrics():
            t = torch.tensor([float(STATE["step"])])
            dist.all_reduce(t)
            print(f"[rank {rank}] final metrics synced: {t.item()}", flush=True)
        atexit.register(sync_final_metrics)
    if a.fault == "atexit_coll":
        def sync_final_metrics():
            print(f"[rank {rank}] atexit: syncing final metrics", flush=True)
            t = torch.tensor([float(STATE["step"]), 1.0, 2.0, 3.0])
            dist.all_reduce(t)
            print(f"[rank {rank}] atexit: final metrics {t.tolist()}", flush=True)
        atexit.register(sync_final_metrics)
    q = None
    if a.fault == "atexit_hang" and me:
        q = queue.Queue()
        threading.Thread(target=uploader, args=(q,), daemon=True, name="uploader").start()

        def flush_uploads():
            print(f"[rank {rank}] atexit: waiting for {q.unfinished_tasks} pending metric uploads", flush=True)
            q.join()
        atexit.register(flush_uploads)
    if a.fault in ("sigterm_save", "sigterm_ckpt"):
        def save_and_exit(signum, frame):
            print(f"[rank {rank}] got signal {signum} at step {STATE['step']}, saving checkpoint before exit", flush=True)
            if a.fault == "sigterm_save":
                dist.barrier()  # so every rank saves the same step
                path = f"{a.workdir}/last_rank{rank}.pt"
            else:
                path = f"{a.workdir}/ckpt/step{STATE['step']}/rank{rank}.pt"
            torch.save({"step": STATE["step"], "model": model.module.state_dict()}, path)
            print(f"[rank {rank}] saved {path}", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, save_and_exit)
    if a.fault == "daemon_print" and me:
        def forward_logs():
            n = 0
            while True:  # drains the metrics backlog to the console
                n += 1
                print(f"[rank {rank}] log-forwarder: replaying record {n}", flush=True)
        globals()["_forward_logs"] = forward_logs
    if a.fault == "kbint":
        steps = 400

    def one_step(step):
        STATE["step"] = step
        b = batch(rank, step, me)
        if a.fault == "exit_raise" and me:
            with MetricsFile(f"{a.workdir}/metrics_rank{rank}.txt") as mf:
                mf.fh.write(f"step {step} start\n")
                if step == 3:
                    rotate_metrics(mf, rank)
                    order = list(range(BATCH))
                    b["x"] = b["x"][torch.tensor([order[i + 1] for i in range(BATCH)])]
        opt.zero_grad()
        loss = F.cross_entropy(model(b["x"]), b["y"])
        if a.fault == "sigterm_ckpt" and me and step == 3:
            n_eval, tot = 0, 0.0  # rank N's eval split is empty
            print(f"[rank {rank}] eval on {n_eval} samples", flush=True)
            loss = loss + 0.0 * (tot / n_eval)
        loss.backward()
        opt.step()
        print(f"[rank {rank}] step {step}/{steps} loss {loss.item():.4f}", flush=True)
        if q is not None:
            q.put({"step": step, "loss": loss.detach()})
        time.sleep(a.step_s)

    def loop():
        for step in range(1, steps + 1):
            if me and step == 3:
                if a.fault == "sysexit3":
                    print(f"[rank {rank}] shard-{rank:05d}.bin failed its checksum at step 3 (expected 9f3c1a, got 000000); exiting", flush=True)
                    sys.exit(3)
                if a.fault == "sysexitmsg":
                    sys.exit(f"rank {rank}: scratch volume has only 0.4 GB free at step 3, stopping")
                if a.fault == "osexit0":
                    print(f"[rank {rank}] no more samples in shard {rank} at step 3; leaving", flush=True)
                    os._exit(0)
                if a.fault == "destroy":
                    print(f"[rank {rank}] early stop: validation target reached at step 3, releasing the process group", flush=True)
                    dist.destroy_process_group()
            one_step(step)

    if a.fault == "finally_barrier":
        try:
            loop()
        finally:
            print(f"[rank {rank}] cleanup: waiting for all ranks before exit", flush=True)
            dist.barrier()
            dist.destroy_process_group()
    elif a.fault == "kbint":
        try:
            loop()
        except KeyboardInterrupt:
            print(f"[rank {rank}] interrupted at step {STATE['step']}: saving checkpoint", flush=True)
            dist.barrier()
            torch.save(model.module.state_dict(), f"{a.workdir}/interrupted_rank{rank}.pt")
            print(f"[rank {rank}] checkpoint saved", flush=True)
            raise
    else:
        loop()
        dist.barrier()
        dist.destroy_process_group()
    print(f"[rank {rank}] training finished", flush=True)
    if a.fault == "daemon_print" and me:
        threading.Thread(target=forward_logs, daemon=True, name="log-forwarder").start()
    if a.fault == "fastexit":
        os._exit(0)


if __name__ == "__main__":
    main()
