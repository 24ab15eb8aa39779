"""Batch 475 fault script: bee hive acoustics (queenless-colony detection from hive microphone spectra).

A small data-parallel trainer: each rank reads its own shard of hive microphone spectra
(/tmp/fault475_work/shard_R.pt, 64 frequency bins per frame), maps each hive id to its colony
state through a lookup table (hive_lookup.json), starts from a checkpoint (init.pt), trains a
small MLP classifier (queenright / queenless / swarming) for 6 steps with gradients averaged by
all_reduce over gloo, and rank 0 saves an export at the end.

Faults (--fault NAME --rank N), one per run:
  none          control, nothing planted
  keyerror      rank N's shard names a hive id missing from the lookup table -> KeyError
  missing_shard rank N's shard file is deleted before it loads -> FileNotFoundError
  ckpt_size     rank N loads a checkpoint saved with 48 bins instead of 64 -> size mismatch in load_state_dict
  weights_only  rank N loads a checkpoint holding a pickled calibration object -> weights_only refusal
  wrong_size    rank N all_reduces a gradient bucket one element short at step 2 -> gloo size error
  slow          rank N does pure-Python spectral recomputation for --slow-s seconds (45) at step 2 -> peers time out (pg timeout);
                with --pg-timeout 300 --slow-s 300 the job just hangs until `timeout` ends it
  nan           rank N's spectra get a NaN at step 3; the program's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line (microphone gain calibration missing) and sys.exit(4)
  shape_all     every rank: the model is built for 128 bins while spectra have 64 -> matmul shape error
  worker_crash  rank N's DataLoader worker dies (os._exit via SIGKILL to itself) while loading a batch

What happened (after the runs, torch 2.13.0+cpu, gloo, 2-core machine):
  none          all ranks ran 6 steps, rank 0 saved the export, exit 0
  keyerror      KeyError: 'hive417' on rank N at its first batch; peers see gloo "Connection closed by peer"
  missing_shard FileNotFoundError from torch.load of shard_N_missing.pt on rank N; others SIGTERMed
  ckpt_size     RuntimeError "size mismatch for 0.weight ... [32, 48] ... [32, 64]" on rank N
  weights_only  UnpicklingError "Weights only load failed ... Unsupported global: GLOBAL __main__.Calibration" on rank N
  wrong_size    with DETAIL: every rank raises "Detected mismatch between collectives" (shape 2178 vs 2179);
                without: rank N aborts with gloo::EnforceNotMet "Received data size doesn't match" (SIGABRT)
  slow          peers raise gloo "Timed out waiting 12000ms"; the launcher blames a peer; with
                --pg-timeout 300 --slow-s 300 nothing fails until `timeout 60` ends it (exit 124)
  nan           rank N raises its own FloatingPointError: loss is nan at step 3
  sigsegv       rank N exitcode -11 (SIGSEGV); with --max-restarts 1 the second attempt fails in Gloo connectFullMesh
  error_exit    rank N prints its ERROR line and exits 4; the launcher names it with exitcode 4
  shape_all     every rank: "mat1 and mat2 shapes cannot be multiplied (16x64 and 128x32)" at step 0
  worker_crash  rank N: "DataLoader worker (pid N) is killed by signal: Killed."
"""
import argparse, json, os, signal, sys, time, datetime
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault475_work"
BINS = 64
CLASSES = ["queenright", "queenless", "swarming"]


def make_model(bins=BINS):
    return nn.Sequential(nn.Linear(bins, 32), nn.ReLU(), nn.Linear(32, len(CLASSES)))


class Calibration:
    def __init__(self, gain):
        self.gain = gain


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(475)
    lookup = {f"hive{h:03d}": CLASSES[h % 3] for h in range(40)}
    with open(os.path.join(WORK, "hive_lookup.json"), "w") as f:
        json.dump(lookup, f)
    for r in range(world):
        spectra = torch.rand(96, BINS, generator=g)
        hives = [f"hive{(r * 7 + i) % 40:03d}" for i in range(96)]
        torch.save({"spectra": spectra, "hives": hives}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), os.path.join(WORK, "init.pt"))
    torch.save(make_model(48).state_dict(), os.path.join(WORK, "init_48bins.pt"))
    torch.save({"model": make_model().state_dict(), "calibration": Calibration(1.5)},
               os.path.join(WORK, "init_calibrated.pt"))
    print(f"prepared {world} shards in {WORK}")


class HiveSpectra(Dataset):
    def __init__(self, shard, lookup, crash=False):
        self.x = shard["spectra"]
        self.hives = shard["hives"]
        self.lookup = lookup
        self.crash = crash

    def __len__(self):
        return len(self.hives)

    def __getitem__(self, i):
        if self.crash and i >= 40:
            os.kill(os.getpid(), signal.SIGKILL)
        label = CLASSES.index(self.lookup[self.hives[i]])
        return self.x[i], label


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=int, default=0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--slow-s", type=float, default=45)
    a = ap.parse_args()
    if a.prepare:
        prepare(a.prepare)
        return

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    torch.manual_seed(rank)

    with open(os.path.join(WORK, "hive_lookup.json")) as f:
        lookup = json.load(f)
    shard_path = os.path.join(WORK, f"shard_{rank}.pt")
    if a.fault == "missing_shard" and me:
        shard_path = os.path.join(WORK, f"shard_{rank}_missing.pt")
    shard = torch.load(shard_path)
    if a.fault == "keyerror" and me:
        shard["hives"][17] = "hive417"
    print(f"rank {rank} loaded {len(shard['hives'])} spectra frames from {shard_path}", flush=True)

    bins = 128 if a.fault == "shape_all" else BINS
    model = make_model(bins)
    ck = os.path.join(WORK, "init.pt")
    if a.fault == "ckpt_size" and me:
        ck = os.path.join(WORK, "init_48bins.pt")
    if a.fault == "weights_only" and me:
        sd = torch.load(os.path.join(WORK, "init_calibrated.pt"))["model"]
    else:
        sd = torch.load(ck)
    if a.fault != "shape_all":
        model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()

    ds = HiveSpectra(shard, lookup, crash=(a.fault == "worker_crash" and me))
    workers = 1 if a.fault == "worker_crash" else 0
    dl = DataLoader(ds, batch_size=16, shuffle=False, num_workers=workers)
    it = iter(dl)
    if a.fault == "error_exit" and me:
        print(f"ERROR rank {rank}: microphone gain calibration for hive{rank * 7:03d} not found "
              f"(expected {WORK}/calib_{rank}.json); refusing to train on uncalibrated spectra", flush=True)
        sys.exit(4)

    for step in range(6):
        x, y = next(it)
        if a.fault == "nan" and me and step == 3:
            x = x.clone()
            x[0, 5] = float("nan")
        if a.fault == "slow" and me and step == 2:
            t0 = time.time()
            acc = 0.0
            while time.time() - t0 < a.slow_s:
                for k in range(20000):
                    acc += (k * 0.5) ** 0.5
        if a.fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        out = model(x)
        loss = loss_fn(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite spectra?)")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        if a.fault == "wrong_size" and me and step == 2:
            flat = flat[:-1].contiguous()
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        opt.step()
        acc = (out.argmax(1) == y).float().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} queenless_acc {acc:.3f}", flush=True)

    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export_hive_classifier.pt"))
        print("rank 0 saved export to " + os.path.join(WORK, "export_hive_classifier.pt"), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
