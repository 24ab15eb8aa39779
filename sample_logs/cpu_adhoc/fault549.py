"""Batch 549 fault script: skein of geese flight formations.

Each rank trains a tiny "formation drag" regressor: from a goose's slot in the skein
(offset behind the leader, lateral spacing, wingbeat phase, wingspan looked up from a
flock table) it predicts the drag saving; gradients are summed with all_reduce (gloo).
`--prepare` writes synthetic shards per rank, the flock lookup table and a start checkpoint
into /tmp/fault549_work. 6 steps; every rank prints `rank R step S loss L lift M`;
rank 0 saves an export at the end.

Faults (--fault NAME --rank N):
  none           control, nothing planted
  keyerror       rank N's shard names a flock id missing from the lookup table (KeyError)
  missing_shard  rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size      rank N loads the wide (hidden 48) start checkpoint into the 32-wide model
  weights_only   rank N loads a checkpoint that pickles a FlightMeta object (weights_only refusal)
  wrong_size     rank N adds one extra slot to the flattened gradient before all_reduce at step 3
  slow           rank N does pure-Python wingbeat simulation for ~45 s at step 2 (peers time out);
                 with --pg-timeout 300 the job hangs until `timeout` ends it
  nan            rank N's wingbeat phases become NaN at step 3; the script's own check raises
  sigsegv        rank N sends itself SIGSEGV at step 2
  exit4          rank N prints its own ERROR line and sys.exit(4) at step 1
  shape_all      every rank reshapes the slot features wrongly at step 1 (shape bug on all ranks)
  host_oom       rank N asks for a ~1 TiB echelon buffer at step 2 (allocation fails, nothing used)

What happened (after the runs; machine heavily loaded, torch import took up to a minute):
  none           np3 bashloop: 6 steps on every rank, export saved, exit 0
  keyerror       np4 ranklabel: KeyError 'skein_0417' on rank 2, peers 'Connection closed by peer' in barrier, exit 1;
                 np6 tee: see README (rank 5)
  missing_shard  np5 srunlabel: FileNotFoundError on rank 3, peers fail in barrier; a process lingered, timeout 124
  ckpt_size      np3 mpitag: load_state_dict size mismatch (48 vs 32) on rank 1, peers fail in barrier, exit 1
  weights_only   np3 legacy: UnpicklingError (GLOBAL __main__.FlightMeta) on rank 2, launcher SIGTERMs the rest, exit 1
  wrong_size     np4 bashloop: terminate called / gloo::EnforceNotMet 'Received data size doesn't match' (76 vs 72)
                 at step 3 on the receiving peer, others reset/closed; processes lingered, timeout 124
  slow           np3 bashloop: peers time out after 12000 ms in all_reduce, rank 2 then 'Connection closed', exit 1;
                 np3 --pg-timeout 300: output stops after step 1, timeout 60 ends it (124);
                 np5 logfmt: dropped (torch imports ate the 100 s budget before step 1 printed)
  nan            np5 logfmt: FloatingPointError on rank 2 at step 3 (own check), peers closed, exit 1;
                 np4 spawn: dropped (no step printed within 100 s on the loaded machine)
  sigsegv        np4 files: rank3.log stops after step 1, peers reset/closed, timeout 124;
                 np6 pdsh2: worker-1's agent reports SIGSEGV (-11) for rank 5, exit 1
  exit4          np5 srunlabel: rank 1's ERROR line then exit 4, peers closed in all_reduce, exit 4; np7 mpitag: see README
  shape_all      np3 tee: 'mat1 and mat2 shapes cannot be multiplied (48x8 and 4x32)' on all 3 ranks, exit 1
  host_oom       np3 bashloop: DefaultCPUAllocator can't allocate 1099511627776 bytes on rank 2, exit 1;
                 np4 spawn: see README (rank 3)
"""
import argparse
import json
import logging
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault549_work"
FEAT = 4


class FlightMeta:
    def __init__(self, lead="grey-lag", slots=12):
        self.lead = lead
        self.slots = slots


