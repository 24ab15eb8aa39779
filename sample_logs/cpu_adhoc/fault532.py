"""Cork oak bark thickness from forest plots: a small data-parallel regression job (gloo, CPU).

Each rank reads its own shard of forest-plot tree records (diameter at breast height, age,
stripping cycle, rainfall, slope), joins a site lookup table (altitude, soil class), starts
from a shared checkpoint and trains a small MLP that predicts bark (cork) thickness in mm.
Gradients are all_reduced by hand (no DDP wrapper). 6 steps; every rank prints
`rank R step S loss L mae_mm M`; rank 0 saves an export at the end.

Usage:
  python fault532.py --prepare                      # writes synthetic data to /tmp/fault532_work
  torchrun --nproc-per-node W fault532.py [--fault NAME --rank N] [--pg-timeout 12]

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none          control, nothing planted
  site_key      rank N's shard holds a tree from site 'S9999' that the site table lacks (KeyError)
  missing_shard rank N looks for its shard in a folder that does not exist (FileNotFoundError)
  ckpt_size     rank N loads a checkpoint of a wider model (hidden 24, not 16): size mismatch
  weights_only  rank N loads a checkpoint that also pickles a PlotMeta object: weights_only refusal
  gather_size   at step 2 rank N all_reduces a per-site metric vector of 5 values instead of 4
  slow_rank     at step 2 rank N does pure-Python bootstrap work for pg_timeout+30 s; peers time out
                (with --pg-timeout 300 and an outer `timeout 60`: a hang)
  nan_check     at step 3 rank N meets rainfall 0 and takes log(0); the script's own check raises
  segv          at step 2 rank N sends itself SIGSEGV
  logged_exit   at step 1 rank N prints its own ERROR line (QC failure) and calls sys.exit(4)
  shape_all     at step 2 every rank appends a soil-class column (7 features into a 6-input model)
  worker_crash  the DataLoader uses 1 worker; rank N's worker SIGKILLs itself on its 20th record

What happened:
  none: np4 plain exits 0, 6 steps on every rank, export written.
  site_key: KeyError 'S9999' at step 3 on the planted rank (np5 tee; np8 filter hides it, summary names rank 6).
  missing_shard: FileNotFoundError before step 0 (np6 pymodule; np4 redirects keeps it in the log-dir only).
  ckpt_size: load_state_dict size mismatch [24,6] vs [16,6] on rank 2 (np3 loglevel).
  weights_only: UnpicklingError, Unsupported global __main__.PlotMeta on rank 4 (np5 prefix).
  gather_size: DETAIL names it (TensorShape [5] vs [4], np4); plain gloo (np6) only times out after 12 s.
  slow_rank: peers gloo-time out after 12 s, slow rank SIGTERMed (np5 wrapper); pg-timeout 300: hang, timeout 60.
  nan_check: FloatingPointError non-finite loss nan at step 3 (np6 pdsh2; np3 restart, retry dies in connectFullMesh).
  segv: Signal 11 on the planted rank at step 2 (np8 tee_trainer; np4 restart, retry dies in connectFullMesh).
  logged_exit: ERROR line and exitcode 4 at step 1 (np7 prefix, np4 loglevel).
  shape_all: every rank: mat1 and mat2 shapes cannot be multiplied (16x7 and 6x16) at step 2 (np4 pdsh2).
  worker_crash: DataLoader worker killed by signal: Killed before step 0 (np6 pymodule, np3 redirects).
"""
import argparse, json, os, signal, sys, time, random, math

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault532_work"
NFEAT = 6


class BarkNet(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)


class PlotMeta:
    def __init__(self, survey, plots):
        self.survey, self.plots = survey, plots


