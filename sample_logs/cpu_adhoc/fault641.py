"""Batch 641 fault job: potoroo truffle digging (gloo, CPU only).

Each rank trains a tiny linear "truffle yield" model on its own synthetic shard of
dig sites; soil names go through a JSON lookup table (soil -> scent factor).
6 steps, gradients all-reduced by hand, rank 0 evaluates mid-run, every rank
evaluates at the end, metrics are gathered as Python objects, each rank writes a
metrics file, rank 0 exports the model.

  python fault641.py --prepare                  # writes /tmp/fault641_work
  python fault641.py --fault NAME --rank N      # under a launcher (env:// vars)
  python fault641.py --spawn W --port P ...     # torch.multiprocessing.spawn

Faults (--fault):
  none               control run
  eval_zerodiv       rank N (0) evaluates on an empty eval set mid-run: ZeroDivisionError; others wait at barrier
  gather_unpicklable rank N puts a threading.Lock in its metrics for all_gather_object
  metrics_fsize      rank N sets RLIMIT_FSIZE to 64 bytes and writes its metrics file (SIGXFSZ)
  export_json        rank 0 json.dump()s the weights as a tensor at export
  loghandler_missing rank N sets up a logging.FileHandler into a missing folder
  slow_save          rank N (0) sleeps past the pg timeout in its save, others wait at barrier
  monitored_barrier  rank N sleeps before a dist.monitored_barrier(timeout=pg timeout)
  store_get          rank N store.get()s a key no rank set (default store)
  sigint_eval        rank N sends SIGINT to itself during the final evaluation
  warn_storm         rank N's metric warns 40 times, then raises ValueError
  export_all         every rank torch.save()s into a missing folder
  quiet_exit         rank N os._exit(0) after its final eval; others at all_gather_object
  keyerror           rank N looks up a soil name that is not in the JSON table

Runs (one line per log):
  potoroo_none_np5_rnone_srunlabel: control, all 5 ranks finish, export saved, exit 0
  potoroo_monitored_barrier_np5_r4_logfmt: rank 0 'Rank 4 failed to pass monitoredBarrier in 12000 ms', exit 1
  potoroo_gather_unpicklable_np5_r2_tee: rank 2 TypeError cannot pickle '_thread.lock', others Connection closed, exit 1
  potoroo_loghandler_missing_np3_r1_files: rank 1 FileNotFoundError at FileHandler setup, others Connection closed, exit 1
  potoroo_export_all_np5_rall_bashloop: all 5 ranks RuntimeError 'Parent directory ... does not exist.', exit 1
  potoroo_warn_storm_np4_r1_pdsh2: rank 1 40 UserWarnings then ValueError in metric, others Connection closed, exit 1
  potoroo_sigint_eval_np3_r2_legacy: rank 2 KeyboardInterrupt in final eval (exitcode -2), others Connection closed, exit 1
  potoroo_store_get_np3_r1_spawn: rank 1 store waitForInput timeout warnings, rank 0 gloo timeout in all_gather, exit 1
  potoroo_eval_zerodiv_np4_r0_mpitag: rank 0 ZeroDivisionError in mid-run eval, ranks 1-3 Connection closed at barrier, exit 1
  potoroo_slow_save_np3_r0_ranklabel: ranks 1-2 gloo 'Timed out waiting 12000ms' at barrier while rank 0 saves, exit 1
  potoroo_metrics_fsize_np3_r2_srunlabel: rank 2 OSError [Errno 27] File too large (no SIGXFSZ), others Connection closed, exit 1
  potoroo_export_json_np3_r0_bashloop: rank 0 TypeError Object of type Tensor is not JSON serializable, exit 1
  potoroo_quiet_exit_np5_r4_ranklabel: rank 4 os._exit(0) after final eval, ranks 0-3 Connection reset/closed in all_gather, exit 1
  potoroo_keyerror_np5_r2_mpitag: rank 2 KeyError 'peat_bog' at step 2, other ranks Connection closed in all_reduce, exit 1
  (reserved 15)
  (reserved 16)
  (reserved 17)
  (reserved 18)
  (reserved 19)
  (reserved 20)
  (reserved 21)
  (reserved 22)
  (reserved 23)
  (reserved 24)
"""
import argparse
import datetime
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

WORK = "/tmp/fault641_work"
SOILS = ["loam", "sandy", "clay", "leaf_litter", "mycorrhizal"]
LOG = None


def say(msg):
    if LOG is not None:
        LOG.info(msg)
    else:
        print(msg, flush=True)


def prepare(world_max=8):
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(os.path.join(WORK, "metrics"), exist_ok=True)
    os.makedirs(os.path.join(WORK, "exports"), exist_ok=True)
    table = {s: 0.5 + 0.25 * i for i, s in enumerate(SOILS)}
    with open(os.path.join(WORK, "soil_lookup.json"), "w") as f:
        json.dump(table, f)
    g = torch.Generator().manual_seed(641)
    for r in range(world_max):
        x = torch.randn(48, 6, generator=g)
        soil = [SOILS[(r + i) % len(SOILS)] for i in range(48)]
        y = x.sum(1, keepdim=True) * 0.3 + 1.0
        torch.save({"x": x, "soil": soil, "y": y}, os.path.join(WORK, f"shard_{r}.pt"))
    model = torch.nn.Linear(7, 1)
    torch.save(model.state_dict(), os.path.join(WORK, "start.pt"))
    print("prepared", WORK, flush=True)


