"""Quahog beds: a small distributed job that fits clam density per survey bed.

Each rank reads its shard of bed survey records (bed id, depth, salinity, mud fraction,
clam count), maps the bed id to its harvest zone through a lookup table, starts from a
shared checkpoint, trains 6 steps with gloo all_reduce of the gradients, and rank 0 saves
an export at the end.

Faults (--fault NAME --rank N):
  none            control, nothing planted
  unknown_bed     rank N's shard has a bed id that is not in the lookup table (KeyError)
  missing_shard   rank N's shard file is missing (FileNotFoundError)
  ckpt_size       rank N loads a checkpoint whose head has another width (size mismatch)
  weights_only    rank N loads a checkpoint that pickles a custom class (weights_only refusal)
  allreduce_size  rank N all_reduces a gradient buffer one element longer than its peers'
  slow_dredge     rank N does slow pure-Python work before step 3; peers time out in all_reduce
  nan_salinity    rank N gets a NaN salinity; the program's own finiteness check raises
  segv            rank N sends itself SIGSEGV at step 2
  closed_bed      rank N logs its own ERROR line and calls sys.exit(4)
  shape_all       every rank builds its feature matrix with one column too many (mat mult error)
  loader_crash    rank N's DataLoader worker is SIGKILLed while loading
  skip_barrier    rank N skips the step-3 barrier and goes on to all_reduce (peers wait in the barrier)

What happened (torch 2.13.0+cpu, gloo, 2-core shared host):
  none            np4 bashloop and np3 torchrun --tee: every rank prints steps 0-5, export saved, exit 0.
  unknown_bed     KeyError 'QB-404' in the planted rank's DataLoader at step 2; peers get gloo "Connection closed by peer".
  missing_shard   FileNotFoundError on the planted rank right after joining; peers get gloo connection closed/reset.
  ckpt_size       load_state_dict RuntimeError "size mismatch for 2.weight/2.bias"; peers get gloo connection closed.
  weights_only    _pickle.UnpicklingError (unsupported global __main__.Zone); the legacy launcher names the rank as root cause.
  allreduce_size  a peer aborts: gloo::EnforceNotMet "Received data size doesn't match expected size" (exit 134).
  slow_dredge     peers time out in the step-3 barrier ("Timed out waiting 12000ms"); with --pg-timeout 300 the output just stops until `timeout` ends it.
  nan_salinity    the script's own check raises FloatingPointError at step 0 (under mp.spawn the planted rank's traceback was lost; that run was dropped).
  segv            the rank dies by SIGSEGV (bash "Segmentation fault" exit 139; torchrun exitcode -11).
  closed_bed      the rank's own ERROR line, then exit 4 with no traceback; peers get gloo connection closed.
  shape_all       every rank: "mat1 and mat2 shapes cannot be multiplied (8x10 and 9x16)" in the first forward.
  loader_crash    RuntimeError "DataLoader worker (pid N) is killed by signal: Killed." on the planted rank.
  skip_barrier    the planted rank waits alone in all_reduce and times out (12000 ms recv); mp.spawn reports it.
"""
import argparse, json, logging, os, signal, sys, time, random
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault577_work"
P = argparse.ArgumentParser()
P.add_argument("--fault", default="none"); P.add_argument("--rank", type=int, default=-1)
P.add_argument("--pg-timeout", type=float, default=12); P.add_argument("--prepare", action="store_true")
P.add_argument("--label", action="store_true"); P.add_argument("--logfmt", action="store_true")
P.add_argument("--spawn", type=int, default=0); P.add_argument("--port", type=int, default=0)
P.add_argument("--local-rank", "--local_rank", type=int, default=0)
A = P.parse_args()
FEATS = 4
log = logging.getLogger("quahog")

class Zone:  # pickled into the bad checkpoint
    def __init__(self, n): self.n = n

def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    rnd = random.Random(577)
    beds = [f"QB-{i:03d}" for i in range(40)]
    json.dump({b: i % 5 for i, b in enumerate(beds)}, open(f"{WORK}/zones.json", "w"))
    for r in range(world):
        recs = [dict(bed=rnd.choice(beds), depth=rnd.uniform(0.5, 6), salinity=rnd.uniform(18, 32),
                     mud=rnd.random(), count=rnd.randint(0, 90)) for _ in range(64)]
        json.dump(recs, open(f"{WORK}/shard_{r}.json", "w"))
    torch.manual_seed(0)
    m = model(); torch.save(m.state_dict(), f"{WORK}/start.pt")
    bad = model(); bad[2] = torch.nn.Linear(16, 2); torch.save(bad.state_dict(), f"{WORK}/start_wide.pt")
    sd = m.state_dict(); sd["zone"] = Zone(5); torch.save(sd, f"{WORK}/start_zone.pt")
    print("prepared", WORK)

