"""A hundred-and-thirty-third hand-run batch: A MINIATURE TRAINER FRAMEWORK (ACCELERATE / LIGHTNING STYLE).

A small Trainer class wraps a tiny regression model (8-16-1) in DDP (`--ddp 0`: gradients all-reduced by
hand), moves dict batches, runs fit (6 steps, `rank R step S loss L` through Python logging with a rank
filter), validate (metric all_reduce), a checkpoint callback, and test; fit catches exceptions and re-raises
them as TrainerError("fit failed at step N") from the original; teardown() destroys the process group in a
finally block. Run under torchrun with the gloo backend.

Faults:
- keyerr: rank N's collate names the target key "label"; batch["target"] raises KeyError in fit (wrapped).
- attr: every rank calls configure_optimizers on the DDP wrapper instead of the module: AttributeError.
- valskip: rank N's validation shard is empty (off-by-one), it skips the metric all_reduce and waits for the ckpt.
- teardown: rank N's shard has 7 features (shape error in forward); teardown then raises KeyError 'val_loss'.
- nan: rank N's step-2 batch holds an inf; the NaN guard callback logs an ERROR and calls sys.exit(1).
- accum: rank N's config has accumulate_grad_batches 1 against 2; it syncs gradients on every step.
- ckpt: every rank saves last.ckpt to one path; rank N verifies it while it is half-written.
- logfilter: rank N's checkpoint callback logs through a logger without the rank filter (Logging error).
- sigterm: rank N sends itself SIGTERM at step 3.
- segv: rank N gets SIGSEGV at step 4.
- precision: rank N's config asks for precision "16-mixed": ValueError in Trainer setup.
What happened (filled in after the runs):
- keyerr: KeyError 'target' (line 183) on rank N at step 0, chained into TrainerError; peers Connection closed.
- attr: every rank AttributeError 'DistributedDataParallel' ... 'configure_optimizers' (line 176), chained.
- valskip: PG 12 s: peers gloo timeouts in the val all_reduce (line 220); PG 300 s: killed by timeout 60.
- teardown: mat1 and mat2 shapes (16x7 and 8x16) on rank N, then KeyError 'val_loss' in teardown (line 242).
- nan: rank N logs ERROR loss is nan at step 2 and exits 1; peers Connection closed / monitoredBarrier errors.
- accum: DETAIL: collective mismatch [16, 8] vs [2] at seq 13; plain DDP: no error at all, exit 0 (dropped).
- ckpt: np4: PytorchStreamReader ... central directory on rank 3; np3, np5: load won the race, exit 0 (dropped).
- logfilter: '--- Logging error ---' block (KeyError 'rank') from rank N's callback; the run goes on, exit 0.
- sigterm: rank N dies by SIGTERM at step 3 (exitcode -15); peers Connection closed/reset by peer.
- segv: rank N dies by SIGSEGV at step 4 (exitcode -11); the --max-restarts attempt dies in connectFullMesh.
- precision: ValueError precision '16-mixed' on rank N in Trainer setup.
"""
import argparse
import io
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--out", default="/tmp/fault133_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def hit():
    return a.rank == -1 or a.rank == RANK


class RankFilter(logging.Filter):
    def filter(self, record):
        record.rank = RANK
        return True


logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [rank %(rank)s] %(name)s: %(message)s")
log = logging.getLogger("trainer")
log.addFilter(RankFilter())
cblog = logging.getLogger("trainer.callbacks")
cblog.addFilter(RankFilter())


class TrainerError(RuntimeError):
    pass


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def make_config():
    cfg = {"accumulate_grad_batches": 2, "precision": "32", "features": 8, "target_key": "target",
           "verify_ckpt": False, "ckpt_logger": "trainer.callbacks"}
    if a.fault == "accum" and hit():
        cfg["accumulate_grad_batches"] = 1
    if a.fault == "precision" and hit():
        cfg["precision"] = "16-mixed"
    if a.fault == "teardown" and hit():
        cfg["features"] = 7
    if a.fault == "keyerr" and hit():
        cfg["target_key"] = "label"
    if a.fault == "ckpt" and hit():
        cfg["verify_ckpt"] = True
    if a.fault == "logfilter" and hit():
        cfg["ckpt_logger"] = "callbacks.checkpoint"
    return cfg


class NanGuard:
    def on_before_backward(self, trainer, step, loss):
        if not math.isfinite(loss.item()):
            log.error("loss is %s at step %d, stopping the run", loss.item(), step)
            sys.exit(1)


