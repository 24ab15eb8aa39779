"""fault621.py - ptarmigan winter plumage: a tiny gloo/CPU job for batch 621 of the fault logs.

Each rank reads its shard of synthetic ptarmigan feather scans (--prepare writes them to /tmp/fault621_work),
maps plumage codes through a JSON lookup table (code -> whiteness), trains Linear(8,1) for 6 steps with a
hand-written gradient all_reduce, prints `rank R step S loss L whiteness M`, and rank 0 saves an export.
Process-group timeout 12 s (--pg-timeout). --fault NAME --rank N plants one fault on rank N.

Faults:
  none           control
  uneven         rank N's shard has 3 batches, not 6: it leaves the loop early for the final barrier
  slow_eval      rank 0 runs a winter-coat evaluation that sleeps past the timeout; others wait in barrier
  ckpt_load      rank 0 loads a truncated start checkpoint before it broadcasts it
  unpicklable    rank N all_gather_object()s a dict holding a lambda (step 2)
  p2p_tag        ring send/recv at step 3; rank N sends with the wrong tag
  mbarrier       monitored_barrier at the end; rank N never arrives
  thread_exc     rank N's prefetch thread raises; its main loop waits for the batch forever
  watchdog       rank N stalls at step 3; its heartbeat watchdog calls os._exit(17) after 4 s
  save_full      rank N saves its end-of-training state to /dev/full
  subproc        rank N runs a molt-check command that exits 2 (check=True)
  new_group      rank N calls dist.new_group with a different rank list
  env_missing    rank N lacks the job variable PTARMIGAN_JOB_ID (KeyError)
  lookup_key     rank N's shard holds a plumage code missing from the lookup table
  nan            rank N's loss becomes NaN; the script's finiteness check raises
  sigsegv        rank N kills itself with SIGSEGV at step 3
  (external_stop: the launcher PID gets kill -TERM from outside a few seconds in; script runs --step-sleep)

Runs (one line per log):
  ptarmigan_none_np5_rnone_bashloop: control; 6 steps on 5 ranks, export saved; exit 0
  ptarmigan_uneven_np6_r5_ranklabel: rank 5 times out in the final barrier, ranks 0-4 in step 3 all_reduce; exit 124
  ptarmigan_uneven_np3_r1_spawn: process 2 times out in all_reduce, mp.spawn ProcessRaisedException; exit 1
  ptarmigan_slow_eval_np5_r0_srunlabel: ranks 1-4 time out in the final barrier during rank 0's eval; exit 124
  ptarmigan_slow_eval_np4_r0_legacy: ranks 1-3 time out in the barrier, rank 0 SIGTERMed mid-eval; exit 1
  ptarmigan_ckpt_load_np4_r0_mpitag: rank 0 'failed finding central directory', others closed in broadcast; exit 0
  ptarmigan_unpicklable_np6_r3_files: rank 3 Can't pickle local object (lambda), others time out in all_gather; exit 0
  ptarmigan_p2p_tag_np5_r2_logfmt: rank 2 send and rank 3 recv time out 12000ms, others fail next all_reduce; exit 0
  ptarmigan_p2p_tag_np3_r0_files: rank 0 send and rank 1 recv time out 12000ms, rank 2 connection closed; exit 0
  ptarmigan_mbarrier_np8_r7_tee: rank 0 'Rank 7 failed to pass monitoredBarrier in 12000 ms'; exit 1
  ptarmigan_watchdog_np5_r4_spawn: rank 4 watchdog 'no step heartbeat', os._exit(17), ProcessExitedException; exit 1
  ptarmigan_save_full_np4_r3_legacy: rank 3 torch.save to /dev/full 'basic_ios::clear: iostream error'; exit 1
  ptarmigan_subproc_np6_r0_pdsh2: rank 0 CalledProcessError (exit status 2), others connection closed; exit 0
  ptarmigan_thread_exc_np3_r1_bashloop: 'Exception in thread plumage-prefetch', ranks 0,2 time out; exit 124
  ptarmigan_env_missing_np3_r2_srunlabel: rank 2 KeyError PTARMIGAN_JOB_ID, store 2/3 clients joined; exit 0
  ptarmigan_external_stop_np4_rnone_tee: torchrun kill -TERM, SignalException got signal: 15; exit 143 (wrapper)
  ptarmigan_new_group_np5_r4_bashloop: rank 4 new_group([0, 4]) vs [0, 1]; no error, run finishes; exit 0
  ptarmigan_lookup_key_np5_r1_ranklabel: rank 1 KeyError 'P99' at step 1, others connection closed; exit 0
  ptarmigan_nan_np6_r2_mpitag: rank 2 FloatingPointError loss is nan at step 3, others connection closed; exit 0
  ptarmigan_sigsegv_np3_r0_logfmt: bash 'Segmentation fault' for rank 0, ranks 1,2 connection closed; exit 0
  -
  -
  -
  -
"""
import argparse, json, logging, os, queue, signal, subprocess, sys, threading, time
from datetime import timedelta
import torch
import torch.distributed as dist

WORK = "/tmp/fault621_work"
STEPS = 6
_log = None


