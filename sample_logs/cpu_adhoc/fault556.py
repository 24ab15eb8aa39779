"""Batch 556 fault script: tufa tower calcite layering.

A small distributed (gloo, CPU) job that learns to classify calcite laminae of tufa towers
(sparry / micritic / detrital / biofilm layers) from per-layer features: thickness, Mg/Ca, d18O,
porosity and the mineral code looked up in a shared table. `--prepare` writes synthetic shards
(one per rank), the mineral lookup table and a starting checkpoint into /tmp/fault556_work.
Every rank prints `rank R step S loss L layer_acc M` each step; rank 0 exports the model at the end.

Faults (`--fault NAME --rank N`):
  none            control, nothing planted
  keyerror        rank N's shard names a mineral code missing from the lookup table -> KeyError
  missing_shard   rank N opens a shard file that does not exist -> FileNotFoundError
  ckpt_size       rank N loads a starting checkpoint whose layer has another width -> size mismatch
  gather_shape    rank N all_gathers a layer-count tensor of the wrong length -> gloo size error
  slow            rank N does pure-Python work (re-fitting layer boundaries) for --slow-s seconds;
                  its peers time out in the next collective (with --pg-timeout 300: a hang)
  nan             rank N's porosity column turns NaN; the script's own finiteness check raises
  segv            rank N sends itself SIGSEGV at step 2
  exit4           rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       every rank builds its head with the wrong input width -> matmul shape error
  worker_crash    rank N's DataLoader worker kills itself with SIGKILL
  skip_allreduce  rank N skips the loss all_reduce at step 3 (collectives out of step)
  --manual        all_reduce gradients by hand instead of DDP (for TORCH_DISTRIBUTED_DEBUG=DETAIL)

What happened (one line per fault, from the kept logs):
  none            np4 plain: 6 steps on every rank, export written, exit 0.
  keyerror        np5 tee r3 / np3 pymodule r1: KeyError 'dolomite_crust' on the planted rank, peers "Connection closed by peer".
  missing_shard   np6 tee_trainer r4: FileNotFoundError on rank 4; np4 filter r3: rank 3 filtered out, console has only exit 1.
  ckpt_size       np4 redirects r2: size mismatch only in attempt_0/2/stderr.log; np8 pdsh2 r7: size mismatch on rank 7.
  gather_shape    np6 loglevel r5: "ProcessGroupGloo::allgather: invalid tensor size"; np3 detail r0: DETAIL collective mismatch (shape [5] vs [4]).
  slow            np5 plain r2: peers "Timed out waiting 12000ms", rank 2 SIGTERMed; np4 prefix r1 --pg-timeout 300: hang ended by timeout 60 (exit 124).
  nan             np8 wrapper r6 / np4 restart r1: FloatingPointError from the script's own check.
  segv            np6 pdsh2 r3 / np5 filter r4: exitcode -11 (SIGSEGV) on the planted rank.
  exit4           np7 prefix r5 / np4 wrapper r2: the rank's own ERROR line, exit 4.
  shape_all       np5 pymodule: "mat1 and mat2 shapes cannot be multiplied (16x5 and 6x32)" on every rank.
  worker_crash    np4 plain r1: "DataLoader worker (pid N) is killed by signal: Killed."
  skip_allreduce  np3 detail r2: DETAIL collective mismatch (ALLREDUCE vs ALLGATHER); np6 loglevel r4: every rank times out after 12000ms.
"""
import argparse, json, os, signal, sys, time, datetime
import torch, torch.nn as nn, torch.distributed as dist

WORK = "/tmp/fault556_work"
NFEAT = 5
NCLASS = 4
MINERALS = ["calcite_spar", "calcite_micrite", "aragonite", "detrital_quartz", "biofilm_mat"]