def prepare():
    g = torch.Generator().manual_seed(532)
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    sites = {}
    for i in range(40):
        sites[f"S{i:04d}"] = {"altitude_m": 80 + 17 * i, "soil": ["sandy", "schist", "granite"][i % 3]}
    with open(f"{WORK}/sites.json", "w") as f:
        json.dump(sites, f, indent=1)
    for r in range(8):
        n = 256
        site_idx = torch.randint(0, 40, (n,), generator=g)
        dbh = 20 + 40 * torch.rand(n, generator=g)          # cm
        age = 30 + 120 * torch.rand(n, generator=g)         # years
        cycle = 9 + torch.randint(0, 4, (n,), generator=g).float()  # years since stripping
        rain = 450 + 500 * torch.rand(n, generator=g)       # mm/yr
        slope = 25 * torch.rand(n, generator=g)             # degrees
        bark = 0.9 * cycle + 0.08 * dbh + 0.004 * rain - 0.05 * slope + torch.randn(n, generator=g)
        torch.save({"site": [f"S{int(s):04d}" for s in site_idx], "dbh": dbh, "age": age,
                    "cycle": cycle, "rain": rain, "slope": slope, "bark_mm": bark},
                   f"{WORK}/shards/plots_rank{r}.pt")
    torch.manual_seed(532)
    torch.save(BarkNet().state_dict(), f"{WORK}/ckpt/barknet_init.pt")
    torch.save(BarkNet(hidden=24).state_dict(), f"{WORK}/ckpt/barknet_wide.pt")
    torch.save({"model": BarkNet().state_dict(), "meta": PlotMeta("IFN-2025", 212)},
               f"{WORK}/ckpt/barknet_with_meta.pt")
    print("prepared", WORK)


class PlotRecords(torch.utils.data.Dataset):
    def __init__(self, shard, sites, crash_at=None):
        self.s, self.sites, self.crash_at = shard, sites, crash_at

    def __len__(self):
        return len(self.s["site"])

    def __getitem__(self, i):
        if self.crash_at is not None and i >= self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        site = self.sites[self.s["site"][i]]
        x = torch.stack([self.s["dbh"][i] / 60, self.s["age"][i] / 150, self.s["cycle"][i] / 12,
                         torch.log(self.s["rain"][i]) / 7, self.s["slope"][i] / 25,
                         torch.tensor(site["altitude_m"] / 800.0)])
        return x, self.s["bark_mm"][i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare()
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    torch.manual_seed(1000 + rank)
    with open(f"{WORK}/sites.json") as f:
        sites = json.load(f)
    shard_dir = f"{WORK}/shards_2025q4" if (a.fault == "missing_shard" and me) else f"{WORK}/shards"
    shard = torch.load(f"{shard_dir}/plots_rank{rank % 8}.pt")
    if a.fault == "site_key" and me:
        shard["site"][3 * 16 + 5] = "S9999"
    if a.fault == "nan_check" and me:
        shard["rain"][3 * 16 + 2] = 0.0
    model = BarkNet()
    if a.fault == "ckpt_size" and me:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/barknet_wide.pt"))
    elif a.fault == "weights_only" and me:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/barknet_with_meta.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/barknet_init.pt"))
    print(f"rank {rank}/{world}: {len(shard['site'])} trees from shard plots_rank{rank % 8}.pt, "
          f"checkpoint loaded", flush=True)
    workers = 1 if a.fault == "worker_crash" else 0
    ds = PlotRecords(shard, sites, crash_at=20 if (a.fault == "worker_crash" and me) else None)
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    it = iter(dl)
    for step in range(a.steps):
        x, y = next(it)
        if a.fault == "logged_exit" and me and step == 1:
            print(f"ERROR rank {rank}: plot QC failed: 0 of 212 plots in shard plots_rank{rank % 8}.pt "
                  f"have a valid stripping date; refusing to train", flush=True)
            sys.exit(4)
        if a.fault == "shape_all" and step == 2:
            soil = torch.tensor([["sandy", "schist", "granite"].index(sites[s]["soil"]) / 2.0
                                 for s in shard["site"][step * 16:(step + 1) * 16]])
            x = torch.cat([x, soil[:, None]], dim=1)
        if a.fault == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "slow_rank" and me and step == 2:
            t0, acc = time.time(), 0.0
            rnd = random.Random(rank)
            while time.time() - t0 < a.pg_timeout + 30:   # pure-Python bootstrap of bark means
                acc += sum(rnd.gauss(30, 4) for _ in range(1000)) / 1000
        pred = model(x)
        loss = torch.mean((pred - y) ** 2)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                     f"(batch of plots {step * 16}..{step * 16 + 15})")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        mae = torch.mean(torch.abs(pred - y)).detach()
        per_site = torch.zeros(5 if (a.fault == "gather_size" and me and step == 2) else 4)
        per_site[0] = mae
        dist.all_reduce(per_site)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mae_mm {mae.item():.4f}", flush=True)
        time.sleep(0.2)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export/barknet_export.pt")
        print(f"rank 0: export written to {WORK}/export/barknet_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
