"""Batch 605 fault job: "kittiwake cliff ledges".

A small CPU-only torch.distributed (gloo) training job. `--prepare` writes synthetic
data into /tmp/fault605_work: one shard per rank (ledge ids + features + chick counts),
a JSON lookup table (ledge id -> ledge row index) the data goes through, and a start
checkpoint. Each rank trains a tiny DDP model for 6 steps, printing
`rank R step S loss L ledge_occupancy M` each step, an all_reduce of the metric per
step, a final barrier, then rank 0 saves an export.

`--fault NAME --rank N` plants one fault on rank N (or every rank where noted):
  none          control run, nothing planted
  zerodiv       rank N finds zero nesting pairs on its ledge and divides by them (ZeroDivisionError)
  loaderworker  rank N's DataLoader (num_workers=1) looks up a ledge id missing from its table -> IndexError in the worker
  ckpttrunc     rank N loads a truncated copy of the start checkpoint (torch.load fails)
  missingkeys   rank N's start checkpoint lacks a key / has an extra key (load_state_dict strict)
  savedir       rank N (0) saves the export into a folder that does not exist
  skipbarrier   rank N skips the final barrier and lingers, so the others time out in it
  exitquiet     rank N calls os._exit(0) at step 3
  exit3         rank N calls os._exit(3) at step 3 without printing anything
  sigkill       rank N sends itself SIGKILL at step 2
  sigabrt       rank N sends itself SIGABRT at step 2
  anomaly       rank N takes sqrt of a negative ledge density under set_detect_anomaly(True)
  clipnonfinite rank N's loss is scaled by inf, clip_grad_norm_(error_if_nonfinite=True) raises
  unused        every rank: the model has a "fog" head never used, DDP without find_unused_parameters
  deviceids     rank N wraps its CPU model in DDP with device_ids=[0]
  jsonbad       rank N's lookup table file is truncated (json.JSONDecodeError)
  shapeall      every rank: config says 9 input features, the data has 8 (shape error)
  stall         rank N sleeps 400 s at step 2 (others time out; with --pg-timeout 300 the run only hangs)
  portinuse     (launcher-level) MASTER_PORT is held by another python socket before launch

What happened in each run (one line per kept log):
  kittiwake_none_np4_rnone_bashloop: all 4 ranks ran 6 steps, rank 0 saved the export, exit 0.
  kittiwake_zerodiv_np5_r2_ranklabel: rank 2 ZeroDivisionError at step 2; others gloo 'Connection closed by peer' / 12000ms recv timeout.
  kittiwake_skipbarrier_np5_r3_spawn: rank 3 skipped the final barrier; process 0's barrier timed out (12000ms), mp.spawn ProcessRaisedException.
  kittiwake_sigkill_np4_r3_tee: rank 3 SIGKILL at step 2; peers 'Connection reset by peer'; torchrun root cause rank 3 exitcode -9.
  kittiwake_ckpttrunc_np6_r5_mpitag: rank 5 torch.load 'failed finding central directory'; others gloo closed in DDP's param check.
  kittiwake_savedir_np4_r0_files: rank 0 torch.save 'Parent directory ... does not exist.'; ranks 1-3 finished cleanly.
  kittiwake_exitquiet_np3_r1_legacy: rank 1 os._exit(0) at step 3; ranks 0/2 gloo closed/reset; launcher names rank 2.
  kittiwake_exit3_np5_r0_logfmt: rank 0 os._exit(3) at step 3, nothing printed; ranks 1-4 gloo reset/closed.
  kittiwake_anomaly_np4_r1_pdsh2: rank 1 'SqrtBackward0 returned nan values'; others gloo closed; both agents ChildFailedError.
  kittiwake_loaderworker_np3_r2_srunlabel: rank 2 'Caught IndexError in DataLoader worker process 0'; others gloo closed.
  kittiwake_jsonbad_np7_r6_bashloop: rank 6 json.decoder.JSONDecodeError; others gloo closed / send timeout.
  kittiwake_stall_np3_r1_srunlabel: --pg-timeout 300, rank 1 slept; output stopped after step 1 until timeout 60 (124).
  kittiwake_clipnonfinite_np5_r4_legacy: inf loss on rank 4 spread by DDP; all ranks' clip_grad_norm_ raised non-finite norm.
  kittiwake_sigabrt_np6_r3_spawn: rank 3 SIGABRT at step 2; mp.spawn 'process 3 terminated with signal SIGABRT'.
  kittiwake_deviceids_np5_r2_tee: rank 2 DDP ValueError for device_ids on a CPU module; others gloo closed / SIGTERM.
  kittiwake_missingkeys_np8_r7_bashloop: rank 7 load_state_dict Missing "2.bias" / Unexpected "ledge_bias"; others gloo closed.
  kittiwake_unused_rall_np4_ranklabel: every rank 'Expected to have finished reduction in the prior iteration' at step 1.
  kittiwake_shapeall_np6_rall_files: every rank 'mat1 and mat2 shapes cannot be multiplied (8x8 and 9x16)'.
  kittiwake_portinuse_np5_r0_bashloop: rank 0 TCPStore EADDRINUSE on the held port; other ranks' store clients timed out (12000ms).
  (dropped: kittiwake_unused_rall_np3_bashloop, from the first `unused` version whose fog head ran in forward -> shape error.)
(See the README text for the final, checked per-run notes.)
"""
import argparse
import datetime
import json
import logging
import math
import os
import signal
import sys
import time

