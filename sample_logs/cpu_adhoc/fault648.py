"""Galago leap distances: a tiny multi-rank regression job (batch 648 of the hand-run fault logs).

Each rank reads its own shard of synthetic galago leap records (site id, 4 features), maps every
site id through a JSON lookup table (per-site scale and elevation list), predicts the leap distance
with a Linear(4, 1) model started from a shared checkpoint, all-reduces the gradients by hand (no
DDP, so TORCH_DISTRIBUTED_DEBUG=DETAIL works on gloo), and logs every step through `logging` with
timestamps, a progress line and a stats table every 10 steps. Rank 0 saves an export at the end.

  python fault648.py --prepare                       # writes /tmp/fault648_work
  torchrun --nproc-per-node W fault648.py --fault NAME --rank N [--steps S] [--pg-timeout 12]

Faults (--fault NAME --rank N; N is ignored where the fault says every rank):
  none          control run, nothing planted
  fh_stall      faulthandler.dump_traceback_later(5) armed on every rank each step; rank N sleeps 45 s
                at step 20, so faulthandler dumps the stacks before the 12 s gloo timeout
  segv          faulthandler.enable() on every rank; rank N reads address 0 via ctypes at step 28 (SIGSEGV)
  abort         faulthandler.enable() on every rank; rank N calls os.abort() at step 27 (SIGABRT)
  noisy_exc     another rank (0, or 1 when N is 0) logs a handled ValueError with logger.exception on
                every step; rank N then fails for real at step 42 (torch.cat of mismatched shapes)
  keyerror      rank N's shard gets a site id missing from the lookup table at step 40 (KeyError)
  stats_value   rank N's leap validation raises ValueError at step 33 (stats table has eval_error and
                failed_batches columns on every run)
  memgrow       rank N keeps every batch plus a growing buffer under an RLIMIT_AS cap -> MemoryError
  nan_late      rank N's input becomes inf at step 35; the script's own finiteness check raises
  loader_die    every rank reads through a DataLoader (1 worker) whose dataset warns every item;
                rank N's worker SIGKILLs itself at item 30
  export_fail   training finishes; rank 0's export goes through a long saving phase, then to /dev/full
  sigkill       rank N SIGKILLs itself at step 38 (like the OOM killer)
  restart_idx   (use with --max-restarts 1) rank N's elevation lookup indexes past the list at step 40;
                rank 0 writes a resume step every step, so the restarted attempt fails two steps in
  sched_zero    every rank: the decay schedule divides by zero at step steps-5 (same late bug everywhere)
  missing_shard rank N's shard list names a file that was never written (FileNotFoundError)
  ckpt_size     rank N loads the wide start checkpoint (Linear(5, 1)) -> size mismatch
  --warn-every-step adds a Python UserWarning on every step of every rank.

Runs (one line per kept log; written after the runs):
#R01
#R02
#R03
#R04
#R05
#R06
#R07
#R08
#R09
#R10
#R11
#R12
#R13
#R14
#R15
#R16
#R17
#R18
#R19
#R20
#R21
#R22
#R23
#R24
"""
import argparse
import datetime
import faulthandler
import json
import logging
import math
import os
import resource
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist

WORK = "/tmp/fault648_work"
NSITES = 32
BATCH = 16
MAXSTEPS = 60


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(648)
    for r in range(8):
        ids = torch.randint(0, NSITES, (MAXSTEPS * BATCH,), generator=g)
        feats = torch.rand(MAXSTEPS * BATCH, 4, generator=g)
        torch.save({"site": ids, "x": feats}, f"{WORK}/shard_{r:02d}.pt")
    table = {f"site_{i:03d}": {"scale": 1.0 + 0.05 * i, "elev": [0.5 * i, 0.5 * i + 0.25, 0.5 * i + 0.75]}
             for i in range(NSITES)}
    with open(f"{WORK}/lookup.json", "w") as f:
        json.dump(table, f)
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(4, 1).state_dict(), f"{WORK}/ckpt_start.pt")
    torch.save(torch.nn.Linear(5, 1).state_dict(), f"{WORK}/ckpt_start_wide.pt")
    print(f"prepared {WORK}: 8 shards, lookup.json ({NSITES} sites), ckpt_start.pt, ckpt_start_wide.pt")


