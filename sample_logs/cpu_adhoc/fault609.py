"""fault609.py - pingo ice-cored hills: a tiny multi-rank (gloo, CPU) regression job for batch 609.

Each rank reads its own shard of synthetic pingo surveys (4 features: height, basal diameter,
crater depth, permafrost temperature; plus a hill-class id), maps the class id through a JSON
lookup table (class -> ice-core fraction) to a target, and trains a small MLP under DDP for 6
steps, printing `rank R step S loss L ice_core_frac M` each step. Rank 0 saves an export at the end.

Usage:  python fault609.py --prepare            (writes /tmp/fault609_work: shards, lookup.json, start.pt)
        python fault609.py [--fault NAME --rank N] [--pg-timeout S] [--spawn W --port P] [--logfmt]

Faults (--fault NAME, planted on --rank N unless it says every rank):
  none           control run
  jsondecode     rank N reads a truncated copy of lookup.json -> json.JSONDecodeError
  dlworker       rank N's dataset holds a class id past the lookup list; DataLoader worker (num_workers=1) raises IndexError
  ckpt_trunc     rank N loads a truncated copy of start.pt -> torch.load fails
  ckpt_keys      rank N loads the DDP-prefixed start checkpoint (module.* keys) -> missing/unexpected keys
  save_nodir     rank 0 saves its export into a directory that does not exist
  skip_allreduce rank N skips the metric all_reduce at step 3 -> the others wait and time out
  exit0          rank N calls sys.exit(0) quietly at step 3
  exit3          rank N calls os._exit(3) at step 2 without printing anything
  sigkill        rank N sends itself SIGKILL at step 3
  anomaly        anomaly detection on; rank N takes sqrt of a negative at step 2 -> NaN in backward
  clipnan        rank N's inputs get an inf at step 4; clip_grad_norm_(error_if_nonfinite=True)
  ddp_unused     every rank: a spare head is registered but never used, DDP without find_unused_parameters
  ddp_shape      rank N builds its hidden layer 17 wide instead of 16 -> DDP model check
  modnotfound    rank N imports a module that does not exist (pingo_permafrost_kernels)
  asmem          rank N caps RLIMIT_AS, then allocates a 3 GiB survey grid -> allocation fails
  stall          rank N sleeps 400 s at step 3 (the others time out, or with --pg-timeout 300 the run only hangs)
  zerodiv        rank N's cored-class filter matches no samples -> ZeroDivisionError in the metric
  port_in_use    (launcher fault) the master port is held by another socket before launch

Runs (one line per log kept in sample_logs/cpu_adhoc):
  pingo_none_np3_rnone_bashloop: exit 0; Control run: 3 ranks print 6 steps each and rank 0 saves the export; exit 0.
  pingo_exit3_np5_r1_ranklabel: exit 1; Rank 1 os._exit(3) at step 2 without output; ranks 0,2,3,4 fail in DDP forward with gloo connection reset/closed by peer.
  pingo_sigkill_np4_r3_srunlabel: exit 137; Rank 3 SIGKILLs itself at step 3; bash prints 'Killed' for it and ranks 0-2 fail with gloo connection reset/closed by peer.
  pingo_jsondecode_np3_r2_mpitag: exit 1; Rank 2 reads a truncated lookup.json and raises JSONDecodeError; ranks 0,1 fail in DDP's parameter check with gloo 'Connection closed by peer'.
  pingo_ckpt_trunc_np3_r0_files: exit 1; Rank 0's torch.load of a truncated start checkpoint fails (failed finding central directory); ranks 1,2 fail with gloo 'Connection closed by peer'. One file per rank.
  pingo_zerodiv_np5_r4_logfmt: exit 124; Rank 4 raises ZeroDivisionError in its ice_core_frac at step 1; others fail with gloo connection closed / 12000ms send timeout; the outer 100 s timeout (exit 124) ended the heavily loaded run.
  pingo_anomaly_np3_r1_spawn: exit 1; Anomaly detection catches NaN in SqrtBackward0 on process 1 at step 2; mp.spawn SIGTERMs the others and re-raises process 1's error.
  pingo_modnotfound_np4_r2_legacy: exit 1; Rank 2 raises ModuleNotFoundError for pingo_permafrost_kernels; torch.distributed.launch SIGTERMs the rest and names rank 2 as root cause.
  pingo_dlworker_np3_r0_tee: exit 1; Rank 0's DataLoader worker raises IndexError (Caught IndexError in DataLoader worker process 0); ranks 1,2 fail with gloo connection closed; torchrun names rank 0.
  pingo_skip_allreduce_np3_r1_bashloop: exit 1; Rank 1 skips the step-3 metric all_reduce; rank 0 aborts on gloo 'Received data size doesn't match expected size' (terminate called, Aborted), ranks 1,2 fail with connection closed.
  pingo_save_nodir_np5_r0_srunlabel: exit 1; All ranks finish 6 steps; rank 0's export save into a missing directory raises 'Parent directory ... does not exist'.
  pingo_clipnan_np5_r2_mpitag: exit 1; Rank 2's step-4 loss is nan after an inf input; clip_grad_norm_(error_if_nonfinite=True) raises on all 5 ranks after DDP averaged the gradients.
  pingo_asmem_np6_r5_ranklabel: exit 1; Rank 5 caps RLIMIT_AS then allocates 3 GiB at step 2: DefaultCPUAllocator can't allocate memory; others fail with gloo connection closed / 12000ms recv timeout.
  (dropped) pingo_ddp_unused_np4_rall_pdsh2: the spare head broke load_state_dict (missing keys) on every rank before DDP ran.
  (spare line, no run)
  (spare line, no run)
  (spare line, no run)
  (spare line, no run)
  (spare line, no run)
  (spare line, no run)
  (spare line, no run)
  (spare line, no run)
"""
import argparse
import datetime
import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault609_work"
CLASSES = ["open-system", "closed-system", "collapsed", "relict", "seasonal-frost-mound"]

