"""fault492.py - seabird colony counting from drone photos (small CPU/gloo training job).

Each rank reads its own shard of synthetic drone photo tiles (8x8 "patches" with
species codes), maps species codes to class ids through a lookup table, predicts
per-tile bird counts + species, all_reduces gradients by hand, and rank 0 writes
an export at the end.  `--prepare` makes the data in /tmp/fault492_work.

Faults (--fault NAME --rank N):
  none            control, nothing planted
  keyerror        rank N's shard carries a species code ("XXGU") missing from the lookup table -> KeyError
  missing_shard   rank N's shard file is looked up under a wrong flight id -> FileNotFoundError
  ckpt_size       rank N builds its species head with 7 classes, checkpoint has 6 -> load_state_dict size mismatch
  weights_only    rank N loads the survey-metadata pickle with torch.load(weights_only=True) -> UnpicklingError
  allreduce_size  rank N all_reduces a gradient buffer one element short -> gloo size mismatch
  slow            rank N does pure-Python colony re-counting before step 3 -> peers' collective times out
                  (with --pg-timeout 300 this is a hang that `timeout` ends)
  nan             rank N gets a NaN tile; the program's own finiteness check raises FloatingPointError
  segv            rank N sends itself SIGSEGV at step 2
  exit4           rank N prints its own ERROR line and sys.exit(4)
  shape_all       every rank flattens tiles to 63 features instead of 64 -> matmul shape error on all ranks
  worker_crash    rank N's DataLoader worker os._exit(1)s while loading a batch -> DataLoader worker exited unexpectedly

What happened (runs of 2026-12-06, torch 2.13.0+cpu, gloo):
  none            np3 plain: 6 steps on every rank, export saved, exit 0.
  keyerror        KeyError: 'XXGU' in rank N's DataLoader at step 1; peers: gloo "Connection closed by peer"; exit 1.
  missing_shard   FileNotFoundError for flight08_shardN.pt on rank N before step 0; peers die in the broadcast; exit 1.
  ckpt_size       load_state_dict RuntimeError: size mismatch for species_head (6 vs 7) on rank N; exit 1.
  weights_only    _pickle.UnpicklingError "Weights only load failed ... __main__.SurveyMeta" on rank N; exit 1.
  allreduce_size  plain: "terminate called ... gloo::EnforceNotMet ... Received data size doesn't match expected size";
                  DETAIL: every rank raises "Detected mismatch between collectives" (2310 vs 2311); exit 1.
  slow            peers raise gloo "Timed out waiting 12000ms" at step 3, exit 1; with --pg-timeout 300 output stops
                  after step 2 until timeout's SIGTERM/SIGKILL (exit 137).
  nan             FloatingPointError "non-finite loss nan" on rank N at step 3; exit 1 (with --max-restarts 1 the
                  second attempt dies in Gloo connectFullMesh).
  segv            rank N exitcode -11 (SIGSEGV) at step 2, peers gloo connection closed/reset; exit 1.
  exit4           "ERROR rank N: tile GPS tags ..." then exitcode 4; peers gloo connection closed; exit 1.
  shape_all       every rank: "mat1 and mat2 shapes cannot be multiplied (16x63 and 64x32)"; exit 1.
  worker_crash    "DataLoader worker (pid N) exited unexpectedly with exit code 1" on rank N; exit 1.
"""
import argparse, os, sys, json, time, signal, datetime, pickle
import torch, torch.nn as nn, torch.distributed as dist
from torch.utils.data import Dataset, DataLoader

WORK = "/tmp/fault492_work"
SPECIES = ["ATPU", "COMU", "RAZO", "BLKI", "NOGA", "HERG"]


def prepare(world_max=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    table = {s: i for i, s in enumerate(SPECIES)}
    json.dump(table, open(f"{WORK}/species_table.json", "w"))
    for r in range(world_max):
        x = torch.rand(96, 64, generator=g)
        sp = [SPECIES[int(i)] for i in torch.randint(0, 6, (96,), generator=g)]
        cnt = (x.sum(1) / 8).round()
        torch.save({"tiles": x, "species": sp, "counts": cnt}, f"{WORK}/flight07_shard{r}.pt")
    m = Model()
    torch.save(m.state_dict(), f"{WORK}/colony_init.pt")

    torch.save({"meta": SurveyMeta(), "gsd_cm": 1.2}, f"{WORK}/survey_meta.pt")
    print("prepared", WORK)


class SurveyMeta:  # custom class -> not loadable with weights_only=True
    def __init__(self):
        self.site = "Skomer"; self.altitude_m = 40


class Model(nn.Module):
    def __init__(self, n_species=6, in_f=64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_f, 32), nn.ReLU())
        self.count_head = nn.Linear(32, 1)
        self.species_head = nn.Linear(32, n_species)

    def forward(self, x):
        h = self.body(x)
        return self.count_head(h).squeeze(-1), self.species_head(h)


class TileSet(Dataset):
    def __init__(self, path, table, crash=False):
        d = torch.load(path)
        self.x, self.sp, self.cnt = d["tiles"], d["species"], d["counts"]
        self.table, self.crash = table, crash

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.crash and i >= 40:
            os._exit(1)
        return self.x[i], self.table[self.sp[i]], self.cnt[i]


def recount_colony(n):  # pure-Python busy work
    t = 0
    for i in range(n):
        t = (t * 31 + i) % 1000003
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare(); return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank == a.rank)
    torch.manual_seed(1234)
    table = json.load(open(f"{WORK}/species_table.json"))

    shard = f"{WORK}/flight07_shard{rank}.pt"
    if a.fault == "missing_shard" and me:
        shard = f"{WORK}/flight08_shard{rank}.pt"
    ds = TileSet(shard, table, crash=(a.fault == "worker_crash" and me))
    if a.fault == "keyerror" and me:
        ds.sp[21] = "XXGU"

    model = Model(n_species=7 if (a.fault == "ckpt_size" and me) else 6)
    model.load_state_dict(torch.load(f"{WORK}/colony_init.pt", weights_only=True))
    if a.fault == "weights_only" and me:
        meta = torch.load(f"{WORK}/survey_meta.pt", weights_only=True)
    else:
        meta = {"gsd_cm": 1.2}
    for p in model.parameters():  # start identical everywhere
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    nw = 1 if (a.fault == "worker_crash") else 0
    dl = DataLoader(ds, batch_size=16, shuffle=False, num_workers=nw)
    it = iter(dl)
    for step in range(a.steps):
        x, y, c = next(it)
        if a.fault == "shape_all":
            x = x[:, :63]
        if a.fault == "nan" and me and step == 3:
            x[5, 7] = float("nan")
        if a.fault == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "exit4" and me and step == 2:
            print(f"ERROR rank {rank}: tile GPS tags of flight07 do not match the colony polygon, refusing to count", flush=True)
            sys.exit(4)
        if a.fault == "slow" and me and step == 3:
            recount_colony(250_000_000 if a.pg_timeout < 100 else 10**10)
        pc, ps = model(x)
        loss = nn.functional.mse_loss(pc, c) + nn.functional.cross_entropy(ps, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} in colony count")
        opt.zero_grad(); loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if a.fault == "allreduce_size" and me and step == 2:
            flat = flat[:-1]
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel(); p.grad.copy_(flat[off:off + n].view_as(p)); off += n
        opt.step()
        acc = (ps.argmax(1) == y).float().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} species_acc {acc:.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/colony_export.pt")
        print("rank 0 saved export colony_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
