"""Batch 631 fault job: corella flock roosts (per-rank roost sightings -> predicted roost counts).

--prepare writes /tmp/fault631_work: per-rank shards (shard_R.npy habitat features, raw_R.f32 wind/temperature
memmap, roosts_R.jsonl sightings with a roost-name history, counts_R.csv.gz flock counts, notes_R.txt roost notes,
seed_R.txt worker seeds), roost_table.json (roost name -> index lookup), meta.json (rows per rank) and start.pt.
Modes: --mode trainer (LightningModule + L.Trainer, DDPStrategy gloo) or --mode fabric (Fabric, own loop).
Every rank prints `rank R step S loss L roost_occupancy M` for 6 steps; rank 0 saves export.pt at the end.

Faults (--fault NAME --rank N, planted on rank N only; the planted rank damages its own files at start):
  none            control run
  worker_sigkill  DataLoader worker of rank N sends itself SIGKILL at item 10
  worker_segv     DataLoader worker of rank N sends itself SIGSEGV at item 10
  loader_timeout  DataLoader(timeout=2); rank N's worker sleeps 20 s at item 10
  npy_truncated   rank N's shard_R.npy cut to half its bytes (np.load in the Dataset)
  gzip_truncated  rank N's counts_R.csv.gz cut short (gzip EOFError)
  jsonl_broken    rank N's roosts_R.jsonl line 7 cut in the middle (json.JSONDecodeError)
  collate_stack   rank N's roosts_R.jsonl line 10 has a 5-long history (torch.stack in collate_fn fails)
  vocab_keyerror  rank N's roosts_R.jsonl line 11 names a roost not in roost_table.json (KeyError in the worker)
  memmap_short    rank N's raw_R.f32 cut short (np.memmap asks for more than the file holds)
  file_removed    rank N deletes its shard_R.npy after step 1; the worker re-opens it per item
  worker_init     rank N's seed_R.txt holds 'x17' (int() fails in worker_init_fn)
  short_shard     rank N's shard_R.npy re-saved with 13 rows while meta.json says 24 (IndexError in the worker)
  unicode_decode  rank N's notes_R.txt re-written in latin-1 (UnicodeDecodeError reading it as utf-8)
  nan_loss        rank N's loss is multiplied by nan at step 3; the script's own check raises FloatingPointError
  stall           rank N sleeps 40 s before step 3; the others wait in DDP's all-reduce past the pg timeout

Runs (one line per log):
  corella_none_np3_rnone_pltorchrun: exit 0; Control run under torchrun (Trainer, 3 ranks, 1 DataLoader worker each): all ranks print 6 steps, fit stops at max_steps and rank 0 saves the export
  corella_collate_stack_np8_r7_pltorchrun: exit 1; Rank 7's collate_fn raises RuntimeError 'stack expects each tensor to be equal size' inside its DataLoader worker at batch 2
  corella_worker_sigkill_np5_r4_pltee: exit 1; Rank 4's DataLoader worker SIGKILLs itself
  corella_loader_timeout_np6_r0_plloglevel: exit 1; Rank 0's slow DataLoader worker trips timeout=2: rank 0 raises 'DataLoader timed out after 2 seconds', the other five ranks fail with gloo Connection 
  corella_npy_truncated_np5_r2_plbashloop: exit 124; Rank 2's truncated shard_2.npy makes np.load raise ValueError 'Failed to read all data for array' while building its DataLoader
  corella_worker_segv_np5_r1_plfabric: exit 1; Rank 1's DataLoader worker segfaults (SIGSEGV to itself)
  corella_file_removed_np3_r1_plown: exit 1; Lightning's own launcher, 3 ranks: rank 1's worker hits FileNotFoundError for its shard_1.npy (removed after step 1) at step 3
  corella_vocab_keyerror_np6_r5_pltee: exit 1; Rank 5's worker raises KeyError 'Wollongong Cemetery' in the roost-table lookup (Caught KeyError in DataLoader worker process 0)
  corella_gzip_truncated_np4_r3_plfabric: exit 1; Fabric under torchrun: rank 3's truncated gzip counts file raises EOFError 'Compressed file ended before the end-of-stream marker was reached' before 
  corella_jsonl_broken_np5_r0_pltorchrun: exit 1; Rank 0's broken JSONL line raises JSONDecodeError 'Invalid control character at: line 1 column 26 (char 25)' (the line/column are of the single line j
  corella_memmap_short_np4_r2_plloglevel: exit 1; Rank 2's np.memmap over its shortened raw_2.f32 raises 'ValueError: mmap length is greater than file size' in train_dataloader
  corella_worker_init_np6_r3_plbashloop: exit 1; Bash loop, 6 ranks: rank 3's worker_init_fn fails (ValueError: invalid literal for int() with base 10: 'x17', caught in DataLoader worker process 0) b
  corella_short_shard_np7_r6_pltorchrun: exit 1; Rank 6's Dataset __len__ (24) is longer than its 13-row shard
  corella_nan_loss_np4_r1_plown: exit 1; Lightning's own launcher, 4 ranks: rank 1's finiteness check raises FloatingPointError 'rank 1 step 3: loss is nan' after the others print step 3
  corella_stall_np3_r2_pltorchrun: exit 1; Rank 2 stalls 40 s at step 3
  corella_worker_sigkill_np3_r0_plfabric: exit 1; Fabric under torchrun: rank 0's worker SIGKILLs itself and rank 0 raises 'DataLoader worker (pid 14510) is killed by signal: Killed.' before printing 
  corella_loader_timeout_np4_r3_pltee: exit 1; Rank 3's slow worker trips the DataLoader's timeout=2: 'DataLoader timed out after 2 seconds' after step 1
  (unused)
  (unused)
  (unused)
  (unused)
  (unused)
"""
import argparse, csv, gzip, io, json, os, signal, sys, time
from datetime import timedelta

