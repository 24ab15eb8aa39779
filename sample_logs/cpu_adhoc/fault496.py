"""Cocoa bean fermentation grading: a small distributed training job (gloo, CPU) with one planted fault.

Each rank reads its own shard of cut-test records (lot code, fermentation days, box temperature, pH,
cut-test percentages), maps the lot code to its growing region through a lookup table, and trains a small
MLP that predicts the fermentation grade (5 grades).  Gradients are all_reduced by hand (no DDP wrapper,
so TORCH_DISTRIBUTED_DEBUG=DETAIL works on this build).  Every rank prints
`rank R step S loss L grade_acc M` each step; rank 0 saves an export at the end.

  python fault496.py --prepare            # writes shards, the lookup table and checkpoints to /tmp/fault496_work
  torchrun --nproc-per-node W fault496.py --fault NAME --rank N [--pg-timeout 12] [--slow-s 40]

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none          control: nothing planted
  keyerror      rank N's shard has a lot code the region lookup table lacks (KeyError in the dataset)
  missing_shard rank N reads its shard from a re-grading folder that was never copied (FileNotFoundError)
  ckpt_size     rank N starts from the 4-grade checkpoint of last season (size mismatch in load_state_dict)
  weights_only  rank N loads the checkpoint that pickled a GradeScale object (torch.load weights_only refusal)
  wrong_size    rank N all_reduces its gradient buffer with one extra element at step 3
  slow          rank N recomputes its fermentation index in pure Python for --slow-s seconds at step 2;
                its peers time out in all_reduce (with --pg-timeout 300 the job hangs instead)
  nan           rank N's box temperature reads inf at step 3; the program's own finite-loss check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line about cut-test scores and calls sys.exit(4) at step 2
  shape_all     every rank adds a derived feature column the model does not expect (matmul shape error)
  worker_crash  DataLoader with 1 worker on every rank; rank N's worker is SIGKILLed while loading step 2

What happened (runs in sample_logs/cpu_adhoc/cocoa_*, torch 2.13.0+cpu, gloo, 2-core host):
  none          clean: all ranks finish 6 steps, rank 0 saves the export, exit 0 (plain np4; pdsh2 np4 also exits 0)
  keyerror      KeyError 'CI-117' in __getitem__ on rank N at step 1; peers: gloo 'Connection closed by peer'
  missing_shard FileNotFoundError for regrade_2026b/cut_test_shard_0N.json on rank N before training
  ckpt_size     load_state_dict size mismatch (4 vs 5 grades) on rank N; with --local-ranks-filter hiding N, no traceback shows
  weights_only  _pickle.UnpicklingError 'Weights only load failed' (GradeScale) on rank N
  wrong_size    under TORCH_DISTRIBUTED_DEBUG=DETAIL every rank raises 'Detected mismatch between collectives' (709 vs 710)
  slow          peers raise gloo 'Timed out waiting 12000ms' at step 2, slow rank prints nothing; with --pg-timeout 300
                the job makes no progress after step 1 until timeout(1) SIGTERMs torchrun (exit 124)
  nan           FloatingPointError 'loss is nan' from the program's own check on rank N at step 3
  sigsegv       rank N exitcode -11 (SIGSEGV) at step 2; with --max-restarts 1 the second attempt fails in gloo connectFullMesh
  exit4         rank N's own 'ERROR: rank N: cut-test scores ... sum to 142%' line, exitcode 4
  shape_all     every rank: 'mat1 and mat2 shapes cannot be multiplied (16x17 and 16x32)' at step 0
  worker_crash  rank N: 'DataLoader worker (pid P) is killed by signal: Killed' at step 2
"""
import argparse, json, os, random, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
from datetime import timedelta

WORK = "/tmp/fault496_work"
REGIONS = ["ashanti", "western", "san_pedro", "soconusco", "sulawesi", "tabasco", "bahia", "manabi"]
NFEAT = 8
GRADES = 5
BATCH = 16
STEPS = 6


class GradeScale:
    def __init__(self, names):
        self.names = names


def make_model(grades=GRADES):
    return nn.Sequential(nn.Linear(NFEAT + len(REGIONS), 32), nn.ReLU(), nn.Linear(32, grades))


