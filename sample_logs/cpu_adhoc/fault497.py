"""Lichen cover estimation from drone imagery: a small distributed regression job (gloo, CPU).

Each rank reads its own shard of drone image patches (multispectral band means, NDVI, texture and a
substrate code looked up in a table), predicts the fraction of the patch covered by lichen, averages
gradients with all_reduce and reports `rank R step S loss L cover_mae M`. Rank 0 writes an export at the end.

  --prepare            write the synthetic shards, substrate table and start checkpoint to /tmp/fault497_work
  --fault NAME --rank N  plant one fault (see below)
  --pg-timeout S       process-group timeout (default 12 s)
  --spawn W            start W ranks with torch.multiprocessing.spawn inside this script
  --label              prefix every print with `rank R: `
  --logfmt             report progress and errors through logging (asctime + rank in the format)

Faults:
  none          control, nothing planted
  substrate_key rank N's shard holds a substrate code missing from the lookup table -> KeyError
  missing_shard rank N opens a shard file that was never written -> FileNotFoundError
  ckpt_size     rank N builds the model for a 5-band camera and loads the 8-band checkpoint -> size mismatch
  weights_only  rank N loads a checkpoint with a pickled FlightMeta object under torch.load(weights_only=True)
  stats_bcast   rank N receives the band-normalisation broadcast into a buffer of the wrong length
  slow_rank     rank N re-tiles the mosaic in pure Python before step 2's all_reduce; peers time out
  nan_ndvi      rank N's NDVI divides 0/0 on dark tiles; the program's finiteness check raises FloatingPointError
  segv          rank N's tile decoder crashes: the rank sends itself SIGSEGV (faulthandler on)
  logged_exit   rank N logs its own ERROR line (tile grid misaligned) and calls sys.exit(4)
  shape_all     every rank concatenates the substrate embedding twice -> matmul shape error on all ranks
  host_mem      rank N upsamples the orthomosaic under a small address-space limit -> CPU allocator fails
  worker_crash  rank N's DataLoader worker is killed (SIGKILL) while decoding a patch

What happened (after the runs; see the README section of batch 497):
  none          3 ranks ran steps 0-5, rank 0 saved the export, exit 0
  substrate_key KeyError: 'XX-crust' from the DataLoader on rank N at step 2; peers: gloo "Connection closed by peer" (np3 run only ended at the 100 s timeout)
  missing_shard FileNotFoundError for flight_2026-07-14/shard_rN.pt on rank N before step 0; peers: connection closed or a 12000 ms send timeout
  ckpt_size     RuntimeError: Error(s) in loading state_dict ... size mismatch for encoder.weight ([32, 17] vs [32, 14]) on rank N
  weights_only  _pickle.UnpicklingError: Weights only load failed ... Unsupported global __main__.FlightMeta on rank N
  stats_bcast   terminate called after throwing gloo::EnforceNotMet "op.preamble.length <= op.nbytes. 64 vs 48"; Fatal Python error: Aborted (134)
  slow_rank     peers: gloo "Timed out waiting 12000ms" for recv/send at step 2, rank N then "Connection closed"; with --pg-timeout 300 output stops after step 1 until timeout (124)
  nan_ndvi      FloatingPointError: rank N: non-finite loss nan at step 3 (the program's own check)
  segv          Fatal Python error: Segmentation fault on rank N at step 2; torchrun exitcode -11 / mp.spawn "terminated with signal SIGSEGV"
  logged_exit   rank N's "ERROR: tile grid misaligned ..." line after step 0, exit 4; peers: connection closed
  shape_all     RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x21 and 17x32) at step 0 on every rank
  host_mem      RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 9216000000 bytes on rank N at step 2
  worker_crash  RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed / exited unexpectedly on rank N
"""
import argparse
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault497_work"
BANDS = 8          # blue, green, red, red-edge x2, NIR x2, thermal
TEXTURE = 4
STEPS = 6
BATCH = 32
SUBSTRATES = ["granite", "sandstone", "bark-conifer", "bark-deciduous", "soil-crust", "moss-mat", "peat"]


@dataclasses.dataclass
class FlightMeta:
    drone: str
    altitude_m: float
    gsd_cm: float


class LichenCoverNet(nn.Module):
    def __init__(self, bands=BANDS, n_sub=len(SUBSTRATES)):
        super().__init__()
        self.sub_emb = nn.Embedding(n_sub, 4)
        self.encoder = nn.Linear(bands + 1 + TEXTURE + 4, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x, sub, twice=False):
        e = self.sub_emb(sub)
        feats = torch.cat([x, e, e] if twice else [x, e], dim=1)
        return torch.sigmoid(self.head(torch.relu(self.encoder(feats)))).squeeze(1)


