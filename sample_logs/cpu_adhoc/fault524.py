"""Batch 524 fault script: salt evaporation pond brine yield.

A small regression model predicts the salt yield (kg/m2) of an evaporation pond from brine
features (salinity g/L, temperature, wind, depth, pond id -> lookup of pond area).
Each rank reads its own shard; gloo backend, CPU only; gradients all_reduced by hand
(or by DDP with --ddp). Rank 0 saves an export at the end.

Faults (--fault NAME --rank N):
  none            control, no fault
  pond_key        rank N looks up a pond id missing from the pond table -> KeyError
  brine_file      rank N's shard file is missing -> FileNotFoundError
  ckpt_size       rank N loads a checkpoint whose head has the wrong shape -> RuntimeError (size mismatch)
  weights_only    rank N loads a checkpoint holding a custom object with weights_only=True -> UnpicklingError
  gather_size     rank N all_gathers a yield tensor of the wrong length -> gloo size error
  slow_evap       rank N does slow pure-Python evaporation simulation; peers time out (gloo)
  hang_evap       like slow_evap but endless; with --pg-timeout 300 the outer `timeout` ends it
  nan_yield       rank N's salinity becomes NaN; the script's own check raises FloatingPointError
  segv            rank N sends itself SIGSEGV at step 2
  logged_exit     rank N prints its own ERROR line and sys.exit(4)
  shape_all       every rank builds a feature matrix with one column too many -> shape RuntimeError
  worker_crash    rank N's DataLoader worker dies (os._exit) -> DataLoader worker exited unexpectedly
What happened (runs of 2026-12-07, torch 2.13.0+cpu, gloo, 2 CPU cores):
  none          np4 plain and np6 pdsh2: all ranks finish 6 steps, rank 0 saves the export, exit 0.
  pond_key      KeyError: 'pond_77' on rank N before step 0 (np5 tee); with --local-ranks-filter 0,1 (np8, rank 6) only torchrun's summary shows it.
  brine_file    FileNotFoundError for brine_shard_1_evaporated.pt; the traceback is only in the redirected stderr.log.
  ckpt_size     load_state_dict size mismatch for 2.weight/2.bias on rank N (np6 tee_trainer rank 4, np3 wrapper rank 0).
  weights_only  UnpicklingError 'Weights only load failed ... __main__.Crystal' on rank N (np3 pymodule, np5 redirects).
  gather_size   plain: ProcessGroupGloo::allgather invalid tensor size on rank 3, peers 'Connection closed by peer'; DETAIL: every rank reports a collective mismatch, summary blames rank 0.
  slow_evap     ranks 1 and 3 time out after 12000 ms in gloo send/recv, rank 0 sees the connection closed; slow rank 2 prints nothing, summary blames rank 0.
  hang_evap     output stops after step 1; `timeout` SIGTERMs torchrun after 60 s (SignalException, exit 124).
  nan_yield     FloatingPointError 'brine yield loss is nan' on rank 5 at step 3; peers 'Connection closed by peer'.
  segv          rank N dies with SIGSEGV (exitcode -11); with --max-restarts 1 the restarted group fails Gloo connectFullMesh and the final summary blames rank 0.
  logged_exit   rank N's own ERROR line and exit code 4; peers 'Connection closed by peer'.
  shape_all     'mat1 and mat2 shapes cannot be multiplied (64x7 and 6x16)' on every rank.
  worker_crash  'DataLoader worker (pid ...) exited unexpectedly with exit code 1' on rank 1; peers 'Connection closed by peer'.
"""
import argparse, os, sys, time, signal, json
import torch
import torch.distributed as dist

WORK = "/tmp/fault524_work"
NFEAT = 5

class Crystal:  # custom object for the weights_only fault
    def __init__(self, v): self.v = v

