"""A seventy-sixth hand-run batch: DATA FILES AND THEIR FORMATS on disk, broken for one rank's shard, one node's copy,
or everywhere. `python fault76.py --setup --fault F --rank N --world W --data D` plays the preprocessing job: it writes
the data folder D (index.json naming the format and one shard per rank, 96 rows of 8 features and a label in 0..3)
and breaks it as fault F says (--rank -1: every shard). Training (`torchrun ... fault76.py --fault F --data D`) is a
tiny DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, 2 epochs of 6 steps, PG timeout 12 s unless
--pg-timeout, a finite-loss check, an all-reduced mean loss at each epoch's end) that reads shard RANK of index.json;
it does the same whatever F is (F is only printed): what fails is what the data holds. --preload reads the whole shard
before building the model and then waits in a barrier (the form the TORCH_DISTRIBUTED_DEBUG=DETAIL run needed: DDP's
constructor crashes under DETAIL in this build).

Faults (what --setup breaks; the format in brackets):
  none         control: every shard good [csv] (exit 0)
  csv_badrow   shard N's row --at (50) has 'n/a' for f3 [csv]: ValueError: could not convert string to float
  csv_header   a new export renamed the column 'label' to 'target' [csv]: KeyError: 'label'
  csv_fields   shard N's row --at has a free-text field with an unquoted comma [pandas]: pandas' ParserError
  jsonl_cut    shard N's last line cut in half (the writer was killed) [jsonl]: json.decoder.JSONDecodeError, late
  npy_trunc    shard N's .npy cut to 60% of its size (an interrupted copy) [npy]: ValueError from np.load
  npy_width    shard N written with 9 features instead of 8 [npy]: RuntimeError in the first Linear's matmul
  pt_trunc     shard N's .pt cut to 70% (an interrupted copy) [pt]: RuntimeError from torch.load's zip reader
  gz_cut       shard N's .csv.gz cut at 55% [gz]: EOFError: Compressed file ended before the end-of-stream marker
  gz_plain     shard N's .csv.gz holds the plain CSV (a sync tool decompressed it) [gz]: gzip.BadGzipFile
  empty_zdiv   shard N is a zero-length file [csv]: the epoch runs no step; its mean loss divides by 0
  empty_wait   shard N is a zero-length file and training runs with --wait-copy (shards still being synced: wait while
               a shard is empty) [csv]: rank N waits forever; the others time out in DDP's all-reduce
  short        shard N has 40 rows instead of 96 [csv]: rank N ends its epoch after 2 steps (uneven shards)
  encoding     shard N was re-exported in latin-1 ('café' in its src column) [csv]: UnicodeDecodeError
  label_range  shard N's labels come from a 16-class export from row --at on [csv]: IndexError: Target N is out of
               bounds in cross_entropy
  nan_rows     shard N's row --at holds 'nan' features [csv]: the finite-loss check raises FloatingPointError
  mmap_short   shard N's .bin is shorter than its header says [bin]: ValueError from np.memmap
  index_missing  index.json names train-0000N, which the folder lacks [csv]: FileNotFoundError
  index_wait   the preprocessing job died before writing its _SUCCESS marker; training runs with --wait-marker
               (every rank waits for it before reading anything) [csv]: a hang, no collective to time out
"""
import argparse, csv, datetime, gzip, json, math, os, random, struct, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--world", type=int, default=4)
p.add_argument("--at", type=int, default=50)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--data", default="/tmp/fault76_work/data")
p.add_argument("--setup", action="store_true")
p.add_argument("--wait-copy", action="store_true")
p.add_argument("--wait-marker", action="store_true")
p.add_argument("--preload", action="store_true")
a = p.parse_args()
BATCH, ROWS, FEAT = 16, 96, 8
FORMAT = {"csv_fields": "pandas", "jsonl_cut": "jsonl", "npy_trunc": "npy", "npy_width": "npy", "pt_trunc": "pt",
          "gz_cut": "gz", "gz_plain": "gz", "mmap_short": "bin"}
