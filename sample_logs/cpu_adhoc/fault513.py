"""Batch 513 fault script: sled dog team pace prediction from GPS collars.

A small DDP (gloo, CPU) job: each rank reads its own shard of GPS-collar samples
(speed, heading, elevation gain, air temperature, dog load, trail hardness), maps every
collar/dog id to its team through a lookup table, starts from a checkpoint and trains a
small pace regressor (PaceNet) for 6 steps. Every rank prints
`rank R step S loss L mae M` (M = mean absolute pace error in min/km, all-reduced).
Rank 0 saves an export at the end.

  python fault513.py --prepare            # writes synthetic data to /tmp/fault513_work
  python fault513.py --fault NAME --rank N [--pg-timeout 12] [--label] [--logfmt] [--spawn W]

Faults (--fault NAME, planted on --rank N):
  none           control, nothing planted
  dog_key        rank N meets a collar id missing from the dog->team lookup table (KeyError)
  missing_shard  rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size      rank N builds PaceNet with hidden=48, the checkpoint has hidden=32 (load_state_dict size mismatch)
  metric_size    rank N all-reduces a metric tensor of 3 elements, the others 2 (collective size mismatch)
  slow_rank      rank N does pure-Python route smoothing for ~45 s at step 3; peers hit the PG timeout
                 (with --pg-timeout 300 the job just hangs until `timeout` ends it)
  nan_pace       rank N divides by a zero time delta; the script's finiteness check raises FloatingPointError
  segv           rank N sends itself SIGSEGV at step 2
  error_exit     rank N prints its own ERROR line (collar firmware mismatch) and sys.exit(4)
  shape_all      every rank drops the team embedding from the features (matmul shape error on all ranks)
  host_mem       rank N (address space capped with RLIMIT_AS) tries to build a dense trail-distance matrix
                 (DefaultCPUAllocator cannot allocate)
  worker_crash   rank N's DataLoader worker is SIGKILLed while decoding a collar packet

What happened (only 5 runs finished in the time limit; the host had load ~20-28 on 2 cores):
  none           np3 bashloop: 6 steps on all ranks, export saved, exit 0
  dog_key        np4 ranklabel: rank 2 KeyError 'COLLAR-7F3A' at step 2; peers gloo connection closed / recv timeout; exit 124
  missing_shard  np5 mpitag: rank 3 FileNotFoundError day2/gps_shard_003.pt; peers gloo connection closed in DDP init; exit 124
  ckpt_size      np4 files: rank 1 load_state_dict size mismatch [32,10] vs [48,10]; other ranks stuck silently in DDP init; exit 124
  metric_size    np5 tee: no size error; rank 0 got a different step-3 mae, then gloo 12 s send/recv timeouts on all ranks; exit 1
  others         not run (slow_rank legacy and the slow_rank hang run were stopped unfinished, the rest never started)
"""
import argparse, json, logging, os, resource, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault513_work"
NFEAT, NTEAMS, HIDDEN, STEPS, BATCH = 6, 12, 32, 6, 64
log = None


