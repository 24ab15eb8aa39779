"""A thirtieth hand-run batch: RED HERRINGS. A small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), a DataLoader
over a synthetic per-rank shard of {"x", "y"} dicts, --steps steps) whose output carries benign error-looking text
printed by real code paths that handle it (--herrings, on --herring-ranks), mostly before the real fault and, with
--late-rank, by another rank after it; then ONE real fault on rank --rank at step --fstep.

Herrings (comma list; each really happens and is handled):
  import     `import apex_fused_adam` fails: traceback.print_exc(), "falling back to torch.optim.AdamW" (start-up)
  metrics    a metrics client connects to 127.0.0.1:9 (refused): logging.error("metrics server unreachable: ...")
  metricstb  the same, but the handler prints the traceback (ConnectionRefusedError: [Errno 111] ...) and goes on
  ioretry    a flaky shard reader raises OSError(EIO) on its first read: traceback printed, "retrying (1/3)", works
  badsample  sample 17 of the shard fails to parse (ValueError): "skipping bad sample 17: ValueError: ..."
  strict     resume from a warm-start file with renamed/extra keys: load_state_dict(strict=False) result printed
  overflow   fp16-style loss scaling: the scaled loss overflows at step 1: "Gradient overflow. Skipping step ..."
  nanskip    step 2's loss on this rank is nan (a NaN feature): "loss is nan, skipping step 2" (no optimizer step)
  warn       os.sched_setaffinity to CPU 4095 fails: UserWarning "failed to set CPU affinity ..." + a DeprecationWarning
  evalhook   an eval hook at step 2 divides by an empty eval set: logging.exception("eval hook failed ..."), goes on
  thread     a heartbeat thread dies (Exception in thread heartbeat: ... ConnectionResetError) while training goes on

Faults (on --rank, at --fstep unless noted):
  key        the batch comes from a shard written with 'labels' (KeyError: 'y')
  value      a sample field is 'n/a' (ValueError: could not convert string to float: 'n/a')
  shape      the batch has 7 features (RuntimeError: mat1 and mat2 shapes cannot be multiplied)
  segv       os.kill(getpid, SIGSEGV)          sigkill   os.kill(getpid, SIGKILL)
  exit3      os._exit(3), no message           nan       a NaN feature; the loss check raises FloatingPointError
  stall      sleeps 60 s (the others' gloo all-reduce times out)
  ckmissing  start-up resume: this rank's checkpoint file is absent (torch.load: FileNotFoundError)
  cktrunc    start-up resume: this rank's checkpoint is cut in half (torch.load fails on the zip archive)
  memerr     a 64 TiB prefetch buffer: bytearray raises MemoryError, uncaught
  connref    the step's checkpoint push to 127.0.0.1:9 is refused: uncaught ConnectionRefusedError
  none       no fault
"""
import argparse, datetime, errno, io, logging, math, os, signal, socket, sys, threading, time, traceback, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--fstep", type=int, default=4)
p.add_argument("--steps", type=int, default=7)
p.add_argument("--herrings", default="")
p.add_argument("--herring-ranks", default="all")
p.add_argument("--late-rank", type=int, default=-1)
p.add_argument("--late-herrings", default="metrics")
p.add_argument("--fmt", choices=["plain", "kv", "log", "tqdm", "frac"], default="plain")
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--ckdir", default="/tmp/fault30/ckpt")
a = p.parse_args()
BATCH = 16
HERRINGS = [h for h in a.herrings.split(",") if h]
LATE = [h for h in a.late_herrings.split(",") if h]
log = logging.getLogger("train")


def herring_here(rank: int, name: str) -> bool:
    if name not in HERRINGS:
        return False
    return a.herring_ranks == "all" or str(rank) in a.herring_ranks.split(",")


def progress(rank: int, step: int, loss: float, bar=None) -> None:
    if a.fmt == "plain":
        print(f"rank {rank} step {step} loss {loss:.4f}", flush=True)
    elif a.fmt == "kv":
        print(f"step={step} rank={rank} loss={loss:.4f} lr=0.01", flush=True)
    elif a.fmt == "log":
        log.info("[rank %d] step %d/%d loss %.4f", rank, step, a.steps, loss)
    elif a.fmt == "frac":
        print(f"[{rank}] it {step}/{a.steps} | loss {loss:.3f}", flush=True)
    elif a.fmt == "tqdm":
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.update(1)
        else:
            print(f"rank {rank} step {step} loss {loss:.4f}", flush=True)