class PatchShard(Dataset):
    def __init__(self, shard, table, kill_at=None):
        self.bands = shard["bands"]
        self.texture = shard["texture"]
        self.codes = shard["substrate"]
        self.cover = shard["cover"]
        self.table = table
        self.kill_at = kill_at

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        if self.kill_at is not None and i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.bands[i], self.texture[i], self.table[self.codes[i]], self.cover[i]


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(497)
    for r in range(8):
        n = 6 * BATCH
        bands = torch.rand(n, BANDS, generator=g) * 0.6 + 0.05
        codes = [SUBSTRATES[int(i)] for i in torch.randint(0, len(SUBSTRATES), (n,), generator=g)]
        shard = {"bands": bands, "texture": torch.rand(n, TEXTURE, generator=g),
                 "substrate": codes, "cover": torch.rand(n, generator=g)}
        torch.save(shard, f"{WORK}/shard_r{r}.pt")
        bad = dict(shard)
        bad["substrate"] = list(codes)
        bad["substrate"][BATCH * 2 + 5] = "XX-crust"
        torch.save(bad, f"{WORK}/shard_r{r}_badcode.pt")
    with open(f"{WORK}/substrate_table.json", "w") as f:
        json.dump({s: i for i, s in enumerate(SUBSTRATES)}, f)
    torch.manual_seed(0)
    model = LichenCoverNet()
    torch.save(model.state_dict(), f"{WORK}/init.pt")
    torch.save({"state_dict": model.state_dict(), "meta": FlightMeta("M300-Altum", 40.0, 1.7)},
               f"{WORK}/init_meta.pt")
    print("prepared", WORK)


def main(rank=None, world=None, args=None):
    if rank is None:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
    fault = args.fault if args.rank in (rank, -1) or args.fault == "shape_all" else "none"
    log = None
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("lichen")

    def say(msg):
        if log:
            log.info(msg)
        elif args.label:
            print(f"rank {rank}: {msg}", flush=True)
        else:
            print(msg, flush=True)

    try:
        run(rank, world, args, fault, say, log)
    except Exception:
        if log:
            log.exception("rank %d failed", rank)
            sys.exit(1)
        raise


def run(rank, world, args, fault, say, log):
    faulthandler.enable()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    torch.manual_seed(rank)
    with open(f"{WORK}/substrate_table.json") as f:
        table = json.load(f)
    shard_path = f"{WORK}/shard_r{rank}.pt"
    if fault == "substrate_key":
        shard_path = f"{WORK}/shard_r{rank}_badcode.pt"
    if fault == "missing_shard":
        shard_path = f"{WORK}/flight_2026-07-14/shard_r{rank}.pt"
    shard = torch.load(shard_path)

    bands = BANDS
    if fault == "ckpt_size":
        bands = 5  # MicaSense RedEdge profile picked by mistake
    model = LichenCoverNet(bands=bands)
    if fault == "weights_only":
        state = torch.load(f"{WORK}/init_meta.pt", weights_only=True)["state_dict"]
    else:
        state = torch.load(f"{WORK}/init.pt", weights_only=True)
    model.load_state_dict(state)

    # band normalisation statistics computed on rank 0 and broadcast
    stats = torch.zeros(2, BANDS)
    if rank == 0:
        stats = torch.stack([shard["bands"].mean(0), shard["bands"].std(0)])
    if fault == "stats_bcast":
        stats = torch.zeros(2, BANDS - 2)  # thermal and second NIR band dropped by mistake
    dist.broadcast(stats, src=0)
    mean, std = stats[0], stats[1]

    kill_at = BATCH + 3 if fault == "worker_crash" else None
    workers = 1 if args.fault == "worker_crash" else 0
    ds = PatchShard(shard, table, kill_at=kill_at)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    say(f"rank {rank}/{world} ready: {len(ds)} patches, substrate table {len(table)} entries")
    for step, (b, tex, sub, cover) in enumerate(loader):
        if step >= STEPS:
            break
        b = b.clone()
        if fault == "nan_ndvi" and step == 3:
            b[:4, 2] = 0.0  # shadowed tiles: red and NIR both zero
            b[:4, 5] = 0.0
        red, nir = b[:, 2], b[:, 5]
        ndvi = (nir - red) / (nir + red)
        x = torch.cat([(b - mean) / std, ndvi[:, None], tex], dim=1)
        pred = model(x, sub, twice=(fault == "shape_all"))
        loss = nn.functional.mse_loss(pred, cover)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (check NDVI inputs)")
        opt.zero_grad()
        loss.backward()

        if fault == "slow_rank" and step == 2:
            t0 = time.time()
            tiles = []
            while time.time() - t0 < args.slow_s:
                tiles.append(sum(i * i for i in range(20000)) % 97)
                if len(tiles) > 1000:
                    tiles.clear()
        if fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "logged_exit" and step == 1:
            msg = f"tile grid misaligned: orthomosaic tile (41, 17) of rank {rank} is offset 3.2 m from the GCP grid"
            if log:
                log.error(msg)
            else:
                print(("rank %d: " % rank if args.label else "") + "ERROR: " + msg, flush=True)
            sys.exit(4)
        if fault == "host_mem" and step == 2:
            import resource
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
            mosaic = torch.empty(4, 24000, 24000, dtype=torch.float32)  # 4x upsampled orthomosaic
            mosaic.fill_(0)

        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        opt.step()
        mae = (pred - cover).abs().mean().detach()
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} cover_mae {mae.item() / world:.4f}")

    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/lichen_cover_net.pt")
        say("saved export to " + f"{WORK}/export/lichen_cover_net.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_entry(i, world, args):
    main(i, world, args)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-2)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--slow-s", type=float, default=30)
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--label", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    a = ap.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(spawn_entry, args=(a.spawn, a), nprocs=a.spawn)
    else:
        main(args=a)