import numpy as np
import torch
import torch.nn as nn

WORK = "/tmp/fault631_work"
ROWS, BATCH, STEPS = 24, 4, 6
ROOSTS = ["Bicentennial Park", "Centennial Park", "Lake Burley Griffin", "Kings Park", "Botanic Gardens",
          "Murray Bridge", "Victor Harbor", "Mildura Riverfront"]


def p(name, r):
    return os.path.join(WORK, name.replace("R", str(r), 1) if "_R." in name else name)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    json.dump({n: i for i, n in enumerate(ROOSTS)}, open(p("roost_table.json", 0), "w"))
    json.dump({"rows": {str(r): ROWS for r in range(world)}}, open(p("meta.json", 0), "w"))
    for r in range(world):
        g = np.random.default_rng(100 + r)
        np.save(p("shard_R.npy", r), g.normal(size=(ROWS, 6)).astype(np.float32))
        g.normal(size=(ROWS, 2)).astype(np.float32).tofile(p("raw_R.f32", r))
        with open(p("roosts_R.jsonl", r), "w") as f:
            for i in range(ROWS):
                f.write(json.dumps({"id": i, "roost": ROOSTS[(i + r) % 8],
                                    "history": [ROOSTS[(i + k) % 8] for k in range(4)]}) + "\n")
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["id", "count"])
        for i in range(ROWS):
            w.writerow([i, round(float(abs(g.normal()) * 40 + 20), 1)])
        with gzip.open(p("counts_R.csv.gz", r), "wt") as f:
            f.write(buf.getvalue() * 1)
        with open(p("notes_R.txt", r), "w", encoding="utf-8") as f:
            for i in range(ROWS):
                f.write(f"roost note {i}: little corellas settle at dusk\n")
        open(p("seed_R.txt", r), "w").write(str(17 + r))
    torch.save(Net().state_dict(), p("start.pt", 0))
    print(f"prepared {WORK} for {world} ranks")


