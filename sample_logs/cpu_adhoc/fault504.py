"""Peatland carbon flux estimation from eddy-covariance towers (batch 504 fault script).

A small distributed job: every rank reads its own shard of half-hourly tower records
(air temperature, PAR, VPD, water-table depth, soil temperature, friction velocity) and
fits an MLP that estimates net ecosystem exchange (NEE, umol CO2 m-2 s-1).  Gradients are
all_reduced by hand (gloo, CPU); rank 0 exports the model at the end.

    python fault504.py --prepare            # writes shards, station table, init checkpoint
    torchrun --nproc-per-node W fault504.py [--fault NAME --rank N] [--pg-timeout S]

Faults (--fault NAME, planted on --rank N):
  none           control, nothing planted
  key_error      rank N's shard names a tower id missing from the station lookup table -> KeyError
  missing_shard  rank N opens a shard file that was never written -> FileNotFoundError
  ckpt_size      rank N builds its model with 48 hidden units; loading the 32-unit init checkpoint fails (size mismatch)
  wrong_size     rank N all_reduces a flux-sum buffer of 5 floats where the others use 4 (step 3)
  slow_rank      rank N does ~pure-Python gap filling for a long time at step 2; its peers time out in all_reduce
  nan_flux       rank N's shard gets a NaN friction velocity; the script's own finiteness check raises FloatingPointError
  segv           rank N sends itself SIGSEGV at step 3
  error_exit     rank N prints its own ERROR line (footprint QC) and sys.exit(4) at step 2
  shape_all      every rank builds its feature matrix with 5 columns instead of 6 -> matmul shape error on all ranks
  loader_worker  rank N's DataLoader worker SIGKILLs itself while loading a batch
  host_alloc     rank N asks for a 2 TiB footprint-climatology grid -> CPU allocator fails (nothing is really used)

What happened (filled in after the runs, torch 2.13.0+cpu, gloo):
  none           clean: 6 steps on every rank, rank 0 exports, exit 0 (first try aborted at exit in a gloo
                 destroy race, 'terminate called without an active exception'; fixed by a barrier before destroy)
  key_error      KeyError: 'US-P07' in the dataset on rank N before step 0; peers 'Connection closed by peer'
  missing_shard  FileNotFoundError on rank N at start; visible only in the redirect files or not at all (filter)
  ckpt_size      load_state_dict RuntimeError size mismatch ([32, 7] vs [48, 7]) on rank N
  wrong_size     with DETAIL: 'Detected mismatch between collectives' (TensorShape [5] vs [4]); without it gloo
                 reports no size error, every rank times out after 12 s in recv/send
  slow_rank      peers time out in all_reduce after 12 s, the summary blames a peer; with --pg-timeout 300 the
                 output stops after step 1 until timeout's SIGTERM (agent SignalException, exit 124)
  nan_flux       FloatingPointError from the script's own check at step 1 on rank N
  segv           rank N exitcode -11 (SIGSEGV), no traceback; with --max-restarts 1 the restart fails in connectFullMesh
  error_exit     rank N's own 'ERROR footprint QC' line, exitcode 4
  shape_all      every rank: 'mat1 and mat2 shapes cannot be multiplied (32x6 and 7x32)' at step 0
  loader_worker  'DataLoader worker (pid N) is killed by signal: Killed.' on rank N
  host_alloc     DefaultCPUAllocator: can't allocate memory (2199023255552 bytes) on rank N at step 2
"""
import argparse, os, sys, time, signal, datetime, json
import torch
import torch.distributed as dist

