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
  galago_none_np3_rnone_plain (plain, 41300): control; 40 steps on 3 ranks, export saved, exit 0
  galago_keyerror_np8_r4_plain (plain, 41301): rank 4 KeyError 'site_999' at step 40 of 50; exit 1
  galago_fh_stall_np5_r2_tee (tee, 41302): all 5 ranks dump 'Timeout (0:00:05)!' stacks, 4 gloo 12 s timeouts; exit 1
  galago_segv_np6_r5_tee_trainer (tee_trainer, 41303): per-step UserWarnings, rank 5 'Fatal Python error: Segmentation fault', -11; exit 1
  galago_sigkill_np6_r3_pdsh2 (pdsh2, 41304): rank 3 exitcode -9 at step 38, peers reset, node 0 loses the store; exit 1
  galago_nan_late_np8_r0_redirects (redirects, 41305): rank 0 FloatingPointError loss nan at step 35 (in rank files); exit 1
  galago_noisy_exc_np5_r3_loglevel (loglevel, 41306): rank 0 logs 42 handled ValueError tracebacks, rank 3 torch.cat RuntimeError at 42; exit 1
  galago_stats_value_np6_r0_detail (detail, 41307): rank 0 ValueError at step 33, peers report monitoredBarrier errors; exit 1
  galago_nan_late_np5_r4_pymodule (pymodule, 41309): rank 4 FloatingPointError loss nan at step 35; exit 1
  galago_loader_die_np3_r1_filter (filter, 41310): per-item UserWarnings, rank 1 'DataLoader worker ... killed by signal: Killed'; exit 1
  galago_export_fail_np4_r0_wrapper (wrapper, 41311): training done, 30 saving lines, torch.save to /dev/full RuntimeError; exit 1
  galago_restart_idx_np4_r2_restart (restart, 41312): attempt 0 rank 2 IndexError at step 40, attempt 1 Gloo connectFullMesh refused; exit 1
  galago_sched_zero_np5_rall_tee (tee, 41313): every rank ZeroDivisionError at step 45 amid per-step UserWarnings; exit 1
  galago_abort_np4_r0_prefix (prefix, 41314): rank 0 'Fatal Python error: Aborted', exitcode -6 at step 27; exit 1
  galago_missing_shard_np7_r6_plain (plain, 41315): rank 6 FileNotFoundError for shards_v2/shard_06.pt; exit 1
  galago_ckpt_size_np3_r2_loglevel (loglevel, 41316): rank 2 load_state_dict size mismatch [1, 5] vs [1, 4]; exit 1
  galago_fh_stall_np8_r7_plain (plain, 41317): all 8 ranks dump stacks, ranks 0-6 gloo 12 s timeouts, rank 7 SIGTERMed; exit 1
  galago_keyerror_np3_r0_wrapper (wrapper, 41318): rank 0 KeyError 'site_999' at step 40 of 50; exit 1
  galago_stats_value_np3_r1_prefix (prefix, 41319): rank 1 ValueError at step 33 after eval_error/failed_batches tables; exit 1
  galago_sigkill_np5_r0_tee_trainer (tee_trainer, 41320): rank 0 exitcode -9 at step 38, peers reset; exit 1
  galago_memgrow_np6_r5_tee (tee, 41321): rank 5 rss grows under RLIMIT_AS, MemoryError at step 26 of 40; exit 1
  dropped: galago_memgrow_np4_r3_redirects (41308): MemoryError at step 5, too fast (14 MiB/step), growth then cut to 1 MiB/step


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
