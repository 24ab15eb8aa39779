"""A hundred-and-thirty-eighth hand-run batch: NOISY CONSOLES: THE FAULT AMONG WARNINGS, DEBUG OUTPUT AND PROGRESS BARS.
A chatty little DDP regression trainer (Linear(8,16)-ReLU-Linear(16,1), gloo, --ddp 0: rank 0's weights broadcast
and gradients all-reduced by hand). Every rank logs a 30-line config dump with ANSI colours, triggers a UserWarning
and a DeprecationWarning of its own (warnings.warn), reads its data shard (data/shard-0000R.pt, written by
`--fault prep` beforehand), loads the init checkpoint (ckpt/v2/model.pt), draws a tqdm-like progress bar redrawn with
`\r` on stderr, prints `rank R step S loss L` (2 epochs x 5 steps), all-reduces a metrics vector at each epoch's end
(rank 0 logs `epoch E: val loss V`), broadcasts rank 0's lr schedule, then barrier, `rank R done`, destroy.
--rank N picks the faulty rank (-1: every rank); --warn-rank the rank of the red-herring warning.

Faults:
  none      control: loud warnings, config dumps, bars; 10 steps per rank, exit 0
  value     rank N's node config has warmup_steps -2: the lr scheduler raises ValueError at startup
  typeerr   every rank: the epoch summary divides the list of losses by the step count (TypeError)
  wait      rank N waits in a recv for a resume token rank 0 never sends (step 3); the others' all_reduce times out
  segv      rank N's "fast" loss kernel crashes at step 3 (SIGSEGV, os.kill)
  nan       rank N's shard has a NaN target; the program's finite-loss check raises FloatingPointError
  ckpt      rank N's checkpoint cache points at ckpt/v1 (old key names): load_state_dict raises (missing keys)
  shape     rank N thinks the lr schedule has 3 entries, rank 0 broadcasts 4: the broadcast sizes differ
  missing   rank N's data root is the unfinished staging dir: its shard file is missing (FileNotFoundError)
  herring   --warn-rank logs a WARNING line with "ERROR" in it and goes on; rank N later raises KeyError in eval
  env       rank N's node does not export NOISY_SCRATCH: the program's check calls sys.exit with a message

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 tee + TORCH_CPP_LOG_LEVEL=INFO): warnings, dumps, bars, 10 steps, every rank done.
  value: ValueError warmup_steps must be >= 0, got -2 in lr_at at startup on rank N (r2 np4; r3 np5 filtered).
  typeerr: TypeError unsupported operand type(s) for /: 'list' and 'int' on every rank after epoch 0 (np3, np4).
  wait: PG 12 s: rank N in recv, the others in backward: all 'Timed out waiting 12000ms'; PG 300 s + 60 s: 124.
  segv: rank N SIGSEGV (exitcode -11) at step 3, peers closed/reset; restart: connectFullMesh Connect timeout.
  nan: FloatingPointError rank N step 2: loss is nan; DETAIL: rank 0 'Ranks 1 failed to pass monitoredBarrier'.
  ckpt: RuntimeError Error(s) in loading state_dict: Missing key(s) / Unexpected key(s) on rank N at startup.
  shape: gloo EnforceNotMet 16 vs 12 (rank N SIGABRT); DETAIL: Detected mismatch, BROADCAST [3] vs [4], all.
  missing: FileNotFoundError .../data_staging/shard-0000N.pt on rank N (np6, two agents), peers closed by peer.
  herring: warn-rank's WARNING 'ERROR count 3 ...' is harmless; rank N KeyError: 'val_acc' in epoch 1's eval.
  env: sys.exit 'scratch directory not configured ... (NOISY_SCRATCH is unset), rank N', exitcode 1, no trace.
"""
import argparse, datetime, logging, os, signal, socket, sys, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--warn-rank", type=int, default=1)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault138_work")
a = p.parse_args()
torch.set_num_threads(1)


def make_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


if a.fault == "prep":
    torch.manual_seed(0)
    os.makedirs(f"{a.work}/data", exist_ok=True)
    for r in range(8):
        x = torch.randn(40, 8)
        torch.save({"x": x, "y": x.sum(1, keepdim=True) * 0.3}, f"{a.work}/data/shard-{r:05d}.pt")
    os.makedirs(f"{a.work}/ckpt/v2", exist_ok=True)
    os.makedirs(f"{a.work}/ckpt/v1", exist_ok=True)
    sd = make_model().state_dict()
    torch.save(sd, f"{a.work}/ckpt/v2/model.pt")
    torch.save({k.replace("0.", "fc1.").replace("2.", "head."): v for k, v in sd.items()}, f"{a.work}/ckpt/v1/model.pt")
    print("prepared", a.work)
    sys.exit(0)

rank = int(os.environ["RANK"]); ws = int(os.environ["WORLD_SIZE"]); local = int(os.environ["LOCAL_RANK"])
bad = a.rank in (-1, rank)
C = {"g": "\x1b[32m", "y": "\x1b[33m", "r": "\x1b[31m", "b": "\x1b[34m", "0": "\x1b[0m"}


class Colour(logging.Formatter):
    def format(self, rec):
        c = {"INFO": C["g"], "WARNING": C["y"], "ERROR": C["r"], "DEBUG": C["b"]}.get(rec.levelname, "")
        return f"{c}{self.formatTime(rec, '%H:%M:%S')} {rec.levelname:<7}{C['0']} [rank {rank}] {rec.name}: {rec.getMessage()}"