def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(524)
    table = {str(i): 1000.0 + 250.0 * i for i in range(12)}
    with open(os.path.join(WORK, "ponds.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = torch.rand(64, NFEAT, generator=g)
        pond = torch.randint(0, 12, (64,), generator=g)
        y = (x @ torch.tensor([3.0, 1.5, 0.7, -0.4, 0.2])).unsqueeze(1)
        torch.save({"x": x, "pond": pond, "y": y}, os.path.join(WORK, f"brine_shard_{r}.pt"))
    model = torch.nn.Sequential(torch.nn.Linear(NFEAT + 1, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    torch.save(model.state_dict(), os.path.join(WORK, "init.pt"))
    bad = torch.nn.Sequential(torch.nn.Linear(NFEAT + 1, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    torch.save(bad.state_dict(), os.path.join(WORK, "init_bad_head.pt"))
    torch.save({"state": model.state_dict(), "meta": Crystal(3)}, os.path.join(WORK, "init_pickled.pt"))
    print("prepared", WORK)

def evaporate(n):
    s = 0.0
    for i in range(n):
        s += (i % 7) * 0.001
    return s

class PondDS(torch.utils.data.Dataset):
    def __init__(self, x, y, crash): self.x, self.y, self.crash = x, y, crash
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        if self.crash and i >= 20:
            os._exit(1)
        return self.x[i], self.y[i]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare(a.world); return
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank == a.rank)
    torch.manual_seed(0)
    with open(os.path.join(WORK, "ponds.json")) as f:
        ponds = json.load(f)
    shard = os.path.join(WORK, f"brine_shard_{rank}.pt")
    if a.fault == "brine_file" and me:
        shard = os.path.join(WORK, f"brine_shard_{rank}_evaporated.pt")
    data = torch.load(shard)
    x, pond, y = data["x"], data["pond"], data["y"]
    ids = [str(int(p)) for p in pond]
    if a.fault == "pond_key" and me:
        ids[17] = "pond_77"
    area = torch.tensor([ponds[i] for i in ids]).unsqueeze(1) / 4000.0
    feats = torch.cat([x, area], dim=1)
    if a.fault == "shape_all":
        feats = torch.cat([feats, torch.ones(len(feats), 1)], dim=1)
    model = torch.nn.Sequential(torch.nn.Linear(NFEAT + 1, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ck = os.path.join(WORK, "init.pt")
    if a.fault == "ckpt_size" and me:
        ck = os.path.join(WORK, "init_bad_head.pt")
    if a.fault == "weights_only" and me:
        sd = torch.load(os.path.join(WORK, "init_pickled.pt"), weights_only=True)["state"]
    else:
        sd = torch.load(ck, weights_only=True)
    model.load_state_dict(sd)
    if a.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = None
    if a.fault == "worker_crash":
        ds = PondDS(feats, y, crash=me)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=1)
    for step in range(a.steps):
        if loader is not None:
            bx, by = [], []
            for xb, yb in loader:
                bx.append(xb); by.append(yb)
            fx, fy = torch.cat(bx), torch.cat(by)
        else:
            fx, fy = feats, y
        if a.fault == "nan_yield" and me and step == 3:
            fx = fx.clone(); fx[5, 0] = float("nan")
        if a.fault == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "logged_exit" and me and step == 2:
            print(f"ERROR rank {rank}: brine density sensor for pond 4 reports 0.0 g/L, refusing to train on it", flush=True)
            sys.exit(4)
        if a.fault == "slow_evap" and me and step == 2:
            evaporate(200_000_000)
        if a.fault == "hang_evap" and me and step == 2:
            while True:
                evaporate(10_000_000)
        pred = model(fx)
        loss = torch.nn.functional.mse_loss(pred, fy)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: brine yield loss is {loss.item()} (non-finite)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad); p.grad /= world
        opt.step()
        yld = pred.detach().mean().reshape(1)
        if a.fault == "gather_size" and me and step == 1:
            yld = torch.cat([yld, yld, yld])
        outs = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(outs, yld)
        mean_yield = torch.cat(outs).mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} yield_kg_m2 {mean_yield:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "brine_yield_export.pt"))
        print("rank 0 saved export brine_yield_export.pt", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
