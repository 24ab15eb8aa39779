"""A hundred-and-fortieth hand-run batch: DISTRIBUTED BATCH INFERENCE (NO TRAINING). A prediction job on gloo.
Rank 0 writes the model checkpoint (Linear(8,16)-ReLU-Linear(16,4) classifier, model.pt) and everyone waits at a
barrier; every rank loads it, builds a synthetic dataset of 96 JSON records (json lines), takes its shard with a
DistributedSampler (no shuffle), runs inference in batches of 8 (`rank R step S loss L`, L = mean NLL of the argmax,
a confidence score), writes `preds_rank{R}.jsonl` under the output dir, all_reduces the per-class counts (int64),
gathers a per-rank summary with gather_object, rank 0 merges the per-rank files into preds.jsonl, final barrier,
`rank R done`, destroy. --rank N picks the faulty rank (-1: every rank); PG timeout 12 s unless --pg-timeout.

Faults:
  none      control: every rank infers its shard, rank 0 merges 96 predictions, exit 0
  ckptrace  rank N skips the barrier and loads model.pt before rank 0 wrote it (FileNotFoundError)
  badrec    rank N's shard holds a truncated JSON record: json.JSONDecodeError while parsing it
  perm      rank N's output dir resolves to /sys/fs (read-only on the node): PermissionError writing preds
  merge     rank N writes preds-rank{N}.jsonl (dash): rank 0's merge raises FileNotFoundError for preds_rank{N}
  dtype     rank N builds its class counts as int32: the all_reduce sizes differ (gloo abort)
  noexit    rank N returns after writing its file, skipping gather/merge/barrier (exit 0); peers lose it
  spin      rank N loops forever retrying a record with an empty feature list; the others wait in all_reduce
  config    every rank builds the model with hidden 32 against the 16 in model.pt: load_state_dict size mismatch
  nan       rank N's inputs hold an inf: logits NaN; the program's finite check raises FloatingPointError
  preempt   rank N prints a preemption notice and sends itself SIGTERM mid-shard
  segv      rank N's fast-path softmax crashes (SIGSEGV, os.kill) at step 2

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 train.sh): every rank inferred its shard, rank 0 merged 96 predictions.
  ckptrace: FileNotFoundError .../model.pt in torch.load on rank N (r2 np4 tee, r3 np5 pymodule); peers closed.
  badrec: json.decoder.JSONDecodeError Expecting ',' delimiter (char 23) on rank N (r1 np4, r4 np6 prefix).
  perm: PermissionError [Errno 13] '/sys/fs/preds_rankN.jsonl' on rank N (r3 np4; r1 np3 redirects).
  merge: rank N wrote preds-rankN.jsonl; rank 0's merge FileNotFoundError preds_rankN (r2 np4, r3 np5).
  dtype: plain: gloo EnforceNotMet 8 vs 4, rank N SIGABRT (r2 np3); DETAIL: mismatch, TensorDtypes=Int (r1).
  noexit: rank N 'shard finished, exiting' exit 0; peers Connection closed by peer (r2 np4, r1 np5).
  spin: PG 12 s: rank 0 'Timed out waiting 12000ms' (r1 np4 filter); PG 300 s + timeout 60: exit 124 (r2).
  config: RuntimeError size mismatch for 0.weight [16, 8] vs [32, 8] on every rank (np3, np5).
  nan: FloatingPointError rank N step 2: non-finite logits (r3 np4, r4 np5); np6 run hit IndexError: dropped.
  preempt: rank N preemption line, exitcode -15 (r1 np3); np4 has 3 steps: never fired, dropped; restart r2.
  segv: rank N exitcode -11 (SIGSEGV) at step 2 (r2 np4 two agents, r3 np5 DETAIL).
"""
import argparse, datetime, json, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DistributedSampler

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--records", type=int, default=96)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--hidden", type=int, default=16)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault140_work")
a = p.parse_args()
torch.set_num_threads(1)

