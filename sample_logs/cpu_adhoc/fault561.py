"""Batch 561 fault script: "pumice raft drift".

A small drift-forecast job: each rank reads its own shard of pumice-raft buoy tracks
(/tmp/fault561_work/shard_R.pt), maps buoy ids to raft cluster rows through a lookup
table (raft_lookup.json), starts from a checkpoint (drift_init.pt), trains a tiny MLP
that predicts the next displacement (gloo, CPU, all-reduce of the gradients by hand),
prints `rank R step S loss L drift_km D` each step and rank 0 saves drift_export.pt.

Faults (--fault NAME --rank N):
  none            control, nothing planted
  lookup_key      rank N looks up a buoy id that is not in the lookup table (KeyError)
  missing_shard   rank N's shard file is missing (FileNotFoundError)
  ckpt_size       rank N loads a checkpoint whose head has another width (size mismatch)
  nan_check       rank N's drift becomes NaN; the program's own check raises FloatingPointError
  segv            rank N sends itself SIGSEGV at step 2
  logged_exit     rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       every rank builds the head with the wrong input width (RuntimeError in matmul)
  slow_rank       rank N does long pure-Python work at step 2; peers hit the gloo timeout
  hang            like slow_rank but forever-ish; run with --pg-timeout 300 so `timeout` ends it
  wrong_numel     rank N all-reduces a gradient buffer of another size
  loader_worker   a DataLoader worker of rank N dies (os._exit inside the worker)

What happened:
  none            np4 bashloop: 6 steps on every rank, export saved, exit 0
  lookup_key      KeyError: 'buoy_raft_X17' on rank N in the first batch; peers get gloo "Connection closed by peer"
  missing_shard   FileNotFoundError for shard_N_drifted.pt on rank N; peers get "Connection closed by peer"
  ckpt_size       load_state_dict size mismatch (24 vs 16 hidden) on rank N; peers get "Connection closed by peer"
  nan_check       FloatingPointError "drift_km is not finite on rank N at step 3: nan"; peers cascade
  segv            rank N dies with SIGSEGV at step 2 (bash 'Segmentation fault' / torchrun exitcode -11)
  logged_exit     rank N prints its ERROR line and exits 4; torchrun names it as root cause
  shape_all       the wrong head width surfaces as a load_state_dict size mismatch on every rank
  slow_rank       peers fail with gloo "Timed out waiting 12000ms"; torchrun's summary blames rank 0
  hang            steps 0-1, then silence until `timeout` kills the job (exit 124)
  wrong_numel     rank N aborts: terminate called after gloo::EnforceNotMet "84 vs 68"; peers reset/closed
  loader_worker   rank N: "DataLoader worker (pid ...) exited unexpectedly with exit code 9"; peers time out/close
"""
import argparse, json, logging, os, signal, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault561_work"
FEAT = 6


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(561)
    lookup = {f"buoy{i:03d}": i % 8 for i in range(64)}
    with open(f"{WORK}/raft_lookup.json", "w") as f:
        json.dump(lookup, f)
    for r in range(world):
        ids = [f"buoy{(r * 7 + j) % 64:03d}" for j in range(48)]
        x = torch.randn(48, FEAT, generator=g)
        y = torch.randn(48, 2, generator=g) * 0.1
        torch.save({"ids": ids, "x": x, "y": y}, f"{WORK}/shard_{r}.pt")
    m = build_model(FEAT)
    torch.save(m.state_dict(), f"{WORK}/drift_init.pt")
    bad = build_model(FEAT, hidden=24)
    torch.save(bad.state_dict(), f"{WORK}/drift_init_wide.pt")
    print(f"prepared {world} shards in {WORK}")


def build_model(inp, hidden=16):
    return nn.Sequential(nn.Linear(inp + 8, hidden), nn.Tanh(), nn.Linear(hidden, 2))


class Tracks(torch.utils.data.Dataset):
    def __init__(self, shard, lookup, bad_worker):
        self.s, self.lookup, self.bad = shard, lookup, bad_worker

    def __len__(self):
        return len(self.s["ids"])

    def __getitem__(self, i):
        if self.bad and i >= 20:
            os._exit(9)
        cl = torch.zeros(8)
        cl[self.lookup[self.s["ids"][i]]] = 1.0
        return torch.cat([self.s["x"][i], cl]), self.s["y"][i]


def main(rank, world, args):
    torch.set_num_threads(1)
    pre = f"rank {rank}: " if args.label else ""
    log = None
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("pumice.drift")

    def say(msg):
        if log:
            log.info(msg)
        else:
            print(pre + msg, flush=True)

    f, fr = args.fault, args.rank
    mine = rank == fr
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.pg_timeout))
    say(f"joined drift group world={world} fault={f}")
    with open(f"{WORK}/raft_lookup.json") as fh:
        lookup = json.load(fh)
    shard_path = f"{WORK}/shard_{rank}.pt"
    if f == "missing_shard" and mine:
        shard_path = f"{WORK}/shard_{rank}_drifted.pt"
    shard = torch.load(shard_path)
    if f == "lookup_key" and mine:
        shard["ids"][5] = "buoy_raft_X17"
    model = build_model(FEAT)
    if f == "shape_all":
        model = nn.Sequential(nn.Linear(FEAT, 16), nn.Tanh(), nn.Linear(16, 2))
    ck = f"{WORK}/drift_init.pt"
    if f == "ckpt_size" and mine:
        ck = f"{WORK}/drift_init_wide.pt"
    model.load_state_dict(torch.load(ck, weights_only=True))
    ds = Tracks(shard, lookup, f == "loader_worker" and mine)
    nw = 1 if f == "loader_worker" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=nw)
    it = iter(dl)
    for step in range(6):
        x, y = next(it)
        if f == "slow_rank" and mine and step == 2:
            t0 = time.time(); acc = 0
            while time.time() - t0 < args.pg_timeout + 10:
                acc += sum(i * i for i in range(2000))
        if f == "hang" and mine and step == 2:
            t0 = time.time(); acc = 0
            while time.time() - t0 < 1000:
                acc += sum(i * i for i in range(2000))
        if f == "segv" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "logged_exit" and mine and step == 3:
            print(f"{pre}ERROR: raft cluster table for rank {rank} drifted out of range (cluster 9 >= 8); aborting", flush=True)
            sys.exit(4)
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        drift = out.detach().norm(dim=1).mean() * 111.0
        if f == "nan_check" and mine and step == 3:
            drift = drift * float("nan")
        if not torch.isfinite(drift):
            raise FloatingPointError(f"drift_km is not finite on rank {rank} at step {step}: {drift.item()}")
        model.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if f == "wrong_numel" and mine and step == 1:
            flat = torch.cat([flat, torch.zeros(7)])
        dist.all_reduce(flat)
        flat /= world
        o = 0
        for p in model.parameters():
            n = p.numel(); p.grad.copy_(flat[o:o + n].view_as(p)); o += n
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
        say(f"rank {rank} step {step} loss {loss.item():.4f} drift_km {drift.item():.3f}")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/drift_export.pt")
        say("saved drift_export.pt")
    dist.destroy_process_group()


def spawn_entry(rank, world, args):
    os.environ["RANK"] = str(rank); os.environ["LOCAL_RANK"] = str(rank)
    main(rank, world, args)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=int, default=0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--label", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    a = ap.parse_args()
    if a.prepare:
        prepare(a.prepare); sys.exit(0)
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(a.spawn, a), nprocs=a.spawn)
    else:
        try:
            main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)
        except BaseException:
            if a.logfmt:
                logging.getLogger("pumice.drift").exception("drift step failed")
            raise