def metrics_connect(rank: int, tb: bool) -> None:
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=2).close()
    except OSError as e:
        if tb:
            traceback.print_exc()
            print(f"rank {rank}: metrics disabled, training continues", flush=True)
        else:
            logging.error("metrics server unreachable: %r; continuing without metrics", e)


class Shard(torch.utils.data.Dataset):
    def __init__(self, rank: int, n: int):
        self.rank, self.n = rank, n
        self.fault = a.fault if rank == a.rank else ""
        self.badsample = herring_here(rank, "badsample")
        self.nanskip = herring_here(rank, "nanskip")

    def __len__(self):
        return self.n

    def parse(self, i: int, fields):
        return torch.tensor([float(v) for v in fields])

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        x, y = torch.randn(8, generator=g), int(torch.randint(0, 4, (1,), generator=g))
        fault_batch = (a.fstep - 1) * BATCH <= i < a.fstep * BATCH
        if self.badsample and i == 17:
            try:
                x = self.parse(i, ["0.5"] * 6 + ["", "0.1"])
            except ValueError as e:
                print(f"rank {self.rank}: skipping bad sample {i}: ValueError: {e}", flush=True)
        if self.nanskip and i == BATCH + 5:
            x = x.clone()
            x[2] = float("nan")
        if fault_batch and self.fault == "key":
            return {"x": x, "labels": y}
        if fault_batch and self.fault == "value" and i == (a.fstep - 1) * BATCH + 3:
            x = self.parse(i, ["0.12"] * 7 + ["n/a"])
        if fault_batch and self.fault == "shape":
            x = x[:7]
        if fault_batch and self.fault == "nan" and i == (a.fstep - 1) * BATCH + 6:
            x = x.clone()
            x[5] = float("nan")
        return {"x": x, "y": y}


class FlakyReader:
    def __init__(self, rank: int):
        self.rank, self.calls = rank, 0

    def read(self) -> int:
        self.calls += 1
        if self.calls == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO), f"/tmp/job/data/shard{self.rank:03d}.bin")
        return 4096


def heartbeat(rank: int) -> None:
    time.sleep(0.3)
    print(f"rank {rank} heartbeat sent", flush=True)
    raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (heartbeat collector)")


def evaluate(rank: int) -> float:
    results = []  # the eval shard of this rank is empty
    return sum(results) / len(results)


