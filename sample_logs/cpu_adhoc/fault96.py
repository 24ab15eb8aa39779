"""A ninety-sixth hand-run batch: THE PROCESS GROUP'S LIFECYCLE IN ONE JOB on gloo. A small learning-rate sweep run
inside one torchrun job: --trials (3) trials one after another in the same processes, lr from the grid
[0.1, 0.05, 0.02, 0.01][:trials]. Each trial builds a tiny model Linear(8,16)-ReLU-Linear(16,4) (seeded by the trial),
wraps it in DDP, trains --steps (4) SGD steps on 32 synthetic samples per rank, then evaluates: the validation loss is
averaged over the ranks with `dist.all_reduce` on the trial's evaluation group (`dist.new_group(backend="gloo",
timeout=--eval-timeout)`, made for the trial and destroyed after it). By default every trial does
`init_process_group("gloo", store=PrefixStore("sweep/trial<t>/a<attempt>", <torchrun's TCPStore, as a client>),
timeout=--pg-timeout)` ... `destroy_process_group()` (a fresh key namespace per trial; --store env: plain env://);
with --keep-group one default group is kept for the whole sweep and only the models (and evaluation groups) are
rebuilt. After the sweep every rank prints its best trial; the leader (rank 0) writes the sweep summary. Prints
`rank R world W fault F trials T keep K`, `rank R trial t lr L step S loss X`, `rank R trial t val V`,
`rank R sweep best trial t val V` and `rank R done`. No @record.

Faults (rank N = --rank):
  none        control (exit 0); with --keep-group: one group kept, models rebuilt per trial
  fewer       rank N's node-local sweep override drops the last lr: it finishes one trial early, destroys its group
              and exits 0 while the others start the last trial (their init_process_group waits for it; with
              --keep-group the kept group stays, and the last trial's new_group waits for it)
  extra       rank N's node-local sweep override adds lr 0.01: after the others have finished and left, rank N
              starts one trial more alone (its init_process_group waits for peers that are gone)
  keepinit    rank N is the trial logger: after writing a new best trial it returns from the trial's teardown before
              destroy_process_group(); its next trial's init_process_group raises (initialised twice)
  noteardown  the sweep's teardown is skipped on every rank ("reuse the group" flag set, but each trial still
              calls init_process_group): every rank raises at trial 2 (initialised twice)
  afterdestroy after the sweep's final destroy_process_group() rank N (the writer of the sweep report) waits for
              the others with dist.barrier() before writing it: not initialised on rank N only
  evalafter   train-then-evaluate: after the sweep every rank destroys the group, then a final evaluation of the best
              trial all-reduces its metric with dist.all_reduce: not initialised on every rank
  slowval     rank N writes the trial's validation predictions to disk synchronously before the eval all-reduce
              (blocks --eval-timeout + 5 s) in trial 2: the evaluation group's shorter timeout runs out on the
              others (a subgroup timeout, the default group's --pg-timeout is longer)
  envkeys     --store env: every trial calls plain init_process_group("gloo") (env://, torchrun's store, the same
              key names every trial): trial 2's groups read the gloo addresses trial 1 left in the store before all
              ranks replaced them: connectFullMesh cannot connect on every rank (no single rank)
  leakstore   --store own: the sweep makes its own TCPStore per trial on a fixed sweep port (MASTER_PORT + 40,
              hosted by rank N) and keeps each trial's store in the trial record: trial 2's TCPStore on rank N
              cannot listen (its own trial-1 store still holds the port)
  (a timeout: --pg-timeout for the default group and the store, --eval-timeout for the evaluation groups)
  retry       the trial loop retries a failed trial once after destroy_process_group()/init_process_group(); rank N
              reads a feature width of 10 from its node-local override in trial 2 (its batch is [32, 10]): its
              forward raises, it re-initialises and retries, the others' collectives break (caught, they
              retry too), and rank N's second attempt raises the same error
  widthdiff   --keep-group: rank N's node-local override gives hidden width 24 for trial 2: the rebuilt model's
              DDP constructor finds the parameter shapes differ across ranks
"""
import argparse, datetime, json, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--trials", type=int, default=3)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--eval-timeout", type=float, default=None)
p.add_argument("--keep-group", action="store_true")
p.add_argument("--store", default="job", choices=["job", "env", "own"])
a = p.parse_args()
if a.fault == "envkeys": a.store = "env"        # the faults' own launch configs
if a.fault == "leakstore": a.store = "own"
if a.fault == "widthdiff": a.keep_group = True

rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
addr = os.environ["MASTER_ADDR"]; sweep_port = int(os.environ["MASTER_PORT"]) + 40
pg_timeout = datetime.timedelta(seconds=a.pg_timeout)
eval_timeout = datetime.timedelta(seconds=a.eval_timeout if a.eval_timeout else a.pg_timeout)
GRID = [0.1, 0.05, 0.02, 0.01]


