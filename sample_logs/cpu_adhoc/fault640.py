"""fault640.py: gharial river basking, a tiny multi-rank CPU job (gloo) for batch 640.

Each rank reads its shard of river-bank sightings, looks every sighting's bank up in a JSON table of
basking temperatures, and fits a small model of basking minutes; gradients are all-reduced by hand
(no DDP). 6 steps; every rank prints `rank R step S loss L basking_minutes M`. After step 3 every rank
runs the side work (an evaluation, a metrics file, an object exchange); rank 0 exports at the end.

  python fault640.py --prepare              # writes /tmp/fault640_work (shards, table, start checkpoint)
  torchrun ... fault640.py --fault NAME --rank N [--pg-timeout 12]

Faults (--rank N picks the rank; -1 = every rank):
  none               control
  eval_zerodiv       rank N's eval set is empty; its mean metric divides by zero (others go to the barrier)
  pickle_lock        rank N puts a threading.Lock in its stats for dist.all_gather_object
  metrics_fsize      rank N sets RLIMIT_FSIZE to 256 bytes, then writes its metrics file (File too large)
  log_handler        rank N adds a logging.FileHandler into a folder that does not exist, at set-up
  export_json        rank 0's export json.dump()s a tensor
  export_rall        every rank torch.save()s its export into a missing folder
  slow_save          rank N leaves the loop for a slow save (sleeps past the timeout); others wait at barrier
  monitored_barrier  rank N arrives late at dist.monitored_barrier(timeout=5 s)
  store_get          rank N store.get()s a key no rank set (store timeout 5 s)
  sigint_eval        rank N sends SIGINT to itself during its evaluation
  warn_storm         rank N's metrics raise a storm of numpy RuntimeWarnings, then a ValueError
  quiet_exit         rank N os._exit(0)s after its eval; the others go on to the next all_reduce
  lookup_key         rank N's lookup table lacks one bank (KeyError)

Runs (one line per kept log):
  gharial_lookup_key_np8_r7_tee: rank 7 KeyError 'bank5' before step 0; others SIGTERMed; exit 1
  gharial_eval_zerodiv_np6_r0_plain: rank 0 ZeroDivisionError in eval; ranks 1,2,4,5 gloo closed in barrier; exit 1
  gharial_quiet_exit_np6_r3_pdsh2: rank 3 silent os._exit(0); ranks 1,2,4,5 gloo reset/closed; script exit 0 (sed status)
  gharial_pickle_lock_np5_r2_tee_trainer: rank 2 TypeError cannot pickle '_thread.lock'; ranks 1,3 gloo closed; exit 1
  gharial_monitored_barrier_np5_r4_prefix: rank 0: Rank 4 failed to pass monitoredBarrier in 5000 ms; exit 1
  gharial_export_json_np5_r0_loglevel: rank 0 TypeError Tensor not JSON serializable in export; exit 1
  gharial_store_get_np5_r1_filter: rank 1 DistStoreError wait timeout 5000ms; rank 0 gloo closed; exit 1
  gharial_metrics_fsize_np4_r3_redirects: rank 3 OSError [Errno 27] File too large (rank files); exit 1
  gharial_warn_storm_np4_r1_detail: numpy warning storm, rank 1 ValueError percentiles; DETAIL names rank 1; exit 1
  gharial_sigint_eval_np5_r4_wrapper: rank 4 KeyboardInterrupt, exitcode -2 (SIGINT); no done line; exit 1
  gharial_log_handler_np3_r2_pymodule: rank 2 FileNotFoundError from FileHandler before init; exit 1
  gharial_export_rall_np3_rall_restart: all ranks RuntimeError parent dir missing; restart: connectFullMesh timeout; exit 1
  gharial_slow_save_np4_r0_plain: rank 0 slow save; ranks 1-3 gloo Timed out 12000ms in barrier; exit 1
  gharial_none_np4_rnone_tee: control: 6 steps, export done; exit 0
  gharial_monitored_barrier_np3_r1_detail: rank 0: Rank 1 failed to pass monitoredBarrier in 5000 ms; exit 1
  gharial_sigint_eval_np3_r1_loglevel: rank 1 KeyboardInterrupt, exitcode -2 (SIGINT); exit 1
  gharial_pickle_lock_np3_r0_plain: rank 0 TypeError cannot pickle '_thread.lock'; ranks 1,2 gloo closed; exit 1
  gharial_quiet_exit_np4_r2_plain: rank 2 silent os._exit(0); ranks 0,1,3 gloo reset/closed; exit 1
  gharial_eval_zerodiv_np3_r0_tee: rank 0 ZeroDivisionError in eval; ranks 1,2 gloo closed in barrier; exit 1
  gharial_warn_storm_np5_r0_tee: numpy warning storm, rank 0 ValueError percentiles; ranks 1,4 gloo closed; exit 1
  -
  -
"""
import argparse
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

