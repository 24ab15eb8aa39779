"""A twentieth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault19.py), run
under PyTorch Lightning (`lightning` package): `Trainer(accelerator="cpu", devices=N, strategy=DDPStrategy(...))`
launched by Lightning itself (`python fault20_lightning.py --devices N ...`) or under torchrun
(`torchrun --nproc_per_node N fault20_lightning.py --devices N ...`). The 15 s process-group timeout goes
through `DDPStrategy(timeout=...)`, with gloo. Faults: `step_raise`, `callback_raise`, `stall`, `sigkill`, `skip_step`, `log_rank_only`,
`unused_param`, `ckpt_missing`, `save_missing_dir` (rank 0 only), and `devices` (a --devices that does not
match the launch)."""
import argparse, datetime, os, signal, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--devices", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
OUT = "/tmp/job/out"


def say(rank, msg):
    print(f"rank {rank} {msg}", flush=True)


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 1)  # an auxiliary head; only used when --fault is not unused_param

    def training_step(self, batch, idx):
        x, y = batch
        if self.global_rank == a.rank and idx == 3:
            if a.fault == "step_raise":
                if (x.abs() > 1.0).any():  # a data check the author added while debugging, left in
                    raise ValueError(f"batch {idx}: input out of the normalised range [-1, 1]")
            if a.fault == "stall":
                say(self.global_rank, "step 3: waiting for the shared data cache to fill")
                time.sleep(60)
            if a.fault == "skip_step":
                say(self.global_rank, "step 3: batch has padding only, skipping it")
                return None  # Lightning skips the optimizer step for this batch on this rank only
            if a.fault == "sigkill":
                say(self.global_rank, "step 3: host memory watchdog kills this process")
                os.kill(os.getpid(), signal.SIGKILL)
        h = self.body(x)
        loss = F.cross_entropy(self.head(h), y)
        if a.fault != "unused_param":
            loss = loss + 0.01 * self.aux(h).pow(2).mean()
        self.log("train_loss", loss, sync_dist=True)
        if a.fault == "log_rank_only" and self.global_rank == a.rank and idx == 3:
            say(self.global_rank, "step 3: logging a debug metric")
            self.log("debug_grad_scale", loss.detach() * 2, sync_dist=True)  # sync_dist on one rank only
        say(self.global_rank, f"step {idx} loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RankLog(L.Callback):
    """Appends each rank's loss to a per-rank file in the run folder."""

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        if a.fault == "callback_raise" and idx == 3:
            folder = f"{OUT}/metrics" if trainer.global_rank != a.rank else f"{OUT}/metrics_rank{trainer.global_rank}"
            os.makedirs(f"{OUT}/metrics", exist_ok=True)  # made for the shared folder only
            with open(f"{folder}/loss.txt", "a") as f:
                f.write(f"{idx} {outputs['loss'].item()}\n")


def main():
    torch.manual_seed(0)
    n = 16 * a.devices * (a.steps + 1)
    ds = TensorDataset(torch.randn(n, 8).clamp(-3, 3), torch.randint(0, 4, (n,)))
    dl = DataLoader(ds, batch_size=16)
    strategy = DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    trainer = L.Trainer(accelerator="cpu", devices=a.devices, strategy=strategy, max_steps=a.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[RankLog()], default_root_dir=OUT)
    ckpt = f"{OUT}/ckpts/last.ckpt" if a.fault == "ckpt_missing" else None  # resume from a run that never saved
    trainer.fit(Net(), dl, ckpt_path=ckpt)
    if a.fault == "save_missing_dir":
        trainer.save_checkpoint(f"/sys/ckpt/final.ckpt")  # a folder this user cannot create (stands in for a read-only mount)
    say(trainer.global_rank, "finished")


if __name__ == "__main__":
    main()
