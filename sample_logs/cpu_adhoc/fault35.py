"""A thirty-fifth hand-run batch: NUMERICS. One rank's NaN/inf, where it starts and how it spreads.
A small DDP regression loop on gloo (Linear(8,16)-ReLU-Linear(16,1), batch 16, MSE, SGD, process-group timeout
15 s, --steps steps) with ONE numerical fault on rank R (--rank) from step K (--step), chosen with --fault, and a
reaction chosen with --react.

Faults (what rank R's data or config does):
  inf_input   one feature of one sample of step K's batch is inf
  nan_input   one feature of one sample of step K's batch is NaN
  log_zero    the target is log(count); one sample of step K's batch has count 0 (target -inf)
  div_zero    the loss is a masked mean; step K's batch has every mask 0 (0/0)
  fp16        step K's batch has an unnormalised sample (values ~300); the script's feature-energy term is
              computed in float16 on purpose (sum of squares > 65504 -> inf)
  bf16        the same in bfloat16 with a value ~1e20 (square > 3.4e38 -> inf)
  lr          rank R reads its learning rate from a per-rank list, its entry 1e2 (a typo for 1e-2): its loss explodes
  zero_norm   step K's batch has an all-zero (padding) sample; the weighted norm feature sqrt(sum gain*x^2) is finite (0)
              but its backward to the learned gain is 0/0 = NaN (loss finite, gradients NaN)
  metric      the eval metric (accuracy over valid samples) on rank R counts 0 samples at step K (0/0 = NaN); it
              is all-reduced (a plain dist.all_reduce, not DDP) and every rank's reduced metric is NaN
  scale       from step K on rank R's shard has a unit error (values ~1e4); the script's own loss scaler
              (scale 64, halved on every overflow) skips every step until it is below its minimum
  scale_once  the same unit error in step K's batch only: one overflow, one skipped step, then training goes on
Reactions:
  silent      nothing: the loss prints nan/inf until the end, exit 0
  assert      assert torch.isfinite(loss) on every rank before backward (only the bad rank fails it)
  raise       raise FloatingPointError("loss is nan") on every rank before backward
  raise_after the same check after backward and the optimizer step (the NaN has been all-reduced by then)
  clip        clip_grad_norm_(..., error_if_nonfinite=True) after backward on every rank
  anomaly     torch.autograd.set_detect_anomaly(True) on every rank
  agree       a non-finite flag is all-reduced before backward; every rank raises at once
              (FloatingPointError: non-finite loss on N of W ranks)
  linger      the bad rank logs the error, spends 25 s dumping the batch, then raises (peers time out first)
  skip        a non-finite loss (flag all-reduced) or grad norm skips the step with a warning; training goes on
  metric_check the reduced metric is checked on every rank: raise ValueError('eval metric is nan')
Progress formats (--fmt): plain, bracket, hf (rank 0 only), log (logging, every rank), tqdm (every rank).
"""
import argparse, datetime, logging, math, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--react", default="assert")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--step", type=int, default=3)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--fmt", default="plain")
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
BATCH = 16


def batch_for(rank: int, step: int, bad: bool):
    g = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(BATCH, 8, generator=g)
    w = torch.linspace(-1, 1, 8)
    count = torch.randint(1, 20, (BATCH,), generator=g).float()
    y = (x @ w).unsqueeze(1) * 0.5 + 0.1 * torch.log(count).unsqueeze(1)
    mask = torch.ones(BATCH, 1)
    f = a.fault
    if bad and step == a.step:
        if f == "inf_input":
            x[5, 3] = float("inf")
        elif f == "nan_input":
            x[11, 2] = float("nan")
        elif f == "log_zero":
            count[9] = 0.0
            y = (x @ w).unsqueeze(1) * 0.5 + 0.1 * torch.log(count).unsqueeze(1)
        elif f == "div_zero":
            mask = torch.zeros(BATCH, 1)
        elif f == "fp16":
            x[4] = 300.0 + x[4]
        elif f == "bf16":
            x[4] = 1e20
        elif f == "zero_norm":
            x[7] = 0.0
    if bad and f == "scale" and step >= a.step:
        x = x * 1e4
    if bad and f == "scale_once" and step == a.step:
        x = x * 1e4  # one batch with the unit error
    return x, y, mask


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 1))
        if a.fault == "zero_norm":
            self.gain = nn.Parameter(torch.ones(8))  # learned per-feature weights of the norm feature

    def forward(self, x):
        if a.fault == "fp16":
            energy = x.half().pow(2).sum(-1, keepdim=True).float() * 1e-3
        elif a.fault == "bf16":
            energy = x.bfloat16().pow(2).sum(-1, keepdim=True).float() * 1e-3
        elif a.fault == "zero_norm":
            energy = torch.sqrt((x * x * self.gain).sum(-1, keepdim=True))  # d/dgain at a zero row: 0/0
        else:
            energy = torch.sqrt((x * x).sum(-1, keepdim=True))  # the feature norm
        return self.body(torch.cat([x, energy], dim=1))