class LeapSet(torch.utils.data.Dataset):
    def __init__(self, shard, steps, kill_at):
        self.shard, self.steps, self.kill_at = shard, steps, kill_at

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        warnings.warn(f"leap record block {i}: timestamps interpolated for 3 frames", UserWarning)
        if self.kill_at is not None and i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        sl = slice(i * BATCH, (i + 1) * BATCH)
        return self.shard["site"][sl].clone(), self.shard["x"][sl].clone()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--warn-every-step", action="store_true")
    p.add_argument("--run-tag", default="run")
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    me = a.rank == rank
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s galago[rank {rank}] %(name)s: %(message)s")
    log = logging.getLogger("galago.train")
    warnings.simplefilter("always")
    if a.fault in ("fh_stall", "segv", "abort"):
        faulthandler.enable()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    log.info("process group up: world %d, attempt %d, fault %s on rank %d", world, attempt, a.fault, a.rank)

    shard_path = f"{WORK}/shard_{rank:02d}.pt"
    if a.fault == "missing_shard" and me:
        shard_path = f"{WORK}/shards_v2/shard_{rank:02d}.pt"
    log.info("loading shard %s", shard_path)
    shard = torch.load(shard_path)
    with open(f"{WORK}/lookup.json") as f:
        table = json.load(f)
    model = torch.nn.Linear(4, 1)
    ck = f"{WORK}/ckpt_start_wide.pt" if (a.fault == "ckpt_size" and me) else f"{WORK}/ckpt_start.pt"
    log.info("loading start checkpoint %s", ck)
    model.load_state_dict(torch.load(ck))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w_true = torch.tensor([[1.5], [0.7], [-0.4], [2.2]])

    if a.fault == "keyerror" and me:
        shard["site"][40 * BATCH + 3] = 999
    shard["frame"] = shard["site"] % 3
    if a.fault == "restart_idx" and me:
        shard["frame"][40 * BATCH + 5] = 3

    start = 0
    resume_file = f"{WORK}/resume_{a.run_tag}.json"
    if attempt > 0 and os.path.exists(resume_file):
        with open(resume_file) as f:
            start = json.load(f)["step"]
        log.info("resuming from step %d (attempt %d)", start, attempt)
    elif attempt == 0 and rank == 0 and os.path.exists(resume_file):
        os.remove(resume_file)

    keep, rlimit_set = [], False
    if a.fault == "memgrow" and me:
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
        cap = vm + 500 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        log.info("address space capped at %d MiB", cap // 2**20)

    loader = None
    if a.fault == "loader_die":
        ds = LeapSet(shard, a.steps, 30 if me else None)
        loader = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1))

    t0 = time.time()
    failed_batches = 0
    for step in range(start, a.steps):
        if a.fault == "fh_stall":
            faulthandler.dump_traceback_later(5, exit=False)
        if loader is not None:
            ids, x = next(loader)
        else:
            sl = slice(step * BATCH, (step + 1) * BATCH)
            ids, x = shard["site"][sl], shard["x"][sl]
        scales, elevs = [], []
        frames = shard["frame"][step * BATCH:(step + 1) * BATCH].tolist()
        for i, fr in zip(ids.tolist(), frames):
            rec = table[f"site_{i:03d}"]
            scales.append(rec["scale"])
            elevs.append(rec["elev"][fr])
        scale = torch.tensor(scales).unsqueeze(1)
        elev = torch.tensor(elevs).unsqueeze(1)
        if a.fault == "nan_late" and me and step == 35:
            x = x * float("inf")
        if a.fault == "noisy_exc" and rank == (1 if a.rank == 0 else 0):
            try:
                datetime.datetime.strptime(f"24:{61 + step % 3}", "%H:%M")
            except ValueError:
                log.exception("ERROR parsing leap timestamp for block %d; falling back to frame index", step)
        if a.fault == "noisy_exc" and me and step == 42:
            x = torch.cat([x, elev.repeat(1, 2)], dim=0)
        if a.fault == "stats_value" and me and step == 33:
            raise ValueError(f"leap distance -{3.2 + rank:.1f} m out of range for block {step} (site {ids[0].item()})")
        if a.fault == "segv" and me and step == 28:
            import ctypes
            ctypes.string_at(0)
        if a.fault == "abort" and me and step == 27:
            os.abort()
        if a.fault == "sigkill" and me and step == 38:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault == "fh_stall" and me and step == 20:
            log.info("refreshing leap cache for block %d", step)
            time.sleep(45)
        if a.fault == "memgrow" and me:
            keep.append((x.clone(), bytearray(2**20 * (step + 1))))
        if a.warn_every_step:
            warnings.warn(f"block {step}: leap timestamps not monotonic, sorting", UserWarning)
        y = (x @ w_true) * scale + 0.1 * elev
        pred = model(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
        decay = 1.0
        if a.fault == "sched_zero":
            decay = 1.0 / (a.steps - 5 - step)
        for gr in opt.param_groups:
            gr["lr"] = 0.05 * min(1.0, abs(decay))
        opt.step()
        if a.fault == "fh_stall":
            faulthandler.cancel_dump_traceback_later()
        leap = pred.mean().item()
        log.info("block %d: %d records, mean scale %.3f", step, len(scales), scale.mean().item())
        print(f"rank {rank} step {step} loss {loss.item():.4f} leap_m {leap:.3f}", flush=True)
        done = step + 1
        bar = "#" * (done * 20 // a.steps) + "-" * (20 - done * 20 // a.steps)
        el = time.time() - t0
        print(f"[rank {rank}] progress {done}/{a.steps} [{bar}] {100 * done // a.steps}% "
              f"elapsed {el:.1f}s eta {el / max(1, done - start) * (a.steps - done):.1f}s", flush=True)
        if rank == 0:
            with open(resume_file, "w") as f:
                json.dump({"step": step}, f)
        if done % 10 == 0:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
            print(f"[rank {rank}] stats @ step {done}\n"
                  f"  | step | loss     | leap_m  | eval_error | failed_batches | rss_mb |\n"
                  f"  | {done:4d} | {loss.item():8.4f} | {leap:7.3f} | {abs(leap - 4.0):10.4f} "
                  f"| {failed_batches:14d} | {rss:6d} |", flush=True)
    dist.barrier()
    log.info("training done after %d steps", a.steps)
    if rank == 0:
        target = f"{WORK}/export_{a.run_tag}.pt"
        if a.fault == "export_fail":
            for k in range(30):
                log.info("saving export: packing leap table chunk %d/30", k + 1)
                time.sleep(0.05)
            target = "/dev/full"
        log.info("saving export to %s", target)
        torch.save({"model": model.state_dict(), "steps": a.steps}, target)
        log.info("export saved")
    dist.destroy_process_group()
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    main()
