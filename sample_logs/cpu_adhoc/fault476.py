"""fault476.py - river discharge forecasting from upstream gauges and rainfall (batch 476).

A small data-parallel job: each rank reads its shard of hourly windows (4 upstream gauge
levels + 3 rainfall lags per sample, plus a gauge id), looks up the basin area of the
gauge in a shared table, builds 8 features and trains a small MLP (DischargeNet) to
predict discharge at the outlet.  Gradients are averaged by hand with gloo all_reduce,
6 steps, every rank prints `rank R step S loss L nse M`, rank 0 saves an export.

Usage:
  python fault476.py --prepare                      # synthetic data into /tmp/fault476_work
  python fault476.py [--fault NAME --rank N] [--pg-timeout S] [--label] [--logfmt] [--spawn W]

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none            control, nothing planted
  gauge_keyerror  rank N's batch at step 2 carries a gauge id missing from the area table -> KeyError
  missing_shard   rank N opens a shard file for a month that was never written -> FileNotFoundError
  ckpt_size       rank N builds DischargeNet with hidden=48, the start checkpoint has 32 -> load_state_dict size mismatch
  weights_only    rank N loads the calibrated checkpoint (holds a GaugeCalibration object) with weights_only=True -> UnpicklingError
  gather_size     rank N all_gathers a per-station error vector of 5 entries, the others 4 (step 3)
  slow_rank       rank N spends --slow-s seconds in pure-Python channel routing before step 2's all_reduce; peers time out
                  (with --pg-timeout 300 the job just hangs until `timeout` ends it)
  nan_check       rank N's rainfall at step 3 holds a NaN; the program's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 3
  logged_exit     rank N prints its own ERROR line about a gauge gap and calls sys.exit(4) at step 1
  shape_all       every rank drops the basin-area column from its features -> matmul shape error on every rank
  host_mem        rank N caps its address space (RLIMIT_AS) and then allocates a 6 GiB radar cube -> DefaultCPUAllocator error
  loader_worker   rank N reads through a DataLoader worker that is SIGKILLed at step 2 -> DataLoader worker killed

What happened (batch 476 runs, gloo on CPU, torch 2.13.0+cpu):
  none            np3 mpitag: all ranks ran 6 steps, rank 0 saved the export, exit 0.
  gauge_keyerror  np4 r2 bashloop / np6 r5 mpitag: KeyError: 'G-0917' on the planted rank, peers died with gloo
                  connection closed / 12000ms recv timeouts (np4 exited 124 via the 100 s wrapper under load; mpitag exit 0 via its pipes).
  missing_shard   np5 r3 srunlabel: FileNotFoundError for shards/rank03_2026-11.pt, peers' gloo errors; exit 124 (wrapper, overloaded machine).
  ckpt_size       np3 r1 legacy: load_state_dict size mismatch (48 vs 32) on rank 1, launcher SIGTERMed the rest; exit 1.
  weights_only    np6 r4 files / np3 r0 logfmt: _pickle.UnpicklingError (GaugeCalibration not an allowed global), peers' gloo errors.
  gather_size     np3 r2 ranklabel / np8 r6 tee: ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4)).
  slow_rank       np4 r2 logfmt: peers timed out after 12 s, slow rank then saw connection closed; processes hung at exit, exit 124.
                  np3 r1 bashloop --pg-timeout 300: output stopped at rank 1's "re-routing" line until timeout 60 ended it (exit 124).
  nan_check       np4 r1 spawn: FloatingPointError: rank 1 step 3: non-finite discharge loss nan, re-raised by mp.spawn; exit 1.
  sigsegv         np5 r4 tee: rank 4 died silently with exitcode -11, torchrun root cause names it; exit 1.
  logged_exit     np5 r4 srunlabel: rank 4's ERROR line, then "terminate called without an active exception" at its exit; exit 0 (sed pipes).
  shape_all       np4 pdsh2: mat1 and mat2 shapes cannot be multiplied (16x7 and 8x32) on all four ranks; exit 1.
  host_mem        np3 r2 bashloop: DefaultCPUAllocator: can't allocate memory (6442450944 bytes) on rank 2; exit 1.
  loader_worker   np4 r1 files: DataLoader worker (pid N) is killed by signal: Killed. on rank 1; exit 1.
"""
import argparse, json, logging, os, signal, sys, time, datetime

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault476_work"
NGAUGE = 12
BATCH = 16
STEPS = 6


class GaugeCalibration:
    def __init__(self, offsets):
        self.offsets = offsets