EXT = {"csv": ".csv", "pandas": ".csv", "jsonl": ".jsonl", "npy": ".npy", "pt": ".pt", "gz": ".csv.gz", "bin": ".bin"}


# ---------------------------------------------------------------- the preprocessing job (--setup)
def rows_for(r: int, n: int = ROWS, feat: int = FEAT, classes: int = 4):
    g = random.Random(1000 + r)
    return [([round(g.gauss(0, 1), 4) for _ in range(feat)], g.randrange(classes)) for _ in range(n)]


def csv_text(rows, label="label", src="crawl-07", bad=None):
    cols = [f"f{i}" for i in range(FEAT)] + [label, "src"]
    out = [",".join(cols)]
    for i, (x, y) in enumerate(rows):
        vals = [str(v) for v in x] + [str(y), src]
        if bad and i in bad:
            bad[i](vals)
        out.append(",".join(vals))
    return "\n".join(out) + "\n"


def setup() -> None:
    import numpy as np
    fmt = FORMAT.get(a.fault, "csv")
    os.makedirs(a.data, exist_ok=True)
    for f in os.listdir(a.data):
        os.remove(os.path.join(a.data, f))
    shards = []
    for r in range(a.world):
        hit = a.rank == -1 or a.rank == r
        name = f"train-{r:05d}{EXT[fmt]}"
        path = os.path.join(a.data, name)
        shards.append(name)
        n = 40 if (a.fault == "short" and hit) else ROWS
        feat = 9 if (a.fault == "npy_width" and hit) else FEAT
        rows = rows_for(r, n, feat, 16 if (a.fault == "label_range" and hit) else 4)
        if a.fault == "label_range" and hit:  # the first rows happen to be in 0..3
            rows = [(x, y % 4) if i < a.at else (x, y) for i, (x, y) in enumerate(rows)]
            j = next(i for i in range(a.at, n) if rows[i][1] >= 4)
            print(f"setup: shard {r} first label >= 4 at row {j}: {rows[j][1]}")
        if a.fault == "index_missing" and hit:
            continue
        if fmt in ("csv", "pandas", "gz"):
            bad = {}
            if a.fault == "csv_badrow" and hit:
                bad[a.at] = lambda v: v.__setitem__(3, "n/a")
            if a.fault == "nan_rows" and hit:
                bad[a.at] = lambda v: v.__setitem__(2, "nan")
            if a.fault == "csv_fields" and hit:
                bad[a.at] = lambda v: v.__setitem__(-1, "forum, thread 12")
            src = "café-reviews" if (a.fault == "encoding" and hit) else "crawl-07"
            text = csv_text(rows, "target" if (a.fault == "csv_header" and hit) else "label", src, bad)
            if a.fault in ("empty_zdiv", "empty_wait") and hit:
                text = ""
            data = text.encode("latin-1" if (a.fault == "encoding" and hit) else "utf-8")
            if fmt == "gz" and not (a.fault == "gz_plain" and hit):
                data = gzip.compress(data)
            if a.fault == "gz_cut" and hit:
                data = data[: int(len(data) * 0.55)]
            with open(path, "wb") as fh:
                fh.write(data)
        elif fmt == "jsonl":
            lines = [json.dumps({"x": x, "y": y, "src": "crawl-07"}) for x, y in rows]
            text = "\n".join(lines) + "\n"
            if a.fault == "jsonl_cut" and hit:
                text = "\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2]
            with open(path, "w") as fh:
                fh.write(text)
        elif fmt in ("npy", "pt", "bin"):
            arr = np.array([x + [float(y)] for x, y in rows], dtype=np.float32)
            if fmt == "npy":
                np.save(path, arr)
            elif fmt == "pt":
                torch.save({"x": torch.from_numpy(arr[:, :-1]).clone(), "y": torch.from_numpy(arr[:, -1]).long()}, path)
            else:
                with open(path, "wb") as fh:
                    fh.write(struct.pack("<4sII", b"SHRD", arr.shape[0], arr.shape[1]))
                    fh.write(arr.tobytes())
            cut = {"npy_trunc": 0.6, "pt_trunc": 0.7, "mmap_short": 0.5}.get(a.fault)
            if cut and hit:
                size = os.path.getsize(path)
                os.truncate(path, int(size * cut))
    with open(os.path.join(a.data, "index.json"), "w") as fh:
        json.dump({"format": fmt, "rows_per_shard": ROWS, "shards": shards}, fh, indent=1)
    if a.fault != "index_wait":
        open(os.path.join(a.data, "_SUCCESS"), "w").close()
    print(f"setup: {a.data} fault {a.fault} rank {a.rank} world {a.world} format {fmt}")


