"""Talus slope creep: a small data-parallel regression of creep rate (mm/day) on slope sensors.

Each rank reads its own shard of inclinometer / pore-pressure readings, looks up a per-cell
creep coefficient in a table, starts from a shared checkpoint, averages its gradients with
the others (gloo, CPU) for 6 steps and prints `rank R step S loss L creep_mm M`; rank 0 writes
an export at the end.  `--prepare` writes the synthetic data into the work folder.

Faults (--fault NAME --rank N plants one):
  none            control, nothing planted
  keyerror        rank N looks up a slope cell id the coefficient table does not have (KeyError)
  missing_shard   rank N opens a shard file that was never written (FileNotFoundError)
  ckpt_size       rank N builds its net with a wider hidden layer; load_state_dict size mismatch
  weights_only    rank N loads a survey-metadata checkpoint holding a custom class (weights_only refusal)
  wrong_size      rank N all_reduces a gradient buffer one element longer than its peers'
  slow_rank       rank N does a long pure-Python recount at step 3; its peers' collective times out
                  (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan_check       rank N's pore pressure becomes NaN; the program's own finiteness check raises
  sigsegv         rank N sends itself SIGSEGV at step 2
  error_exit      rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       every rank drops one sensor column at step 2 (matmul shape error on all ranks)
  worker_crash    rank N's DataLoader worker is killed by SIGKILL (use --workers 1)
  skip_barrier    rank N skips the barrier before the export and goes on to a long local check

What happened (gloo, torch 2.13.0+cpu, on a heavily loaded 2-core machine):
  none            np3 bashloop: 6 steps on every rank, export written, exit 0
  keyerror        np4 ranklabel / np6 tee: KeyError 'cell17' / 'cell12' on the planted rank, peers get gloo
                  'Connection closed by peer'; exit 134 (one process aborted) / 1 (torchrun names the rank)
  missing_shard   np5 srunlabel: FileNotFoundError for resurvey/shard_3.pt on rank 3; two peers never finished
                  tearing down and the 100 s timeout ended the run (exit 124)
  ckpt_size       np4 mpitag: load_state_dict size mismatch (48 vs 32) on rank 1; peers' connection closed; exit 1
  weights_only    np3 files: UnpicklingError 'Weights only load failed' (SurveyMeta) in rank2.log; exit 1
  wrong_size      np3 mpitag: rank 1 aborts on gloo 'Received data size doesn't match' (372 vs 368); exit 134
                  (an np6 bashloop run never reached step 0 in 100 s and was dropped)
  slow_rank       np5 logfmt: output stops after step 2, no timeout error appears, 100 s timeout (exit 124);
                  np3 srunlabel with --pg-timeout 300: the hang, output stops after step 2, 60 s timeout (exit 124)
  nan_check       np3 spawn: FloatingPointError from the script's own check on rank 1, re-raised by mp.spawn; exit 1
  sigsegv         np4 pdsh2: rank 2 dies of SIGSEGV (exitcode -11) on worker-1, peers reset/closed; exit 1
  error_exit      np6 ranklabel: rank 4's own ERROR line, sys.exit(4), peers' connection closed; exit 4
  shape_all       np4 logfmt: every rank logs mat1 and mat2 shapes cannot be multiplied (8x15 and 16x32); exit 1
  worker_crash    np3 bashloop: 'DataLoader worker (pid N) is killed by signal: Killed.' on rank 1; exit 1
  skip_barrier    np5 srunlabel: rank 1 skips the barrier, ranks 0,2,3,4 time out after 12000 ms in it; exit 1
"""
import argparse, json, logging, os, signal, sys, time

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault589_work"
NSENS = 16


class SurveyMeta:
    def __init__(self, site):
        self.site = site


class CreepNet(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.enc = nn.Linear(NSENS, hidden)
        self.act = nn.Tanh()
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.act(self.enc(x))).squeeze(-1)


