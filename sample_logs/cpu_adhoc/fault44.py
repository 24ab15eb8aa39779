"""A forty-fourth hand-run batch: RESOURCE LIMITS. One rank (--rank N; -1: every rank) runs into a real operating-system
limit, set inside this script with resource.setrlimit for that rank only, each run with ONE real fault. The loop is a
small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, 5 steps, `rank R step S loss L` lines, PG
timeout 15 s); the fault happens at step 3 unless said otherwise. Nothing is simulated: every error below is the one
the kernel, the allocator or the library gives when the limit is hit.

Faults:
  as_alloc      RLIMIT_AS = current address space + 1 GiB on rank N; at step 3 it builds a 4 GiB activation buffer
                (torch.zeros): DefaultCPUAllocator: can't allocate memory
  as_memerr     the same limit; at step 3 rank N reads a 3 GiB shard into a bytearray: MemoryError
  as_gather     the same limit with 96 MiB headroom; at step 3 every rank calls all_gather_object on a 48 MiB
                statistics object; rank N's allocation fails inside all_gather_object
  as_worker     every rank reads batches through a DataLoader with one worker; rank N's worker gets RLIMIT_AS =
                its address space + 512 MiB (worker_init_fn) and at step 3 decodes a sample into a 2 GiB buffer
  nofile_open   RLIMIT_NOFILE = open fds + 16 on rank N at start; at step 3 it opens the 40 files of its shard set
                (keeping a handle per shard): OSError [Errno 24] Too many open files
  nofile_gloo   RLIMIT_NOFILE = open fds + 2 on rank N BEFORE init_process_group: gloo's connections cannot be made
  fsize_sig     RLIMIT_FSIZE = 256 KiB on rank N; at step 3 every rank torch.save()s a checkpoint with a 2 MiB buffer.
                As observed: the kernel cuts the write at the limit, torch's stream writer fails on the short write
                ("basic_ios::clear: iostream error", "unexpected pos"); no write starts past the limit, no SIGXFSZ
  fsize_ign     the same with SIGXFSZ ignored (the same outcome)
  fsizebuf      the same limit; the checkpoint is serialised to a BytesIO and written with one Python write(): the
                retried write past the limit fails; CPython ignores SIGXFSZ from start-up, so OSError [Errno 27]
  fsizebuf_dfl  the same with SIGXFSZ put back to SIG_DFL: the write past the limit gets SIGXFSZ, which kills rank N
  cpu           RLIMIT_CPU = CPU time used + 3 s on rank N; at step 3 it runs a CPU-heavy evaluation: SIGXCPU
  diskfull      at step 3 rank N saves its checkpoint to a volume that is full (/dev/full): ENOSPC (errno 28)
  diskfull_json at step 3 rank N writes its metrics JSON to a full volume (/dev/full): OSError [Errno 28]
  nproc_thread  rank N runs as a non-root user (nobody; root ignores RLIMIT_NPROC) with RLIMIT_NPROC = its own thread
                count; at step 3 it starts a prefetch thread: RuntimeError: can't start new thread
  nproc_loader  the same limit; at step 3 rank N builds its eval DataLoader with 2 workers: the fork fails
  stack_rec     at step 3 rank N flattens a nested config 5000 levels deep with a recursive function: RecursionError
  stack_segv    rank N raises sys.setrecursionlimit to 10**6 and sets RLIMIT_STACK to 2 MiB; at step 3 it pickles a
                nested config 300000 levels deep (C recursion in pickle): SIGSEGV on the stack limit
  oomkill       rank N leaks 160 MiB per step into a cache; a sidecar watchdog (`--watchdog MB`, run beside torchrun)
                SIGKILLs any worker whose RSS passes MB, as the OOM killer does (its note goes to a file, not the console)
  ok_as         control: RLIMIT_AS = address space + 2 GiB on rank N, never reached; exit 0
  ok_memerr     control: RLIMIT_AS as as_memerr; rank N's 3 GiB prefetch buffer fails with MemoryError, which the
                script catches; it logs a WARNING and streams instead; exit 0
  ok_fsize      control: RLIMIT_FSIZE = 64 MiB on rank N; the checkpoints are far smaller; exit 0
"""
import argparse, datetime, importlib, io, json, os, pickle, resource, signal, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--ckdir", default="/tmp/fault44/ckpt")
p.add_argument("--watchdog", type=int, default=0, help="run as the sidecar watchdog: SIGKILL workers above MB RSS")
a = p.parse_args()


