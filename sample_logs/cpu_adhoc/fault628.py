"""fault628.py - tarsier night hunting: a tiny gloo/CPU job that learns which prey a tarsier catches at night.

Data (written by --prepare into /tmp/fault628_work): per-rank shards shard_R.npy (sensor features), shard_R.jsonl
(one sighting per line: prey name and lux), shard_R.jsonl.gz, shard_R.txt, shard_R.bin, a JSON lookup table
prey_lookup.json (prey name -> class id) that every label goes through, and a start checkpoint start.pt.
Each step every rank prints `rank R step S loss L catch_rate M`; gradients are all-reduced by hand (no DDP);
rank 0 saves export_tarsier.pt at the end. Process-group timeout 12 s (--pg-timeout).

Faults (--fault NAME --rank N; N=-1 means every rank):
  none            control run
  worker_sigkill  rank N's DataLoader worker sends itself SIGKILL at step 2
  worker_segv     rank N's DataLoader worker sends itself SIGSEGV at step 2
  loader_timeout  rank N's DataLoader (timeout=2) worker sleeps 8 s at step 3
  npy_trunc       rank N loads a copy of its .npy shard cut short (np.load)
  gzip_trunc      rank N reads a copy of its .jsonl.gz cut short (EOFError in gzip)
  jsonl_broken    rank N's worker parses a copy of its .jsonl with line 20 broken (json.JSONDecodeError)
  collate_stack   rank N's collate_fn gets one sample with 9 features at step 3 (torch.stack size error)
  vocab_keyerror  rank N's worker looks up a prey name missing from prey_lookup.json at step 2 (KeyError)
  memmap_short    rank N maps its .bin shard with np.memmap asking for more rows than the file holds
  file_removed    rank N's main process deletes its (copied) jsonl shard after step 1; the worker re-opens it
  worker_init     rank N's worker_init_fn raises
  unicode         rank N reads a copy of its text shard written in UTF-16 as UTF-8 (UnicodeDecodeError)
  len_wrong       rank N's Dataset.__len__ claims 8 rows more than the shard has (IndexError in the worker)
  nan_loss        rank N's loss becomes NaN at step 3; the script's own check raises FloatingPointError
  stall           rank N sleeps 40 s before the all_reduce of step 3 (the others time out in gloo)

Runs (one line per kept log):
  tarsier_none_np8_rnone_plain: control, 8 ranks x 6 steps, export saved; exit 0
  tarsier_worker_sigkill_np6_r5_plain: r5 worker SIGKILL -> 'killed by signal: Killed', peers closed; exit 1
  tarsier_worker_init_np6_r3_pdsh2: r3 worker_init_fn RuntimeError, 2nd agent loses store; exit 0 (sed)
  tarsier_vocab_keyerror_np6_r0_loglevel: 2 steps, r0 worker KeyError 'loris_moth'; exit 1
  tarsier_jsonl_broken_np6_r5_pymodule: 2 steps, r5 worker JSONDecodeError line 20; exit 1
  tarsier_loader_timeout_np5_r2_tee: 3 steps, r2 'DataLoader timed out after 2 seconds'; exit 1
  tarsier_npy_trunc_np5_r0_redirects: r0 np.load ValueError (309/384 elements), in rank files; exit 1
  tarsier_gzip_trunc_np5_r4_prefix: r4 EOFError end-of-stream marker before step 0; exit 1
  tarsier_file_removed_np5_r2_wrapper: 4 steps, r2 worker FileNotFoundError, no done line; exit 1
  tarsier_len_wrong_np5_r4_tee: 6 steps, r4 worker IndexError index 48, barrier breaks; exit 1
  tarsier_collate_stack_np5_r3_redirects: 3 steps, r3 collate stack [8] vs [9], in rank files; exit 1
  tarsier_jsonl_broken_np4_r3_tee_trainer: 2 steps, r3 worker JSONDecodeError; exit 1
  tarsier_memmap_short_np4_r3_detail: r3 'mmap length is greater than file size', DETAIL barrier; exit 1
  tarsier_unicode_np4_r1_filter: r1 UnicodeDecodeError byte 0xff before step 0; exit 1
  tarsier_worker_segv_np3_r2_restart: r2 worker segfault, restart fails connectFullMesh; exit 1
  tarsier_stall_np4_r2_plain: 3 steps, r2 sleeps, r0/r1/r3 gloo 12000ms timeouts; exit 1
  tarsier_collate_stack_np3_r1_pymodule: 3 steps, r1 collate stack [8] vs [9]; exit 1
  tarsier_nan_loss_np3_r0_prefix: 3 steps, r0 FloatingPointError loss is nan; exit 1
  tarsier_worker_sigkill_np3_r0_wrapper: 1 step, r0 ConnectionResetError then worker Killed; exit 1
  tarsier_loader_timeout_np3_r1_loglevel: r1 'DataLoader timed out after 2 seconds'; exit 1
  (20 runs kept, none dropped; ports 39301-39320)
  .
  .
  .
"""
import argparse, gzip, json, os, shutil, signal, sys, time
import numpy as np
import torch
import torch.distributed as dist
from datetime import timedelta
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault628_work"
PREY = ["cricket", "moth", "beetle", "gecko"]
ROWS, FEAT, BATCH, STEPS = 48, 8, 8, 6