class DischargeNet(nn.Module):
    def __init__(self, nin=8, hidden=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(nin, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def prepare():
    g = torch.Generator().manual_seed(476)
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    areas = {f"G-{i:04d}": float(50 + 37 * i) for i in range(1, NGAUGE + 1)}
    with open(f"{WORK}/gauge_areas.json", "w") as f:
        json.dump(areas, f, indent=1)
    ids = sorted(areas)
    for r in range(8):
        n = BATCH * STEPS
        levels = torch.rand(n, 4, generator=g) * 3.0
        rain = torch.rand(n, 3, generator=g) * 20.0
        gid = [ids[int(i)] for i in torch.randint(0, NGAUGE, (n,), generator=g)]
        q = 0.8 * levels.sum(1) + 0.05 * rain.sum(1) + 0.1 * torch.randn(n, generator=g)
        torch.save({"levels": levels, "rain": rain, "gauge": gid, "q": q}, f"{WORK}/shards/rank{r:02d}_2026-10.pt")
    torch.manual_seed(0)
    m = DischargeNet()
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    torch.save({"model": m.state_dict(), "calibration": GaugeCalibration([0.01] * NGAUGE)}, f"{WORK}/start_calibrated.pt")
    print("prepared", WORK)


def main(rank=None, world=None, args=None):
    if rank is None:
        rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
    fault, frank = args.fault, args.rank
    mine = fault != "none" and (fault == "shape_all" or rank == frank)
    pre = f"rank {rank}: " if args.label else ""
    log = None
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("rivq.train")

    def say(msg):
        if log: log.info(msg)
        else: print(pre + msg, flush=True)

    def err(msg):
        if log: log.error(msg)
        else: print(pre + msg, flush=True)

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    say(f"rank {rank}/{world} joined (gloo, pg timeout {args.pg_timeout}s)")
    month = "2026-11" if (fault == "missing_shard" and mine) else "2026-10"
    shard = torch.load(f"{WORK}/shards/rank{rank:02d}_{month}.pt")
    with open(f"{WORK}/gauge_areas.json") as f:
        areas = json.load(f)

    hidden = 48 if (fault == "ckpt_size" and mine) else 32
    model = DischargeNet(hidden=hidden)
    if fault == "weights_only" and mine:
        state = torch.load(f"{WORK}/start_calibrated.pt", weights_only=True)["model"]
    else:
        state = torch.load(f"{WORK}/start.pt", weights_only=True)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    say(f"loaded start checkpoint, {sum(p.numel() for p in model.parameters())} parameters, {len(shard['q'])} windows")

    loader_iter = None
    if fault == "loader_worker" and mine:
        class Windows(torch.utils.data.Dataset):
            def __len__(self): return STEPS
            def __getitem__(self, i):
                if i == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return i
        loader_iter = iter(torch.utils.data.DataLoader(Windows(), batch_size=None, num_workers=1))

    for step in range(STEPS):
        if loader_iter is not None:
            step_idx = next(loader_iter)
        sl = slice(step * BATCH, (step + 1) * BATCH)
        levels, rain, q = shard["levels"][sl], shard["rain"][sl].clone(), shard["q"][sl]
        gids = list(shard["gauge"][sl])
        if fault == "gauge_keyerror" and mine and step == 2:
            gids[5] = "G-0917"
        if fault == "nan_check" and mine and step == 3:
            rain[7, 1] = float("nan")
        if fault == "logged_exit" and mine and step == 1:
            err(f"ERROR rank {rank}: upstream gauge G-0004 has 3 of 24 hourly readings in this window; "
                f"refusing to train on a gap-filled series")
            sys.exit(4)
        if fault == "sigsegv" and mine and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "host_mem" and mine and step == 2:
            import resource
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
            radar = torch.zeros(24, 64, 1024, 1024)  # 6 GiB float32 rainfall radar cube
        area = torch.tensor([areas[gid] for gid in gids]) / 1000.0
        feats = [levels, rain / 10.0] if fault == "shape_all" else [levels, rain / 10.0, area[:, None]]
        x = torch.cat(feats, 1)
        pred = model(x)
        loss = nn.functional.mse_loss(pred, q)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite discharge loss {loss.item()} "
                                     f"(rainfall or gauge input contains NaN/inf)")
        opt.zero_grad()
        loss.backward()
        if fault == "slow_rank" and mine and step == 2:
            say(f"rank {rank} re-routing channel reaches for step {step}")
            t0 = time.time(); acc = 0.0; k = 0
            while time.time() - t0 < args.slow_s:  # pure-Python Muskingum routing, far too slow
                for j in range(20000):
                    acc = 0.3 * acc + 0.7 * ((k + j) % 97) / 97.0
                k += 1
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        with torch.no_grad():
            nse = 1 - ((pred - q) ** 2).sum() / ((q - q.mean()) ** 2).sum()
        if step == 3:
            nerr = 5 if (fault == "gather_size" and mine) else 4
            st_err = torch.full((nerr,), loss.item())
            out = [torch.zeros(4) for _ in range(world)]
            dist.all_gather(out, st_err)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        say(f"rank {rank} step {step} loss {lt.item() / world:.4f} nse {nse.item():.4f}")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_discharge.pt")
        say(f"rank 0 saved export to {WORK}/export_discharge.pt")
    dist.destroy_process_group()
    say(f"rank {rank} done")


def _wrapped(rank, world, args):
    if args.logfmt:
        try:
            main(rank, world, args)
        except SystemExit:
            raise
        except BaseException:
            logging.getLogger("rivq.train").exception("training failed")
            sys.exit(1)
    else:
        main(rank, world, args)


def _spawn_entry(rank, world, args):
    os.environ["RANK"] = str(rank); os.environ["WORLD_SIZE"] = str(world)
    _wrapped(rank, world, args)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--slow-s", type=float, default=40)
    ap.add_argument("--label", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    a = ap.parse_args()
    if a.prepare:
        prepare(); sys.exit(0)
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(_spawn_entry, args=(a.spawn, a), nprocs=a.spawn)
    else:
        r = int(os.environ["RANK"]); _wrapped(r, int(os.environ["WORLD_SIZE"]), a)
