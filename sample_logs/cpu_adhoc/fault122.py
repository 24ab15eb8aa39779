"""A hundred-and-twenty-second hand-run batch: TIME-SERIES FORECASTING ON TABULAR DATA. Each rank owns one partition
of a synthetic hourly multivariate series (load, temp, humidity, price, wind), exported as a CSV file per rank (written
by each rank at start, standing in for the upstream exporter). A rank parses its CSV (dates with strptime, missing
readings as nan), caches the parsed array as .npy, splits it 70/30 into train/validation, all-reduces per-feature
sums, sums of squares and counts to normalise every feature with the global mean/std, and cuts sliding windows
(lookback --lookback 24, horizon --horizon 6; inputs add hour-of-day sin/cos). A small MLP forecaster
(Flatten-Linear(L*7,64)-ReLU-Linear(64,64)-ReLU-Linear(64,H*5), gloo) in DDP (`--ddp 0`: parameters broadcast from rank
0 and gradients all-reduced by hand) is trained with MSE (`rank R epoch E step S loss L`); per epoch the validation MAE
is all-reduced (`epoch E train mse X val mae Y`) and rank 0 saves the best model by validation MAE. With
--resume the loader rank (--rank) loads the previous job's best checkpoint and broadcasts it. At the end every rank
reloads the best checkpoint, dist.barrier(), destroy_process_group(). --rank N picks the faulty rank (-1: every rank).
PG timeout --pg-timeout (12 s). No @record.

Faults:
  none         control: 3 epochs on every rank, `rank R done`, exit 0
  shortshard   rank N's exporter wrote only 20 rows (< lookback + horizon): zero training windows, and the shuffled
               DataLoader's RandomSampler refuses an empty dataset on that rank before the first step
  constfeat    the `wind` sensor was offline for the whole export period and every rank's CSV holds 0.0 in that
               column: the global std is 0, normalisation gives nan and the program's check raises on every rank
  colorder     rank N's CSV comes from an older exporter with `temp` and `load` swapped in the header: the header
               check asserts on that rank while the others wait in the stats all_reduce
  dateparse    rank N's CSV was exported with a day-first locale (`03/01/2024 00:00`): strptime raises on that rank
  horizon      rank N reads a stale config with horizon 12: its forecaster head is Linear(64, 60), not Linear(64, 30)
  nanraw       rank N's CSV has a gap of empty `temp` readings (read as nan); the stats skip nan, the windows do not:
               the first batch holding the gap gives loss nan and the program's loss check raises on that rank
  float64      rank N's parsed-array cache was written by an older version in float64: the forecaster's matmul
               gets Double inputs on that rank
  resume       the loader rank N resumes from the previous job's best.pt, which was cut short when that job was
               killed mid-save: torch.load fails on the truncated archive while the others wait in the broadcast
  segv         rank N's native rolling-feature helper (ctypes) dereferences a null pointer at epoch 0 step 3: SIGSEGV
  offbyone     every rank's window builder takes the targets as t + L + 1 ... t + L + H (off by one): the last
               window's last target index equals the series length: IndexError on every rank
  waitcsv      rank N's CSV partition was never exported: it polls for the file with a message every 10 s and never
               reaches the stats all_reduce

What happened (filled in after the runs):
  none: exit 0 (np4 plain, np3 tee); 3 epochs, `epoch 2 ... val mae 0.3786 (best)` (np4), every rank reloads best and is done.
  shortshard: `0 train / 0 val windows`; ValueError: num_samples should be a positive integer value, but got num_samples=0.
  constfeat: every rank: FloatingPointError: non-finite values after normalisation ... features ['wind'] (std 0); then SIGABRTs.
  colorder: AssertionError: .../part-000N.csv: columns ['temp', 'load', ...] do not match the model's features (restart: connectFullMesh).
  dateparse: ValueError: time data '17/01/2024 16:00' does not match format '%Y-%m-%d %H:%M' on rank N (pdsh2: rank 2 on worker-1).
  horizon: DDP: params[4] in this process with sizes [60, 64] appears not to match ...; DETAIL --ddp 0: BROADCAST [60, 64] vs [30, 64].
  nanraw: FloatingPointError: loss is nan at epoch 0 step 0 on rank N; the others Connection closed by peer.
  float64: RuntimeError: mat1 and mat2 must have the same dtype, but got Double and Float on rank N at step 0.
  resume: torch.load of the truncated best.pt: OSError: [Errno 22] Invalid argument (PyTorchFileReader) on the loader rank.
  segv: steps 0-2, then the rank dies without output: exitcode -11 (SIGSEGV); peers Connection reset by peer.
  offbyone: every rank: IndexError: index 280 is out of bounds for axis 0 with size 280 in windows(); np6: rank 2 SIGABRT at exit.
  waitcsv: `rank N: waiting for .../part-000N.csv`; PG 12 s: the others time out in the stats all_reduce; PG 300 s + timeout 60: exit 124.
"""
import argparse, csv, ctypes, datetime, math, os, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--rows", type=int, default=400)
p.add_argument("--lookback", type=int, default=24)
p.add_argument("--horizon", type=int, default=6)
p.add_argument("--bs", type=int, default=32)
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--data", default="/tmp/fault122_work/data")
p.add_argument("--ckpt", default="/tmp/fault122_work/ckpt/best.pt")
p.add_argument("--resume", type=int, default=0)
a = p.parse_args()
FEATURES = ["load", "temp", "humidity", "price", "wind"]
DATE_FMT = "%Y-%m-%d %H:%M"


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


