"""A two-hundred-and-second hand-run batch: MOLECULAR PROPERTY PREDICTION WITH MESSAGE PASSING.

Each rank reads its shard of synthetic molecules (atom symbols, bond lists, a scalar property) from
/tmp/job_work/data/mols_shardRR.json, builds one-hot atom features, a directed edge_index with per-graph
offsets and a batch vector by hand, and trains a small message-passing network (messages gathered by
edge source, scatter-added with index_add_ onto the destination atoms, graph pooling by index_add_ over
the batch vector) on normalised targets. Rank 0 saves the initial weights and every rank reloads them; the
model is wrapped in DDP; after training the per-rank MAE sums are all_gathered and the MAE is all_reduced;
rank 0 saves the model. Launch under torchrun, torch.distributed.launch, a bash loop (env://) or --spawn N.

Faults:
  edgeidx   rank N offsets each graph's bonds by n_atoms+1: the last graph's edges point past the batch
  featdim   every rank adds a formal-charge column: atom features 9 wide, the encoder expects 8
  graphfile rank N opens mols_shardR.json (no zero padding), which is not there (FileNotFoundError)
  zerostd   rank N takes its target statistics from a 1-molecule subset: std 0, targets inf (program's check)
  atomtype  rank N's shard has a bromine atom, 'Br' is not in the atom vocabulary (KeyError)
  depthstr  every rank reads the message-passing depth as the string "3" (TypeError)
  maelen    rank N all_gathers [sum, count, max] instead of [sum, count] (gloo size mismatch)
  slowcache rank N rebuilds its graph cache before the MAE all_reduce (peers time out)
  ckpthid   rank N builds the network with hidden size 48 and loads the 32-wide init checkpoint
  sigbus    rank N sends itself SIGBUS after step 3
  exit5     rank N prints an error line after validation and exits with code 5
  none      no fault

What happened (filled in after the runs):
  edgeidx   IndexError: index out of range in self (index_select) on rank N; peers closed (np4 r2 ranklabel)
  featdim   RuntimeError mat1 and mat2 shapes cannot be multiplied (..x9 and 8x32) on every rank (np3 rall srunlabel)
  graphfile FileNotFoundError mols_shard3.json on rank 3; peers Connection closed in barrier (np4 r3 mpitag)
  zerostd   FloatingPointError non-finite loss nan at step 0, target std 0 on rank 1 (np3 r1 spawn)
  atomtype  not run (time limit)
  depthstr  not run (time limit)
  maelen    not run (time limit)
  slowcache not run (time limit)
  ckpthid   not run (time limit)
  sigbus    not run (time limit)
  exit5     not run (time limit)
  none      exit 0, rank 0 saved the property model (np3 bashloop)
"""
import argparse, json, logging, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ATOMS = {"C": 0, "N": 1, "O": 2, "F": 3, "S": 4, "Cl": 5}
WORK = "/tmp/fault202_work"


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def prepare(n_shards=8, per_shard=64):
    os.makedirs(os.path.join(WORK, "data"), exist_ok=True)
    gen = torch.Generator().manual_seed(7)
    syms = list(ATOMS)
    for s in range(n_shards):
        mols = []
        for _ in range(per_shard):
            n = int(torch.randint(4, 12, (1,), generator=gen))
            atoms = [syms[int(i)] for i in torch.multinomial(torch.tensor([6., 2, 2, .5, .5, .5]), n, True, generator=gen)]
            bonds = [[i, i + 1] for i in range(n - 1)]
            if n > 5:
                bonds.append([0, 5])
            y = sum({"C": 1.2, "N": 0.7, "O": -0.4, "F": -1.1, "S": 0.9, "Cl": -0.8}[a] for a in atoms) + 0.3 * len(bonds)
            mols.append({"atoms": atoms, "bonds": bonds, "y": round(y, 4)})
        with open(os.path.join(WORK, "data", f"mols_shard{s:02d}.json"), "w") as f:
            json.dump(mols, f)


def featurize(mol, charge_col):
    deg = [0] * len(mol["atoms"])
    for i, j in mol["bonds"]:
        deg[i] += 1
        deg[j] += 1
    x = torch.zeros(len(mol["atoms"]), len(ATOMS) + 2 + (1 if charge_col else 0))
    for k, a in enumerate(mol["atoms"]):
        x[k, ATOMS[a]] = 1.0
        x[k, len(ATOMS)] = deg[k] / 4.0
        x[k, len(ATOMS) + 1] = 1.0 if a in ("N", "O") else 0.0
    return x


def collate(mols, feats, extra_offset):
    xs, srcs, dsts, batch, off = [], [], [], [], 0
    for g, (m, x) in enumerate(zip(mols, feats)):
        b = torch.tensor(m["bonds"], dtype=torch.long).t() + off
        srcs += [b[0], b[1]]
        dsts += [b[1], b[0]]
        xs.append(x)
        batch.append(torch.full((x.shape[0],), g, dtype=torch.long))
        off += x.shape[0] + extra_offset
    return torch.cat(xs), torch.cat(srcs), torch.cat(dsts), torch.cat(batch)


