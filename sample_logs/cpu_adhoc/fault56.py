"""A fifty-sixth hand-run batch: DISTRIBUTED EVALUATION and BATCH INFERENCE. The script people run after training:
rank 0 broadcasts an eval config (dist.broadcast_object_list), every rank takes the shard range(rank, n, world) of a
synthetic eval set of CSV-like rows, runs a tiny classifier (Linear(8,16)-ReLU-Linear(16,4), the same seed on every
rank) under torch.no_grad() in batches of 8, all-gathers each batch's predictions (dist.all_gather), then
all_gather_object's its per-rank summary dict, reduces the correct/seen counts to rank 0 (dist.reduce), and rank 0
computes the metrics and writes preds.json; progress lines `[rank R] evaluated S/T samples`.

Faults (--rank N: the rank at fault):
  ok          no fault (control)
  uneven      rank N's shard has 8 more rows (the split gives it the remainder): it runs one more batch and one
              more all_gather, which meets the others' all_gather_object
  ragged      rank N's last batch is 5 rows, not 8 (no drop_last): the all_gather of tensors of different lengths
  pklambda    rank N's summary dict holds its postprocess function (a lambda): all_gather_object cannot pickle it
  pkfile      rank N's summary dict holds its open per-rank log file: all_gather_object cannot pickle it
  zerodiv     rank 0's per-class recall divides by a class count that is 0 (ZeroDivisionError) after the gather
  keyerr      rank 0's per-class table is keyed by label names and a gathered summary holds 'unknown' (KeyError)
  nodir       rank 0 writes preds.json into a directory that was never created (FileNotFoundError)
  rofs        rank 0 writes preds.json into a read-only mount (OSError: [Errno 30] Read-only file system)
  prep        rank N's shard holds a malformed row ('n/a' field): float() raises ValueError in preprocessing
  loadsd      rank N loads another checkpoint (a model saved with other layer names): load_state_dict fails
  nan         rank N's logits are NaN for one batch; the script checks and raises FloatingPointError
  exit3       rank N calls os._exit(3) after its second batch (a library's hard exit)
  segv        rank N dereferences NULL (ctypes.string_at(0)) after its second batch
  hang        rank N blocks (a stuck read from shared storage) before its third batch's all_gather; the others time
              out after the PG timeout
--barrier: every rank waits in dist.barrier() after rank 0's metrics/write (else ranks > 0 return at once).
"""
import argparse, ctypes, datetime, json, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", default="ok")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--rows-per-rank", type=int, default=24)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--out", default="/tmp/fault56/results")
p.add_argument("--barrier", action="store_true")
a = p.parse_args()
BS = 8
LABELS = ["cat", "dog", "bird", "fish"]


def row_text(i: int) -> str:
    g = torch.Generator().manual_seed(i)
    feats = [f"{v:.3f}" for v in torch.randn(8, generator=g).tolist()]
    return ",".join(feats + [LABELS[i % 4]])


def parse(line: str):
    *feats, label = line.split(",")
    return [float(v) for v in feats], LABELS.index(label)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault != "ok" and rank == a.rank

    cfg = [{"batch_size": BS, "n": world * a.rows_per_rank, "out": a.out, "split": "val"}] if rank == 0 else [None]
    dist.broadcast_object_list(cfg, src=0)
    cfg = cfg[0]
    n = cfg["n"]
    idx = list(range(rank, n, world))
    if a.fault == "uneven" and me:
        idx += list(range(n, n + BS))  # the remainder rows
    if a.fault == "ragged" and me:
        idx = idx[:-3]
    rows = [row_text(i) for i in idx]
    if a.fault == "prep" and me:
        f = rows[13].split(",")
        f[4] = "n/a"
        rows[13] = ",".join(f)

    model = make_model()
    ck = f"/tmp/fault56/ckpt_{rank}.pt"
    sd = model.state_dict()
    if a.fault == "loadsd" and me:
        torch.manual_seed(0)
        other = nn.Sequential()
        other.add_module("encoder", nn.Linear(8, 16))
        other.add_module("act", nn.ReLU())
        other.add_module("head", nn.Linear(16, 4))
        sd = other.state_dict()  # the checkpoint of another run
    torch.save(sd, ck)
    model.load_state_dict(torch.load(ck))
    model.eval()
    print(f"[rank {rank}] loaded {ck}, shard of {len(rows)} rows", flush=True)

    preds, correct, seen = [], 0, 0
    logf = open(f"/tmp/fault56/eval_rank{rank}.log", "w")
    with torch.no_grad():
        for b in range(0, len(rows), BS):
            step = b // BS
            if a.fault == "hang" and me and step == 2:
                time.sleep(60)  # a read from shared storage that never returns
            parsed = [parse(r) for r in rows[b:b + BS]]
            x = torch.tensor([p_[0] for p_ in parsed])
            y = torch.tensor([p_[1] for p_ in parsed])
            logits = model(x)
            if a.fault == "nan" and me and step == 1:
                logits = logits * float("nan")
            if not torch.isfinite(logits).all():
                raise FloatingPointError(f"non-finite logits in batch {step} on rank {rank}")
            pred = logits.argmax(1)
            correct += int((pred == y).sum())
            seen += len(y)
            out = [torch.zeros_like(pred) for _ in range(world)]
            dist.all_gather(out, pred)
            preds.extend(torch.cat(out).tolist())
            logf.write(f"batch {step} ok\n")
            print(f"[rank {rank}] evaluated {seen}/{len(rows)} samples", flush=True)
            if me and step == 1 and a.fault == "exit3":
                os._exit(3)
            if me and step == 1 and a.fault == "segv":
                ctypes.string_at(0)

    summary = {"rank": rank, "seen": seen, "correct": correct,
               "per_class": {LABELS[c]: int((torch.tensor(preds) == c).sum()) for c in range(4)}}
    if a.fault == "pklambda" and me:
        summary["postprocess"] = lambda t: t.softmax(-1)
    if a.fault == "pkfile" and me:
        summary["log"] = logf
    if a.fault == "keyerr" and rank == a.rank:
        summary["per_class"]["unknown"] = 1
    gathered = [None] * world
    dist.all_gather_object(gathered, summary)
    counts = torch.tensor([correct, seen], dtype=torch.long)
    dist.reduce(counts, dst=0)
    logf.close()

    if rank == 0:
        acc = counts[0].item() / counts[1].item()
        totals = {k: 0 for k in LABELS}
        for s in gathered:
            for k, v in s["per_class"].items():
                totals[k] += v
        if a.fault == "zerodiv":
            totals["fish"] = 0  # the eval split holds no 'fish' predictions after the filter
        recall = {k: totals[k] / (totals[k] if a.fault == "zerodiv" else max(totals[k], 1)) for k in LABELS}
        print(f"[rank 0] accuracy {acc:.4f} over {counts[1].item()} samples; per-class {totals}", flush=True)
        out = cfg["out"]
        if a.fault == "nodir":
            out = os.path.join(out, "epoch_3", "val")
        if a.fault == "rofs":
            out = "/tmp/fault56/results_ro"
        path = os.path.join(out, "preds.json")
        with open(path, "w") as fh:
            json.dump({"accuracy": acc, "recall": recall, "preds": preds}, fh)
        print(f"[rank 0] wrote {path}", flush=True)
    if a.barrier:
        dist.barrier()
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