def export_partition(rank):
    """Stands in for the upstream exporter: one CSV partition per rank."""
    os.makedirs(a.data, exist_ok=True)
    path = os.path.join(a.data, f"part-{rank:04d}.csv")
    if faulty(rank, "waitcsv"):
        return path  # this partition's export never finished
    n = 20 if faulty(rank, "shortshard") else a.rows
    rng = np.random.default_rng(100 + rank)
    t = np.arange(n) + rank * a.rows
    x = np.stack([50 + 10 * np.sin(2 * np.pi * t / 24) + rng.normal(0, 1, n),
                  15 + 5 * np.sin(2 * np.pi * (t - 6) / 24) + rng.normal(0, 0.5, n),
                  60 + 10 * np.cos(2 * np.pi * t / 24) + rng.normal(0, 2, n),
                  40 + 0.2 * np.sin(2 * np.pi * t / 168) * 10 + rng.normal(0, 1, n),
                  np.abs(rng.normal(5, 2, n))], axis=1)
    if a.fault == "constfeat":
        x[:, 4] = 0.0  # the wind sensor was offline for the whole period
    start = datetime.datetime(2024, 1, 1) + datetime.timedelta(hours=int(rank * a.rows))
    header = ["date"] + (["temp", "load"] + FEATURES[2:] if faulty(rank, "colorder") else FEATURES)
    fmt = "%d/%m/%Y %H:%M" if faulty(rank, "dateparse") else DATE_FMT
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for i in range(n):
            row = [f"{v:.3f}" for v in x[i]]
            if faulty(rank, "colorder"):
                row[0], row[1] = row[1], row[0]
            if faulty(rank, "nanraw") and 150 <= i < 156:
                row[1] = ""  # a gap in the temp sensor
            w.writerow([(start + datetime.timedelta(hours=i)).strftime(fmt)] + row)
    os.replace(path + ".tmp", path)
    return path


def read_partition(rank, path):
    t0 = time.monotonic()
    while not os.path.exists(path):
        waited = time.monotonic() - t0
        if int(waited) % 10 == 0:
            print(f"rank {rank}: waiting for {path} ({waited:.0f}s)", flush=True)
        time.sleep(1.0)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    assert header[1:] == FEATURES, f"{path}: columns {header[1:]} do not match the model's features {FEATURES}"
    hours, values = [], []
    for r in rows[1:]:
        hours.append(datetime.datetime.strptime(r[0], DATE_FMT).hour)
        values.append([float(v) if v else math.nan for v in r[1:]])
    cache = path.replace(".csv", ".npy")
    arr = np.asarray(values, dtype=np.float32)
    np.save(cache, arr.astype(np.float64) if faulty(rank, "float64") else arr)  # older version cached float64
    return np.asarray(hours), np.load(cache)


def global_stats(train):
    finite = np.isfinite(train)
    s = np.where(finite, train, 0.0)
    t = torch.tensor(np.concatenate([s.sum(0), (s * s).sum(0), finite.sum(0)]), dtype=torch.float64)
    dist.all_reduce(t)
    f = len(FEATURES)
    cnt = t[2 * f:]
    mean = t[:f] / cnt
    var = t[f:2 * f] / cnt - mean * mean
    return mean.numpy().astype(np.float32), np.sqrt(np.maximum(var.numpy(), 0.0)).astype(np.float32)