def prepare(max_world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(556)
    table = {m: i / len(MINERALS) for i, m in enumerate(MINERALS)}
    with open(os.path.join(WORK, "mineral_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(max_world):
        n = 96
        x = torch.rand(n, NFEAT - 1, generator=g)
        y = (x[:, 0] * 2 + x[:, 1] * 2).long().clamp(0, NCLASS - 1)
        minerals = [MINERALS[int(i)] for i in torch.randint(0, len(MINERALS), (n,), generator=g)]
        torch.save({"x": x, "y": y, "mineral": minerals}, os.path.join(WORK, f"tower_shard_{r:02d}.pt"))
    torch.manual_seed(0)
    torch.save(make_model(NFEAT).state_dict(), os.path.join(WORK, "laminae_init.pt"))
    torch.save(make_model(NFEAT, hidden=48).state_dict(), os.path.join(WORK, "laminae_init_wide.pt"))
    print("prepared", WORK)


def make_model(nin, hidden=32):
    return nn.Sequential(nn.Linear(nin, hidden), nn.ReLU(), nn.Linear(hidden, NCLASS))


class LaminaeSet(torch.utils.data.Dataset):
    def __init__(self, path, table, crash_worker=False, bad_key=False, nan=False):
        d = torch.load(path)
        self.x, self.y, self.m = d["x"], d["y"], list(d["mineral"])
        if bad_key:
            self.m[37] = "dolomite_crust"
        if nan:
            self.x[40:48, 3] = float("nan")
        self.table, self.crash_worker = table, crash_worker

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash_worker and i >= 40 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        code = self.table[self.m[i]]
        return torch.cat([self.x[i], torch.tensor([code])]), self.y[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--slow-s", type=float, default=40)
    ap.add_argument("--manual", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    f = a.fault
    if rank == 0:
        print(f"tufa laminae trainer: world={world} fault={f} fault_rank={a.rank} pg_timeout={a.pg_timeout}s", flush=True)
    with open(os.path.join(WORK, "mineral_table.json")) as fh:
        table = json.load(fh)
    shard = os.path.join(WORK, f"tower_shard_{rank:02d}.pt")
    if f == "missing_shard" and me:
        shard = os.path.join(WORK, f"tower_shard_{rank:02d}_resampled.pt")
    ds = LaminaeSet(shard, table, crash_worker=(f == "worker_crash" and me),
                    bad_key=(f == "keyerror" and me), nan=(f == "nan" and me))
    nw = 1 if f == "worker_crash" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=nw)
    nin = NFEAT + 1 if f == "shape_all" else NFEAT
    model = make_model(nin)
    ck = "laminae_init_wide.pt" if (f == "ckpt_size" and me) else "laminae_init.pt"
    if f != "shape_all":
        model.load_state_dict(torch.load(os.path.join(WORK, ck), weights_only=True))
    if not a.manual:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    for xb, yb in dl:
        step += 1
        if step > a.steps:
            break
        if f == "shape_all":
            xb = xb[:, :NFEAT]
        if not torch.isfinite(xb).all():
            bad = int((~torch.isfinite(xb)).sum())
            raise FloatingPointError(f"rank {rank} step {step}: {bad} non-finite porosity values in layer batch")
        if me and f == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if me and f == "exit4" and step == 3:
            print(f"rank {rank} ERROR: tower profile T{rank:02d} has overlapping calcite laminae (depth 12.4 m < 12.7 m); aborting", flush=True)
            sys.exit(4)
        if me and f == "slow" and step == 2:
            t0 = time.time(); k = 0
            while time.time() - t0 < a.slow_s:
                k = (k * 1103515245 + 12345) % 2147483648
        out = model(xb)
        loss = nn.functional.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward()
        if a.manual:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        acc = (out.argmax(1) == yb).float().mean()
        lt = loss.detach().clone()
        if not (me and f == "skip_allreduce" and step == 3):
            dist.all_reduce(lt)
        counts = torch.bincount(out.argmax(1), minlength=NCLASS).float()
        if me and f == "gather_shape":
            counts = torch.cat([counts, counts[:1]])
        gathered = [torch.zeros(NCLASS) for _ in range(world)]
        dist.all_gather(gathered, counts)
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f} layer_acc {acc.item():.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        m = model.module if hasattr(model, "module") else model
        torch.save(m.state_dict(), os.path.join(WORK, "laminae_export.pt"))
        print("rank 0 exported laminae_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