class CheckpointCallback:
    def __init__(self, cfg):
        self.cfg = cfg
        self.path = os.path.join(a.out, "last.ckpt")

    def on_validation_end(self, trainer):
        lg = logging.getLogger(self.cfg["ckpt_logger"])
        buf = io.BytesIO()
        torch.save({"model": trainer.module.state_dict(), "step": trainer.step}, buf)
        data = buf.getvalue()
        half = len(data) // 2
        with open(self.path, "wb") as f:
            f.write(data[:half])
            f.flush()
            dist.barrier()
            if self.cfg["verify_ckpt"]:
                sd = torch.load(self.path, map_location="cpu")
                lg.info("verified %s (%d keys)", self.path, len(sd["model"]))
            f.write(data[half:])
        dist.barrier()
        lg.info("saved checkpoint %s at step %d", self.path, trainer.step)


class Trainer:
    def __init__(self, cfg, callbacks):
        self.cfg = cfg
        self.callbacks = callbacks
        self.metrics = {}
        self.step = 0
        if cfg["precision"] not in ("32", "bf16-mixed"):
            raise ValueError(f"precision {cfg['precision']!r} is not supported on CPU; use '32' or 'bf16-mixed'")
        torch.manual_seed(0)
        self.module = TinyNet()
        self.model = DDP(self.module) if a.ddp else self.module
        log.info("model wrapped: %s, world size %d", type(self.model).__name__, WORLD)

    def batches(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        for s in range(n):
            x = torch.randn(16, self.cfg["features"], generator=g)
            y = x[:, :1] * 0.5 + 0.1
            if a.fault == "nan" and hit() and s == 2:
                x[3, 1] = float("inf")
                x[5, 2] = float("-inf")
            yield {"inputs": x, self.cfg["target_key"]: y}

    def sync_grads(self):
        for prm in self.module.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= WORLD

    def fit(self):
        try:
            if a.fault == "attr":
                opt = self.model.configure_optimizers()
            else:
                opt = self.module.configure_optimizers()
            accum = self.cfg["accumulate_grad_batches"]
            for s, batch in enumerate(self.batches(a.steps, 100 + RANK)):
                self.step = s
                x = batch["inputs"]
                y = batch["target"]
                if a.fault == "sigterm" and hit() and s == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                if a.fault == "segv" and hit() and s == 4:
                    os.kill(os.getpid(), signal.SIGSEGV)
                loss = F.mse_loss(self.model(x), y) / accum
                for cb in self.callbacks:
                    if hasattr(cb, "on_before_backward"):
                        cb.on_before_backward(self, s, loss)
                boundary = (s + 1) % accum == 0
                if a.ddp and not boundary:
                    with self.model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                if boundary:
                    if not a.ddp:
                        self.sync_grads()
                    opt.step()
                    opt.zero_grad()
                log.info("rank %d step %d loss %.4f", RANK, s, loss.item() * accum)
            self.validate()
        except Exception as e:
            raise TrainerError(f"fit failed at step {self.step}") from e

    def validate(self):
        n_val = 12
        per = n_val // WORLD
        start = RANK * per
        stop = start + per if not (a.fault == "valskip" and hit()) else start
        n = stop - start
        if n > 0:
            tot = torch.zeros(2)
            with torch.no_grad():
                for batch in self.batches(n, 900 + RANK):
                    tot[0] += F.mse_loss(self.module(batch["inputs"]), batch["target"]) * 16
                    tot[1] += 16
            dist.all_reduce(tot)
            self.metrics["val_loss"] = (tot[0] / tot[1]).item()
            log.info("validation: val_loss %.4f over %d samples", self.metrics["val_loss"], int(tot[1]))
        else:
            log.info("validation: no batches on this rank, skipping")
        ready = os.path.join(a.out, "val_done")
        if RANK == 0:
            open(ready, "w").write(str(self.step))
        else:
            while not os.path.exists(ready) or os.path.getmtime(ready) < START:
                time.sleep(0.5)
        for cb in self.callbacks:
            if hasattr(cb, "on_validation_end"):
                cb.on_validation_end(self)

    def test(self):
        t = torch.tensor([float(RANK)])
        dist.all_reduce(t)
        log.info("test: rank sum %.0f", t.item())

    def teardown(self):
        if a.fault == "teardown":
            log.info("final val_loss %.4f", self.metrics["val_loss"])
        else:
            log.info("final val_loss %s", self.metrics.get("val_loss"))
        if dist.is_initialized():
            dist.destroy_process_group()


START = time.time()


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    if RANK == 0:
        try:
            os.remove(os.path.join(a.out, "val_done"))
        except FileNotFoundError:
            pass
    dist.barrier()
    cfg = make_config()
    trainer = Trainer(cfg, [NanGuard(), CheckpointCallback(cfg)])
    try:
        trainer.fit()
        trainer.test()
        log.info("done")
    finally:
        trainer.teardown()


if __name__ == "__main__":
    main()
