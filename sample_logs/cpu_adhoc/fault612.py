"""fault612.py - murrelet old-growth nests: a tiny multi-rank job with planted faults (batch 612).

Each rank reads its own shard of synthetic nest-survey rows (/tmp/fault612_work/shard_R.pt), maps the nest ids
through a JSON lookup table (nest_lookup.json) to stand ids, and trains a small regressor that predicts
nest success from canopy features.  Gloo on CPU, gradients all-reduced by hand, 6 steps, each rank prints
"rank R step S loss L nest_success M"; rank 0 saves an export at the end.

Faults (--fault NAME --rank N):
  none          control run
  two_ranks     rank N raises ValueError at step 2; rank N+1 (mod W) sleeps 1 s and raises KeyError
  warn_storm    every rank warns (UserWarning) each step; rank N raises RuntimeError at step 3
  caught_then   rank 0 catches a ZeroDivisionError at step 1 and logs it (log.exception), goes on;
                rank N then hits a missing shard file (FileNotFoundError) at step 4
  chained       rank N: KeyError in the lookup at step 2, re-raised as RuntimeError(...) from err
  save_fail     rank N torch.save()s its eval export into a missing folder after step 5; others wait in a barrier
  first_step    rank N fails in the forward of step 0 (mat1/mat2 shape mismatch), before any step line
  tqdm_bar      a tqdm bar on stderr on every rank; rank N raises ValueError at step 3, mid-bar
  restart_ok    rank N raises RuntimeError at step 2 on the first attempt only (TORCHELASTIC_RESTART_COUNT=0)
  log_rank      rank N logs through logging with timestamps, the rest print; rank N: FileNotFoundError at step 3
  long_msg      rank N raises ValueError whose message holds a tensor repr and a dict (multi-line) at step 2
  sys_exit      rank N calls sys.exit("...") at step 3
  sigint        rank N sends itself SIGINT at step 2 (KeyboardInterrupt)
  dtype_mm      rank N torch.mm of float and long at step 2 (RuntimeError)
  embed_index   rank N looks up a stand id past the embedding table at step 3 (IndexError)
  same_early    every rank raises the same KeyError (unknown nest id in its data); rank N one step earlier
  segv          rank N sends itself SIGSEGV at step 3

Runs (one line per log, written after the runs):
  murrelet_two_ranks_np8_r2_plain: rank 2 ValueError, rank 3 KeyError 1 s later, rest peer-closed; exit 1
  murrelet_first_step_np7_r6_detail: rank 6 shape error in step 0 forward, rank 0 monitoredBarrier timeout; exit 1
  murrelet_warn_storm_np6_r5_tee: 24 UserWarnings, then rank 5 RuntimeError at step 3; exit 1
  murrelet_chained_np6_r4_pdsh2: rank 4 KeyError -> RuntimeError from err, two agents fail; console exit 0 (sed)
  murrelet_long_msg_np6_r3_prefix: rank 3 multi-line ValueError with tensor repr and dict; exit 1
  murrelet_save_fail_np5_r3_redirects: rank 3 torch.save into missing folder after step 5; exit 1
  murrelet_tqdm_bar_np5_r1_filter: tqdm bars on ranks 0,1, rank 1 ValueError at 3/6; exit 1
  murrelet_dtype_mm_np5_r4_wrapper: rank 4 mm float != long at step 2, no done line; exit 1
  murrelet_none_np5_rnone_tee: control, 6 steps on 5 ranks, export saved; exit 0
  murrelet_caught_then_np5_r3_loglevel: rank 0 logs caught ZeroDivisionError, rank 3 FileNotFoundError; exit 1
  murrelet_restart_ok_np4_r3_restart: rank 3 RuntimeError, restart fails in gloo connectFullMesh; exit 1
  murrelet_sigint_np4_r1_pymodule: rank 1 KeyboardInterrupt, exitcode -2 (SIGINT); exit 1
  murrelet_sys_exit_np3_r2_tee_trainer: rank 2 sys.exit message, no traceback; exit 1
  murrelet_log_rank_np3_r1_plain: rank 1 timestamped logging, then FileNotFoundError at step 3; exit 1
  murrelet_embed_index_np4_r0_tee: rank 0 IndexError index out of range in self at step 3; exit 1
  murrelet_segv_np4_r2_plain: rank 2 SIGSEGV at step 3, exitcode -11; exit 1
  murrelet_two_ranks_np4_r3_tee: rank 3 ValueError, rank 0 KeyError 1 s later; exit 1
  murrelet_chained_np3_r0_detail: rank 0 chained RuntimeError, DETAIL monitoredBarrier errors; exit 1
  murrelet_warn_storm_np3_r1_redirects: warnings and rank 1 RuntimeError in rank files only; exit 1
  murrelet_restart_ok_np5_r0_restart: rank 0 RuntimeError, restart fails in gloo connectFullMesh; exit 1
  (unused)
  (unused)
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

WORK = "/tmp/fault612_work"
STEPS = 6
FEAT = 8
NSTANDS = 12


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(612)
    lookup = {f"nest-{i:03d}": i % NSTANDS for i in range(60)}
    with open(os.path.join(WORK, "nest_lookup.json"), "w") as f:
        json.dump(lookup, f)
    for r in range(world):
        x = torch.randn(STEPS * 4, FEAT, generator=g)
        y = torch.rand(STEPS * 4, 1, generator=g)
        ids = [f"nest-{(r * 7 + j) % 60:03d}" for j in range(STEPS * 4)]
        torch.save({"x": x, "y": y, "ids": ids}, os.path.join(WORK, f"shard_{r}.pt"))
    model = Net()
    torch.save(model.state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {world} shards in {WORK}")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stand = torch.nn.Embedding(NSTANDS, 4)
        self.fc1 = torch.nn.Linear(FEAT + 4, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x, stand):
        h = torch.cat([x, self.stand(stand)], dim=1)
        return torch.sigmoid(self.fc2(torch.relu(self.fc1(h))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=int, default=0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    a = ap.parse_args()
    if a.prepare:
        prepare(a.prepare)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    fault, frank = a.fault, a.rank
    mine = rank == frank
    log = logging.getLogger("murrelet")
    if fault == "log_rank" and mine:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    elif fault == "caught_then":
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
    if fault == "warn_storm":
        warnings.simplefilter("always")

    with open(os.path.join(WORK, "nest_lookup.json")) as f:
        lookup = json.load(f)
    shard = torch.load(os.path.join(WORK, f"shard_{rank}.pt"))
    model = Net()
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if fault == "same_early":
        bad_step = 2 if mine else 3
        shard["ids"][bad_step * 4 + 1] = f"nest-{900 + rank}"

    steps = range(STEPS)
    if fault == "tqdm_bar":
        from tqdm import tqdm
        steps = tqdm(steps, file=sys.stderr, desc=f"rank{rank} nests")

    for step in steps:
        sl = slice(step * 4, step * 4 + 4)
        x, y = shard["x"][sl], shard["y"][sl]
        ids = shard["ids"][sl]
        if fault == "chained" and mine and step == 2:
            ids = ids[:2] + ["nest-unsurveyed-77"] + ids[3:]
        try:
            stand = torch.tensor([lookup[i] for i in ids])
        except KeyError as err:
            if fault == "chained":
                raise RuntimeError(f"rank {rank}: could not map nest ids of step {step} to stands") from err
            raise
        if fault == "embed_index" and mine and step == 3:
            stand = stand + NSTANDS
        if fault == "first_step" and mine and step == 0:
            x = x[:, :FEAT - 3]
            out = model.fc1(x)
        if fault == "dtype_mm" and mine and step == 2:
            canopy = torch.mm(x, torch.arange(FEAT * 2).reshape(FEAT, 2))
        if fault == "caught_then" and rank == 0 and step == 1:
            try:
                ratio = 1 / (len(ids) - 4)
            except ZeroDivisionError:
                log.exception("nest ratio for step %d failed; using 0.0", step)
                ratio = 0.0
        if fault == "caught_then" and mine and step == 4:
            torch.load(os.path.join(WORK, f"shard_{rank}_extra.pt"))
        if fault == "log_rank" and mine and step == 3:
            torch.load(os.path.join(WORK, f"canopy_{rank}.pt"))
        if fault == "two_ranks" and step == 2:
            if mine:
                raise ValueError(f"rank {rank}: canopy height {x[0, 0].item():.3f} below survey floor")
            if rank == (frank + 1) % world:
                time.sleep(1)
                raise KeyError(f"stand-{rank}-plot-missing")
        if fault == "warn_storm":
            warnings.warn(f"rank {rank} step {step}: nest survey rows with no canopy cover", UserWarning)
            if mine and step == 3:
                raise RuntimeError(f"rank {rank}: survey transect overlaps a previous one")
        if fault == "tqdm_bar" and mine and step == 3:
            raise ValueError(f"rank {rank}: negative nest count in batch {step}")
        if fault == "restart_ok" and mine and step == 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise RuntimeError(f"rank {rank}: transient stand-map read failure")
        if fault == "long_msg" and mine and step == 2:
            raise ValueError(f"rank {rank}: nest features out of range:\n{x}\nsummary: " + repr({"ids": ids, "step": step, "y": y.flatten().tolist()}))
        if fault == "sys_exit" and mine and step == 3:
            sys.exit(f"rank {rank}: nest survey quota reached, stopping")
        if fault == "sigint" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
        if fault == "segv" and mine and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        pred = model(x, stand)
        loss = torch.nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        succ = (pred > 0.5).float().mean().item()
        if fault == "log_rank" and mine:
            log.info("rank %d step %d loss %.4f nest_success %.3f", rank, step, loss.item(), succ)
        else:
            print(f"rank {rank} step {step} loss {loss.item():.4f} nest_success {succ:.3f}", flush=True)

    if fault == "save_fail" and mine:
        torch.save(model.state_dict(), os.path.join(WORK, "eval_exports", "missing", f"eval_{rank}.pt"))
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export.pt"))
        print("rank 0 saved export", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
