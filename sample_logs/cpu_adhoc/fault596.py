"""Avocet feeding sweeps: a small distributed training job (gloo, CPU) used to make labelled failure logs.

Each rank reads its own shard of synthetic avocet sweep records (bill-sweep angle, mud depth, sweep rate,
prey type), maps prey types through a lookup table, and trains a small catch-rate regressor, all-reducing
gradients by hand. Every rank prints `rank R step S loss L catch_rate M` per step; rank 0 saves an export.

Faults (--fault NAME --rank N plants one):
  none          control run, nothing planted
  keyerror      rank N meets a prey type ("brine_shrimp") that is not in the lookup table -> KeyError
  missing_shard rank N's shard file is absent -> FileNotFoundError
  ckpt_size     rank N builds its head with 24 hidden units; the 16-unit start checkpoint -> size mismatch
  weights_only  rank N loads a checkpoint that pickles a custom SweepMeta object; torch.load refuses it
  gather_shape  rank N all_gathers its catch tally with 5 elements instead of 4 (gloo invalid size)
  slow          rank N does 40 s of pure-Python sweep re-scoring at step 2; peers time out (pg timeout 12 s)
  hang          like slow but 400 s and run with --pg-timeout 300; the outer `timeout` ends the run
  nan           rank N's sweep rates turn NaN at step 3; the job's own finiteness check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line and calls sys.exit(4)
  shape_all     every rank builds the mud-depth feature with one column too many -> matmul shape error
  worker_crash  rank N's DataLoader worker kills itself with SIGKILL at step 2

What happened (after the runs):
  none          3 ranks x 6 steps, export saved, exit 0.
  keyerror      KeyError: 'brine_shrimp' on the planted rank before step 0; with --local-ranks-filter hiding it, only the summary (exit 1).
  missing_shard FileNotFoundError for shard_1_sweeps_missing.pt, visible only in the rank's redirected stderr.log.
  ckpt_size     load_state_dict RuntimeError: size mismatch [16, 8] vs [24, 8] on the planted rank.
  weights_only  _pickle.UnpicklingError: Weights only load failed, Unsupported global __main__.SweepMeta.
  gather_shape  plain gloo: "ProcessGroupGloo::allgather: invalid tensor size" on the planted rank, peers see connection closed;
                under TORCH_DISTRIBUTED_DEBUG=DETAIL every rank raises "Detected mismatch between collectives" (shape [5] vs [4]).
  slow          peers fail all_reduce with gloo "Timed out waiting 12000ms"; the slow rank prints nothing and is SIGTERMed.
  hang          steps 0-1 then silence; `timeout` ended it (rc 124), the agent died with SignalException signal 15.
  nan           FloatingPointError from the job's own check at step 3 (once followed by "terminate called", SIGABRT exit).
  segv          exitcode -11 (SIGSEGV) root cause, peers see gloo connection closed/reset.
  error_exit    the rank's own ERROR line, exit code 4; with --max-restarts 1 the restart died in gloo connectFullMesh.
  shape_all     every rank: mat1 and mat2 shapes cannot be multiplied (16x9 and 8x16).
  worker_crash  "DataLoader worker (pid N) is killed by signal: Killed." on the planted rank.
"""
import argparse, os, sys, time, signal, json, math
import torch
import torch.distributed as dist
from datetime import timedelta

WORK = "/tmp/fault596_work"
PREY = ["chironomid", "corixid", "nereid", "amphipod", "snail"]


class SweepMeta:
    def __init__(self, site):
        self.site = site


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(596)
    for r in range(8):
        n = 64
        recs = {
            "angle": torch.rand(n, generator=g) * 60.0,
            "depth": torch.rand(n, generator=g) * 4.0,
            "rate": torch.rand(n, generator=g) * 2.0,
            "prey": [PREY[int(i)] for i in torch.randint(0, len(PREY), (n,), generator=g)],
        }
        torch.save(recs, f"{WORK}/shard_{r}.pt")
    with open(f"{WORK}/prey_lookup.json", "w") as f:
        json.dump({p: i for i, p in enumerate(PREY)}, f)
    model = make_model(16)
    torch.save(model.state_dict(), f"{WORK}/start.pt")
    torch.save({"state": model.state_dict(), "meta": SweepMeta("Titchwell")}, f"{WORK}/start_meta.pt")
    print("prepared", WORK)


def make_model(hidden):
    return torch.nn.Sequential(torch.nn.Linear(3 + len(PREY), hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


class SweepSet(torch.utils.data.Dataset):
    def __init__(self, feats, target, crash):
        self.feats, self.target, self.crash = feats, target, crash

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        if self.crash and i >= 32:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.feats[i], self.target[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    pid_dir = os.environ.get("FAULT596_PIDS")
    if pid_dir:
        os.makedirs(pid_dir, exist_ok=True)
        open(f"{pid_dir}/{os.getpid()}", "w").close()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = a.rank == rank
    torch.manual_seed(0)

    shard = f"{WORK}/shard_{rank}.pt"
    if a.fault == "missing_shard" and mine:
        shard = f"{WORK}/shard_{rank}_sweeps_missing.pt"
    recs = torch.load(shard)
    with open(f"{WORK}/prey_lookup.json") as f:
        lookup = json.load(f)
    prey = list(recs["prey"])
    if a.fault == "keyerror" and mine:
        prey[17] = "brine_shrimp"
    prey_idx = torch.tensor([lookup[p] for p in prey])
    onehot = torch.nn.functional.one_hot(prey_idx, len(PREY)).float()
    cols = [recs["angle"] / 60.0, recs["depth"] / 4.0, recs["rate"] / 2.0]
    if a.fault == "shape_all":
        cols.append(recs["depth"] ** 2)
    feats = torch.cat([torch.stack(cols, 1), onehot], 1)
    target = (recs["rate"] * (1.0 + prey_idx.float() * 0.1) - recs["depth"] * 0.05).unsqueeze(1)

    model = make_model(24 if (a.fault == "ckpt_size" and mine) else 16)
    if a.fault == "weights_only" and mine:
        ck = torch.load(f"{WORK}/start_meta.pt")
        model.load_state_dict(ck["state"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    ds = SweepSet(feats, target, a.fault == "worker_crash" and mine)
    dl = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=1 if (a.fault == "worker_crash" and mine) else 0)
    it = iter(dl)
    for step in range(a.steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(dl)
            x, y = next(it)
        if a.fault == "nan" and mine and step == 3:
            x = x.clone()
            x[:, 2] = float("nan")
        if a.fault in ("slow", "hang") and mine and step == 2:
            limit = 40.0 if a.fault == "slow" else 400.0
            t0, acc = time.time(), 0.0
            while time.time() - t0 < limit:
                for k in range(20000):
                    acc += math.sin(k * 0.001) * 0.5
        if a.fault == "segv" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "error_exit" and mine and step == 1:
            print(f"ERROR rank {rank}: sweep log for site Titchwell has 0 usable sweeps after depth filter, aborting", flush=True)
            sys.exit(4)
        pred = model(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite sweep rate in batch)")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        tally = torch.tensor([float(step), loss.item(), float(len(y)), float(rank)])
        if a.fault == "gather_shape" and mine and step == 2:
            tally = torch.cat([tally, torch.ones(1)])
        out = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(out, tally)
        catch = float(pred.detach().mean())
        print(f"rank {rank} step {step} loss {loss.item():.4f} catch_rate {catch:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_avocet.pt")
        print("rank 0 saved export", f"{WORK}/export_avocet.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