log = None


def say(msg):
    if log is not None:
        log.info(msg)
    else:
        print(msg, flush=True)


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(609)
    for r in range(8):
        x = torch.randn(48, 4, generator=g)
        cls = torch.randint(0, len(CLASSES), (48,), generator=g)
        torch.save({"x": x, "cls": cls}, f"{WORK}/shard_r{r}.pt")
    table = {"classes": [{"name": n, "ice_frac": round(0.15 * (i + 1), 2)} for i, n in enumerate(CLASSES)]}
    with open(f"{WORK}/lookup.json", "w") as f:
        json.dump(table, f, indent=1)
    m = build_model(16)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    torch.save({"module." + k: v for k, v in m.state_dict().items()}, f"{WORK}/start_ddp.pt")
    print(f"prepared {WORK}", flush=True)


class Hills(nn.Module):
    def __init__(self, hidden, spare=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        if spare:
            self.spare_head = nn.Linear(hidden, 1)  # never used in forward

    def forward(self, x):
        return self.body(x)


def build_model(hidden, spare=False):
    torch.manual_seed(7)
    return Hills(hidden, spare)


class Surveys(Dataset):
    def __init__(self, shard, table, offset=0):
        self.x, self.cls, self.table, self.offset = shard["x"], shard["cls"], table, offset

    def __len__(self):
        return len(self.cls)

    def __getitem__(self, i):
        c = int(self.cls[i]) + self.offset
        ice = self.table["classes"][c]["ice_frac"]
        return self.x[i], torch.tensor([ice], dtype=torch.float32), int(self.cls[i])


def load_table(rank, fault, frank):
    path = f"{WORK}/lookup.json"
    if fault == "jsondecode" and rank == frank:
        with open(path) as f:
            text = f.read()
        path = f"{WORK}/lookup_r{rank}.json"
        with open(path, "w") as f:
            f.write(text[: len(text) // 2])
    with open(path) as f:
        return json.load(f)


def load_start(model, rank, fault, frank):
    path = f"{WORK}/start.pt"
    if fault == "ckpt_trunc" and rank == frank:
        with open(path, "rb") as f:
            data = f.read()
        path = f"{WORK}/start_r{rank}.pt"
        with open(path, "wb") as f:
            f.write(data[: len(data) * 2 // 3])
    if fault == "ckpt_keys" and rank == frank:
        path = f"{WORK}/start_ddp.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)


def worker(rank, world, args):
    global log
    fault, frank = args.fault, args.rank
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s [rank %(rank)s] %(levelname)s %(message)s")
        log = logging.LoggerAdapter(logging.getLogger("pingo"), {"rank": rank})
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    if fault == "modnotfound" and rank == frank:
        import pingo_permafrost_kernels  # noqa: F401
    table = load_table(rank, fault, frank)
    shard = torch.load(f"{WORK}/shard_r{rank}.pt", weights_only=True)
    offset = 5 if (fault == "dlworker" and rank == frank) else 0
    ds = Surveys(shard, table, offset)
    dl = DataLoader(ds, batch_size=8, shuffle=False, num_workers=1 if fault == "dlworker" else 0)
    hidden = 17 if (fault == "ddp_shape" and rank == frank) else 16
    model = build_model(hidden, spare=(fault == "ddp_unused"))
    if hidden == 16:
        load_start(model, rank, fault, frank)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    cored = (0, 1) if not (fault == "zerodiv" and rank == frank) else (7,)
    if fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    it = iter(dl)
    for step in range(1, 7):
        x, y, cls = next(it)
        if fault == "exit3" and rank == frank and step == 2:
            os._exit(3)
        if fault == "exit0" and rank == frank and step == 3:
            sys.exit(0)
        if fault == "sigkill" and rank == frank and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "stall" and rank == frank and step == 3:
            time.sleep(400)
        if fault == "asmem" and rank == frank and step == 2:
            import resource
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize:")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
            grid = torch.zeros(3 << 28, dtype=torch.float32)  # 3 GiB survey grid
            x = x + grid[:1]
        if fault == "clipnan" and rank == frank and step == 4:
            x = x.clone()
            x[0, 0] = float("inf")
        pred = ddp(x)
        loss = ((pred - y) ** 2).mean()
        if fault == "anomaly" and rank == frank and step == 2:
            loss = loss + (pred.mean() * 0 - 1.0).sqrt()
        n_cored = sum(1 for c in cls.tolist() if c in cored)
        ice_sum = sum(float(v) for v, c in zip(y.view(-1).tolist(), cls.tolist()) if c in cored)
        metric = ice_sum / n_cored if n_cored else 0.0
        if fault == "zerodiv" and rank == frank:
            metric = ice_sum / n_cored
        say(f"rank {rank} step {step} loss {loss.item():.4f} ice_core_frac {metric:.4f}")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        t = torch.tensor([metric])
        if not (fault == "skip_allreduce" and rank == frank and step == 3):
            dist.all_reduce(t)
    dist.barrier()
    if rank == 0:
        out = f"{WORK}/export" if fault != "save_nodir" else f"{WORK}/exports/2026-12/pingo_final"
        os.makedirs(out, exist_ok=True) if fault != "save_nodir" else None
        torch.save(model.state_dict(), f"{out}/hills_final.pt")
        say(f"rank 0 saved export {out}/hills_final.pt")
    dist.destroy_process_group()


def spawn_entry(rank, world, args):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    worker(rank, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn, join=True)
        return
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