def prepare(max_ranks=8):
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(496)
    lots = {f"{r[:2].upper()}-{i:03d}": j for j, r in enumerate(REGIONS) for i in range(12)}
    with open(os.path.join(WORK, "lot_regions.json"), "w") as f:
        json.dump(lots, f)
    codes = sorted(lots)
    for rank in range(max_ranks):
        rows = []
        for k in range(BATCH * STEPS):
            days = rng.uniform(2, 8)
            rows.append({"lot": rng.choice(codes), "days": days, "temp": rng.uniform(38, 50),
                         "ph": rng.uniform(4.5, 6.0), "brown": rng.uniform(30, 90), "purple": rng.uniform(5, 50),
                         "slaty": rng.uniform(0, 20), "mouldy": rng.uniform(0, 6), "moisture": rng.uniform(6, 9),
                         "grade": min(GRADES - 1, int(days) - 2 if days > 2 else 0) % GRADES})
        with open(os.path.join(WORK, f"cut_test_shard_{rank:02d}.json"), "w") as f:
            json.dump(rows, f)
    torch.manual_seed(496)
    torch.save(make_model().state_dict(), os.path.join(WORK, "init_grader.pt"))
    torch.save(make_model(4).state_dict(), os.path.join(WORK, "init_grader_2025_4grades.pt"))
    torch.save({"model": make_model().state_dict(), "scale": GradeScale(["I", "II", "III", "sub", "reject"])},
               os.path.join(WORK, "init_grader_with_scale.pt"))
    print(f"prepared {max_ranks} shards, lookup table and checkpoints in {WORK}")


class CutTestSet(torch.utils.data.Dataset):
    def __init__(self, rows, lots, rank, args):
        self.rows, self.lots, self.rank, self.args = rows, lots, rank, args

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        a = self.args
        if a.fault == "worker_crash" and self.rank == a.rank and i == 2 * BATCH:
            os.kill(os.getpid(), signal.SIGKILL)
        r = self.rows[i]
        region = self.lots[r["lot"]]
        temp = r["temp"]
        if a.fault == "nan" and self.rank == a.rank and i == 3 * BATCH:
            temp = float("inf")
        x = [r["days"] / 8, temp / 50, r["ph"] / 6, r["brown"] / 100, r["purple"] / 100,
             r["slaty"] / 20, r["mouldy"] / 6, r["moisture"] / 9]
        if a.fault == "shape_all":
            x.append(r["brown"] / max(r["purple"], 1.0) / 10)  # derived "fermentation index" column
        onehot = [0.0] * len(REGIONS)
        onehot[region] = 1.0
        return torch.tensor(x + onehot), torch.tensor(r["grade"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--slow-s", type=float, default=40)
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000 + rank)
    with open(os.path.join(WORK, "lot_regions.json")) as f:
        lots = json.load(f)
    shard = os.path.join(WORK, f"cut_test_shard_{rank:02d}.json")
    if a.fault == "missing_shard" and rank == a.rank:
        shard = os.path.join(WORK, "regrade_2026b", f"cut_test_shard_{rank:02d}.json")
    with open(shard) as f:
        rows = json.load(f)
    if a.fault == "keyerror" and rank == a.rank:
        rows[BATCH + 5]["lot"] = "CI-117"  # a Cote d'Ivoire lot the table does not list
    model = make_model()
    ck = os.path.join(WORK, "init_grader.pt")
    if a.fault == "ckpt_size" and rank == a.rank:
        ck = os.path.join(WORK, "init_grader_2025_4grades.pt")
    if a.fault == "weights_only" and rank == a.rank:
        state = torch.load(os.path.join(WORK, "init_grader_with_scale.pt"))["model"]
    else:
        state = torch.load(ck)
    model.load_state_dict(state)
    workers = 1 if a.fault == "worker_crash" else 0
    loader = torch.utils.data.DataLoader(CutTestSet(rows, lots, rank, a), batch_size=BATCH, num_workers=workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lossf = nn.CrossEntropyLoss()
    print(f"rank {rank}/{world}: {len(rows)} cut-test records from {os.path.basename(shard)}", flush=True)
    for step, (x, y) in enumerate(loader):
        if step >= STEPS:
            break
        if step == 2 and rank == a.rank:
            if a.fault == "slow":
                t0 = time.time(); acc = 0
                while time.time() - t0 < a.slow_s:
                    for k in range(20000):
                        acc += (k * 7919) % 13
            elif a.fault == "sigsegv":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif a.fault == "exit4":
                print(f"ERROR: rank {rank}: cut-test scores for lot {rows[2 * BATCH]['lot']} sum to 142% "
                      f"(brown+purple+slaty+mouldy > 100); refusing to grade this shard", file=sys.stderr, flush=True)
                sys.exit(4)
        out = model(x)
        loss = lossf(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite); "
                                     f"check the box temperature readings")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([q.grad.flatten() for q in model.parameters()])
        if a.fault == "wrong_size" and rank == a.rank and step == 3:
            flat = torch.cat([flat, torch.zeros(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for q in model.parameters():
            n = q.numel(); q.grad.copy_(flat[off:off + n].view_as(q)); off += n
        opt.step()
        acc = (out.argmax(1) == y).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        print(f"rank {rank} step {step} loss {loss.item():.4f} grade_acc {acc.item():.3f} "
              f"(mean loss {stats[0].item():.4f})", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "grader_export.pt"))
        print("rank 0: saved grader export to", os.path.join(WORK, "grader_export.pt"), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
