"""A twenty-third hand-run batch: faults where telling the FIRST failing rank apart from its consequences takes
reasoning across ranks (4-8 ranks): two ranks failing differently, the same error on all or on some ranks, a NaN
that one rank makes and an all-reduce spreads, a hung rank named by another rank's monitored_barrier, a silent
SIGKILL, a restart that fails on another rank, a saving rank retrying while the others time out in the barrier
after the save, and a shape mismatch under TORCH_DISTRIBUTED_DEBUG=DETAIL.

Run under torchrun (plain, --tee 3, --role, --local-ranks-filter, --redirects 3 --log-dir, --max-restarts), under
fault22_nodes.py (srun/pdsh two-node emulation), under mpirun (RANK/WORLD_SIZE/LOCAL_RANK from OMPI_COMM_WORLD_*),
or under this script's own `srun --label -n N` emulation (--srun N: N copies, one per rank, lines prefixed "i: ",
no task killed when another fails, as srun without --kill-on-bad-exit; MASTER_ADDR/MASTER_PORT from the env).

Faults (--fault NAME --rank N, some with --rank2 M):
  ckpt_partial   rank N saves the shared step-2 checkpoint; the disk fills mid-write (OSError ENOSPC); its except
                 waits 1 s for its async writer before re-raising, while every other rank loads the cut file at
                 step 3 and fails in torch.load
  attr_typo      every rank: opt.param_group (for param_groups) after step 2 -> AttributeError on all ranks
  bad_record     ranks N and M: a record with label -1 in their step-3 batch -> IndexError in cross_entropy
  nan_spread     rank N: a NaN feature in its step-3 batch; its local loss is NaN, the loss all-reduce spreads it,
                 and every rank's check on the averaged loss raises FloatingPointError
  hang_monitored rank N sleeps 40 s at step 3; every rank calls monitored_barrier(5 s, wait_all_ranks=True) there,
                 and rank 0 raises naming rank N
  sigkill_step2  rank N sends itself SIGKILL at step 2 (before its forward), printing nothing
  restart_diff   attempt 0: rank N's step-2 batch has the key 'labels' (KeyError); later attempts: rank M's step-3
                 batch has 12 features (matmul shape RuntimeError); run with torchrun --max-restarts 1
  save_retry     rank N (the saver) cannot write the step-2 checkpoint (PermissionError: /sys is not writable) and
                 retries 3 times 8 s apart; the others wait in the dist.barrier() after the save and time out
  shape_detail   rank N all-reduces a 3-element eval metric at step 3, the others 2 (run with
                 TORCH_DISTRIBUTED_DEBUG=DETAIL and --ddp 0: DETAIL with DDP segfaults on this build)"""
import argparse, datetime, errno, io, logging, math, os, signal, subprocess, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--rank2", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--logfmt", choices=["print", "bracket", "kv"], default="print")
p.add_argument("--ddp", type=int, default=1, help="0: average gradients with explicit all_reduce calls")
p.add_argument("--srun", type=int, default=0, help="emulate `srun --label -n N` around this script")
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16
CKDIR = "/tmp/fault23_ckpt"
RO_DIR = "/sys/fs"  # not writable even for root: stands in for a read-only checkpoint mount
log = logging.getLogger("train")


def srun_label(n: int) -> int:
    """Start n tasks with RANK set, prefix every line of task i with 'i: ' (stdout and stderr), as srun --label;
    no task is killed when another fails (srun without --kill-on-bad-exit)."""
    args = [sys.executable] + list(sys.argv)
    i = args.index("--srun")
    del args[i:i + 2]
    lock = threading.Lock()
    procs, threads = [], []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), SLURM_PROCID=str(r))
        pr = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(pr)
        for stream, out in ((pr.stdout, sys.stdout), (pr.stderr, sys.stderr)):
            def pump(stream=stream, out=out, r=r):
                for line in iter(stream.readline, b""):
                    with lock:
                        out.write(f"{r}: {line.decode(errors='replace')}")
                        out.flush()
            t = threading.Thread(target=pump, daemon=True)
            t.start()
            threads.append(t)
    codes = [pr.wait() for pr in procs]
    for t in threads:
        t.join(timeout=2)
    rc = 0
    for r, code in enumerate(codes):
        if code != 0:
            with lock:
                if code < 0:
                    sys.stderr.write(f"srun: error: localhost: task {r}: {signal.strsignal(-code)}\n")
                else:
                    sys.stderr.write(f"srun: error: localhost: task {r}: Exited with exit code {code}\n")
                sys.stderr.flush()
            rc = max(rc, 128 - code if code < 0 else code)
    return rc