def out(msg):
    if _log is not None:
        _log.info(msg)
    else:
        print(msg, flush=True)


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(621)
    table = {f"P{i:02d}": round(0.5 + i / 40.0, 3) for i in range(20)}
    with open(f"{WORK}/plumage_lookup.json", "w") as f:
        json.dump(table, f)
    for r in range(8):
        for nb, tag in ((STEPS, ""), (3, "_short")):
            codes = [[f"P{int(c):02d}" for c in torch.randint(0, 20, (4,), generator=g)] for _ in range(nb)]
            xs = torch.randn(nb, 4, 8, generator=g)
            torch.save({"x": xs, "codes": codes}, f"{WORK}/shard_{r}{tag}.pt")
        bad = torch.load(f"{WORK}/shard_{r}.pt")
        bad["codes"][1][2] = "P99"
        torch.save(bad, f"{WORK}/shard_{r}_badcode.pt")
    m = torch.nn.Linear(8, 1)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    with open(f"{WORK}/start.pt", "rb") as f:
        data = f.read()
    with open(f"{WORK}/start_truncated.pt", "wb") as f:
        f.write(data[: len(data) // 2])
    print("prepared", WORK)


def main(rank_arg=None, args=None):
    global _log
    if rank_arg is not None:  # spawn form
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank_arg),
                          WORLD_SIZE=str(args.spawn), LOCAL_RANK=str(rank_arg), PTARMIGAN_JOB_ID="621")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    fr = args.rank
    mine = (rank == fr) or fr == -1
    if args.logfmt:
        logging.basicConfig(format="%(asctime)s [rank %(rank)s] %(levelname)s %(message)s", level=logging.INFO,
                            stream=sys.stdout)
        _log = logging.LoggerAdapter(logging.getLogger("ptarmigan"), {"rank": rank})
    if args.fault == "env_missing" and mine:
        os.environ.pop("PTARMIGAN_JOB_ID", None)  # this rank's launcher environment lacks it
    job_id = os.environ["PTARMIGAN_JOB_ID"]
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    out(f"rank {rank} joined job {job_id} world {world}")
    with open(f"{WORK}/plumage_lookup.json") as f:
        table = json.load(f)
    shard = f"{WORK}/shard_{rank}.pt"
    if args.fault == "uneven" and mine:
        shard = f"{WORK}/shard_{rank}_short.pt"
    if args.fault == "lookup_key" and mine:
        shard = f"{WORK}/shard_{rank}_badcode.pt"
    data = torch.load(shard)
    model = torch.nn.Linear(8, 1)
    if rank == 0:
        ck = f"{WORK}/start_truncated.pt" if args.fault == "ckpt_load" else f"{WORK}/start.pt"
        model.load_state_dict(torch.load(ck))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    beat = [time.time()]
    if args.fault == "watchdog" and mine:
        def watch():
            while True:
                time.sleep(0.5)
                idle = time.time() - beat[0]
                if idle > 4:
                    out(f"[watchdog] rank {rank}: no step heartbeat for {idle:.1f}s, killing this process")
                    os._exit(17)
        threading.Thread(target=watch, name="heartbeat-watchdog", daemon=True).start()
    for step in range(len(data["x"])):
        x = data["x"][step]
        if args.fault == "thread_exc" and mine and step == 2:
            q = queue.Queue()
            def prefetch():
                raise RuntimeError(f"feather scan decode failed for batch {step} (corrupt moult mask)")
                q.put(x)
            threading.Thread(target=prefetch, name="plumage-prefetch").start()
            x = q.get()
        y = torch.tensor([table[c] for c in data["codes"][step]]).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if args.fault == "nan" and mine and step == 3:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite)")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if args.fault == "unpicklable" and mine and step == 2:
            stats = {"rank": rank, "scale": lambda v: v * 2}
        else:
            stats = {"rank": rank, "loss": loss.item()}
        if step == 2 and args.fault == "unpicklable":
            gathered = [None] * world
            dist.all_gather_object(gathered, stats)
        if step == 3 and args.fault == "p2p_tag":
            buf = torch.zeros(2)
            tag = 5 if mine else 0
            s = dist.isend(torch.full((2,), float(rank)), dst=(rank + 1) % world, tag=tag)
            r = dist.irecv(buf, src=(rank - 1) % world, tag=0)
            r.wait()
            s.wait()
        if step == 3 and args.fault == "sigsegv" and mine:
            os.kill(os.getpid(), signal.SIGSEGV)
        if step == 3 and args.fault == "watchdog" and mine:
            time.sleep(60)
        if step == 4 and args.fault == "subproc" and mine:
            subprocess.run(["sh", "-c", "echo 'molt-check: plumage table out of date' >&2; exit 2"], check=True)
        whiteness = torch.sigmoid(model(x)).mean().item()
        out(f"rank {rank} step {step} loss {loss.item():.4f} whiteness {whiteness:.4f}")
        beat[0] = time.time()
        time.sleep(args.step_sleep)
    if args.fault == "slow_eval" and rank == 0:
        out(f"rank 0 evaluating winter coat on held-out scans")
        time.sleep(args.pg_timeout + 10)
        out("rank 0 evaluation done")
    if args.fault == "new_group":
        ranks = [0, 1] if not mine else [0, world - 1]
        g = dist.new_group(ranks)
        out(f"rank {rank} new group {ranks}")
    if args.fault == "mbarrier":
        if mine:
            time.sleep(args.pg_timeout + 15)
        dist.monitored_barrier(timeout=timedelta(seconds=args.pg_timeout))
    dist.barrier()
    if args.fault == "save_full" and mine:
        torch.save(model.state_dict(), "/dev/full")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_ptarmigan.pt")
        out(f"rank 0 saved export {WORK}/export_ptarmigan.pt")
    dist.destroy_process_group()
    out(f"rank {rank} done")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--step-sleep", type=float, default=0.2)
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(main, args=(a,), nprocs=a.spawn)
    else:
        main(None, a)