rank = int(os.environ["RANK"]); ws = int(os.environ["WORLD_SIZE"])
bad = a.rank in (-1, rank)
hidden = 32 if a.fault == "config" else a.hidden


def make_model(h):
    return nn.Sequential(nn.Linear(8, h), nn.ReLU(), nn.Linear(h, 4))


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
print(f"rank {rank}/{ws} up, pid {os.getpid()}", flush=True)
ckpt = f"{a.work}/model.pt"
if rank == 0:
    time.sleep(1.0)
    torch.manual_seed(0)
    torch.save(make_model(a.hidden).state_dict(), ckpt)
    print(f"rank 0 wrote checkpoint {ckpt}", flush=True)
if not (bad and a.fault == "ckptrace"):
    dist.barrier()
model = make_model(hidden)
model.load_state_dict(torch.load(ckpt))
model.eval()
print(f"rank {rank} loaded {ckpt} (hidden {hidden})", flush=True)

g = torch.Generator().manual_seed(7)
lines = []
for i in range(a.records):
    feats = torch.randn(8, generator=g).tolist()
    lines.append(json.dumps({"id": i, "x": [round(f, 4) for f in feats]}))
sampler = DistributedSampler(range(a.records), num_replicas=ws, rank=rank, shuffle=False)
idx = list(sampler)
if bad and a.fault == "badrec":
    lines[idx[11]] = lines[idx[11]][:23]
if bad and a.fault == "spin":
    lines[idx[13]] = json.dumps({"id": idx[13], "x": []})


def parse(line):
    rec = json.loads(line)
    while len(rec["x"]) < 8:
        rec = json.loads(line)  # retry the read until the features are complete
    return rec


recs = [parse(lines[i]) for i in idx]
x = torch.tensor([r["x"] for r in recs])
if bad and a.fault == "nan":
    x[19, 3] = float("inf")

out_dir = f"{a.work}/out"
if bad and a.fault == "perm":
    out_dir = "/sys/fs"
os.makedirs(out_dir, exist_ok=True)
name = f"preds-rank{rank}.jsonl" if (bad and a.fault == "merge") else f"preds_rank{rank}.jsonl"
counts = torch.zeros(4, dtype=torch.int32 if (bad and a.fault == "dtype") else torch.int64)
rows = []
with torch.no_grad():
    for s in range(0, len(recs), a.batch):
        step = s // a.batch
        logits = model(x[s:s + a.batch])
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and a.fault == "preempt" and step == 3:
            print(f"rank {rank}: preemption notice received from the node, stopping inference at step {step}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite logits in batch {s}-{s + a.batch}")
        prob = logits.softmax(-1)
        pred = prob.argmax(-1)
        loss = -prob.max(-1).values.log().mean().item()
        print(f"rank {rank} step {step} loss {loss:.4f}", flush=True)
        for r, c in zip(recs[s:s + a.batch], pred.tolist()):
            rows.append({"id": r["id"], "pred": c})
            counts[c] += 1
        time.sleep(0.2)
with open(f"{out_dir}/{name}", "w") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")
print(f"rank {rank} wrote {len(rows)} predictions to {out_dir}/{name}", flush=True)
if bad and a.fault == "noexit":
    print(f"rank {rank} shard finished, exiting", flush=True)
    sys.exit(0)

dist.all_reduce(counts)
summary = {"rank": rank, "n": len(rows), "first": rows[0]["id"] if rows else None}
gathered = [None] * ws if rank == 0 else None
dist.gather_object(summary, gathered, dst=0)
if rank == 0:
    print(f"class counts {counts.tolist()} from {[s['n'] for s in gathered]}", flush=True)
    merged = []
    for r in range(ws):
        with open(f"{out_dir}/preds_rank{r}.jsonl") as f:
            merged.extend(json.loads(l) for l in f)
    merged.sort(key=lambda d: d["id"])
    with open(f"{out_dir}/preds.jsonl", "w") as f:
        for row in merged:
            f.write(json.dumps(row) + "\n")
    print(f"merged {len(merged)} predictions into {out_dir}/preds.jsonl", flush=True)
dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