def plant(fault, rank):
    """The planted rank damages its own input files before it reads them."""
    if fault == "npy_truncated":
        b = open(p("shard_R.npy", rank), "rb").read()
        open(p("shard_R.npy", rank), "wb").write(b[: len(b) // 2])
    elif fault == "gzip_truncated":
        b = open(p("counts_R.csv.gz", rank), "rb").read()
        open(p("counts_R.csv.gz", rank), "wb").write(b[: len(b) - 30])
    elif fault in ("jsonl_broken", "collate_stack", "vocab_keyerror"):
        lines = open(p("roosts_R.jsonl", rank)).read().splitlines()
        if fault == "jsonl_broken":
            lines[6] = lines[6][:25]
        elif fault == "collate_stack":
            d = json.loads(lines[9]); d["history"].append("Kings Park"); lines[9] = json.dumps(d)
        else:
            d = json.loads(lines[10]); d["roost"] = "Wollongong Cemetery"; lines[10] = json.dumps(d)
        open(p("roosts_R.jsonl", rank), "w").write("\n".join(lines) + "\n")
    elif fault == "memmap_short":
        b = open(p("raw_R.f32", rank), "rb").read()
        open(p("raw_R.f32", rank), "wb").write(b[:100])
    elif fault == "worker_init":
        open(p("seed_R.txt", rank), "w").write("x17")
    elif fault == "short_shard":
        np.save(p("shard_R.npy", rank), np.load(p("shard_R.npy", rank))[:13])
    elif fault == "unicode_decode":
        with open(p("notes_R.txt", rank), "w", encoding="latin-1") as f:
            for i in range(ROWS):
                f.write(f"roost note {i}: corellas at Bélair, Ménindee and Murray Bridge\n")


class RoostSet(torch.utils.data.Dataset):
    def __init__(self, rank, fault, faulty):
        self.rank, self.fault, self.faulty = rank, fault, faulty
        self.shard = p("shard_R.npy", rank)
        self.n = json.load(open(p("meta.json", 0)))["rows"][str(rank)]
        np.load(self.shard)  # check the shard reads
        self.weather = np.array(np.memmap(p("raw_R.f32", rank), dtype=np.float32, mode="r", shape=(self.n, 2)))
        self.sightings = [json.loads(line) for line in open(p("roosts_R.jsonl", rank))]
        with gzip.open(p("counts_R.csv.gz", rank), "rt") as f:
            rows = list(csv.DictReader(f))
        self.counts = [float(row["count"]) for row in rows]
        with open(p("notes_R.txt", rank), encoding="utf-8") as f:
            self.notes = f.read().splitlines()
        self.table = json.load(open(p("roost_table.json", 0)))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.faulty and i == 10:
            if self.fault == "worker_sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "worker_segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.fault == "loader_timeout":
                time.sleep(20)
        feats = np.load(self.shard, mmap_mode="r")[i]
        s = self.sightings[i]
        x = torch.from_numpy(np.concatenate([np.asarray(feats), self.weather[i]]).astype(np.float32))
        hist = torch.tensor([self.table[h] for h in s["history"]])
        return x, torch.tensor(self.table[s["roost"]]), hist, torch.tensor(self.counts[i] / 50.0)


def collate(items):
    xs, roost, hist, y = zip(*items)
    return torch.stack(xs), torch.stack(roost), torch.stack(hist), torch.stack(y)


def seed_worker(wid):
    info = torch.utils.data.get_worker_info()
    seed = int(open(p("seed_R.txt", info.dataset.rank)).read())
    np.random.seed(seed + wid)


def make_loader(rank, args):
    faulty = args.fault != "none" and args.rank == rank
    if faulty:
        plant(args.fault, rank)
    ds = RoostSet(rank, args.fault, faulty)
    kw = dict(batch_size=BATCH, shuffle=False, collate_fn=collate, num_workers=args.workers)
    if args.workers > 0:
        kw.update(worker_init_fn=seed_worker, timeout=2 if args.fault == "loader_timeout" else 0)
    return ds, torch.utils.data.DataLoader(ds, **kw)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(len(ROOSTS), 4)
        self.mlp = nn.Sequential(nn.Linear(8 + 4 + 4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, roost, hist):
        return self.mlp(torch.cat([x, self.emb(roost), self.emb(hist).mean(1)], 1)).squeeze(1)


def step_loss(net, batch, rank, step, args, ds):
    x, roost, hist, y = batch
    pred = net(x, roost, hist)
    loss = ((pred - y) ** 2).mean()
    faulty = args.fault != "none" and args.rank == rank
    if faulty and args.fault == "nan_loss" and step == 3:
        loss = loss * float("nan")
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (roost batch {roost.tolist()})")
    if faulty and args.fault == "stall" and step == 3:
        time.sleep(40)
    if faulty and args.fault == "file_removed" and step == 1:
        os.remove(ds.shard)
    print(f"rank {rank} step {step} loss {loss.item():.4f} roost_occupancy {pred.mean().item() * 50:.2f}", flush=True)
    return loss


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class RoostModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.net.load_state_dict(torch.load(p("start.pt", 0)))

        def train_dataloader(self):
            self.ds, dl = make_loader(self.global_rank, args)
            return dl

        def training_step(self, batch, idx):
            return step_loss(self.net, batch, self.global_rank, idx, args, self.ds)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=STEPS, logger=False,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    model = RoostModule()
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save(model.net.state_dict(), p("export.pt", 0))
        print(f"rank 0 saved export {p('export.pt', 0)}", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    net = Net()
    net.load_state_dict(torch.load(p("start.pt", 0)))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    ds, dl = make_loader(rank, args)
    for step, batch in enumerate(dl):
        if step >= STEPS:
            break
        loss = step_loss(net, batch, rank, step, args, ds)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
    fabric.barrier()
    if rank == 0:
        torch.save(net.module.state_dict(), p("export.pt", 0))
        print(f"rank 0 saved export {p('export.pt', 0)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--mode", choices=["trainer", "fabric"], default="trainer")
    ap.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    args = ap.parse_args()
    if args.prepare:
        return prepare(args.world)
    torch.manual_seed(0)
    (run_fabric if args.mode == "fabric" else run_trainer)(args)


if __name__ == "__main__":
    main()