# ---------------------------------------------------------------- the training job's data code
def read_csv_rows(fh):
    for row in csv.DictReader(fh):
        yield [float(row[f"f{i}"]) for i in range(FEAT)], int(row["label"])


def read_shard(path: str, fmt: str):
    """Yields (features, label) one row at a time, reading lazily where the format allows it."""
    if a.wait_copy:
        while os.path.getsize(path) == 0:  # the sync job creates the file first and fills it later
            time.sleep(0.5)
    if fmt == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            yield from read_csv_rows(fh)
    elif fmt == "gz":
        with gzip.open(path, "rt", newline="", encoding="utf-8") as fh:
            yield from read_csv_rows(fh)
    elif fmt == "pandas":
        import pandas as pd
        df = pd.read_csv(path)
        for rec in df.itertuples(index=False):
            yield [float(getattr(rec, f"f{i}")) for i in range(FEAT)], int(rec.label)
    elif fmt == "jsonl":
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                yield rec["x"], rec["y"]
    elif fmt == "npy":
        import numpy as np
        arr = np.load(path)
        for row in arr:
            yield row[:-1].tolist(), int(row[-1])
    elif fmt == "pt":
        d = torch.load(path)
        for x, y in zip(d["x"], d["y"]):
            yield x.tolist(), int(y)
    elif fmt == "bin":
        import numpy as np
        with open(path, "rb") as fh:
            magic, n, cols = struct.unpack("<4sII", fh.read(12))
        arr = np.memmap(path, dtype=np.float32, mode="r", offset=12, shape=(n, cols))
        for row in arr:
            yield row[:-1].tolist(), int(row[-1])
    else:
        raise ValueError(f"unknown shard format {fmt!r}")


def batches(path: str, fmt: str):
    buf = []
    for x, y in read_shard(path, fmt):
        buf.append((x, y))
        if len(buf) == BATCH:
            xs, ys = zip(*buf)
            yield torch.tensor(xs), torch.tensor(ys)
            buf = []


def main() -> None:
    if a.setup:
        setup()
        return
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if a.wait_marker:
        marker = os.path.join(a.data, "_SUCCESS")
        print(f"rank {rank}: waiting for {marker}", flush=True)
        while not os.path.exists(marker):
            time.sleep(1.0)
    with open(os.path.join(a.data, "index.json")) as fh:
        index = json.load(fh)
    fmt = index["format"]
    path = os.path.join(a.data, index["shards"][rank])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    print(f"rank {rank} world {world} fault {a.fault} shard {path} ({fmt})", flush=True)
    if a.preload:  # read the whole shard into memory first, then wait until every rank has its data
        data = list(batches(path, fmt))
        print(f"rank {rank} loaded {len(data)} batches", flush=True)
        dist.barrier()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(FEAT, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    for epoch in range(1, a.epochs + 1):
        total, steps = 0.0, 0
        for x, y in (data if a.preload else batches(path, fmt)):
            step += 1
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}, stopping")
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
            print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        mean = torch.tensor([total / steps])
        dist.all_reduce(mean)
        if rank == 0:
            print(f"epoch {epoch} mean loss {mean.item() / world:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