WORK = "/tmp/fault605_work"
N_FEAT = 8
N_LEDGES = 40


def prepare(world):
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(605)
    table = {f"ledge-{i:03d}": i for i in range(N_LEDGES)}
    with open(os.path.join(WORK, "ledge_lookup.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        ids = [f"ledge-{int(i):03d}" for i in torch.randint(0, N_LEDGES, (32,), generator=g)]
        feats = torch.randn(32, N_FEAT, generator=g)
        chicks = torch.randint(0, 4, (32,), generator=g).float()
        torch.save({"ids": ids, "feats": feats, "chicks": chicks}, os.path.join(WORK, f"shard_{r}.pt"))
    model = build_model(N_FEAT, False)
    torch.save({"model": model.state_dict(), "step": 0}, os.path.join(WORK, "start.pt"))
    raw = open(os.path.join(WORK, "start.pt"), "rb").read()
    open(os.path.join(WORK, "start_trunc.pt"), "wb").write(raw[: len(raw) // 2])
    sd = dict(model.state_dict())
    sd.pop("2.bias")
    sd["ledge_bias"] = torch.zeros(1)
    torch.save({"model": sd, "step": 0}, os.path.join(WORK, "start_keys.pt"))
    txt = open(os.path.join(WORK, "ledge_lookup.json")).read()
    open(os.path.join(WORK, "ledge_lookup_trunc.json"), "w").write(txt[: len(txt) // 3])
    print(f"prepared {world} shards in {WORK}")


def build_model(n_in, fog):
    import torch.nn as nn

    m = nn.Sequential(nn.Linear(n_in, 16), nn.ReLU(), nn.Linear(16, 1))
    if fog:
        class WithFog(nn.Module):
            def __init__(self, body):
                super().__init__()
                self.body = body
                self.fog = nn.Linear(16, 1)  # "fog" head, never used in forward

            def forward(self, x):
                return self.body(x)
        return WithFog(m)
    return m


def main(args, rank=None, world=None):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    if rank is None:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
    else:
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world)

    if args.logfmt:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stdout,
            format="%(asctime)s [rank %(rank)s] %(levelname)s %(message)s")
        base = logging.getLogger("kittiwake")
        log = logging.LoggerAdapter(base, {"rank": rank})
        say = lambda m: (log.info(m), sys.stdout.flush())
    else:
        say = lambda m: print(m, flush=True)

    fault = args.fault
    here = args.rank == rank or args.rank == -1

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    say(f"rank {rank}/{world} joined gloo group (timeout {args.pg_timeout}s)")

    lookup_path = os.path.join(WORK, "ledge_lookup.json")
    if fault == "jsonbad" and here:
        lookup_path = os.path.join(WORK, "ledge_lookup_trunc.json")
    with open(lookup_path) as f:
        table = json.load(f)

    shard = torch.load(os.path.join(WORK, f"shard_{rank}.pt"))
    ids = list(shard["ids"])
    if fault == "loaderworker" and here:
        ids[5] = "ledge-999"

    class Ledges(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            row = table.get(ids[i], N_LEDGES + 59)
            if row >= N_LEDGES:
                raise IndexError(f"ledge row {row} out of range for {N_LEDGES} surveyed ledges ({ids[i]})")
            return shard["feats"][i], shard["chicks"][i], row

    n_in = N_FEAT + 1 if fault == "shapeall" else N_FEAT
    model = build_model(n_in, fault == "unused")
    ck = os.path.join(WORK, "start.pt")
    if fault == "ckpttrunc" and here:
        ck = os.path.join(WORK, "start_trunc.pt")
    if fault == "missingkeys" and here:
        ck = os.path.join(WORK, "start_keys.pt")
    if fault not in ("shapeall", "unused"):
        state = torch.load(ck)
        model.load_state_dict(state["model"])
    if fault == "deviceids" and here:
        ddp = DDP(model, device_ids=[0])
    else:
        ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(
        Ledges(), batch_size=8, shuffle=False,
        num_workers=1 if (fault == "loaderworker" and here) else 0)

    if fault == "anomaly" and here:
        torch.autograd.set_detect_anomaly(True)

    step = 0
    while step < 6:
        for feats, chicks, rows in loader:
            if step >= 6:
                break
            if fault == "sigkill" and here and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "sigabrt" and here and step == 2:
                os.kill(os.getpid(), signal.SIGABRT)
            if fault in ("exitquiet", "exit3") and here and step == 3:
                os._exit(0 if fault == "exitquiet" else 3)
            if fault == "stall" and here and step == 2:
                time.sleep(400)
            out = ddp(feats).squeeze(-1)
            loss = ((out - chicks) ** 2).mean()
            if fault == "anomaly" and here and step == 1:
                density = out.mean() - 100.0  # negative ledge density
                loss = loss + torch.sqrt(density)
            if fault == "clipnonfinite" and here and step == 2:
                loss = loss * float("inf")
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0, error_if_nonfinite=True)
            opt.step()
            pairs = float((chicks > 0).sum())
            if fault == "zerodiv" and here and step == 2:
                pairs = 0.0  # this rank's ledge has no nesting pairs
            occupancy = float(chicks.sum()) / pairs
            m = torch.tensor([occupancy])
            dist.all_reduce(m)
            say(f"rank {rank} step {step} loss {loss.item():.4f} ledge_occupancy {m.item() / world:.4f}")
            step += 1

    if fault == "skipbarrier" and here:
        say(f"rank {rank} writing ledge summary")
        time.sleep(3 * args.pg_timeout)
    else:
        dist.barrier()
    if rank == 0:
        out_dir = "/tmp/fault605_work/exports" if not (fault == "savedir" and here) else "/tmp/fault605_work/no_such_colony/exports"
        os.makedirs("/tmp/fault605_work/exports", exist_ok=True)
        torch.save({"model": model.state_dict(), "step": step}, os.path.join(out_dir, "kittiwake_export.pt"))
        say(f"rank 0 saved export to {out_dir}")
    dist.destroy_process_group()


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0, help="write data for this many ranks and exit")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-2)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0, help="start this many ranks with torch.multiprocessing.spawn")
    return p.parse_args()


def _spawn_entry(r, args, world):
    main(args, r, world)


if __name__ == "__main__":
    a = parse()
    if a.prepare:
        prepare(a.prepare)
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(_spawn_entry, args=(a, a.spawn), nprocs=a.spawn)
    else:
        main(a)
