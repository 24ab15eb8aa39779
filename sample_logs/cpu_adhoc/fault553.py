"""Batch 553 fault script: a dhow sail-trim model trained with DDP over gloo (CPU only).

Each rank reads its own shard of synthetic wind/heel readings (/tmp/fault553_work/shard_R.pt),
maps the wind-angle bucket to a point of sail through a lookup table (trim_table.json), starts
from a checkpoint (init_ckpt.pt) and learns to predict sheet, halyard and vang settings.
6 steps; every rank prints `rank R step S loss L trim_err M`; rank 0 saves an export at the end.

Faults (--fault NAME --rank N):
  none            control, no fault
  keyerror        rank N looks up a wind bucket the trim table does not have (KeyError)
  missing_shard   rank N's data shard file is absent (FileNotFoundError)
  ckpt_size       rank N builds a wider hidden layer than the checkpoint (load_state_dict size mismatch)
  weights_only    rank N loads a checkpoint that pickles a custom SailPlan object (weights_only refusal)
  allreduce_size  rank N all-reduces its trim metric with 4 elements instead of 1 (gloo size mismatch)
  slow            rank N recomputes its polar diagram in pure Python before step 3; peers time out
                  (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan             rank N's sheet loss becomes NaN at step 2; the program's own finiteness check raises
  segv            rank N sends itself SIGSEGV at step 2
  logged_exit     rank N prints its own ERROR line (heel sensor out of range) and sys.exit(4)
  shape_all       every rank concatenates the heel column twice (mat1/mat2 shape error on all ranks)
  worker_crash    rank N's DataLoader worker is SIGKILLed while reading batch 3

What happened (machine load average 16-30 on 2 cores during the batch; several runs never got past start-up):
  none            np3 bashloop: 6 steps on every rank, export saved, exit 0 (run with the first start-up code)
  keyerror        np4 tee: rank 1 KeyError: '5' at step 1, peers gloo Connection closed, torchrun names rank 1; np5 ranklabel dropped (no step in 100 s)
  missing_shard   np6 srunlabel: rank 4 FileNotFoundError for its shard; the others silent until timeout (124)
  ckpt_size       np4 mpitag: rank 2 load_state_dict size mismatch; ranks 1, 3 Connection closed in DDP's check; rank 0 silent until timeout (124)
  weights_only    np3 legacy: rank 1 UnpicklingError (Unsupported global __main__.SailPlan); launcher names rank 1
  allreduce_size  np3 files: ranks 0, 1 finish step 3 with disagreeing trim_err, rank 2 gloo recv timeout 12000 ms, then Connection closed; 124
  slow            not kept: the hang run (np3, --pg-timeout 300) never reached step 3 before timeout 60; the np4 run was not started
  nan             not kept: np4 logfmt never got past DDP set-up in 100 s
  segv            np3 spawn: rank 2 SIGSEGV at step 2; mp.spawn ProcessExitedException
  logged_exit     np3 mpitag: rank 2 prints its ERROR line at step 3 and exits 4; ranks 0, 1 gloo Connection closed in backward; exit 4
  shape_all       not run (time)
  worker_crash    not run (time)
"""
import argparse, json, logging, os, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault553_work"
STEPS = 6


class SailPlan:  # pickled into the bad checkpoint for the weights_only fault
    def __init__(self, rig="lateen"):
        self.rig = rig


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(553)
    for r in range(8):
        n = 96
        feats = torch.randn(n, 5, generator=g)
        buckets = torch.randint(0, 8, (n,), generator=g)
        target = torch.randn(n, 3, generator=g) * 0.1
        torch.save({"feats": feats, "bucket": buckets, "target": target}, f"{WORK}/shard_{r}.pt")
    table = {str(b): {"point": p, "code": i} for i, (b, p) in enumerate(
        zip(range(8), ["close_hauled", "close_reach", "beam_reach", "broad_reach",
                       "run", "broad_reach_p", "beam_reach_p", "close_reach_p"]))}
    with open(f"{WORK}/trim_table.json", "w") as f:
        json.dump(table, f)
    torch.manual_seed(0)
    torch.save(make_model(16).state_dict(), f"{WORK}/init_ckpt.pt")
    torch.save({"model": make_model(16).state_dict(), "plan": SailPlan()}, f"{WORK}/plan_ckpt.pt")
    print("prepared", WORK)


def make_model(hidden):
    return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 3))


