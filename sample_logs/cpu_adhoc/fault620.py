"""fault620.py - numbat termite foraging: a tiny multi-rank CPU training job with planted faults.

Each rank reads its shard of synthetic numbat foraging bouts (mound features -> termites eaten), passes
each bout's mound type through a JSON lookup table (mound -> richness weight), fits a linear model with a
hand-written gradient all_reduce (gloo, CPU), and prints `rank R step S loss L termites_per_min M`.
Rank 0 loads the start checkpoint and broadcasts it; rank 0 saves an export at the end.
`--prepare` writes the shards, the lookup table and the start checkpoint into /tmp/fault620_work.

Faults (--fault NAME --rank N):
  none        control run, no fault
  uneven      rank N's shard (shard_short.pt) has 3 batches: it leaves the loop early for the final barrier
  slowexport  rank 0 alone runs a slow export (sleeps pg_timeout+10 s) while the others wait in a barrier
  ckptload    rank 0 loads a truncated start checkpoint before broadcasting it (others wait in broadcast)
  pickle      rank N puts a lambda into all_gather_object (cannot be pickled)
  p2ptag      rank N sends its trail tensor with the wrong tag in the step-2 ring exchange; a recv waits
  monbarrier  rank N sleeps before dist.monitored_barrier(timeout=6 s) and never arrives in time
  thread      rank N's prefetch thread raises; its main loop waits on the queue the thread should fill
  watchdog    rank N stalls at step 3; its heartbeat watchdog kills the process (os._exit(N), SIGKILL on rank 0)
  savefull    rank N writes its end-of-training state with torch.save to /dev/full (No space left on device)
  subprocess  rank N runs its mound-census helper, which exits 2 (subprocess.run check=True)
  envmissing  the job reads NUMBAT_SITE_<rank>; the launcher exported it for every rank but N (KeyError)
  newgroup    rank N alone calls dist.new_group([0, N]) at start-up
  keyerror    rank N's shard names a mound type the lookup table lacks (KeyError)
  extstop     every step sleeps 2 s; the launcher is stopped from outside with kill -TERM (no fault in here)

Runs (one line per kept log):
  numbat_none_np3_rnone_plain: none: all 3 ranks finish 6 steps, export saved, exit 0
  numbat_keyerror_np8_r7_plain: keyerror r7: KeyError 'spinifex_mound' at step 2, others connection closed, exit 1
  numbat_watchdog_np8_r6_loglevel: watchdog r6: watchdog line, os._exit(6), agent reports exitcode 6, exit 1
  numbat_slowexport_np6_r0_prefix: slowexport r0: ranks 1-5 time out (12000ms) in dist.barrier, rank 0 silent, exit 1
  numbat_monbarrier_np6_r5_tee_trainer: monbarrier r5: rank 0 'Rank 5 failed to pass monitoredBarrier in 6000 ms', exit 1
  numbat_envmissing_np6_r4_pdsh2: envmissing r4: KeyError 'NUMBAT_SITE_4' on worker-1, both agents fail, shell exit 0
  numbat_uneven_np6_r2_redirects: uneven r2: rank 2 times out in barrier, others in all_reduce (rank files), exit 1
  numbat_uneven_np5_r4_tee: uneven r4: rank 4 stops after step 2, all 5 ranks time out after 12 s, exit 1
  numbat_pickle_np5_r2_detail: pickle r2: AttributeError can't pickle lambda; DETAIL names rank 2 at rank 0, exit 1
  numbat_thread_np5_r1_filter: thread r1: 'Exception in thread numbat-prefetch-1', rank 0 times out, exit 1
  numbat_savefull_np5_r4_plain: savefull r4: torch.save to /dev/full -> RuntimeError iostream error, exit 1
  numbat_ckptload_np4_r0_loglevel: ckptload r0: PytorchStreamReader central directory error, others fail in broadcast
  numbat_p2ptag_np4_r3_pymodule: p2ptag r3: rank 0 recv and rank 3 send time out, ranks 1-2 in all_reduce, exit 1
  numbat_subprocess_np4_r1_wrapper: subprocess r1: CalledProcessError exit status 2, others fail in broadcast, exit 1
  numbat_extstop_np4_rall_tee: extstop: launcher kill -TERM before step 0 printed, SignalException 15, exit 1
  numbat_newgroup_np3_r1_restart: newgroup r1: 0/2 time out in broadcast; restart: connectFullMesh fails, exit 1
  numbat_savefull_np3_r2_wrapper: savefull r2: /dev/full save RuntimeError, others connection closed, exit 1
  numbat_slowexport_np3_r0_pymodule: slowexport r0: ranks 1-2 time out in dist.barrier during rank 0's export, exit 1
  numbat_watchdog_np4_r0_prefix: watchdog r0: watchdog line then SIGKILL, agent reports exitcode -9, exit 1
  numbat_p2ptag_np5_r0_detail: p2ptag r0: rank 1 recv / rank 0 send time out, DETAIL errors on 2-4, exit 1
  numbat_extstop_np5_rall_plain: extstop: kill -INT at step 3, KeyboardInterrupt on all ranks, SignalException 2
  (spare line)
"""
import argparse
import datetime
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