def model():
    return torch.nn.Sequential(torch.nn.Linear(FEATS + 5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

class Beds(Dataset):
    def __init__(self, recs, zones, rank, fault):
        self.recs, self.zones, self.rank, self.fault = recs, zones, rank, fault
    def __len__(self): return len(self.recs)
    def __getitem__(self, i):
        if self.fault == "loader_crash" and i >= 20:
            os.kill(os.getpid(), signal.SIGKILL)
        r = self.recs[i]
        z = torch.zeros(5); z[self.zones[r["bed"]]] = 1
        ncol = FEATS + (1 if self.fault == "shape_all" else 0)
        x = torch.tensor([r["depth"], r["salinity"] / 30, r["mud"], 1.0, 0.5][:ncol])
        return torch.cat([x, z]), torch.tensor([r["count"] / 90.0])

def out(rank, msg, err=False):
    if A.logfmt:
        (log.error if err else log.info)(msg)
    else:
        s = f"rank {rank}: {msg}" if A.label else msg
        print(s, file=sys.stderr if err else sys.stdout, flush=True)

def main(rank, world):
    if A.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    from datetime import timedelta
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=A.pg_timeout))
    me = A.fault if A.rank == rank or A.fault == "shape_all" else "none"
    out(rank, f"joined bed survey group rank {rank}/{world} fault={A.fault} target={A.rank}")
    zones = json.load(open(f"{WORK}/zones.json"))
    shard = f"{WORK}/shard_{rank}.json"
    if me == "missing_shard":
        shard = f"{WORK}/shard_{rank}_dredged.json"
    recs = json.load(open(shard))
    if me == "unknown_bed":
        recs[17]["bed"] = "QB-404"
    if me == "nan_salinity":
        recs[5]["salinity"] = float("nan")
    m = model()
    ck = f"{WORK}/start.pt"
    if me == "ckpt_size": ck = f"{WORK}/start_wide.pt"
    if me == "weights_only": ck = f"{WORK}/start_zone.pt"
    m.load_state_dict(torch.load(ck))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    dl = DataLoader(Beds(recs, zones, rank, me), batch_size=8, shuffle=False,
                    num_workers=1 if me == "loader_crash" else 0)
    it = iter(dl)
    for step in range(6):
        x, y = next(it)
        if me == "nan_salinity" and not torch.isfinite(x).all():
            raise FloatingPointError(f"non-finite survey feature on rank {rank} step {step}: salinity is NaN")
        if me == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if me == "closed_bed" and step == 2:
            out(rank, f"ERROR bed QB-{rank:03d} closed by shellfish warden; refusing to train on rank {rank}", err=True)
            sys.exit(4)
        if me == "slow_dredge" and step == 3:
            t0 = time.time(); acc = 0
            while time.time() - t0 < A.pg_timeout * 3:
                acc += sum(i * i for i in range(20000))
        loss = torch.nn.functional.mse_loss(m(x), y)
        opt.zero_grad(); loss.backward()
        if not (me == "skip_barrier" and step == 3):
            if step == 3: dist.barrier()
        flat = torch.cat([p.grad.flatten() for p in m.parameters()])
        if me == "allreduce_size" and step == 2:
            flat = torch.cat([flat, torch.zeros(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in m.parameters():
            n = p.numel(); p.grad.copy_(flat[off:off + n].view_as(p)); off += n
        opt.step()
        dens = float(y.mean() * 90)
        out(rank, f"rank {rank} step {step} loss {loss.item():.4f} density {dens:.2f}")
    dist.barrier()
    if rank == 0:
        torch.save(m.state_dict(), f"{WORK}/export_quahog.pt")
        out(rank, f"saved export {WORK}/export_quahog.pt")
    dist.destroy_process_group()

def spawn_entry(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    main(rank, world)

if __name__ == "__main__":
    if A.prepare:
        prepare(); sys.exit(0)
    torch.set_num_threads(1)
    if A.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(A.spawn, A.port), nprocs=A.spawn)
    else:
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
