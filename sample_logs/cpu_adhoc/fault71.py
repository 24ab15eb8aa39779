"""A seventy-first hand-run batch: TWO JOBS ON ONE MACHINE getting in each other's way. A tiny DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, a synthetic per-rank shard, PG timeout 15 s, no @record) printing
`job J rank R step S loss L` every step; two torchrun launches of it (job A, then job B once A is under way) from
fault71_two.py share something. --job names the job, --role says what this job does with the shared thing.

Roles (--rank N: the rank of THIS job that touches the shared thing):
  plain       train only (the other job of a port clash, a control run, a job killed from outside)
  ckpt_save   rank N saves the shared checkpoint CKDIR/latest.pt at step 2, then at step 4 waits (every rank of the job
              waits, outside any collective; before commit 37787839 only rank N did) for the other job's marker (CKDIR/../fault71_b_started, up to 40 s: stands in for the other job starting meanwhile) and
              reloads it (a resume check): FileNotFoundError if the other job cleared the folder, size mismatch if it
              overwrote the file with its own wider model
  ckpt_clear  rank N (job B) clears CKDIR at start ("fresh run") and writes the marker
  ckpt_over   rank N (job B) writes its own checkpoint (hidden 32) to CKDIR/latest.pt at start, then the marker
  lock_hold   rank N takes the FileLock LOCK before step 1 and holds it until training ends (dataset preparation)
  lock_take   rank N takes the FileLock LOCK with a 8 s timeout before step 1: filelock.Timeout if the other job holds it
  shm_hold    rank N creates the shared-memory block SHM (batch staging) and holds it until the end, then unlinks it
  shm_take    rank N creates the shared-memory block SHM: FileExistsError if the other job holds it
  keyerr      rank N's step-3 batch carries 'labels' instead of 'y' (KeyError: 'y') (the failing job of a shared log)
"""
import argparse, datetime, os, shutil, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--job", default="A")
p.add_argument("--role", default="plain")
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--step-s", type=float, default=0.2)
p.add_argument("--ckdir", default="/tmp/fault71_work/ckpt")
p.add_argument("--lock", default="/tmp/fault71_work/dataset.lock")
p.add_argument("--shm", default="fault71_batches")
a = p.parse_args()
MARK = os.path.join(os.path.dirname(a.ckdir.rstrip("/")), "fault71_b_started")


def say(rank, msg):
    print(f"job {a.job} rank {rank} {msg}", flush=True)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    me = rank == a.rank
    say(rank, f"world {world} ready (gloo)")
    lock = shm = None
    if me and a.role == "ckpt_clear":
        shutil.rmtree(a.ckdir, ignore_errors=True)
        os.makedirs(a.ckdir, exist_ok=True)
        open(MARK, "w").close()
        say(rank, f"fresh run: cleared {a.ckdir}")
    if me and a.role == "ckpt_over":
        os.makedirs(a.ckdir, exist_ok=True)
        wide = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        torch.save({"model": wide.state_dict(), "step": 0}, os.path.join(a.ckdir, "latest.pt"))
        open(MARK, "w").close()
        say(rank, f"saved initial checkpoint {a.ckdir}/latest.pt")
    if me and a.role in ("lock_hold", "lock_take"):
        from filelock import FileLock
        os.makedirs(os.path.dirname(a.lock), exist_ok=True)
        lock = FileLock(a.lock, timeout=-1 if a.role == "lock_hold" else 8)
        say(rank, f"waiting for {a.lock}")
        lock.acquire()
        say(rank, f"holding {a.lock} while preparing the dataset")
    if me and a.role in ("shm_hold", "shm_take"):
        from multiprocessing import shared_memory
        shm = shared_memory.SharedMemory(name=a.shm, create=True, size=1 << 20)
        say(rank, f"staging batches in /dev/shm/{a.shm}")
    dist.barrier()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        batch = {"x": torch.randn(16, 8, generator=g), "y": torch.randint(0, 4, (16,), generator=g)}
        if me and a.role == "keyerr" and step == 3:
            batch = {"x": batch["x"], "labels": batch["y"]}
        opt.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        time.sleep(a.step_s)
        say(rank, f"step {step} loss {loss.item():.4f}")
        if me and a.role == "ckpt_save" and step == 2:
            os.makedirs(a.ckdir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(a.ckdir, "latest.pt"))
            say(rank, f"saved checkpoint {a.ckdir}/latest.pt")
        if a.role == "ckpt_save" and step == 4:
            t0 = time.time()  # every rank waits (outside any collective), so that the others do not time out
            while not os.path.exists(MARK) and time.time() - t0 < 40:
                time.sleep(0.2)
        if me and a.role == "ckpt_save" and step == 4:
            say(rank, f"resume check: reloading {a.ckdir}/latest.pt")
            state = torch.load(os.path.join(a.ckdir, "latest.pt"))
            model.module.load_state_dict(state["model"])
            say(rank, f"resume check ok (step {state['step']})")
    dist.barrier()
    if lock is not None:
        lock.release()
    if shm is not None:
        shm.close()
        shm.unlink()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    main()