class Shard(torch.utils.data.Dataset):
    def __init__(self, d, crash_rank):
        self.d, self.crash = d, crash_rank

    def __len__(self):
        return len(self.d["x"])

    def __getitem__(self, i):
        if self.crash and i >= 16:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.d["x"][i], self.d["cell"][i], self.d["y"][i]


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(589)
    for r in range(8):
        x = torch.randn(64, NSENS, generator=g)
        cell = torch.randint(0, 12, (64,), generator=g)
        y = x[:, 0] * 0.3 + x[:, 3] * 0.1 + 0.05 * torch.randn(64, generator=g)
        torch.save({"x": x, "cell": cell, "y": y}, f"{WORK}/shard_{r}.pt")
    json.dump({f"cell{i}": round(0.8 + 0.03 * i, 3) for i in range(12)}, open(f"{WORK}/cells.json", "w"))
    torch.manual_seed(0)
    torch.save(CreepNet().state_dict(), f"{WORK}/init.pt")
    torch.save({"meta": SurveyMeta("north talus"), "epoch": 3}, f"{WORK}/survey_meta.pt")
    print("prepared", WORK)


def run(rank, world, a):
    tag = f"rank {rank}: " if os.environ.get("RANKLABEL") else ""
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    lg = logging.getLogger("talus")

    def say(msg):
        if a.logfmt:
            lg.info(msg)
        else:
            print(tag + msg, flush=True)

    bad = a.rank == rank
    import datetime
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.pg_timeout))
    say(f"joined world of {world}, talus creep model, pg timeout {a.pg_timeout}s")
    table = json.load(open(f"{WORK}/cells.json"))
    shard_path = f"{WORK}/shard_{rank}.pt"
    if a.fault == "missing_shard" and bad:
        shard_path = f"{WORK}/resurvey/shard_{rank}.pt"
    data = torch.load(shard_path)
    hidden = 48 if (a.fault == "ckpt_size" and bad) else 32
    model = CreepNet(hidden)
    model.load_state_dict(torch.load(f"{WORK}/init.pt"))
    if a.fault == "weights_only" and bad:
        meta = torch.load(f"{WORK}/survey_meta.pt")
        say(f"survey meta {meta}")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = Shard(data, a.fault == "worker_crash" and bad)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=a.workers)
    it = iter(dl)
    for step in range(6):
        x, cell, y = next(it)
        if a.fault == "keyerror" and bad and step == 2:
            cell = cell + 12
        coef = torch.tensor([table[f"cell{int(c)}"] for c in cell])
        if a.fault == "nan_check" and bad and step == 3:
            x = x.clone(); x[:, 5] = float("nan")
        if a.fault == "shape_all" and step == 2:
            x = x[:, 1:]
        if a.fault == "sigsegv" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "error_exit" and bad and step == 1:
            print(f"{tag}ERROR: slope cell survey on rank {rank} has no reading for inclinometer T{rank}7; refusing to train",
                  flush=True)
            sys.exit(4)
        if a.fault == "slow_rank" and bad and step == 3:
            n = 0
            t0 = time.time()
            while time.time() - t0 < a.slow_s:
                for k in range(20000):
                    n += k % 7
        pred = model(x) * coef
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite creep loss {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if a.fault == "wrong_size" and bad and step == 2:
            flat = torch.cat([flat, torch.zeros(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n_ = p.numel(); p.grad.copy_(flat[off:off + n_].view_as(p)); off += n_
        opt.step()
        say(f"rank {rank} step {step} loss {loss.item():.4f} creep_mm {pred.mean().item():.3f}")
    if a.fault == "skip_barrier" and bad:
        say("skipping export barrier; running local drift check")
        t0 = time.time(); n = 0
        while time.time() - t0 < a.slow_s:
            for k in range(20000):
                n += k % 5
    else:
        dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/creepnet.pt")
        say("export written")
    dist.destroy_process_group()
    say("done")


def spawn_entry(i, world, a):
    run(i, world, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=30)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(a.spawn, a), nprocs=a.spawn)
        return
    rank = int(os.environ["RANK"])
    if not a.logfmt:
        return run(rank, int(os.environ["WORLD_SIZE"]), a)
    try:
        run(rank, int(os.environ["WORLD_SIZE"]), a)
    except Exception:
        logging.getLogger("talus").exception("training failed on rank %d", rank)
        sys.exit(1)


if __name__ == "__main__":
    main()