WORK = "/tmp/fault640_work"
BANKS = [f"bank{i}" for i in range(8)]


def make_model():
    torch.manual_seed(640)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(640)
    table = {b: round(26.0 + 0.7 * i, 2) for i, b in enumerate(BANKS)}
    with open(f"{WORK}/basking_temps.json", "w") as f:
        json.dump(table, f)
    for r in range(8):
        x = torch.randn(40, 6, generator=g)
        sites = [BANKS[(r + i) % 8] for i in range(40)]
        torch.save({"x": x, "site": sites}, f"{WORK}/shard_{r}.pt")
    torch.save(make_model().state_dict(), f"{WORK}/start.pt")
    print(f"prepared {WORK}")


def evaluate(rank, model, x, y, sites, fault, mine):
    # evaluation on the sightings from the shaded banks
    keep = [i for i, s in enumerate(sites) if s in ("bank0", "bank1", "bank2")]
    if fault == "eval_zerodiv" and mine:
        keep = []  # this rank's eval set came out empty
    if fault == "sigint_eval" and mine:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    err = 0.0
    with torch.no_grad():
        for i in keep:
            err += float((model(x[i:i + 1]).squeeze() - y[i]) ** 2)
    mean_err = err / len(keep)
    return {"rank": rank, "eval_mse": mean_err, "n": len(keep)}


def metrics_summary(rank, values, fault, mine):
    arr = np.asarray(values, dtype=np.float64)
    if fault == "warn_storm" and mine:
        warnings.simplefilter("always")
        for b in range(24):
            np.mean(arr[arr > 1e9 + b])  # empty slice: numpy's RuntimeWarning each time
        q = 150.0
    else:
        q = 90.0
    return {"p": float(np.percentile(arr, q)), "mean": float(np.mean(arr))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    fault = a.fault
    mine = a.rank == -1 or a.rank == rank

    log = logging.getLogger("gharial")
    log.setLevel(logging.INFO)
    if fault == "log_handler" and mine:
        log.addHandler(logging.FileHandler(f"{WORK}/river_logs/rank{rank}.log"))

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))

    with open(f"{WORK}/basking_temps.json") as f:
        table = json.load(f)
    if fault == "lookup_key" and mine:
        del table["bank5"]
    shard = torch.load(f"{WORK}/shard_{rank}.pt")
    x, sites = shard["x"], shard["site"]
    temp = torch.tensor([table[s] for s in sites])
    y = x.sum(1) * 0.1 + (temp - 26.0) * 0.5

    model = make_model()
    model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    history = []
    for step in range(a.steps):
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        with torch.no_grad():
            bask = float(model(x).abs().mean() * 60.0)
        history.append(bask)
        print(f"rank {rank} step {step} loss {loss.item():.4f} basking_minutes {bask:.2f}", flush=True)

        if step == 3:
            ev = evaluate(rank, model, x, y, sites, fault, mine)
            if fault == "quiet_exit" and mine:
                os._exit(0)
            if fault == "eval_zerodiv":
                dist.barrier()
            stats = dict(ev, **metrics_summary(rank, history, fault, mine))
            if fault == "metrics_fsize" and mine:
                resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))
            with open(f"{WORK}/metrics_rank{rank}.json", "w") as f:
                json.dump(dict(stats, history=history * 20), f)
            if fault == "pickle_lock" and mine:
                stats["guard"] = threading.Lock()
            gathered = [None] * world
            dist.all_gather_object(gathered, stats)
            if fault == "store_get" and mine:
                store = dist.distributed_c10d._get_default_store()
                store.set_timeout(timedelta(seconds=5))
                store.get("gharial_eval_done")
            if fault == "monitored_barrier":
                if mine:
                    time.sleep(9)
                dist.monitored_barrier(timeout=timedelta(seconds=5))
            if rank == 0:
                print(f"rank 0 eval mse {sum(g['eval_mse'] for g in gathered) / world:.4f}", flush=True)

    if fault == "slow_save" and mine:
        print(f"rank {rank} saving basking model (slow)", flush=True)
        time.sleep(a.pg_timeout + 10)
    dist.barrier()
    state = model.state_dict()
    if fault == "export_rall":
        torch.save(state, f"{WORK}/no_export_dir/gharial_rank{rank}.pt")
    if rank == 0:
        torch.save(state, f"{WORK}/export/gharial_model.pt")
        summary = {"basking_minutes": history[-1], "steps": a.steps}
        if fault == "export_json":
            summary["final_weight"] = state["2.weight"]
        with open(f"{WORK}/export/gharial_summary.json", "w") as f:
            json.dump(summary, f)
        print("rank 0 export done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