WORK = "/tmp/fault504_work"
FEATS = ["tair", "par", "vpd", "wtd", "tsoil", "ustar"]
NTOWERS = 12


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(504)
    for r in range(8):
        n = 256
        x = torch.randn(n, len(FEATS), generator=g)
        tower = torch.randint(0, NTOWERS, (n,), generator=g)
        nee = -0.8 * x[:, 1] + 0.5 * x[:, 0] - 0.3 * x[:, 3] + 0.1 * torch.randn(n, generator=g)
        torch.save({"x": x, "tower": tower, "nee": nee}, f"{WORK}/shard_{r:02d}.pt")
    table = {f"US-P{t:02d}": {"lat": 45.0 + t * 0.1, "canopy_h": 0.3 + 0.05 * t} for t in range(NTOWERS)}
    with open(f"{WORK}/stations.json", "w") as f:
        json.dump(table, f)
    torch.manual_seed(0)
    torch.save(make_model(32).state_dict(), f"{WORK}/init.pt")
    print("prepared", WORK)


def make_model(hidden):
    return torch.nn.Sequential(torch.nn.Linear(len(FEATS) + 1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


class TowerShard(torch.utils.data.Dataset):
    def __init__(self, path, table, ncols, kill_worker):
        d = torch.load(path, weights_only=True)
        self.x, self.tower, self.nee = d["x"][:, :ncols], d["tower"], d["nee"]
        self.table, self.kill_worker = table, kill_worker

    def __len__(self):
        return len(self.nee)

    def __getitem__(self, i):
        if self.kill_worker and i >= 100 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        tid = f"US-P{int(self.tower[i]):02d}"
        canopy = self.table[tid]["canopy_h"]
        return torch.cat([self.x[i], torch.tensor([canopy])]), self.nee[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    fault = a.fault
    torch.manual_seed(1)

    with open(f"{WORK}/stations.json") as f:
        table = json.load(f)
    if fault == "key_error" and me:
        del table["US-P07"]
    shard = f"{WORK}/shard_{rank:02d}.pt"
    if fault == "missing_shard" and me:
        shard = f"{WORK}/shard_{rank:02d}_gapfilled.pt"
    ncols = 5 if fault == "shape_all" else len(FEATS)
    ds = TowerShard(shard, table, ncols, fault == "loader_worker" and me)
    if fault == "nan_flux" and me:
        ds.x[40, 5] = float("nan")
    nw = 1 if (fault == "loader_worker" and me) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=False, num_workers=nw)

    hidden = 48 if (fault == "ckpt_size" and me) else 32
    model = make_model(hidden)
    model.load_state_dict(torch.load(f"{WORK}/init.pt", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if rank == 0:
        print(f"peat-flux: world={world} towers={NTOWERS} features={FEATS} pg_timeout={a.pg_timeout}s", flush=True)

    it = iter(dl)
    for step in range(a.steps):
        xb, yb = next(it)
        if fault == "host_alloc" and me and step == 2:
            grid = torch.empty(2 ** 41, dtype=torch.uint8)  # 2 TiB footprint climatology
            grid.fill_(0)
        if fault == "slow_rank" and me and step == 2:
            acc = 0
            t0 = time.time()
            while time.time() - t0 < 400:
                for k in range(200000):
                    acc += (k * 31) % 7
        if fault == "error_exit" and me and step == 2:
            print(f"[rank {rank}] ERROR footprint QC: 61% of half-hours outside the fetch of tower US-P03, refusing to train", flush=True)
            sys.exit(4)
        if fault == "segv" and me and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if not torch.isfinite(xb).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite driver values in batch (ustar/par/vpd)")
        pred = model(xb).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, yb)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        n = 5 if (fault == "wrong_size" and me and step == 3) else 4
        fsum = torch.zeros(n)
        fsum[0], fsum[1], fsum[2], fsum[3] = pred.sum().item(), yb.sum().item(), float(len(yb)), loss.item()
        dist.all_reduce(fsum)
        bias = (fsum[0] - fsum[1]) / fsum[2]
        print(f"rank {rank} step {step} loss {loss.item():.4f} nee_bias {bias.item():.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_nee_mlp.pt")
        print(f"rank 0 exported {WORK}/export_nee_mlp.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