def watchdog(limit_mb: int) -> None:
    """The sidecar: scan the workers of this script every 0.2 s; SIGKILL one whose RSS passes the limit."""
    me = os.getpid()
    log = open("/tmp/fault44/watchdog.txt", "a")
    t0 = time.time()
    while time.time() - t0 < 90:
        seen = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                if not any(c.endswith(b"fault44.py") for c in cmd) or b"--fault" not in cmd or b"torchrun" in b" ".join(cmd[:2]):
                    continue
                seen = True
                rss = 0
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) // 1024
                if rss > limit_mb:
                    os.kill(int(pid), signal.SIGKILL)
                    log.write(f"{time.strftime('%H:%M:%S')} killed pid {pid} rss {rss} MiB > {limit_mb} MiB\n")
                    log.flush()
            except (OSError, ValueError):
                continue
        if not seen and time.time() - t0 > 20:
            return
        time.sleep(0.2)


if a.watchdog:
    watchdog(a.watchdog)
    sys.exit(0)

import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16
GiB = 1 << 30
MiB = 1 << 20


def vm_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def limit_as(headroom: int) -> None:
    cur = vm_bytes() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (cur, cur))


class Shard(torch.utils.data.Dataset):
    def __init__(self, rank: int, n: int, bad_worker: bool = False):
        self.rank, self.n, self.bad_worker = rank, n, bad_worker

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        x, y = torch.randn(8, generator=g), int(torch.randint(0, 4, (1,), generator=g))
        if self.bad_worker and i == 2 * BATCH + 5:
            buf = torch.empty(2 * GiB, dtype=torch.uint8)  # decode the sample's raw record
            x = x + float(buf[:1].numel() - 1)
        return x, y


def worker_init(worker_id: int) -> None:
    limit_as(512 * MiB)