class Out:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.log = logging.getLogger("train")
        if a.fmt == "log":
            logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                                format=f"%(asctime)s [%(levelname)s] [rank{rank}] %(name)s: %(message)s")
        self.bar = None
        if a.fmt == "tqdm":
            from tqdm import tqdm
            self.bar = tqdm(total=a.steps, desc=f"rank {rank} train", mininterval=0, file=sys.stderr)

    def info(self, msg: str) -> None:
        if a.fmt == "log":
            self.log.info(msg)
        elif a.fmt == "hf":
            if self.rank == 0:
                print(msg, flush=True)
        else:
            print(f"[rank {self.rank}] {msg}" if a.fmt == "bracket" else f"rank {self.rank}: {msg}", flush=True)

    def warn(self, msg: str) -> None:
        if a.fmt == "log":
            self.log.warning(msg)
        else:
            print(f"WARNING rank {self.rank}: {msg}", flush=True)

    def error(self, msg: str) -> None:
        if a.fmt == "log":
            self.log.error(msg)
        else:
            print(f"ERROR rank {self.rank}: {msg}", flush=True)

    def step(self, step: int, loss: float, gnorm: float, lr: float, extra: str = "") -> None:
        if a.fmt == "plain":
            print(f"rank {self.rank} step {step}/{a.steps} loss {loss:.4f}{extra}", flush=True)
        elif a.fmt == "bracket":
            print(f"[rank {self.rank}] it {step} | loss {loss:.3e} | gnorm {gnorm:.3e} | lr {lr:g}{extra}", flush=True)
        elif a.fmt == "hf":
            if self.rank == 0:
                print({"loss": round(loss, 4) if math.isfinite(loss) else loss, "grad_norm": gnorm,
                       "learning_rate": lr, "epoch": round(step / a.steps, 2)}, flush=True)
        elif a.fmt == "log":
            self.log.info(f"step {step} loss={loss:.5f} grad_norm={gnorm:.4f}{extra}")
        elif a.fmt == "tqdm":
            self.bar.set_postfix(loss=f"{loss:.4f}", gnorm=f"{gnorm:.3f}")
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def grad_norm(model) -> float:
    return float(torch.norm(torch.stack([q.grad.detach().norm() for q in model.parameters() if q.grad is not None])))


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Out(rank, world)
    bad = rank == a.rank
    if rank == 0:
        print(f"world_size={world} backend=gloo torch={torch.__version__} steps={a.steps}", flush=True)
    if a.react == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    base_lr = 0.05
    lr = base_lr
    if a.fault == "lr":
        per_rank = [base_lr] * world
        per_rank[a.rank] = 1e2  # a config typo: 1e2 instead of 1e-2
        lr = per_rank[rank]
        out.info(f"lr={lr:g} (from LR_PER_RANK)")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scale, min_scale = 64.0, 1.0
    out.info("model ready")
    for step in range(1, a.steps + 1):
        x, y, mask = batch_for(rank, step, bad)
        pred = model(x)
        if a.fault == "div_zero":
            loss = (((pred - y) ** 2) * mask).sum() / mask.sum()
        else:
            loss = F.mse_loss(pred, y)
        lv = float(loss.detach())
        finite = math.isfinite(lv)
        if a.react == "assert":
            assert torch.isfinite(loss), f"loss is not finite at step {step}: {lv}"
        elif a.react == "raise" and not finite:
            raise FloatingPointError(f"loss is nan at step {step}" if math.isnan(lv) else f"loss is inf at step {step}")
        elif a.react in ("agree", "skip"):
            flag = torch.tensor([0.0 if finite else 1.0])
            dist.all_reduce(flag)
            nbad = int(flag.item())
            if nbad and a.react == "agree":
                raise FloatingPointError(f"non-finite loss on {nbad} of {world} ranks at step {step}")
            if nbad:
                if not finite:
                    out.warn(f"non-finite loss ({lv}) at step {step}, skipping batch")
                else:
                    out.warn(f"step {step}: non-finite loss on {nbad} rank(s), skipping batch")
                opt.zero_grad(set_to_none=True)
                out.step(step, lv, 0.0, lr, " (skipped)")
                continue
        elif a.react == "linger" and not finite and bad:
            out.error(f"loss is {lv} at step {step}; dumping the batch to /tmp/job/bad_batch_rank{rank}.pt")
            torch.save({"x": x, "y": y}, f"/tmp/fault35_bad_batch_rank{rank}.pt")
            time.sleep(25)  # a slow upload of the dump to shared storage
            raise FloatingPointError(f"loss is {lv} at step {step}")
        opt.zero_grad(set_to_none=True)
        if a.fault in ("scale", "scale_once"):
            (loss * scale).backward()
            overflow = any(not bool(torch.isfinite(q.grad.half()).all()) for q in model.parameters())
            if overflow:
                if scale / 2 < min_scale:
                    raise RuntimeError("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
                out.info(f"OVERFLOW! Rank {rank} Skipping step. Attempted loss scale: {scale:g}, reducing to {scale / 2:g}")
                scale /= 2
                out.step(step, lv, float("inf"), lr, " (skipped)")
                continue
            for q in model.parameters():
                q.grad.div_(scale)
        else:
            loss.backward()
        if a.react == "clip":
            gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True))
        else:
            gn = grad_norm(model)
        if a.react == "skip" and not math.isfinite(gn):
            out.warn(f"grad norm is {gn}, skipping step {step}")
            opt.zero_grad(set_to_none=True)
            out.step(step, lv, gn, lr, " (skipped)")
            continue
        opt.step()
        extra = ""
        if a.fault == "metric":
            acc_hits = float(((pred - y).abs() < 0.5).float().sum())
            n = 0.0 if (bad and step == a.step) else float(BATCH)
            local = torch.tensor([acc_hits / n if n else float("nan")])
            dist.all_reduce(local)
            metric = float(local.item()) / world
            extra = f" acc {metric:.3f}"
            if a.react == "metric_check" and not math.isfinite(metric):
                raise ValueError(f"eval metric is {metric} at step {step} (accuracy over the valid samples)")
        out.step(step, lv, gn, lr, extra)
        if a.react == "raise_after" and not math.isfinite(lv):
            raise FloatingPointError(f"loss is nan at step {step}")
        time.sleep(0.05)
    out.close()
    out.info("training finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