def windows(series, hours, L, H, rank):
    n = len(series) - L - H + 1
    if n <= 0:
        return torch.zeros(0, L * (series.shape[1] + 2)), torch.zeros(0, H * series.shape[1])
    tod = np.stack([np.sin(2 * np.pi * hours / 24), np.cos(2 * np.pi * hours / 24)], 1).astype(series.dtype)
    feats = np.concatenate([series, tod], 1)
    xs, ys = [], []
    for i in range(n):
        xs.append(feats[i:i + L].reshape(-1))
        tgt = i + L + np.arange(1, H + 1) if a.fault == "offbyone" else i + L + np.arange(H)
        ys.append(series[tgt].reshape(-1))
    return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))


class Forecaster(nn.Module):
    def __init__(self, L, H, f_in, f_out):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(L * f_in, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, H * f_out)

    def forward(self, x):
        return self.head(self.net(x))


def rolling_features(rank, x):
    if faulty(rank, "segv"):
        ctypes.string_at(0)  # stands in for the native helper's null-pointer bug
    return x


def save_previous_job_ckpt(model):
    """Stands in for the previous job, killed while it was writing best.pt."""
    os.makedirs(os.path.dirname(a.ckpt), exist_ok=True)
    torch.save({"model": model.state_dict(), "epoch": 7, "val_mae": 0.41}, a.ckpt)
    size = os.path.getsize(a.ckpt)
    with open(a.ckpt, "r+b") as f:
        f.truncate(size // 2)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    L = a.lookback
    H = 12 if faulty(rank, "horizon") else a.horizon  # the stale config copy says horizon: 12
    path = export_partition(rank)
    hours, series = read_partition(rank, path)
    split = int(len(series) * 0.7)
    mean, std = global_stats(series[:split])
    norm = (series - mean) / std
    if not np.isfinite(norm[np.isfinite(series)]).all():
        bad = [FEATURES[j] for j in range(len(FEATURES)) if not np.isfinite(norm[:, j][np.isfinite(series[:, j])]).all()]
        raise FloatingPointError(f"non-finite values after normalisation on rank {rank}: features {bad} "
                                 f"(global std {dict(zip(FEATURES, np.round(std, 3).tolist()))})")
    xtr, ytr = windows(norm[:split], hours[:split], L, H, rank)
    xva, yva = windows(norm[split:], hours[split:], L, H, rank)
    print(f"rank {rank}/{world} pid {os.getpid()}: {len(series)} rows from {path}, lookback {L} horizon {H}, "
          f"{len(xtr)} train / {len(xva)} val windows", flush=True)
    torch.manual_seed(0)
    model = Forecaster(L, H, len(FEATURES) + 2, len(FEATURES))
    if a.resume:
        loader = a.rank if a.rank >= 0 else 0
        if rank == loader:
            if a.fault == "resume":
                save_previous_job_ckpt(model)
            state = torch.load(a.ckpt, map_location="cpu")
            model.load_state_dict(state["model"])
            print(f"rank {rank}: resumed from {a.ckpt} (epoch {state['epoch']}, val mae {state['val_mae']})",
                  flush=True)
        for prm in model.parameters():
            dist.broadcast(prm.data, loader)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(7 + rank)
    dl = DataLoader(TensorDataset(xtr, ytr), batch_size=a.bs, shuffle=True, generator=g)
    best = math.inf
    for epoch in range(a.epochs):
        net.train()
        total, batches = 0.0, 0
        for step, (x, y) in enumerate(dl):
            x = rolling_features(rank, x) if epoch == 0 and step == 3 else x
            loss = nn.functional.mse_loss(net(x), y)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch} step {step} on rank {rank}")
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                for prm in model.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
            opt.step()
            total += loss.item()
            batches += 1
            print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            time.sleep(0.02)
        train_mse = total / batches
        net.eval()
        with torch.no_grad():
            err = (model(xva) - yva).abs().sum() if len(xva) else torch.tensor(0.0)
        val = torch.tensor([err.item(), float(yva.numel()), train_mse], dtype=torch.float64)
        dist.all_reduce(val)
        mae = val[0].item() / val[1].item()
        if rank == 0:
            mark = ""
            if mae < best:
                best, mark = mae, " (best)"
                os.makedirs(os.path.dirname(a.ckpt), exist_ok=True)
                torch.save({"model": model.state_dict(), "epoch": epoch, "val_mae": mae}, a.ckpt)
            print(f"epoch {epoch} train mse {val[2].item() / world:.4f} val mae {mae:.4f}{mark}", flush=True)
    dist.barrier()
    state = torch.load(a.ckpt, map_location="cpu")
    model.load_state_dict(state["model"])
    print(f"rank {rank}: reloaded best checkpoint (epoch {state['epoch']}, val mae {state['val_mae']:.4f})",
          flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