def ranks_at_fault(world: int):
    return set(range(world)) if a.rank < 0 else {a.rank}


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    f = a.fault
    here = rank in ranks_at_fault(world)
    if f == "nofile_gloo" and here:
        nfd = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (nfd + 2, nfd + 2))
        print(f"rank {rank} open files limit {nfd + 2}", flush=True)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    workers = 1 if f == "as_worker" else 0
    ds = Shard(rank, BATCH * a.steps, bad_worker=(f == "as_worker" and here))
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers,
                                         worker_init_fn=worker_init if (f == "as_worker" and here) else None)
    if here:
        if f in ("as_alloc", "as_memerr", "ok_memerr"):
            limit_as(1 * GiB)
        elif f == "as_gather":
            limit_as(96 * MiB)
        elif f == "ok_as":
            limit_as(2 * GiB)
        elif f == "nofile_open":
            nfd = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (nfd + 16, nfd + 16))
        elif f in ("fsize_sig", "fsize_ign", "fsizebuf", "fsizebuf_dfl"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
            if f == "fsize_ign":
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            if f == "fsizebuf_dfl":  # CPython ignores SIGXFSZ at start-up; put the kernel's default back
                signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        elif f == "ok_fsize":
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * MiB, 64 * MiB))
        elif f in ("nproc_thread", "nproc_loader"):
            # nobody cannot read root's Python install: load what a DataLoader's workers need first
            import multiprocessing.queues, multiprocessing.synchronize, multiprocessing.popen_fork  # noqa: F401
            import multiprocessing.connection, multiprocessing.reduction, multiprocessing.resource_tracker  # noqa: F401
            importlib.import_module("torch.utils.data._utils.worker")
            os.setgid(65534)
            os.setuid(65534)
            nthr = len(os.listdir("/proc/self/task"))
            resource.setrlimit(resource.RLIMIT_NPROC, (nthr, nthr))
        elif f == "cpu":
            used = int(sum(resource.getrusage(resource.RUSAGE_SELF)[:2])) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (used + 3, used + 10))
        elif f == "stack_segv":
            sys.setrecursionlimit(10 ** 6)
            resource.setrlimit(resource.RLIMIT_STACK, (2 * MiB, 2 * MiB))
    if rank == 0:
        print(f"world_size={world} backend=gloo torch={torch.__version__} fault={f}", flush=True)
    os.makedirs(a.ckdir, exist_ok=True)
    cache = []
    step = 0
    for x, y in loader:
        step += 1
        if here and step == 3:
            if f == "as_alloc":
                act = torch.zeros(64, 16 * MiB)  # 4 GiB of float32 activations for the eval pass
                del act
            elif f == "as_memerr":
                raw = bytearray(3 * GiB)  # read the packed shard into memory
                del raw
            elif f == "ok_memerr":
                try:
                    raw = bytearray(3 * GiB)
                    del raw
                except MemoryError:
                    print(f"WARNING rank {rank}: could not allocate the 3 GiB prefetch buffer (MemoryError); "
                          f"streaming the shard instead", flush=True)
            elif f == "nofile_open":
                d = "/tmp/fault44/shards"
                os.makedirs(d, exist_ok=True)
                handles = []
                for k in range(40):
                    path = f"{d}/part-{k:05d}.bin"
                    if not os.path.exists(path):
                        open(path, "wb").close()
                    handles.append(open(path, "rb"))
            elif f == "cpu":
                m = torch.randn(512, 512)
                t0 = time.time()
                while time.time() - t0 < 30:  # the evaluation pass
                    m = torch.tanh(m @ m) 
            elif f == "nproc_thread":
                th = threading.Thread(target=lambda: None, name="prefetch")
                th.start()
            elif f == "nproc_loader":
                ev = torch.utils.data.DataLoader(Shard(rank, BATCH * 2), batch_size=BATCH, num_workers=2)
                for _ in ev:
                    pass
            elif f == "stack_rec":
                cfg = {}
                node = cfg
                for k in range(5000):
                    node["child"] = {}
                    node = node["child"]

                def flatten(d, prefix=""):
                    out = {}
                    for k, v in d.items():
                        if isinstance(v, dict):
                            out.update(flatten(v, prefix + k + "."))
                        else:
                            out[prefix + k] = v
                    return out
                flatten(cfg)
            elif f == "stack_segv":
                cfg = []
                node = cfg
                for k in range(300000):
                    node.append([])
                    node = node[0]
                pickle.dumps(cfg)
        if f == "as_gather" and step == 3:
            stats = {"rank": rank, "hist": bytes(48 * MiB)}
            gathered = [None] * world
            dist.all_gather_object(gathered, stats)
        if f == "oomkill" and here:
            cache.append(torch.ones(40 * MiB))  # 160 MiB per step kept for the "feature cache"
        out = ddp(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step == 3 and f in ("fsize_sig", "fsize_ign", "fsizebuf", "fsizebuf_dfl", "ok_fsize", "diskfull"):
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                     "ema_stats": torch.zeros(512 * 1024)}
            path = f"{a.ckdir}/rank{rank}_step{step}.pt"
            if f == "diskfull" and here:
                path = "/tmp/fault44/fullvol/rank%d_step%d.pt" % (rank, step)
            if f.startswith("fsizebuf"):  # serialise to memory, then write the file in one go
                buf = io.BytesIO()
                torch.save(state, buf)
                with open(path, "wb") as fh:
                    fh.write(buf.getvalue())
            else:
                torch.save(state, path)
            print(f"rank {rank} saved checkpoint {path}", flush=True)
        if step == 3 and f == "diskfull_json" and here:
            path = "/tmp/fault44/fullvol/metrics_rank%d.json" % rank
            with open(path, "w") as fh:
                json.dump({"rank": rank, "step": step, "loss": [loss.item()] * 20000}, fh)
        time.sleep(0.05)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