h = logging.StreamHandler(sys.stdout); h.setFormatter(Colour())
log = logging.getLogger("noisy"); log.addHandler(h); log.setLevel(logging.DEBUG); log.propagate = False

cfg = {"model": "mlp-8-16-1", "hidden": 16, "layers": 2, "activation": "relu", "optimizer": "sgd", "lr": 0.05,
       "momentum": 0.9, "weight_decay": 0.0, "warmup_steps": 2, "schedule": "linear", "epochs": a.epochs,
       "steps_per_epoch": a.steps, "batch_size": 8, "grad_clip": 1.0, "seed": 1234 + rank, "backend": "gloo",
       "pg_timeout_s": a.pg_timeout, "ddp": bool(a.ddp), "data_root": f"{a.work}/data",
       "ckpt_dir": f"{a.work}/ckpt/v2", "scratch": os.environ.get("NOISY_SCRATCH", f"{a.work}/scratch"),
       "log_every": 1, "eval_every": a.steps, "amp": False, "compile": False, "num_workers": 0,
       "pin_memory": False, "host": socket.gethostname(), "world_size": ws, "local_rank": local}
if bad and a.fault == "value":
    cfg["warmup_steps"] = -2
if bad and a.fault == "ckpt":
    cfg["ckpt_dir"] = f"{a.work}/ckpt/v1"
if bad and a.fault == "missing":
    cfg["data_root"] = f"{a.work}/data_staging"
if bad and a.fault == "env":
    cfg["scratch"] = os.environ.get("NOISY_SCRATCH_NODE")
log.info("config dump (%d keys):", len(cfg) + 1)
log.info("  run_name = noisy-%s", datetime.date.today().isoformat())
for k, v in cfg.items():
    log.info("  %s = %r", k, v)

warnings.warn("torch.set_num_threads(1) limits intra-op parallelism; throughput may be low", UserWarning)
warnings.warn("cfg['amp'] is deprecated, use cfg['precision'] instead", DeprecationWarning)

if cfg["scratch"] is None:
    sys.exit(f"noisy: scratch directory not configured on {cfg['host']} (NOISY_SCRATCH is unset), rank {rank}")

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
log.debug("process group up: backend=%s world=%d", dist.get_backend(), ws)
torch.manual_seed(0)
model = make_model()
sd = torch.load(f"{cfg['ckpt_dir']}/model.pt")
model.load_state_dict(sd)
log.info("loaded init weights from %s", cfg["ckpt_dir"])
if a.ddp:
    net = DDP(model)
else:
    net = model
    for prm in model.parameters():
        dist.broadcast(prm.data, 0)
opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])


def lr_at(step):
    if cfg["warmup_steps"] < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {cfg['warmup_steps']}")
    return cfg["lr"] * min(1.0, (step + 1) / max(1, cfg["warmup_steps"]))


lr_at(0)
shard = torch.load(f"{cfg['data_root']}/shard-{rank:05d}.pt")
x, y = shard["x"], shard["y"]
if bad and a.fault == "nan":
    y[17, 0] = float("nan")
if rank == a.warn_rank and a.fault == "herring":
    log.warning("ERROR count 3 in shard index: 3 malformed rows skipped, continuing with %d rows", len(x) - 3)


def bar(ep, i, n, t0, loss):
    el = time.time() - t0; rate = i / el if el > 0 else 0.0
    left = (n - i) / rate if rate else 0.0
    fill = "#" * (10 * i // n)
    sys.stderr.write(f"\repoch {ep}: {100 * i // n:3d}%|{fill:<10}| {i}/{n} [00:{int(el):02d}<00:{int(left):02d}, "
                     f"{rate:.1f}it/s, loss={loss:.2f}]")
    sys.stderr.flush()


step = 0
for ep in range(a.epochs):
    t0 = time.time(); losses = []
    for i in range(a.steps):
        xb, yb = x[(i * 8) % 40:(i * 8) % 40 + 8], y[(i * 8) % 40:(i * 8) % 40 + 8]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        if bad and a.fault == "wait" and step == 3:
            tok = torch.zeros(1)
            dist.recv(tok, src=0 if rank != 0 else 1)
        out = net(xb)
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        loss = F.mse_loss(out, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()}")
        opt.zero_grad(); loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad); prm.grad /= ws
        opt.step(); losses.append(loss.item())
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        bar(ep, i + 1, a.steps, t0, loss.item())
        time.sleep(0.05); step += 1
    sys.stderr.write("\n")
    if a.fault == "typeerr":
        mean = losses / len(losses)
    else:
        mean = sum(losses) / len(losses)
    m = torch.tensor([mean, 1.0])
    dist.all_reduce(m)
    metrics = {"val_loss": m[0].item() / ws}
    if bad and a.fault == "herring" and ep == 1:
        log.info("eval: val_acc %.3f", metrics["val_acc"])
    if rank == 0:
        log.info("epoch %d: val loss %.4f", ep, metrics["val_loss"])

sched = torch.tensor([lr_at(s) for s in range(4)]) if rank == 0 else torch.zeros(3 if bad and a.fault == "shape" else 4)
dist.broadcast(sched, 0)
log.debug("lr schedule synced: %s", [round(v, 4) for v in sched.tolist()])
dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
