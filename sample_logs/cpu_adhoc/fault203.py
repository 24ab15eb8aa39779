"""A two-hundred-and-third hand-run batch: LONG-HORIZON FORECASTING WITH AN LSTM ENCODER-DECODER.

Each rank owns a shard of 5 synthetic multivariate series (3 channels: level + seasonal sine + noise,
period 12), standardised with per-series scalers read from /tmp/job_work/data/scalers/shard<R>.json
(written beforehand by `--prep 1`). An LSTM encoder reads a 36-step history and an autoregressive LSTM
decoder forecasts 12 steps with scheduled sampling. Rank 0 saves the initial weights and every rank
reloads them; the model is wrapped in DDP. After training each rank computes a hand-written MASE (scaled
by the seasonal-naive forecast error over the history), all_gathers the per-series errors and all_reduces
the mean MASE; rank 0 saves the model. Launch under torchrun, a bash loop (env://) or --spawn N.

Faults:
  season     rank N reads the seasonal period as 48 with a 36-step history (the program's ValueError)
  zeroscale  rank N's series 2 is a stuck sensor over the history: naive scale 0, MASE inf (program's check)
  featdim    every rank feeds the decoder the target plus a calendar feature, 4 inputs for 3 (RuntimeError)
  scaler     rank N opens scalers/shard0N.json (zero-padded name), which is not there (FileNotFoundError)
  horizonstr every rank reads the horizon from the config as the string "12" (TypeError)
  errlen     rank N drops its last series before the per-series all_gather (gloo size mismatch)
  ckptlayers rank N builds a 2-layer encoder and loads the 1-layer init checkpoint (missing keys)
  slowrefit  rank N refits its scalers on the full history before the MASE all_reduce (peers time out)
  sigkill    rank N sends itself SIGKILL after step 3
  exit2      rank N prints an error line after validation and exits with code 2
  none       no fault

What happened (filled in after the runs):
  season     ValueError seasonal period 48 > history 36 on rank N; peers Connection closed by peer (np4 r2 ranklabel, np3 r1 legacy)
  zeroscale  FloatingPointError MASE is not finite (inf), naive scale 0.0 for series 2 on rank N (np3 r1 spawn, np4 r3 logfmt)
  featdim    RuntimeError input.size(-1) must be equal to input_size. Expected 3, got 4 on every rank (np3 rall srunlabel, np4 rall tee)
  scaler     FileNotFoundError scalers/shard0N.json on rank N; peers Connection closed by peer (np4 r3 mpitag, np3 r2 files)
  horizonstr TypeError unsupported operand type(s) for -: 'int' and 'str' on every rank (np4 rall pdsh2)
  errlen     rank N: ProcessGroupGloo::allgather: invalid tensor size (expected (4), got (5)) (np3 r1 ranklabel, np4 r2 spawn)
  ckptlayers rank N Missing key(s) enc/dec *_l1 loading the init checkpoint (np4 r2 logfmt, np3 r1 mpitag)
  slowrefit  12 s: ranks 0/1 Timed out waiting 12000ms in all_reduce (np3 r2 bashloop); 300 s: killed by timeout 60 (np4 r1 srunlabel)
  sigkill    rank N killed by SIGKILL after step 3 (np4 r3 legacy, Root Cause -9; np3 r1 spawn, ProcessExitedException)
  exit2      rank N ERROR line and exit 2 after validation (np4 r1 files, loop exit 2; np4 r3 pdsh2, Root Cause exitcode 2)
  none       exit 0, rank 0 saved the forecaster (np3 bashloop)
"""
import argparse, json, logging, math, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault203_work"
N_SERIES, CH, LENGTH = 5, 3, 240


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def make_series(shard):
    g = torch.Generator().manual_seed(500 + shard)
    t = torch.arange(LENGTH, dtype=torch.float32)
    level = torch.rand(N_SERIES, CH, 1, generator=g) * 20 + 5
    amp = torch.rand(N_SERIES, CH, 1, generator=g) * 4 + 1
    phase = torch.rand(N_SERIES, CH, 1, generator=g) * 6.28
    noise = torch.randn(N_SERIES, CH, LENGTH, generator=g) * 0.3
    return level + amp * torch.sin(2 * math.pi * t / 12 + phase) + noise  # (series, ch, time)


def prep():
    os.makedirs(os.path.join(WORK, "data", "scalers"), exist_ok=True)
    for shard in range(8):
        x = make_series(shard)
        sc = {"mean": x.mean(2).tolist(), "std": x.std(2).tolist()}
        with open(os.path.join(WORK, "data", "scalers", f"shard{shard}.json"), "w") as f:
            json.dump(sc, f)
    print(f"wrote scalers for 8 shards to {WORK}/data/scalers")


class Seq2Seq(nn.Module):
    def __init__(self, ch, hidden, enc_layers=1):
        super().__init__()
        self.enc = nn.LSTM(ch, hidden, num_layers=enc_layers, batch_first=True)
        self.dec = nn.LSTM(ch, hidden, num_layers=enc_layers, batch_first=True)
        self.head = nn.Linear(hidden, ch)

    def forward(self, hist, target, horizon, tf_prob, cal=None):
        _, state = self.enc(hist)
        prev, outs = hist[:, -1:, :], []
        for t in range(horizon):
            inp = prev if cal is None else torch.cat([prev, cal[:, t:t + 1, :]], 2)
            o, state = self.dec(inp, state)
            y = self.head(o)
            outs.append(y)
            use_true = target is not None and torch.rand(()) < tf_prob
            prev = target[:, t:t + 1, :] if use_true else y.detach()
        return torch.cat(outs, 1)


