"""Fern spore germination rate from microscope counts: a small data-parallel regression job.

Each rank reads its own shard of microscope counts (spores counted, spores germinated, plate
species, incubation hours, light level), maps the species name through a lookup table to an
embedding index, and fits a small MLP that predicts the germination rate. Gradients are
all_reduced by hand (gloo, CPU only), 6 steps, every rank prints
`rank R step S loss L germ_rate_mae M`, rank 0 saves an export at the end.

    python fault515.py --prepare          # writes shards, lookup table, start checkpoint to /tmp/fault515_work
    torchrun --nproc-per-node W fault515.py --fault NAME --rank N [--pg-timeout 12]

Faults (--fault NAME, planted on --rank N):
  none           control, nothing planted
  keyerror       rank N's shard holds a species code missing from the lookup table -> KeyError
  missing_shard  rank N looks for a shard file that does not exist -> FileNotFoundError
  ckpt_size      rank N builds its model with a wider hidden layer than the checkpoint -> size mismatch in load_state_dict
  weights_only   rank N loads a checkpoint that pickles a custom class; torch.load(weights_only=True) refuses it
  gather_shape   rank N sends a germination-count tensor of the wrong length into all_gather
  slow           rank N spends 40 s in pure-Python recounting; its peers' all_reduce times out (PG timeout)
                 (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan            rank N divides by zero germinated/counted plates; the script's own finiteness check raises FloatingPointError
  sigsegv        rank N sends itself SIGSEGV at step 2
  exit4          rank N prints its own ERROR line (plate reader calibration) and calls sys.exit(4)
  shape_all      every rank builds features with one column too few -> matmul shape error on every rank
  worker_kill    rank N's DataLoader worker SIGKILLs itself -> DataLoader worker killed

What happened (after the runs, torch 2.13.0+cpu, gloo):
  none           all ranks finish 6 steps, rank 0 saves the export, exit 0
  keyerror       KeyError: 'Cyathea' in the DataLoader on rank N at step 2; peers fail with gloo "Connection closed by peer"
  missing_shard  FileNotFoundError on rank N before step 0; peers SIGTERMed while waiting in all_reduce
  ckpt_size      RuntimeError "size mismatch for 0.weight" from load_state_dict on rank N; peers SIGTERMed
  weights_only   _pickle.UnpicklingError "Weights only load failed" on rank N; peers SIGTERMed
  gather_shape   with DETAIL every rank raises "Detected mismatch between collectives"; without it rank N raises
                 "ProcessGroupGloo::allgather: invalid tensor size", peers see connection closed
  slow           peers raise gloo "Timed out waiting 12000ms for send/recv"; with --pg-timeout 300 no output until timeout
  nan            FloatingPointError from the script's check on rank N at step 3; peers see connection closed
  sigsegv        rank N exitcode -11 (SIGSEGV), no traceback; peers see connection reset/closed
  exit4          rank N's ERROR line and exitcode 4 (with --max-restarts 1 the second attempt failed in Gloo connectFullMesh)
  shape_all      "mat1 and mat2 shapes cannot be multiplied (8x11 and 12x32)" on every rank at step 0
  worker_kill    "DataLoader worker (pid N) is killed by signal: Killed." on rank N; peers see connection closed
"""
import argparse, json, os, random, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault515_work"
SPECIES = ["Polypodium", "Asplenium", "Dryopteris", "Pteridium", "Osmunda", "Blechnum", "Athyrium", "Polystichum"]
NFEAT = 4


class PlateMeta:  # a custom class, pickled into the "annotated" checkpoint
    def __init__(self, scope):
        self.scope = scope


def prepare():
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(515)
    for r in range(8):
        rows = []
        for i in range(64):
            counted = rng.randint(40, 400)
            germ = rng.randint(0, counted)
            rows.append({"plate": f"P{r:02d}-{i:03d}", "species": rng.choice(SPECIES), "counted": counted,
                         "germinated": germ, "hours": rng.choice([24, 48, 72, 96]), "lux": rng.uniform(50, 900)})
        with open(f"{WORK}/shard_{r:02d}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    with open(f"{WORK}/species_lookup.json", "w") as f:
        json.dump({s: i for i, s in enumerate(SPECIES)}, f)
    torch.manual_seed(0)
    m = make_model(32)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    torch.save({"model": m.state_dict(), "meta": PlateMeta("Leica DM500")}, f"{WORK}/start_annotated.pt")
    print("prepared", WORK)


def make_model(hidden):
    return nn.Sequential(nn.Linear(NFEAT + 8, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class Plates(torch.utils.data.Dataset):
    def __init__(self, rows, lookup, fault, is_faulty):
        self.rows, self.lookup, self.fault, self.is_faulty = rows, lookup, fault, is_faulty

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.fault == "worker_kill" and self.is_faulty and i >= 20:
            os.kill(os.getpid(), signal.SIGKILL)
        row = self.rows[i]
        sp = torch.zeros(8)
        sp[self.lookup[row["species"]]] = 1.0
        counted = float(row["counted"])
        if self.fault == "nan" and self.is_faulty and i >= 24:
            counted = 0.0
        rate = row["germinated"] / counted if counted else float("nan")
        ncol = NFEAT - 1 if self.fault == "shape_all" else NFEAT
        x = torch.tensor([row["hours"] / 96.0, row["lux"] / 900.0, counted / 400.0, 1.0][:ncol])
        return torch.cat([x, sp]), torch.tensor([rate], dtype=torch.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    a = ap.parse_args()
    if a.prepare:
        return prepare()
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank == a.rank
    print(f"rank {rank}/{world} fern germination job, fault={a.fault}", flush=True)

    shard = f"{WORK}/shard_{rank:02d}.jsonl"
    if a.fault == "missing_shard" and me:
        shard = f"{WORK}/shard_{rank:02d}_recount.jsonl"
    with open(shard) as f:
        rows = [json.loads(l) for l in f]
    with open(f"{WORK}/species_lookup.json") as f:
        lookup = json.load(f)
    if a.fault == "keyerror" and me:
        rows[17]["species"] = "Cyathea"

    hidden = 48 if (a.fault == "ckpt_size" and me) else 32
    model = make_model(hidden)
    if a.fault == "weights_only" and me:
        sd = torch.load(f"{WORK}/start_annotated.pt", weights_only=True)["model"]
    else:
        sd = torch.load(f"{WORK}/start.pt", weights_only=True)
    model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    ds = Plates(rows, lookup, a.fault, me)
    nw = 1 if a.fault == "worker_kill" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=nw)
    it = iter(dl)
    for step in range(6):
        x, y = next(it)
        if a.fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "exit4" and me and step == 3:
            print(f"ERROR: rank {rank}: plate reader calibration drifted (reference grid count 0 of 100), aborting", flush=True)
            sys.exit(4)
        if a.fault == "slow" and me and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < 40:
                n += sum(i * i for i in range(2000)) % 7
        if not torch.isfinite(y).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite germination rate in batch ({int((~torch.isfinite(y)).sum())} values)")
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        counts = torch.tensor([float(y.numel())] * (3 if (a.fault == "gather_shape" and me) else 2))
        bufs = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(bufs, counts)
        mae = (pred - y).abs().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.5f} germ_rate_mae {mae:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_fern_rate.pt")
        print("rank 0 saved export", f"{WORK}/export_fern_rate.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
