"""A two-hundred-and-eighty-fourth hand-run batch: MULTI-HORIZON DEMAND FORECASTING WITH A TEMPORAL FUSION TRANSFORMER-LITE.

Synthetic store-item demand series (a weekly season, a trend, promotions and holidays from a per-region calendar
table), known covariates read from a covariate file (/tmp/job_work/covariates/known.npy) and observed covariates,
a store embedding, variable selection by a gated residual network, an LSTM encoder (warm-started from
ckpt/encoder_h16.pt), one-head attention over time, a head of 3 quantiles x 6 horizons, a pinball loss on
mean-scaled targets, DDP (gloo), the pinball loss all_reduced every step and the per-horizon losses all_gathered
at step 3, destroy_process_group. --prep 1 writes the covariate file and the checkpoints into the work dir.

Faults:
- storeid: from step 1 rank N draws store ids 0..n_stores (one past the store embedding; IndexError).
- zeromean: rank N's shard has an all-zero series at step 2; the mean scaling divides 0 by 0 and the check raises.
- horizon: rank N all_gathers its per-horizon quantile losses for horizon 7, not 6, at step 3.
- nocov: rank N reads its known covariates from covariates_v2/, which does not exist (FileNotFoundError).
- holiday: rank N's region is "AU", missing from the holiday calendar table (KeyError at startup).
- ncov: every rank feeds 5 known covariates to a selection network built for 4 (shape error at step 0).
- ckpthid: rank N warm-starts its encoder from ckpt/encoder_h32.pt (hidden 32) into the hidden-16 LSTM.
- backtest: rank N backtests every series one window at a time in Python at step 2 for --stall seconds.
- segv: rank N sends itself SIGSEGV after step 2's optimizer step.
- exit8: rank N prints an error about an empty demand shard at step 1 and calls os._exit(8).
- none: control.

What happened (filled in after the runs):
- storeid: IndexError: index out of range in self (store embedding) on rank N at step 1; peers Connection closed by peer (tftl_storeid_np4_r2_bashloop, _np3_r1_spawn).
- zeromean: FloatingPointError 'non-finite pinball loss on rank N at step 2 (1 series with a zero mean scale)' (tftl_zeromean_np3_r1_ranklabel, _np4_r3_logfmt).
- horizon: a receiving rank (2 in np4, 0 in np3), not rank N, aborts: gloo::EnforceNotMet '14 vs 12. Received data size doesn't match' (tftl_horizon_np4_r1_mpitag, _np3_r2_legacy).
- nocov: FileNotFoundError for /tmp/job_work/covariates_v2/known.npy on rank N at startup, in its own rankN.log (tftl_nocov_np3_r1_files, _np4_r2_files).
- holiday: KeyError: 'AU' on rank N at startup (tftl_holiday_np3_r0_tee, _np4_r3_pdsh2).
- ncov: every rank: 'mat1 and mat2 shapes cannot be multiplied (384x6 and 5x16)' in step 0's forward (tftl_ncov_np3_rall_srunlabel, _np4_rall_spawn).
- ckpthid: size mismatch for weight_ih_l0 ([128, 16] vs [64, 16]) loading encoder_h32.pt on rank N (tftl_ckpthid_np4_r1_legacy, _np3_r2_srunlabel).
- backtest: PG 12 s: peers 'Timed out waiting 12000ms' (tftl_backtest_np3_r1_tee); PG 300 s: killed at 60 s, exit 124 (_np3_r2_bashloop).
- segv: rank N dies by SIGSEGV (bash 'Segmentation fault' / exitcode -11), no traceback (tftl_segv_np4_r3_mpitag, _np3_r0_logfmt).
- exit8: rank N's 'ERROR demand shard ... has 0 rows' line, exit status 8; peers Connection closed (tftl_exit8_np3_r2_ranklabel, _np4_r1_pdsh2).
- none: exit 0, 'rank 0 done: 5 steps, last pinball 0.4695' (tftl_none_np3_rnone_spawn).
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

CALENDARS = {"US": [0, 13, 20], "DE": [2, 9, 17], "JP": [4, 5, 22]}
REGIONS = ["US", "DE", "JP"]
QUANTILES = [0.1, 0.5, 0.9]
N_STORES, HID, ENC, HOR, N_KNOWN = 8, 16, 24, 6, 4


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--work", default="/tmp/fault284_work")
    p.add_argument("--prep", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    return p.parse_args()


class GRN(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, HID), nn.Linear(HID, 2 * d_out)
        self.skip = nn.Linear(d_in, d_out)

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(x)))
        a, g = h.chunk(2, dim=-1)
        return self.skip(x) + a * torch.sigmoid(g)


class TFTLite(nn.Module):
    def __init__(self, n_known=N_KNOWN, hid=HID):
        super().__init__()
        self.store = nn.Embedding(N_STORES, hid)
        self.select = GRN(n_known + 1, n_known + 1)
        self.proj = nn.Linear(1, hid)
        self.encoder = nn.LSTM(hid, hid, batch_first=True)
        self.attn = nn.MultiheadAttention(hid, 1, batch_first=True)
        self.head = nn.Linear(hid, HOR * len(QUANTILES))

    def forward(self, store, y, known):
        x = torch.cat([y.unsqueeze(-1), known], dim=-1)
        w = torch.softmax(self.select(x), dim=-1).unsqueeze(-1)
        v = (w * self.proj(x.unsqueeze(-1))).sum(2) + self.store(store).unsqueeze(1)
        h, _ = self.encoder(v)
        a, _ = self.attn(h[:, -1:], h, h)
        return self.head(a[:, 0]).view(-1, HOR, len(QUANTILES))


def pinball(pred, target):
    q = torch.tensor(QUANTILES)
    e = target.unsqueeze(-1) - pred
    return torch.maximum(q * e, (q - 1) * e).mean(dim=(0, 2))


def prep(a):
    os.makedirs(os.path.join(a.work, "covariates"), exist_ok=True)
    os.makedirs("ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(7)
    np.save(os.path.join(a.work, "covariates", "known.npy"), torch.rand(N_STORES, ENC + HOR, N_KNOWN, generator=g).numpy())
    torch.save(nn.LSTM(HID, HID, batch_first=True).state_dict(), "ckpt/encoder_h16.pt")
    torch.save(nn.LSTM(HID, 32, batch_first=True).state_dict(), "ckpt/encoder_h32.pt")
    print("wrote covariates and ckpt/encoder_h16.pt, ckpt/encoder_h32.pt")


def make_batch(a, rank, step, known_tab, holidays, bad):
    g = torch.Generator().manual_seed(1000 * rank + step)
    hi = N_STORES + 1 if (bad and a.fault == "storeid" and step >= 1) else N_STORES
    store = torch.randint(0, hi, (a.batch,), generator=g)
    store[0] = hi - 1
    t = torch.arange(ENC + HOR, dtype=torch.float32)
    level = 5 + 3 * torch.rand(a.batch, 1, generator=g)
    y = level + torch.sin(2 * np.pi * t / 7) + 0.05 * t + 0.3 * torch.randn(a.batch, ENC + HOR, generator=g)
    y[:, holidays] *= 1.5
    if bad and a.fault == "zeromean" and step == 2:
        y[3] = 0.0
    known = known_tab[store.clamp(max=N_STORES - 1)]
    if a.fault == "ncov":
        known = torch.cat([known, torch.rand(a.batch, ENC + HOR, 1, generator=g)], dim=-1)
    scale = y[:, :ENC].mean(dim=1, keepdim=True)
    return store, y[:, :ENC] / scale, known[:, :ENC], y[:, ENC:] / scale


def main(a, rank=None):
    if rank is not None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.spawn),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    r, ws = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == r)
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s")
        log = logging.LoggerAdapter(logging.getLogger("tft"), {"rank": r})
        info, error = log.info, log.error
    else:
        info = error = lambda m: print(m, flush=True)
    torch.manual_seed(0)
    sub = "covariates_v2" if (bad and a.fault == "nocov") else "covariates"
    known_tab = torch.from_numpy(np.load(os.path.join(a.work, sub, "known.npy")))
    region = "AU" if (bad and a.fault == "holiday") else REGIONS[r % len(REGIONS)]
    holidays = CALENDARS[region]
    model = TFTLite()
    enc = "ckpt/encoder_h32.pt" if (bad and a.fault == "ckpthid") else "ckpt/encoder_h16.pt"
    model.encoder.load_state_dict(torch.load(enc))
    info(f"rank {r}/{ws}: region {region}, {len(holidays)} holidays, encoder from {enc}")
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    for step in range(a.steps):
        store, y, known, target = make_batch(a, r, step, known_tab, holidays, bad)
        if bad and a.fault == "exit8" and step == 1:
            print(f"rank {r}: ERROR demand shard {a.work}/demand/part-{r:03d}.npy has 0 rows after the promo filter",
                  file=sys.stderr, flush=True)
            os._exit(8)
        if bad and a.fault == "backtest" and step == 2:
            info(f"rank {r}: backtesting {a.batch} series one window at a time")
            t0, n = time.time(), 0
            while time.time() - t0 < a.stall:
                w = y[n % a.batch, : ENC - HOR].tolist()
                n += sum(1 for v in w if v > 0) > 0
        horizon_loss = pinball(ddp(store, y, known), target)
        loss = horizon_loss.mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite pinball loss on rank {r} at step {step} "
                                     f"({int(torch.isnan(y).any(1).sum())} series with a zero mean scale)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg /= ws
        if step == 3:
            hl = horizon_loss.detach()
            if bad and a.fault == "horizon":
                hl = torch.cat([hl, hl[-1:]])
            parts = [torch.zeros_like(hl) for _ in range(ws)]
            dist.all_gather(parts, hl)
            if r == 0:
                info(f"rank 0 per-horizon pinball: {[round(v, 3) for v in torch.stack(parts).mean(0).tolist()]}")
        info(f"rank {r} step {step} loss {avg.item():.4f}")
    if r == 0:
        info(f"rank 0 done: {a.steps} steps, last pinball {avg.item():.4f}")
    dist.destroy_process_group()


def spawn_worker(rank, a):
    main(a, rank)


if __name__ == "__main__":
    args = parse()
    if args.prep:
        prep(args)
    elif args.spawn:
        torch.multiprocessing.spawn(spawn_worker, args=(args,), nprocs=args.spawn)
    else:
        main(args)