def windows(x, hist, horizon, starts):
    w = torch.stack([x[:, :, s:s + hist + horizon] for s in starts], 1)  # (series, n, ch, T)
    w = w.reshape(-1, x.shape[1], hist + horizon).permute(0, 2, 1)
    return w[:, :hist], w[:, hist:]


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
        say, err = logging.getLogger("forecast").info, logging.getLogger("forecast").error
    else:
        say = err = lambda m: print(m, flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    ws = dist.get_world_size()
    cfg = {"hidden": 16, "history": 36, "horizon": 12, "season": 12, "enc_layers": 1, "lr": 0.02}
    if bad and a.fault == "season":
        cfg["season"] = 48
    if bad and a.fault == "horizonstr":
        cfg["horizon"] = "12"
    if bad and a.fault == "ckptlayers":
        cfg["enc_layers"] = 2
    hist, horizon, m = cfg["history"], cfg["horizon"], cfg["season"]
    say(f"rank {r}/{ws}: history {hist} horizon {horizon} season {m} encoder layers {cfg['enc_layers']}")
    if m > hist:
        raise ValueError(f"seasonal period {m} is longer than the history window {hist}; "
                         "cannot build the seasonal-naive scale")
    sc_name = f"shard{r:02d}.json" if bad and a.fault == "scaler" else f"shard{r}.json"
    with open(os.path.join(WORK, "data", "scalers", sc_name)) as f:
        sc = json.load(f)
    x = make_series(r)
    if bad and a.fault == "zeroscale":
        x[2, :, :] = x[2, :, LENGTH - horizon - 1:LENGTH - horizon].clone()
        x[2, :, LENGTH - horizon:] += torch.linspace(0, 1, horizon)
    mean, std = torch.tensor(sc["mean"]).unsqueeze(2), torch.tensor(sc["std"]).unsqueeze(2)
    z = (x - mean) / std
    train_end = LENGTH - horizon - hist
    torch.manual_seed(0)
    model = Seq2Seq(CH, cfg["hidden"], cfg["enc_layers"])
    ck = os.path.join(WORK, "ckpt", "lstm_init.pt")
    if r == 0:
        os.makedirs(os.path.dirname(ck), exist_ok=True)
        torch.save(model.state_dict(), ck)
    dist.barrier()
    model.load_state_dict(torch.load(ck))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(7 + r)
    for step in range(a.steps):
        starts = torch.randint(0, train_end - horizon, (4,), generator=gen).tolist()
        xh, yt = windows(z, hist, horizon, starts)
        cal = None
        if bad and a.fault == "featdim":
            cal = (torch.arange(hist, hist + horizon) % 12).float().view(1, -1, 1).expand(xh.shape[0], -1, 1) / 12
        tf_prob = max(0.0, 1.0 - step / a.steps)
        pred = ddp(xh, yt, horizon, tf_prob, cal)
        loss = F.mse_loss(pred, yt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"rank {r} step {step} loss {loss.item():.4f} teacher-forcing {tf_prob:.2f}")
        if bad and a.fault == "sigkill" and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    with torch.no_grad():
        xh, yt = windows(z, hist, horizon, [LENGTH - hist - horizon])
        pred = ddp.module(xh, None, horizon, 0.0) * std.squeeze(2).unsqueeze(1) + mean.squeeze(2).unsqueeze(1)
        y = yt * std.squeeze(2).unsqueeze(1) + mean.squeeze(2).unsqueeze(1)
        h_raw = xh * std.squeeze(2).unsqueeze(1) + mean.squeeze(2).unsqueeze(1)
        scale = (h_raw[:, m:] - h_raw[:, :-m]).abs().mean((1, 2))
        per_series = (pred - y).abs().mean((1, 2)) / scale
    mase = per_series.mean()
    if not torch.isfinite(mase):
        raise FloatingPointError(f"rank {r}: MASE is not finite ({mase.item()}); seasonal-naive scale per series "
                                 f"{[round(v, 4) for v in scale.tolist()]}")
    if bad and a.fault == "errlen":
        per_series = per_series[:-1]
    gathered = [torch.zeros(N_SERIES) for _ in range(ws)]
    dist.all_gather(gathered, per_series)
    if bad and a.fault == "slowrefit":
        say(f"rank {r}: scaler drift 0.31 > 0.25 on shard {r}, refitting scalers on full history before scoring")
        time.sleep(a.stall)
    tot = mase.clone().view(1)
    dist.all_reduce(tot)
    tot /= ws
    say(f"rank {r} val MASE {tot.item():.3f} shard MASE {mase.item():.3f} worst series "
        f"{int(torch.cat(gathered).argmax())}")
    if bad and a.fault == "exit2":
        err(f"ERROR rank {r}: shard MASE {mase.item():.3f} on {N_SERIES} series failed the acceptance gate; "
            "refusing to write forecasts")
        sys.exit(2)
    dist.barrier()
    if r == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save({"model": model.state_dict(), "cfg": cfg}, os.path.join(WORK, "out", "lstm_final.pt"))
        say(f"rank 0: saved forecaster to {WORK}/out/lstm_final.pt")
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
    p.add_argument("--prep", type=int, default=0)
    a = p.parse_args()
    if a.prep:
        prep()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        worker(None, a, None)


if __name__ == "__main__":
    main()