def local_override():
    """node-local sweep overrides (what a per-node config file would give this rank)"""
    o = {}
    if rank == a.rank:
        if a.fault == "fewer": o["lrs"] = GRID[:a.trials - 1]
        if a.fault == "extra": o["lrs"] = GRID[:a.trials] + [GRID[a.trials] if a.trials < len(GRID) else 0.005]
        if a.fault == "retry": o["features"] = {2: 10}
        if a.fault == "widthdiff": o["hidden"] = {2: 24}
    return o


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden); self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


trial_log = []


_job_store = None


def setup(t, attempt=1):
    global _job_store
    if a.store == "own":
        store = dist.TCPStore(addr, sweep_port, world, is_master=(rank == a.rank), timeout=pg_timeout)
        trial_log.append({"trial": t, "store": store})
        dist.init_process_group("gloo", store=dist.PrefixStore(f"trial{t}", store), rank=rank, world_size=world,
                                timeout=pg_timeout)
    elif a.store == "env":
        dist.init_process_group("gloo", timeout=pg_timeout)
    else:   # torchrun's own store, one key namespace per trial (and attempt)
        if _job_store is None:
            _job_store = dist.TCPStore(addr, int(os.environ["MASTER_PORT"]), world, is_master=False,
                                       timeout=pg_timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"sweep/trial{t}/a{attempt}", _job_store),
                                rank=rank, world_size=world, timeout=pg_timeout)


def run_trial(t, lr, cfg, eval_pg):
    torch.manual_seed(100 + t)
    hidden = cfg.get("hidden", {}).get(t, 16)
    feats = cfg.get("features", {}).get(t, 8)
    model = DDP(Net(hidden))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(32, feats, generator=g); y = torch.randint(0, 4, (32,), generator=g)
    for s in range(1, a.steps + 1):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        print(f"rank {rank} trial {t} lr {lr} step {s} loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        xv = torch.randn(64, feats, generator=g); yv = torch.randint(0, 4, (64,), generator=g)
        val = nn.functional.cross_entropy(model(xv), yv)
    if a.fault == "slowval" and rank == a.rank and t == 2:
        print(f"rank {rank} trial {t} writing validation predictions to /tmp/fault96_work/preds_t{t}_r{rank}.pt",
              flush=True)
        with open(f"/tmp/fault96_work/preds_t{t}_r{rank}.pt", "wb") as f:
            torch.save(model.module(xv), f)
            f.flush(); os.fsync(f.fileno())
            time.sleep(eval_timeout.total_seconds() + 5)   # the shared mount's sync write
    v = val.detach().clone()
    dist.all_reduce(v, group=eval_pg)
    v /= world
    print(f"rank {rank} trial {t} val {v.item():.4f}", flush=True)
    return v.item()


def teardown(t, val, best):
    if a.fault == "keepinit" and rank == a.rank and (best is None or val < best[1]):
        print(f"rank {rank} trial {t} new best val {val:.4f}, logged", flush=True)
        return
    if a.fault == "noteardown":   # reuse_group=True: the group is meant to be kept
        return
    dist.destroy_process_group()


def main():
    cfg = local_override()
    lrs = cfg.get("lrs", GRID[:a.trials])
    print(f"rank {rank} world {world} fault {a.fault} trials {len(lrs)} keep {a.keep_group}", flush=True)
    best = None
    if a.keep_group:
        setup(0)
    for t, lr in enumerate(lrs, 1):
        attempts = 2 if a.fault == "retry" else 1
        for attempt in range(1, attempts + 1):
            if not a.keep_group:
                setup(t, attempt)
            eval_pg = dist.new_group(backend="gloo", timeout=eval_timeout)
            try:
                val = run_trial(t, lr, cfg, eval_pg)
                break
            except RuntimeError as e:
                if attempt == attempts:
                    raise
                print(f"rank {rank} trial {t} attempt {attempt} failed: {str(e).splitlines()[0]}; "
                      f"re-initialising the process group", flush=True)
                dist.destroy_process_group()
        dist.destroy_process_group(eval_pg)
        if best is None or val < best[1]:
            prev = best
            best = (t, val)
        else:
            prev = best
        if not a.keep_group:
            teardown(t, val, prev)
    if a.keep_group:
        dist.destroy_process_group()
    print(f"rank {rank} sweep best trial {best[0]} val {best[1]:.4f}", flush=True)
    if a.fault == "evalafter":
        v = torch.tensor([best[1]])
        dist.all_reduce(v)           # final evaluation of the best trial, averaged over the ranks
        print(f"rank {rank} final val {v.item() / world:.4f}", flush=True)
    if rank == (a.rank if a.fault == "afterdestroy" else 0):
        if a.fault == "afterdestroy":
            dist.barrier()           # everyone finished before the report is written
        with open(f"/tmp/fault96_work/sweep_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}.json", "w") as f:
            json.dump({"best_trial": best[0], "val": best[1], "lrs": lrs}, f)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