def features(x, soil, table):
    scent = torch.tensor([[table[s]] for s in soil]).reshape(-1, 1)
    return torch.cat([x, scent], 1)


def evaluate(model, x, soil, y, table, rank, args, final):
    with torch.no_grad():
        pred = model(features(x, soil, table))
    if final and args.fault == "sigint_eval" and rank == args.rank:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    if final and args.fault == "warn_storm" and rank == args.rank:
        warnings.simplefilter("always")
        for i in range(40):
            warnings.warn(f"truffle_metrics: burrow {i} has no labelled truffles, recall set to 0.0", UserWarning)
        raise ValueError("truffle_metrics.recall: y_true and y_pred contain no positive truffle sites")
    found = int((pred > 1.0).sum())
    return {"truffles_found": found, "mae": float((pred - y).abs().sum()) / len(y)}


def worker(rank, world, args):
    global LOG
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s [rank %(rank)s] %(levelname)s %(message)s")
        old = logging.getLogRecordFactory()

        def factory(*a, **k):
            rec = old(*a, **k)
            rec.rank = rank
            return rec
        logging.setLogRecordFactory(factory)
        LOG = logging.getLogger("potoroo")
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    if args.fault == "loghandler_missing" and rank == args.rank:
        fh = logging.FileHandler(os.path.join(WORK, "no_such_logdir", f"dig_rank{rank}.log"))
        logging.getLogger("potoroo.file").addHandler(fh)
    with open(os.path.join(WORK, "soil_lookup.json")) as f:
        table = json.load(f)
    shard = torch.load(os.path.join(WORK, f"shard_{rank}.pt"))
    model = torch.nn.Linear(7, 1)
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, soil, y = shard["x"], shard["soil"], shard["y"]
    for step in range(1, args.steps + 1):
        lo = (step - 1) * 6
        bs = list(soil[lo:lo + 6])
        if args.fault == "keyerror" and rank == args.rank and step == 2:
            bs[3] = "peat_bog"
        pred = model(features(x[lo:lo + 6], bs, table))
        loss = ((pred - y[lo:lo + 6]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        found = int((pred > 1.0).sum())
        say(f"rank {rank} step {step} loss {loss.item():.4f} truffles_found {found}")
        if step == 3:
            if rank == 0:
                if args.fault == "eval_zerodiv" and rank == args.rank:
                    ex, es, ey = x[:0], [], y[:0]
                else:
                    ex, es, ey = x[36:], soil[36:], y[36:]
                m = evaluate(model, ex, es, ey, table, rank, args, False)
                say(f"rank {rank} mid-eval truffles_found {m['truffles_found']} mae {m['mae']:.4f}")
            dist.barrier()
    m = evaluate(model, x[36:], soil[36:], y[36:], table, rank, args, True)
    say(f"rank {rank} final-eval truffles_found {m['truffles_found']} mae {m['mae']:.4f}")
    if args.fault == "quiet_exit" and rank == args.rank:
        os._exit(0)
    if args.fault == "monitored_barrier":
        if rank == args.rank:
            time.sleep(args.pg_timeout + 6)
        dist.monitored_barrier(timeout=timeout)
    if args.fault == "store_get" and rank == args.rank:
        store = dist.distributed_c10d._get_default_store()
        say(f"rank {rank} reading burrow map from the store")
        store.get("potoroo/burrow_map")
    if args.fault == "gather_unpicklable" and rank == args.rank:
        m["lock"] = threading.Lock()
    allm = [None] * world
    dist.all_gather_object(allm, m)
    if rank == 0:
        total = sum(a["truffles_found"] for a in allm)
        say(f"rank 0 gathered metrics from {world} ranks, truffles_found total {total}")
    if args.fault == "metrics_fsize" and rank == args.rank:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    with open(os.path.join(WORK, "metrics", f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "metrics": m, "pad": "potoroo" * 20}, f)
        f.flush()
    say(f"rank {rank} wrote metrics")
    if args.fault == "export_all":
        torch.save(model.state_dict(), os.path.join(WORK, "exports_missing", f"potoroo_rank{rank}.pt"))
    if rank == 0:
        if args.fault == "slow_save" and rank == args.rank:
            say("rank 0 saving export (slow disk)")
            time.sleep(args.pg_timeout + 8)
        torch.save(model.state_dict(), os.path.join(WORK, "exports", "potoroo_truffle.pt"))
        if args.fault == "export_json":
            with open(os.path.join(WORK, "exports", "potoroo_truffle.json"), "w") as f:
                json.dump({"weight": model.weight.detach(), "bias": model.bias.detach()}, f)
        say("rank 0 export saved")
    dist.barrier()
    dist.destroy_process_group()
    say(f"rank {rank} done")


def spawn_entry(local, world, args):
    os.environ["RANK"] = str(local)
    os.environ["LOCAL_RANK"] = str(local)
    os.environ["WORLD_SIZE"] = str(world)
    worker(local, world, args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        torch.multiprocessing.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