class PaceNet(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.team = nn.Embedding(NTEAMS, 4)
        self.body = nn.Sequential(nn.Linear(NFEAT + 4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, team, drop_team=False):
        feats = x if drop_team else torch.cat([x, self.team(team)], dim=1)
        return self.body(feats).squeeze(1)


def prepare(world_max=8):
    g = torch.Generator().manual_seed(513)
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    lookup = {f"SD-{i:04d}": i % NTEAMS for i in range(200)}
    json.dump(lookup, open(f"{WORK}/dog_team_lookup.json", "w"))
    for r in range(world_max):
        n = 512
        x = torch.randn(n, NFEAT, generator=g)
        dt = torch.rand(n, generator=g) * 4 + 1
        dogs = [f"SD-{int(i):04d}" for i in torch.randint(0, 200, (n,), generator=g)]
        y = 3.5 + 0.4 * x[:, 0] - 0.2 * x[:, 2] + 0.1 * x[:, 4]
        torch.save({"x": x, "dt": dt, "dog": dogs, "pace": y}, f"{WORK}/shards/gps_shard_{r:03d}.pt")
    torch.manual_seed(0)
    torch.save(PaceNet().state_dict(), f"{WORK}/pacenet_init.pt")
    print("prepared", WORK)


class CollarPackets(torch.utils.data.Dataset):
    def __init__(self, shard, lookup, crash=False):
        self.s, self.lookup, self.crash = shard, lookup, crash

    def __len__(self):
        return len(self.s["dog"])

    def __getitem__(self, i):
        if self.crash and i >= 3 * BATCH:
            os.kill(os.getpid(), signal.SIGKILL)   # decoder dies on a corrupt packet
        return self.s["x"][i], self.s["dt"][i], self.lookup[self.s["dog"][i]], self.s["pace"][i]


def out(rank, msg, level="info"):
    if log is not None:
        getattr(log, level)(msg)
    else:
        print(msg, flush=True)


def run(rank, world, args):
    global log
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("sledpace")
    pre = f"rank {rank}: " if args.label else ""
    say = lambda m, level="info": out(rank, pre + m, level)
    bad = args.fault != "none" and (args.rank == rank or args.fault == "shape_all")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    say(f"rank {rank}/{world} joined gloo group, pg timeout {args.pg_timeout}s")
    lookup = json.load(open(f"{WORK}/dog_team_lookup.json"))
    shard_path = f"{WORK}/shards/gps_shard_{rank:03d}.pt"
    if bad and args.fault == "missing_shard":
        shard_path = f"{WORK}/shards/day2/gps_shard_{rank:03d}.pt"
    shard = torch.load(shard_path)
    say(f"loaded {len(shard['dog'])} collar samples from {shard_path}")
    if bad and args.fault == "error_exit":
        say(f"ERROR collar firmware v2.1 on rank {rank} does not match trained schema v3.0 (heading in radians); refusing to train", "error")
        sys.exit(4)
    model = PaceNet(hidden=48 if bad and args.fault == "ckpt_size" else HIDDEN)
    model.load_state_dict(torch.load(f"{WORK}/pacenet_init.pt"))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ds = CollarPackets(shard, lookup, crash=bad and args.fault == "worker_crash")
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=1 if bad and args.fault == "worker_crash" else 0)
    it = iter(loader)
    for step in range(1, STEPS + 1):
        x, dt, team, y = next(it)
        if bad and args.fault == "dog_key" and step == 2:
            team = torch.tensor([lookup[d] for d in ["SD-0012", "SD-0177", "COLLAR-7F3A"]])
        if bad and args.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and args.fault == "slow_rank" and step == 3:
            t0, acc = time.time(), 0.0
            while time.time() - t0 < 45:   # pure-Python route smoothing, far too slow
                for k in range(20000):
                    acc += (k % 7) * 0.5
        if bad and args.fault == "host_mem" and step == 3:
            vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
            n = 40000
            dists = torch.empty(n, n, dtype=torch.float32)  # dense trail-distance matrix, 6.4 GB
        if bad and args.fault == "nan_pace" and step == 4:
            dt = dt.clone(); dt[5] = 0.0
        x = x.clone(); x[:, 0] = x[:, 0] / dt * dt.mean()
        pred = ddp(x, team, drop_team=bad and args.fault == "shape_all")
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite pace loss {loss.item()} at step {step} on rank {rank} (check GPS time deltas)")
        opt.zero_grad(); loss.backward(); opt.step()
        m = torch.tensor([(pred - y).abs().sum().item(), float(len(y))])
        if bad and args.fault == "metric_size" and step == 3:
            m = torch.tensor([(pred - y).abs().sum().item(), float(len(y)), float(step)])
        dist.all_reduce(m)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {m[0].item() / m[1].item():.4f}")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export/pace_net_final.pt")
        say(f"saved export {WORK}/export/pace_net_final.pt")
    dist.destroy_process_group()


def spawn_entry(i, world, args):
    run(i, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        return prepare()
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
