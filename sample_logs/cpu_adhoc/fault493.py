"""EV charging-station demand forecasting: a small DDP (gloo, CPU) training job for batch 493.

Each rank reads its own shard of station sessions (/tmp/fault493_work/shard_rR.pt), joins each
row with the station lookup table (stations.json: capacity in kW), starts from init.pt and trains a
small MLP that forecasts the next hour's demand (kWh) for 6 steps, printing
`rank R step S loss L mae M` per step.  Rank 0 saves export.pt at the end.

Faults (--fault NAME --rank N):
  none            control, nothing planted
  key_error       rank N meets a station id that is not in the lookup table (KeyError)
  missing_shard   rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size       rank N builds the model with hidden=32, init.pt has hidden=16 (load_state_dict size mismatch)
  weights_only    rank N torch.loads a checkpoint holding a pickled StationMeta object (weights_only refusal)
  bad_allgather   rank N all_gathers a 3-element station-count tensor where peers use 2 (gloo size error)
  slow_rank       rank N does pure-Python feature work for ~45 s at step 3; its peers time out (pg timeout 12 s)
                  (with --pg-timeout 300 the job hangs instead and `timeout` ends it)
  nan_check       rank N gets a NaN in its features at step 3; the program's own finiteness check raises
  sigsegv         rank N sends itself SIGSEGV at step 2
  logged_exit     rank N prints its own ERROR line and sys.exit(4) at step 2
  shape_all       every rank adds a weather column (10 features into a 9-input model): matmul shape error
  worker_crash    rank N's DataLoader worker is SIGKILLed while loading batch 2

What happened (see the readme paragraph of batch 493 for the runs):
  none           all ranks ran 6 steps, rank 0 saved the export, exit 0
  key_error      rank N raised KeyError: 'ST-9999' at step 2; peers failed in gloo (connection closed) or were stopped
  missing_shard  rank N raised FileNotFoundError before step 0; peers failed at their first collective or were stopped
  ckpt_size      rank N raised RuntimeError (size mismatch for net.0.weight ...) in load_state_dict before DDP
  weights_only   rank N raised _pickle.UnpicklingError (Weights only load failed) before step 0
  bad_allgather  rank N raised a gloo size error in all_gather at step 1; peers failed or were stopped
  slow_rank      peers hit gloo timeouts after 12 s at step 3; with pg-timeout 300 nothing failed and timeout ended it
  nan_check      rank N raised FloatingPointError (non-finite loss) at step 3
  sigsegv        rank N died by SIGSEGV at step 2; peers lost their connection to it
  logged_exit    rank N printed ERROR ... and exited 4 at step 2
  shape_all      every rank raised RuntimeError mat1 and mat2 shapes cannot be multiplied at step 0
  worker_crash   rank N raised RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed
"""
import argparse, json, logging, os, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault493_work"
NFEAT = 8


class StationMeta:  # pickled into meta.pt, refused by the weights_only unpickler
    def __init__(self, region, tz):
        self.region, self.tz = region, tz


class Forecaster(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(NFEAT + 1, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(493)
    stations = {f"ST-{i:04d}": float(22 + 7 * (i % 9)) for i in range(40)}
    with open(f"{WORK}/stations.json", "w") as f:
        json.dump(stations, f)
    for r in range(8):
        feats = torch.randn(96, NFEAT, generator=g)
        ids = [f"ST-{int(i):04d}" for i in torch.randint(0, 40, (96,), generator=g)]
        target = feats[:, :3].sum(1) + 0.1 * torch.randn(96, generator=g)
        torch.save({"features": feats, "station_ids": ids, "target": target}, f"{WORK}/shard_r{r}.pt")
    torch.manual_seed(0)
    torch.save(Forecaster(16).state_dict(), f"{WORK}/init.pt")
    torch.save({"state": Forecaster(16).state_dict(), "meta": StationMeta("north", "UTC")}, f"{WORK}/init_meta.pt")
    print("prepared", WORK)


class Sessions(Dataset):
    def __init__(self, shard, stations, rank, fault, frank):
        self.s, self.st, self.rank, self.fault, self.frank = shard, stations, rank, fault, frank
        self.ids = list(shard["station_ids"])
        if fault == "key_error" and rank == frank:
            self.ids[2 * 16 + 5] = "ST-9999"  # a station commissioned after the lookup table was built

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.frank and i == 2 * 16:
            os.kill(os.getpid(), signal.SIGKILL)
        cap = self.st[self.ids[i]]
        x = torch.cat([self.s["features"][i], torch.tensor([cap / 100.0])])
        if self.fault == "shape_all":
            x = torch.cat([x, torch.tensor([0.5])])  # weather column added to the features, not to the model
        return x, self.s["target"][i]


def train(rank, world, args, out):
    fault, frank = args.fault, args.rank
    hit = rank == frank
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=args.pg_timeout))
    shard_path = f"{WORK}/shard_r{rank}.pt"
    if fault == "missing_shard" and hit:
        shard_path = f"{WORK}/shards_2026w49/shard_r{rank}.pt"
    shard = torch.load(shard_path)
    with open(f"{WORK}/stations.json") as f:
        stations = json.load(f)
    model = Forecaster(32 if (fault == "ckpt_size" and hit) else 16)
    if fault == "weights_only" and hit:
        model.load_state_dict(torch.load(f"{WORK}/init_meta.pt")["state"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/init.pt"))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ds = Sessions(shard, stations, rank, fault, frank)
    dl = DataLoader(ds, batch_size=16, shuffle=False, num_workers=1 if fault == "worker_crash" else 0)
    it = iter(dl)
    for step in range(args.steps):
        x, y = next(it)
        if fault == "nan_check" and hit and step == 3:
            x[0, 1] = float("nan")
        if fault == "sigsegv" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "logged_exit" and hit and step == 2:
            out(f"ERROR rank {rank}: occupancy feed for station group {rank} is stale (last update 2026-12-05T23:00Z); refusing to train")
            sys.exit(4)
        if fault == "slow_rank" and hit and step == 3:
            t0, acc = time.time(), 0  # pure-Python rolling-window demand features, far too slow
            while time.time() - t0 < args.slow_s:
                for k in range(20000):
                    acc += (k * 31) % 7
        pred = ddp(x)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} on rank {rank} at step {step} (demand batch has NaN/inf)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        mae = (pred - y).abs().mean().detach().reshape(1)
        dist.all_reduce(mae)
        if step == 1:
            n = torch.tensor([float(len(x)), float(world)] + ([1.0] if (fault == "bad_allgather" and hit) else []))
            outs = [torch.zeros(2) for _ in range(world)]
            dist.all_gather(outs, n)
        out(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export.pt")
        out(f"rank 0 saved export to {WORK}/export.pt")
    dist.destroy_process_group()


def entry(rank, world, args):
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [evch rank {rank}] %(levelname)s %(message)s")
        log = logging.getLogger("evch")
        try:
            train(rank, world, args, lambda m: (log.error if m.startswith("ERROR") else log.info)(m))
        except SystemExit:
            raise
        except BaseException:
            log.exception("training failed")
            sys.stdout.flush()
            sys.exit(1)
        return
    pre = f"rank {rank}: " if args.label else ""
    train(rank, world, args, lambda m: print(pre + m, flush=True))


def spawned(i, world, args):
    entry(i, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--slow-s", type=float, default=45)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    args = p.parse_args()
    if args.prepare:
        return prepare()
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(spawned, args=(args.spawn, args), nprocs=args.spawn)
        return
    entry(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