def run_late(rank: int) -> None:
    time.sleep(0.4)
    if "metrics" in LATE:
        metrics_connect(rank, tb=False)
    if "metricstb" in LATE:
        metrics_connect(rank, tb=True)
    if "evalhook" in LATE:
        try:
            evaluate(rank)
        except Exception:
            log.exception("rank %d: eval hook failed at step %d; continuing", rank, a.fstep)
    if "thread" in LATE:
        t = threading.Thread(target=heartbeat, args=(rank,), name="heartbeat")
        t.start()
        t.join()


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    fmtstr = "%(asctime)s %(levelname)s %(name)s: %(message)s" if a.fmt == "log" else "%(levelname)s:%(name)s:%(message)s"
    logging.basicConfig(level=logging.INFO, format=fmtstr)
    if herring_here(rank, "warn"):
        try:
            os.sched_setaffinity(0, {4095})
        except OSError as e:
            warnings.warn(f"failed to set CPU affinity for rank {rank}: {e}", UserWarning)
        warnings.warn("the 'fused' flag of the optimizer wrapper is deprecated and will be an error in a future "
                      "release", DeprecationWarning)
    opt_cls = torch.optim.SGD
    if herring_here(rank, "import"):
        try:
            import apex_fused_adam  # noqa: F401
        except ImportError:
            traceback.print_exc()
            print(f"rank {rank}: falling back to torch.optim.AdamW", flush=True)
            opt_cls = torch.optim.AdamW
    if herring_here(rank, "metrics"):
        metrics_connect(rank, tb=False)
    if herring_here(rank, "metricstb"):
        metrics_connect(rank, tb=True)
    if herring_here(rank, "thread"):
        threading.Thread(target=heartbeat, args=(rank,), name="heartbeat", daemon=True).start()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    print(f"rank {rank}/{world} initialised, building model", flush=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if herring_here(rank, "strict"):
        warm = {"0.weight": torch.zeros(16, 8), "0.bias": torch.zeros(16), "head.weight": torch.zeros(4, 16),
                "head.bias": torch.zeros(4), "ema_decay": torch.tensor(0.999)}
        res = net.load_state_dict(warm, strict=False)
        print(f"rank {rank}: warm start from /tmp/job/warm/init.pt: {res}", flush=True)
    if a.fault in ("ckmissing", "cktrunc"):
        os.makedirs(a.ckdir, exist_ok=True)
        if rank == 0:
            for r in range(world):
                path = f"{a.ckdir}/rank{r}.pt"
                if os.path.exists(path):
                    os.remove(path)
                if r == a.rank and a.fault == "ckmissing":
                    continue
                buf = io.BytesIO()
                torch.save({"model": net.state_dict(), "step": 3}, buf)
                data = buf.getvalue()
                with open(path, "wb") as fh:
                    fh.write(data[: len(data) // 2] if r == a.rank else data)
        dist.barrier()
        path = f"{a.ckdir}/rank{rank}.pt"
        print(f"rank {rank}: resuming from {path}", flush=True)
        state = torch.load(path)
        net.load_state_dict(state["model"])
        print(f"rank {rank}: resumed at step {state['step']}", flush=True)
    model = nn.parallel.DistributedDataParallel(net)
    opt = opt_cls(model.parameters(), lr=0.01)
    if herring_here(rank, "ioretry"):
        rd = FlakyReader(rank)
        for attempt in range(1, 4):
            try:
                n = rd.read()
                print(f"rank {rank}: read {n} bytes of the shard index on attempt {attempt}", flush=True)
                break
            except OSError:
                traceback.print_exc()
                print(f"rank {rank}: shard read failed, retrying ({attempt}/3)", flush=True)
                time.sleep(0.2)
    loader = torch.utils.data.DataLoader(Shard(rank, BATCH * a.steps), batch_size=BATCH)
    bar = None
    if a.fmt == "tqdm" and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=a.steps, desc="train", file=sys.stderr, mininterval=0)
    scale = 2.0 ** 16
    for step, batch in enumerate(loader, start=1):
        mine = rank == a.rank and step == a.fstep
        if rank == a.late_rank and step == a.fstep:
            run_late(rank)
        if mine and a.fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if mine and a.fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mine and a.fault == "exit3":
            os._exit(3)
        if mine and a.fault == "stall":
            time.sleep(60)
        if mine and a.fault == "memerr":
            prefetch = bytearray(64 << 40)  # 64 TiB prefetch buffer
            del prefetch
        if mine and a.fault == "connref":
            s = socket.create_connection(("127.0.0.1", 9), timeout=2)  # push the step checkpoint to the store
            s.close()
        x, y = batch["x"], batch["y"]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if herring_here(rank, "evalhook") and step == 2:
            try:
                evaluate(rank)
            except Exception:
                log.exception("rank %d: eval hook failed at step %d; continuing", rank, step)
        if not math.isfinite(loss.item()):
            if herring_here(rank, "nanskip") and step == 2:
                print(f"rank {rank}: loss is nan, skipping step {step}", flush=True)
                (sum(q.sum() for q in model.parameters()) * 0.0).backward()  # zero grads into DDP's all-reduce
                opt.zero_grad()
                progress(rank, step, loss.item(), bar)
                continue
            logging.error("rank %d: non-finite loss %s at step %d", rank, loss.item(), step)
            raise FloatingPointError(f"loss is {loss.item()} at step {step}")
        loss.backward()
        if herring_here(rank, "overflow"):
            scaled = loss.detach().half() * scale
            if not torch.isfinite(scaled):
                scale /= 2
                print(f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {scale}", flush=True)
                progress(rank, step, loss.item(), bar)
                continue
        opt.step()
        progress(rank, step, loss.item(), bar)
    if bar is not None:
        bar.close()
    dist.barrier()
    print(f"rank {rank} training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