class MPNN(nn.Module):
    def __init__(self, in_dim, hidden, depth):
        super().__init__()
        self.embed = nn.Linear(in_dim, hidden)
        self.msg = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(depth)])
        self.upd = nn.ModuleList([nn.Linear(2 * hidden, hidden) for _ in range(depth)])
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, src, dst, batch, n_graphs):
        h = torch.relu(self.embed(x))
        for msg, upd in zip(self.msg, self.upd):
            m = torch.relu(msg(h))
            agg = torch.zeros_like(h).index_add_(0, dst, m.index_select(0, src))
            h = torch.relu(upd(torch.cat([h, agg], 1)))
        pooled = h.new_zeros(n_graphs, h.shape[1]).index_add_(0, batch, h)
        return self.head(pooled).squeeze(1)


def worker(rank, a, world):
    if a.spawn:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    r = int(os.environ["RANK"])
    bad = a.fault != "none" and (a.rank == -1 or a.rank == r)
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        h.addFilter(RankFilter(r))
        logging.basicConfig(level=logging.INFO, handlers=[h])
        say, err = logging.getLogger("mpnn").info, logging.getLogger("mpnn").error
    else:
        say = err = lambda m: print(m, flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    ws = dist.get_world_size()
    cfg = {"hidden": 32, "depth": 3, "in_dim": len(ATOMS) + 2, "norm_subset": 64, "lr": 0.01, "bs": 16}
    if bad and a.fault == "depthstr":
        cfg["depth"] = "3"
    if bad and a.fault == "ckpthid":
        cfg["hidden"] = 48
    if bad and a.fault == "zerostd":
        cfg["norm_subset"] = 1
    shard = f"mols_shard{r}.json" if bad and a.fault == "graphfile" else f"mols_shard{r:02d}.json"
    with open(os.path.join(WORK, "data", shard)) as f:
        mols = json.load(f)
    if bad and a.fault == "atomtype":
        mols[11]["atoms"][2] = "Br"
    feats = [featurize(m, bad and a.fault == "featdim") for m in mols]
    ys = torch.tensor([m["y"] for m in mols])
    sub = ys[:cfg["norm_subset"]]
    mean, std = sub.mean(), sub.std(unbiased=False)
    yn = (ys - mean) / std
    say(f"rank {r}/{ws}: {len(mols)} molecules, {sum(x.shape[0] for x in feats)} atoms, "
        f"target mean {mean.item():.3f} std {std.item():.3f}, depth {cfg['depth']}")
    torch.manual_seed(0)
    model = MPNN(cfg["in_dim"], cfg["hidden"], cfg["depth"])
    ck = os.path.join(WORK, "ckpt", "mpnn_init.pt")
    if r == 0:
        os.makedirs(os.path.dirname(ck), exist_ok=True)
        torch.save(model.state_dict(), ck)
    dist.barrier()
    model.load_state_dict(torch.load(ck))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
    extra = 1 if bad and a.fault == "edgeidx" else 0
    for step in range(a.steps):
        lo = (step * cfg["bs"]) % len(mols)
        x, src, dst, batch = collate(mols[lo:lo + cfg["bs"]], feats[lo:lo + cfg["bs"]], extra)
        pred = ddp(x, src, dst, batch, cfg["bs"])
        loss = (pred - yn[lo:lo + cfg["bs"]]).abs().mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {r}: non-finite loss {loss.item()} at step {step} "
                                     f"(target std {std.item():.4g}, normalisation subset {cfg['norm_subset']})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"rank {r} step {step} loss {loss.item():.4f}")
        if bad and a.fault == "sigbus" and step == 3:
            os.kill(os.getpid(), signal.SIGBUS)
    with torch.no_grad():
        x, src, dst, batch = collate(mols, feats, 0)
        pred = ddp.module(x, src, dst, batch, len(mols)) * std + mean
    abs_err = (pred - ys).abs()
    stats = torch.tensor([abs_err.sum().item(), float(len(mols))])
    if bad and a.fault == "maelen":
        stats = torch.cat([stats, abs_err.max().view(1)])
    gathered = [torch.zeros(2) for _ in range(ws)]
    dist.all_gather(gathered, stats)
    if bad and a.fault == "slowcache":
        say(f"rank {r}: graph cache stale, rebuilding edge_index cache for {len(mols)} molecules")
        time.sleep(a.stall)
    tot = stats[:2].clone()
    dist.all_reduce(tot)
    say(f"rank {r} val MAE {(tot[0] / tot[1]).item():.4f} shard MAE {(gathered[r][0] / gathered[r][1]).item():.4f}")
    if bad and a.fault == "exit5":
        err(f"ERROR rank {r}: shard MAE {(abs_err.mean() * 250).item():.1f} kcal/mol exceeds the sanity bound 50.0; "
            "refusing to write the property model")
        sys.exit(5)
    dist.barrier()
    if r == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save({"model": model.state_dict(), "mean": mean, "std": std}, os.path.join(WORK, "out", "mpnn_final.pt"))
        say(f"rank 0: saved property model to {WORK}/out/mpnn_final.pt")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prepare", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        worker(None, a, None)


if __name__ == "__main__":
    main()
