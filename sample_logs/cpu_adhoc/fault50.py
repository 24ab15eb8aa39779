"""A fiftieth hand-run batch: SCALE, many ranks and long logs. A tiny DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4),
SGD, batch 8, no sleeps) run with 12-32 ranks for 200-300 steps; every rank prints `[rank R] step S/T loss L` each
step, and rank 0 adds chatty lines each step (`eval ... val_loss ... acc ...`, `throughput ... samples/s`) and a
checkpoint notice every 50 steps (it really saves to --ckdir). ONE plain fault per run, late (step --step, 150+):

  exc      rank N's label check raises ValueError (a label out of range) at step S
  shape    rank N's step-S batch has 9 features: RuntimeError mat1 and mat2 shapes cannot be multiplied
  nan      rank N's step-S batch holds a NaN; the finite-loss check raises FloatingPointError
  nockpt   at step S (a resume point) rank N reloads its EMA weights from --ckdir/rank{N}/ema_step{S-50}.pt,
           which was never written: FileNotFoundError from torch.load
  osexit   rank N calls os._exit(3) at step S
  segv     rank N reads address 0 (ctypes.string_at(0)) at step S: SIGSEGV, nothing printed
  sigkill  rank N starts a sidecar `sh -c 'sleep 0.5; kill -9 PID'` at step S and goes on training until killed
  hang     rank N sleeps 120 s before its step-S forward; the others time out after --pg-timeout s
  keyall   every rank reads batch['labels'] at step S (the batches hold 'y'): the same KeyError everywhere
  two      rank N raises ValueError after its step-S update; rank --rank2 M raises KeyError at step S+1 before its
           forward (two independent failures, one step apart)
  linger   rank N logs an ERROR record (logging) that its loss is nan at step S, lingers 10 s, then sys.exit(1)
  none     no fault (control)
"""
import argparse, ctypes, datetime, logging, math, os, subprocess, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--rank2", type=int, default=-1)
p.add_argument("--step", type=int, default=180)
p.add_argument("--steps", type=int, default=250)
p.add_argument("--pg-timeout", type=int, default=20)
p.add_argument("--ckdir", default="/tmp/f50_ckpt")
a = p.parse_args()
BATCH = 8
torch.set_num_threads(1)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("trainer")


def make_batch(rank: int, step: int, g: torch.Generator) -> dict:
    x = torch.randn(BATCH, 8, generator=g)
    y = torch.randint(0, 4, (BATCH,), generator=g)
    if step == a.step and rank == a.rank:
        if a.fault == "shape":
            x = torch.randn(BATCH, 9, generator=g)  # this shard was written with an extra feature column
        elif a.fault == "nan":
            x[3, 5] = float("nan")
        elif a.fault == "exc":
            y[2] = 7  # a label from another task's label set
    return {"x": x, "y": y}


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1234 + rank)
    if rank == 0:
        os.makedirs(a.ckdir, exist_ok=True)
        print(f"[rank 0] world {world}, {a.steps} steps, batch {BATCH}/rank, global batch {BATCH * world}", flush=True)
    t0 = time.time()
    for step in range(1, a.steps + 1):
        ts = time.time()
        batch = make_batch(rank, step, g)
        hit = step == a.step and rank == a.rank
        if a.fault == "keyall" and step == a.step:
            y = batch["labels"]
        if a.fault == "two" and rank == a.rank2 and step == a.step + 1:
            y = batch["labels"]
        if hit and a.fault == "osexit":
            os._exit(3)
        if hit and a.fault == "segv":
            ctypes.string_at(0)
        if hit and a.fault == "sigkill":
            subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {os.getpid()}"])
        if hit and a.fault == "hang":
            time.sleep(120)
        if hit and a.fault == "nockpt":
            state = torch.load(f"{a.ckdir}/rank{rank}/ema_step{step - 50:04d}.pt")
        if hit and a.fault == "linger":
            log.error("rank %d: loss is nan at step %d; dumping the batch and stopping", rank, step)
            time.sleep(10)
            sys.exit(1)
        x, y = batch["x"], batch["y"]
        if int(y.max()) >= 4:
            raise ValueError(f"label {int(y.max())} out of range for 4 classes at step {step}")
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}, stopping")
        loss.backward()
        opt.step()
        if a.fault == "two" and rank == a.rank and step == a.step:
            raise ValueError(f"step {step}: parameter checksum differs from the rank-0 broadcast")
        print(f"[rank {rank}] step {step}/{a.steps} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            dt = time.time() - ts
            with torch.no_grad():
                vx = torch.randn(32, 8, generator=g)
                vy = torch.randint(0, 4, (32,), generator=g)
                out = model.module(vx)
                vl = F.cross_entropy(out, vy).item()
                acc = (out.argmax(1) == vy).float().mean().item()
            print(f"[rank 0] eval step {step}: val_loss {vl:.4f} acc {acc:.3f}", flush=True)
            print(f"[rank 0] throughput step {step}: {BATCH * world / max(dt, 1e-6):.1f} samples/s, "
                  f"{dt * 1000:.1f} ms/step, elapsed {time.time() - t0:.1f}s", flush=True)
            if step % 50 == 0:
                path = f"{a.ckdir}/step{step:04d}.pt"
                torch.save({"model": model.module.state_dict(), "step": step}, path)
                print(f"[rank 0] checkpoint saved: {path} (step {step})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"[rank {rank}] training finished", flush=True)


if __name__ == "__main__":
    main()