def setup_logging(rank: int) -> None:
    if a.logfmt == "bracket":
        fmt = f"%(asctime)s [Rank {rank}] %(levelname)s %(message)s"
    else:
        fmt = f"[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] [rank={rank}] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout)


def say(rank: int, msg: str) -> None:
    if a.logfmt == "print":
        print(f"rank {rank} {msg}", flush=True)
    else:
        log.info(msg)
        sys.stdout.flush()


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Shard(torch.utils.data.Dataset):
    def __init__(self, rank: int, n: int):
        self.rank, self.n = rank, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        x, y = torch.randn(8, generator=g), int(torch.randint(0, 4, (1,), generator=g))
        f, r = a.fault, self.rank
        if f == "bad_record" and r in (a.rank, a.rank2) and i == 2 * BATCH + 5:
            y = -1  # a record whose label was never mapped
        if f == "nan_spread" and r == a.rank and i == 2 * BATCH + 3:
            x = x.clone()
            x[2] = float("nan")
        if f == "restart_diff" and attempt() == 0 and r == a.rank and BATCH <= i < 2 * BATCH:
            return {"x": x, "labels": y}
        if f == "restart_diff" and attempt() > 0 and r == a.rank2 and i >= 2 * BATCH:
            return {"x": torch.randn(12, generator=g), "y": y}
        return {"x": x, "y": y}


def save_shared_cut(rank: int, model, path: str) -> None:
    """The saving rank writes the shared checkpoint; the file system fills up half way through."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    data = buf.getvalue()
    say(rank, f"saving shared checkpoint {path} ({len(data)} bytes)")
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])
        fh.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def save_with_retry(rank: int, model, path: str) -> None:
    for n in range(1, 4):
        try:
            with open(path, "wb") as fh:
                torch.save(model.state_dict(), fh)
            return
        except OSError as e:
            if n == 3:
                raise
            say(rank, f"WARNING checkpoint save attempt {n}/3 failed: {e!r}; retrying in 8 s")
            time.sleep(8)


@record
def main() -> None:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    if a.logfmt != "print":
        setup_logging(rank)
    os.makedirs(CKDIR, exist_ok=True)
    shared = f"{CKDIR}/shared_step2.pt"
    if a.fault == "ckpt_partial" and hit and os.path.exists(shared):
        os.remove(shared)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    say(rank, f"world {world} building model (attempt {attempt()})")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = nn.parallel.DistributedDataParallel(net) if a.ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Shard(rank, BATCH * a.steps), batch_size=BATCH)
    step = 0
    try:
        for step, batch in enumerate(loader, start=1):
            f = a.fault
            if f == "sigkill_step2" and hit and step == 2:  # stands in for the kernel OOM killer
                os.kill(os.getpid(), signal.SIGKILL)
            if f == "hang_monitored" and step == 3:
                if hit:  # stuck on a shared-storage lock; prints nothing
                    time.sleep(40)
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=5), wait_all_ranks=True)
            if f == "ckpt_partial" and step == 3 and not hit:  # pick up the EMA weights the saving rank wrote
                while not os.path.exists(shared):
                    time.sleep(0.05)
                time.sleep(0.3)
                say(rank, f"loading shared checkpoint {shared}")
                net.load_state_dict(torch.load(shared))
            x, y = batch["x"], batch["y"]
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            say(rank, f"step {step} local loss {loss.item():.4f}")
            loss.backward()
            if not a.ddp:
                for prm in net.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
            opt.step()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            avg /= world
            if not math.isfinite(avg.item()):
                raise FloatingPointError(f"averaged loss is {avg.item()} at step {step}, stopping")
            if step == 2:
                if f == "attr_typo":  # a refactor renamed the scheduler's lookup; the typo runs on every rank
                    lr = opt.param_group[0]["lr"]
                    say(rank, f"lr {lr}")
                if f == "ckpt_partial" and hit:
                    save_shared_cut(rank, net, shared)
                if f == "save_retry":
                    if hit:
                        save_with_retry(rank, net, f"{RO_DIR}/step2.pt")
                        say(rank, f"saved {RO_DIR}/step2.pt")
                    dist.barrier()  # everyone waits for the save
            if step == 3 and f == "shape_detail":  # eval metric sync; this rank counts an extra class
                metric = torch.zeros(3 if hit else 2)
                dist.all_reduce(metric)
            say(rank, f"step {step} avg loss {avg.item():.4f}")
    except Exception as e:
        if a.logfmt != "print":
            log.exception(f"training failed at step {step}")
        if a.fault == "ckpt_partial" and hit:
            say(rank, f"step {step} checkpoint write failed ({e}); waiting for the async writer to shut down")
            time.sleep(1.0)
        raise
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    if a.srun:
        sys.exit(srun_label(a.srun))
    main()