WORK = "/tmp/fault620_work"
MOUNDS = ["red_mound", "sand_mound", "log_nest", "grass_mound"]
STEPS = 6


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(620)
    for r in range(8):
        bouts = []
        for s in range(STEPS):
            bouts.append({"x": torch.randn(16, 4, generator=g), "y": torch.randn(16, 1, generator=g),
                          "mound": MOUNDS[(r + s) % len(MOUNDS)]})
        torch.save(bouts, f"{WORK}/shard_{r}.pt")
    torch.save(bouts[:3], f"{WORK}/shard_short.pt")
    bad = [dict(b) for b in bouts]
    bad[2]["mound"] = "spinifex_mound"
    torch.save(bad, f"{WORK}/shard_badmound.pt")
    with open(f"{WORK}/mound_lookup.json", "w") as f:
        json.dump({m: 0.5 + 0.25 * i for i, m in enumerate(MOUNDS)}, f)
    model = torch.nn.Linear(4, 1)
    torch.save(model.state_dict(), f"{WORK}/start.pt")
    with open(f"{WORK}/start.pt", "rb") as f:
        data = f.read()
    with open(f"{WORK}/start_truncated.pt", "wb") as f:
        f.write(data[: len(data) // 2])
    print(f"prepared {WORK}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    fault, frank = args.fault, args.rank
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    hit = fault != "none" and (frank == rank or frank < 0)

    site = os.environ["NUMBAT_SITE_%d" % rank] if fault == "envmissing" else "default"
    if hit and fault == "subprocess":
        subprocess.run(["sh", "-c", "echo 'mound census: transect %s unreadable' >&2; exit 2" % rank], check=True)
    if hit and fault == "newgroup":
        dist.new_group(ranks=[0, rank])

    model = torch.nn.Linear(4, 1)
    if rank == 0:
        path = f"{WORK}/start_truncated.pt" if hit and fault == "ckptload" else f"{WORK}/start.pt"
        model.load_state_dict(torch.load(path))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

    meta = {"rank": rank, "site": site, "forager": "numbat"}
    if hit and fault == "pickle":
        meta["score_fn"] = lambda n: n * 2
    gathered = [None] * world
    dist.all_gather_object(gathered, meta)

    with open(f"{WORK}/mound_lookup.json") as f:
        lookup = json.load(f)
    shard = f"{WORK}/shard_{rank}.pt"
    if hit and fault == "uneven":
        shard = f"{WORK}/shard_short.pt"
    if hit and fault == "keyerror":
        shard = f"{WORK}/shard_badmound.pt"
    bouts = torch.load(shard)

    q = queue.Queue()

    def prefetch():
        for i, b in enumerate(bouts):
            if hit and fault == "thread" and i == 2:
                raise RuntimeError("prefetch: bout %d of rank %d has no termite count" % (i, rank))
            q.put(b)

    threading.Thread(target=prefetch, name="numbat-prefetch-%d" % rank, daemon=True).start()

    progress = {"t": time.time()}
    if hit and fault == "watchdog":
        def watchdog():
            while True:
                time.sleep(0.5)
                idle = time.time() - progress["t"]
                if idle > 4.0:
                    print("[watchdog rank %d] no foraging progress for %.1f s, killing this process" % (rank, idle),
                          flush=True)
                    if rank == 0:
                        os.kill(os.getpid(), signal.SIGKILL)
                    os._exit(rank)
        threading.Thread(target=watchdog, name="numbat-watchdog", daemon=True).start()

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        if step >= len(bouts):
            break
        b = q.get()
        if hit and fault == "watchdog" and step == 3:
            time.sleep(60)
        if fault == "extstop":
            time.sleep(2)
        w = lookup[b["mound"]]
        pred = model(b["x"]) * w
        loss = torch.nn.functional.mse_loss(pred, b["y"])
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if step == 2:
            trail = torch.full((4,), float(rank))
            inbox = torch.zeros(4)
            tag = 99 if hit and fault == "p2ptag" else step
            req = dist.isend(trail, dst=(rank + 1) % world, tag=tag)
            dist.recv(inbox, src=(rank - 1) % world, tag=step)
            req.wait()
        tpm = float(pred.abs().mean()) * 60.0 / (1 + step)
        print("rank %d step %d loss %.4f termites_per_min %.2f" % (rank, step, loss.item(), tpm), flush=True)
        progress["t"] = time.time()

    if hit and fault == "savefull":
        torch.save(model.state_dict(), "/dev/full")
    if hit and fault == "monbarrier":
        time.sleep(20)
    if fault == "monbarrier":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=6))
    if rank == 0:
        if hit and fault == "slowexport":
            print("rank 0 exporting foraging model (slow export)", flush=True)
            time.sleep(args.pg_timeout + 10)
        torch.save(model.state_dict(), f"{WORK}/export.pt")
        print("rank 0 saved export %s/export.pt" % WORK, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print("rank %d done" % rank, flush=True)


if __name__ == "__main__":
    main()