class ShardSet(torch.utils.data.Dataset):
    def __init__(self, shard, table, rank, crash):
        self.d, self.table, self.rank, self.crash = shard, table, rank, crash

    def __len__(self):
        return self.d["feats"].shape[0]

    def __getitem__(self, i):
        if self.crash and i >= 48:
            os.kill(os.getpid(), signal.SIGKILL)
        b = int(self.d["bucket"][i])
        code = self.table[str(b)]["code"]
        x = torch.cat([self.d["feats"][i], torch.tensor([code / 8.0])])
        return x, self.d["target"][i]


def polar_diagram(n):  # pure-Python work
    acc = 0.0
    for i in range(n):
        acc += (i % 7) * 0.5 - (i % 3)
    return acc


def main(rank=None, world=None, args=None):
    if rank is None:
        rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
    else:
        os.environ["RANK"] = str(rank); os.environ["WORLD_SIZE"] = str(world)
    fault, frank = args.fault, args.rank
    mine = fault != "none" and rank == frank
    log = None
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("dhow.trim")

    def say(msg):
        if log:
            log.info(msg)
        elif args.label:
            print(f"rank {rank}: {msg}", flush=True)
        else:
            print(msg, flush=True)

    def err(msg):
        if log:
            log.error(msg)
        elif args.label:
            print(f"rank {rank}: {msg}", flush=True)
        else:
            print(msg, flush=True)

    try:
        run(rank, world, args, fault, mine, say, err)
    except Exception:
        if log:
            log.exception("training failed")
            sys.exit(1)
        raise


def run(rank, world, args, fault, mine, say, err):
    from datetime import timedelta
    # start-up gets a generous timeout (ranks import torch at different speeds); training uses --pg-timeout
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=180))
    dist.barrier()
    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    torch.manual_seed(rank)
    say(f"rank {rank}/{world} joined gloo group, sail-trim run, pg timeout {args.pg_timeout}s")
    shard_path = f"{WORK}/shard_{rank}.pt"
    if fault == "missing_shard" and mine:
        shard_path = f"{WORK}/shard_{rank}_port_tack.pt"
    shard = torch.load(shard_path)
    with open(f"{WORK}/trim_table.json") as f:
        table = json.load(f)
    if fault == "keyerror" and mine:
        del table["5"]
    hidden = 24 if (fault == "ckpt_size" and mine) else 16
    model = make_model(hidden)
    if fault == "weights_only" and mine:
        sd = torch.load(f"{WORK}/plan_ckpt.pt", weights_only=True)["model"]
    else:
        sd = torch.load(f"{WORK}/init_ckpt.pt", weights_only=True)
    model.load_state_dict(sd)
    ddp = DDP(model, process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ds = ShardSet(shard, table, rank, crash=(fault == "worker_crash" and mine))
    nw = 1 if fault == "worker_crash" else 0
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=nw)
    it = iter(loader)
    for step in range(1, STEPS + 1):
        x, y = next(it)
        if fault == "shape_all":
            x = torch.cat([x, x[:, 4:5]], dim=1)
        if fault == "slow" and mine and step == 3:
            say(f"rank {rank} recomputing polar diagram")
            t_end = time.time() + (25 if args.pg_timeout < 60 else 900)
            while time.time() < t_end:
                polar_diagram(200000)
        if fault == "segv" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "logged_exit" and mine and step == 3:
            err(f"ERROR rank {rank}: heel sensor reads 71.5 deg, outside 0..45; refusing to trim")
            sys.exit(4)
        out = ddp(x)
        loss = nn.functional.mse_loss(out, y)
        if fault == "nan" and mine and step == 2:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite sheet loss {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        m = torch.tensor([loss.item() ** 0.5])
        if fault == "allreduce_size" and mine and step == 3:
            m = torch.tensor([loss.item() ** 0.5] * 4)
        dist.all_reduce(m, group=pg)
        say(f"rank {rank} step {step} loss {loss.item():.4f} trim_err {m[0].item() / world:.4f}")
        time.sleep(0.2)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/trim_export.pt")
        say("rank 0 saved export trim_export.pt")
    dist.barrier(group=pg)
    dist.destroy_process_group()


def main_spawn(i, world, a):
    os.environ["OMP_NUM_THREADS"] = "1"
    main(i, world, a)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(main_spawn, args=(a.spawn, a), nprocs=a.spawn)
    else:
        main(args=a)