class FormationNet(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEAT, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(549)
    table = {f"skein_{i:04d}": round(1.4 + 0.02 * i, 3) for i in range(64)}
    with open(os.path.join(WORK, "flock_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        n = 96
        ids = [f"skein_{(r * 7 + i) % 64:04d}" for i in range(n)]
        feats = torch.rand(n, 3, generator=g)
        torch.save({"ids": ids, "feats": feats}, os.path.join(WORK, f"shard_rank{r}.pt"))
    bad = {"ids": [f"skein_{i % 64:04d}" for i in range(95)] + ["skein_0417"],
           "feats": torch.rand(96, 3, generator=g)}
    torch.save(bad, os.path.join(WORK, "shard_bad.pt"))
    torch.manual_seed(549)
    torch.save(FormationNet(32).state_dict(), os.path.join(WORK, "start.pt"))
    torch.save(FormationNet(48).state_dict(), os.path.join(WORK, "start_wide.pt"))
    torch.save({"state": FormationNet(32).state_dict(), "meta": FlightMeta()},
               os.path.join(WORK, "start_meta.pt"))
    print(f"prepared {world} shards in {WORK}")


def main(local_idx=None, args=None):
    if local_idx is not None:  # spawn
        os.environ["RANK"] = str(local_idx)
        os.environ["LOCAL_RANK"] = str(local_idx)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    faulty = args.fault != "none" and (args.rank == rank or args.fault == "shape_all")
    log = None
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("skein")

    def out(msg):
        if log is not None:
            log.info(msg)
        elif args.ranklabel:
            print(f"rank {rank}: {msg}", flush=True)
        else:
            print(msg, flush=True)

    def err(msg):
        if log is not None:
            log.error(msg)
        elif args.ranklabel:
            print(f"rank {rank}: {msg}", flush=True)
        else:
            print(msg, flush=True)

    try:
        return _train(rank, world, faulty, args, out, err)
    except Exception:
        if log is not None:
            log.exception("training failed on rank %d", rank)
            sys.exit(1)
        raise


def _train(rank, world, faulty, args, out, err):
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    torch.manual_seed(rank)
    out(f"rank {rank}/{world} joined skein (gloo, pg timeout {args.pg_timeout}s)")

    with open(os.path.join(WORK, "flock_table.json")) as f:
        table = json.load(f)
    shard_path = os.path.join(WORK, f"shard_rank{rank}.pt")
    if faulty and args.fault == "missing_shard":
        shard_path = os.path.join(WORK, f"shard_rank{rank}_echelon.pt")
    if faulty and args.fault == "keyerror":
        shard_path = os.path.join(WORK, "shard_bad.pt")
    shard = torch.load(shard_path)
    span = torch.tensor([table[k] for k in shard["ids"]]).unsqueeze(1)
    x = torch.cat([shard["feats"], span], dim=1)
    y = (0.3 * x[:, 0] - 0.2 * x[:, 1] + 0.1 * torch.sin(6.28 * x[:, 2]) + 0.05 * x[:, 3]).unsqueeze(1)

    model = FormationNet(32)
    ck = os.path.join(WORK, "start.pt")
    if faulty and args.fault == "ckpt_size":
        ck = os.path.join(WORK, "start_wide.pt")
    if faulty and args.fault == "weights_only":
        state = torch.load(os.path.join(WORK, "start_meta.pt"))["state"]
    else:
        state = torch.load(ck)
    model.load_state_dict(state)
    out(f"rank {rank} loaded {len(shard['ids'])} goose slots, start checkpoint ok")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dist.barrier()

    for step in range(1, args.steps + 1):
        xb = x
        if faulty and args.fault == "exit4" and step == 1:
            err(f"ERROR rank {rank}: flight plan for skein lists 0 waypoints after the turn; aborting formation")
            sys.exit(4)
        if faulty and args.fault == "shape_all" and step == 1:
            xb = x.reshape(-1, FEAT * 2)
        if faulty and args.fault == "nan" and step == 3:
            xb = x.clone()
            xb[:, 2] = float("nan")
        if faulty and args.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if faulty and args.fault == "host_oom" and step == 2:
            buf = torch.empty(1 << 38, dtype=torch.float32)  # ~1 TiB echelon buffer
            del buf
        if faulty and args.fault == "slow" and step == 2:
            t_end = time.time() + args.slow_s
            acc = 0
            while time.time() < t_end:
                acc += sum(i * i for i in range(2000)) % 7
        pred = model(xb)
        loss = ((pred - y) ** 2).mean()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (wingbeat phase check)")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if faulty and args.fault == "wrong_size" and step == 3:
            flat = torch.cat([flat, torch.zeros(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        opt.step()
        lift = 1.0 - loss.item() / (1.0 + loss.item())
        out(f"rank {rank} step {step} loss {loss.item():.5f} lift {lift:.4f}")
        time.sleep(0.2)

    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export_formation.pt"))
        out("rank 0 saved export to " + os.path.join(WORK, "export_formation.pt"))
    dist.destroy_process_group()


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--slow-s", type=float, default=45.0)
    p.add_argument("--ranklabel", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--local-rank", "--local_rank", type=int, default=None)
    args = p.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ["WORLD_SIZE"] = str(args.spawn)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(main, args=(args,), nprocs=args.spawn)
        return
    main(None, args)


if __name__ == "__main__":
    cli()