def prepare():
    os.makedirs(WORK, exist_ok=True)
    json.dump({p: i for i, p in enumerate(PREY)}, open(f"{WORK}/prey_lookup.json", "w"))
    g = np.random.default_rng(628)
    for r in range(8):
        x = g.normal(size=(ROWS, FEAT)).astype(np.float32)
        np.save(f"{WORK}/shard_{r}.npy", x)
        x.tofile(f"{WORK}/shard_{r}.bin")
        lines = [json.dumps({"prey": PREY[int(abs(x[i, 0]) * 3) % 4], "lux": float(abs(x[i, 1]) / 10)}) for i in range(ROWS)]
        open(f"{WORK}/shard_{r}.jsonl", "w").write("\n".join(lines) + "\n")
        with gzip.open(f"{WORK}/shard_{r}.jsonl.gz", "wt") as f:
            f.write("\n".join(lines) + "\n")
        open(f"{WORK}/shard_{r}.txt", "w", encoding="utf-8").write("\n".join(f"{i}\tnachtjagd café {PREY[i % 4]}" for i in range(ROWS)) + "\n")
    torch.manual_seed(628)
    torch.save(torch.nn.Linear(FEAT, 4).state_dict(), f"{WORK}/start.pt")
    print("prepared", WORK)


class Sightings(Dataset):
    def __init__(self, x, jsonl_path, lookup, rank, fault, frank):
        self.x, self.path, self.lookup = x, jsonl_path, lookup
        self.hit = fault if rank == frank or frank == -1 else "none"

    def __len__(self):
        return len(self.x) + (8 if self.hit == "len_wrong" else 0)

    def __getitem__(self, i):
        step = i // BATCH
        if step == 2 and self.hit == "worker_sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 2 and self.hit == "worker_segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if step == 3 and i % BATCH == 0 and self.hit == "loader_timeout":
            time.sleep(8)
        with open(self.path) as f:
            line = f.readlines()[i % ROWS]
        rec = json.loads(line)
        prey = "loris_moth" if (step == 2 and self.hit == "vocab_keyerror") else rec["prey"]
        y = self.lookup[prey]
        x = torch.from_numpy(self.x[i])
        if step == 3 and self.hit == "collate_stack" and i % BATCH == 5:
            x = torch.cat([x, torch.zeros(1)])
        return x, y


def collate(batch):
    return torch.stack([b[0] for b in batch]), torch.tensor([b[1] for b in batch])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-2)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args()
    if a.prepare:
        return prepare()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.fault if (a.rank == rank or a.rank == -1) else "none"
    scratch = f"{WORK}/scratch_r{rank}_{os.getpid()}"
    lookup = json.load(open(f"{WORK}/prey_lookup.json"))
    model = torch.nn.Linear(FEAT, 4)
    model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    npy, jsonl = f"{WORK}/shard_{rank}.npy", f"{WORK}/shard_{rank}.jsonl"
    if hit == "npy_trunc":
        shutil.copy(npy, scratch + ".npy")
        os.truncate(scratch + ".npy", os.path.getsize(npy) - 300)
        npy = scratch + ".npy"
    x = np.load(npy)
    if hit == "memmap_short":
        x = np.array(np.memmap(f"{WORK}/shard_{rank}.bin", dtype=np.float32, mode="r", shape=(ROWS * 2, FEAT)))
    if hit == "gzip_trunc":
        gz = f"{WORK}/shard_{rank}.jsonl.gz"
        shutil.copy(gz, scratch + ".jsonl.gz")
        os.truncate(scratch + ".jsonl.gz", os.path.getsize(gz) // 2)
        gz = scratch + ".jsonl.gz"
    else:
        gz = f"{WORK}/shard_{rank}.jsonl.gz"
    with gzip.open(gz, "rt") as f:
        n_sightings = sum(1 for _ in f)
    txt = f"{WORK}/shard_{rank}.txt"
    if hit == "unicode":
        open(scratch + ".txt", "w", encoding="utf-16").write(open(txt, encoding="utf-8").read())
        txt = scratch + ".txt"
    notes = open(txt, encoding="utf-8").read().splitlines()
    if hit in ("jsonl_broken", "file_removed"):
        shutil.copy(jsonl, scratch + ".jsonl")
        jsonl = scratch + ".jsonl"
        if hit == "jsonl_broken":
            lines = open(jsonl).read().splitlines()
            lines[19] = lines[19][:-9]
            open(jsonl, "w").write("\n".join(lines) + "\n")
    ds = Sightings(x, jsonl, lookup, rank, a.fault, a.rank)

    def winit(wid):
        if hit == "worker_init":
            raise RuntimeError(f"tarsier night-vision calibration failed in worker {wid} (rank {rank})")

    kw = dict(batch_size=BATCH, shuffle=False, num_workers=a.workers, collate_fn=collate, worker_init_fn=winit)
    if hit == "loader_timeout":
        kw["timeout"] = 2
    loader = DataLoader(ds, **kw)
    if rank == 0:
        print(f"tarsier job: world {world}, {n_sightings} sightings/rank, {len(notes)} field notes, fault {a.fault} on rank {a.rank}", flush=True)
    steps = 0
    for epoch in range(2):
        for xb, yb in loader:
            if steps >= STEPS:
                break
            if hit == "file_removed" and steps == 1:
                os.remove(jsonl)
            out = model(xb)
            loss = torch.nn.functional.cross_entropy(out, yb)
            if hit == "nan_loss" and steps == 3:
                loss = loss * float("nan")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {steps}: loss is {loss.item()} (night-hunt loss check)")
            opt.zero_grad()
            loss.backward()
            if hit == "stall" and steps == 3:
                time.sleep(40)
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            rate = (out.argmax(1) == yb).float().mean().item()
            print(f"rank {rank} step {steps} loss {loss.item():.4f} catch_rate {rate:.3f}", flush=True)
            steps += 1
        if steps >= STEPS:
            break
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_tarsier.pt")
        print("rank 0 saved export", f"{WORK}/export_tarsier.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
