"""fault650.py - solenodon venom foraging: a tiny venom-dose regressor on gloo/CPU (accelerate or transformers.Trainer).

`--prepare` writes synthetic data into /tmp/fault650_work: one shard per rank (foraging bouts with a prey id), a JSON
lookup table (prey -> venom factor) every batch goes through, and a start checkpoint. Default mode: Accelerator(cpu=True)
with InitProcessGroupKwargs(timeout=--pg-timeout s), accelerator.prepare + accelerator.backward; `--hf`: the same data as
a transformers.Trainer job (1-layer tiny BERT from a config, use_cpu, ddp_backend gloo, ddp_timeout 12).
`--steps` (default 40) steps; every rank logs through `logging` with timestamps, prints `rank R step S loss L venom_dose M`,
a progress line, and a stats table every 10 steps; rank 0 saves an export at the end.
`--fault NAME --rank N` plants one fault on rank N (`--rank -1`: every rank) at step --fault-step (default steps-8).

Faults:
  none          control run
  fh_stall      faulthandler.dump_traceback_later(5) armed on every rank each step; rank N sleeps 40 s at the fault step
  segv          faulthandler.enable() everywhere; rank N reads address 0 through ctypes (SIGSEGV)
  abort         faulthandler.enable() everywhere; rank N calls os.abort() (SIGABRT)
  noisy_exc     rank (N+1)%W logs a caught, handled exception with logger.exception every step; rank N then raises
                a real ZeroDivisionError at the fault step
  data_key      rank N looks up a prey id missing from the JSON table at the fault step (KeyError)
  stats_err     the stats table has eval_error / failed_batches columns on every rank; rank N raises a real ValueError
  mem_grow      rank N keeps every batch plus a 16 MiB buffer per step under an RLIMIT_AS cap -> MemoryError
  nan_late      rank N's loss goes NaN at the fault step; the script's own check raises FloatingPointError
  worker_dies   rank N's DataLoader worker warns every step, then SIGKILLs itself at the fault step
  export_fail   every rank finishes; rank 0's export writes 8 parts for a while, then torch.save to /dev/full fails
  sigkill       rank N SIGKILLs itself at the fault step (like the OOM killer)
  bad_index     rank N indexes past its shard at the fault step (IndexError); a resume file lets a torchrun restart
                (--max-restarts 1) resume at the bad batch, so the second attempt is meant to fail at once
  same_bug      (with --rank -1) every rank hits the same KeyError at the fault step
  missing_shard rank N opens a shard file that does not exist (FileNotFoundError before step 1)

Runs (one line per log):
  solenodon_fh_stall_np8_r5_torchrun: 8 faulthandler dumps, ranks 0-4,6,7 gloo 12 s timeout; exit 1
  solenodon_segv_np6_r0_acc: rank 0 Fatal Python error: Segmentation fault, exitcode -11; exit 1
  solenodon_noisy_exc_np5_r4_tee: rank 0 handled ERROR tracebacks, rank 4 ZeroDivisionError; exit 1
  solenodon_data_key_np5_r2_accdebug: 50 steps, rank 2 KeyError after step 40; exit 1
  solenodon_stats_err_np6_r3_accconfig: eval_error/failed_batches tables, rank 3 ValueError; exit 1
  solenodon_nan_late_np6_r0_acc2nodes: rank 0 FloatingPointError loss nan, two summaries; exit 1
  solenodon_sigkill_np7_r6_torchrun: rank 6 exitcode -9 (SIGKILL), peers Connection closed; exit 1
  solenodon_missing_shard_np8_r7_acc2nodes: rank 7 FileNotFoundError, 0-3 DistStoreError; exit 1
  solenodon_mem_grow_np4_r3_torchrun: rank 3 VmSize climbs to 1370 MiB, MemoryError; exit 1
  solenodon_worker_dies_np4_r1_tee: rank 1 DataLoader worker killed by signal: Killed; exit 1
  solenodon_export_fail_np3_r0_acc: all finish, rank 0 export basic_ios::clear error; exit 1
  solenodon_bad_index_np4_r2_torchrun: rank 2 IndexError; restart fails in connectFullMesh; exit 1
  solenodon_same_bug_np5_rall_accconfig: all 5 ranks KeyError 'prey_hutia9'; exit 1
  solenodon_none_np3_rnone_hf: control, Trainer 40 steps, export saved; exit 0
  solenodon_data_key_np4_r3_hf: rank 3 KeyError in the Trainer's dataset; exit 1
  solenodon_nan_late_np3_r1_hf: rank 1 FloatingPointError loss nan in compute_loss; exit 1
  solenodon_abort_np6_r2_tee: rank 2 Fatal Python error: Aborted, exitcode -6; exit 1
  solenodon_sigkill_np3_r0_hf: rank 0 exitcode -9 (SIGKILL) under the Trainer; exit 1
  solenodon_fh_stall_np4_r0_accdebug: 4 faulthandler dumps, ranks 1-3 gloo 12 s timeout; exit 1
  solenodon_stats_err_np3_r2_acc: eval_error/failed_batches tables, rank 2 ValueError; exit 1
  (test runs on ports 41599/41598 not kept)
  (no further runs)
"""
import argparse
import ctypes
import faulthandler
import json
import logging
import os
import resource
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

WORK = "/tmp/fault650_work"
log = logging.getLogger("solenodon")


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(650)
    table = {f"prey{p}": round(0.4 + 0.15 * p, 3) for p in range(8)}
    with open(os.path.join(WORK, "venom_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = torch.randn(256, 4, generator=g)
        prey = torch.randint(0, 8, (256,), generator=g)
        y = x.sum(1, keepdim=True) * 0.2
        torch.save({"x": x, "prey": prey, "y": y}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.manual_seed(650)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    torch.save(model.state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {world} shards in {WORK}")


class BoutData(torch.utils.data.Dataset):
    def __init__(self, shard, table, fault, planted, fstep, bs):
        self.x, self.prey, self.y = shard["x"], shard["prey"], shard["y"]
        self.table, self.fault, self.planted, self.fstep, self.bs = table, fault, planted, fstep, bs

    def __len__(self):
        return 10 ** 6

    def __getitem__(self, step):
        if self.fault == "worker_dies" and self.planted:
            warnings.warn(f"bout batch {step}: prey column has 3 unscored rows, imputing venom factor 0.4")
            if step == self.fstep and torch.utils.data.get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
        idx = [(step * self.bs + i) % len(self.x) for i in range(self.bs)]
        if self.fault == "bad_index" and self.planted and step == self.fstep:
            idx = [len(self.x) + 3] + idx[1:]
        keys = [f"prey{int(self.prey[i])}" for i in idx]
        if self.fault in ("data_key", "same_bug") and self.planted and step == self.fstep:
            keys[2] = "prey_hutia9"
        factor = torch.tensor([[self.table[k]] for k in keys])
        x = torch.cat([self.x[idx], factor], 1)
        return x, self.y[idx] * factor


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize"):
                return int(line.split()[1]) // 1024
    return 0


def stats_table(rank, step, loss, dose, fault):
    if fault == "stats_err":
        head = f"{'step':>5} {'loss':>9} {'venom_dose':>10} {'eval_error':>10} {'failed_batches':>14} {'retries':>7}"
        row = f"{step:>5} {loss:>9.4f} {dose:>10.4f} {abs(loss - dose) * 0.1:>10.4f} {0:>14} {0:>7}"
    else:
        head = f"{'step':>5} {'loss':>9} {'venom_dose':>10} {'bouts':>6} {'prey_seen':>9} {'lr':>8}"
        row = f"{step:>5} {loss:>9.4f} {dose:>10.4f} {step * 8:>6} {min(8, step):>9} {0.05:>8.3f}"
    log.info("stats rank %d\n  %s\n  %s", rank, head, row)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fault-step", type=int, default=None)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--hf", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare(a.world)
    fstep = a.fault_step if a.fault_step is not None else a.steps - 8
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    warnings.simplefilter("always")
    planted = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    if a.fault in ("segv", "abort"):
        faulthandler.enable()
    table = json.load(open(os.path.join(WORK, "venom_table.json")))
    shard_name = f"shard_{rank}.pt" if not (a.fault == "missing_shard" and planted) else f"shard_{rank}_cave.pt"
    shard = torch.load(os.path.join(WORK, shard_name))
    if a.hf:
        return run_hf(a, rank, world, shard, table, planted, fstep)

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=a.pg_timeout))])
    log.info("accelerator up: %s, process %d of %d, backend %s", acc.state.distributed_type, acc.process_index,
             acc.num_processes, dist.get_backend() if dist.is_initialized() else "none")
    torch.manual_seed(650)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    workers = 1 if (a.fault == "worker_dies" and planted) else 0
    ds = BoutData(shard, table, a.fault, planted, fstep, 8)
    loader = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers))
    start = 1
    resume = os.path.join(WORK, f"resume_{rank}.json")
    if a.fault == "bad_index" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and os.path.exists(resume):
        start = json.load(open(resume))["step"]
        log.info("resuming from %s at step %d", resume, start)
        loader = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0, sampler=range(start, 10 ** 6)))
    kept = []
    noisy = a.fault == "noisy_exc" and rank == (a.rank + 1) % world
    t0 = time.time()
    for step in range(start, a.steps + 1):
        if a.fault == "fh_stall":
            faulthandler.dump_traceback_later(5, repeat=False)
        x, y = next(loader)
        if a.fault == "mem_grow" and planted:
            if step == 4:
                cap = (rss_mb() + 16 * (fstep - 4)) << 20
                resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
                log.info("memory cap set: RLIMIT_AS %d MiB", cap >> 20)
            kept.append((x, y, bytearray(16 << 20)))
            log.info("bout cache: %d batches kept, VmSize %d MiB", len(kept), rss_mb())
        if a.fault == "stats_err" or a.fault == "noisy_exc":
            warnings.warn(f"step {step}: venom_dose smoothing window shorter than 5 bouts", RuntimeWarning)
        if noisy:
            try:
                json.loads("{'prey': %d" % step)
            except json.JSONDecodeError:
                log.exception("ERROR scoring bout %d: malformed tracker record, skipped (handled)", step)
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        if a.fault == "nan_late" and planted and step >= fstep:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (venom dose diverged)")
        if planted and step == fstep:
            if a.fault == "fh_stall":
                log.info("pausing to re-read the burrow map")
                time.sleep(40)
            elif a.fault == "segv":
                ctypes.string_at(0)
            elif a.fault == "abort":
                os.abort()
            elif a.fault == "noisy_exc":
                dose_per_bout = float(out.mean()) / int(len(kept))
            elif a.fault == "stats_err":
                raise ValueError(f"venom_dose calibration out of range on rank {rank}: got {float(out.mean()):.4f}, need [0, 1] for step {step}")
            elif a.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        dose = out.detach().abs().mean()
        dist.all_reduce(dose)
        dose = dose.item() / world
        if a.fault == "fh_stall":
            faulthandler.cancel_dump_traceback_later()
        if a.fault == "bad_index":
            json.dump({"step": step}, open(resume, "w"))
        log.info("step %d done", step)
        print(f"rank {rank} step {step} loss {loss.item():.4f} venom_dose {dose:.4f}", flush=True)
        n = int(20 * step / a.steps)
        print(f"[progress rank {rank}] |{'#' * n}{'.' * (20 - n)}| {step}/{a.steps} {step / (time.time() - t0):.1f} it/s", flush=True)
        if step % 10 == 0:
            stats_table(rank, step, loss.item(), dose, a.fault)
    acc.wait_for_everyone()
    if rank == 0:
        export(acc.unwrap_model(model).state_dict(), a.fault)
    log.info("rank %d finished", rank)


def export(state, fault):
    path = "/dev/full" if fault == "export_fail" else os.path.join(WORK, "export.pt")
    for part in range(1, 9):
        log.info("saving venom-model export part %d/8 ...", part)
        time.sleep(0.6 if fault == "export_fail" else 0.05)
    torch.save(state, path)
    log.info("export saved to %s", path)


def run_hf(a, rank, world, shard, table, planted, fstep):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    torch.manual_seed(650)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=1)
    model = BertForSequenceClassification(cfg)

    class HFBouts(torch.utils.data.Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            key = f"prey{int(shard['prey'][i])}"
            if a.fault == "data_key" and planted and self.calls == fstep * 4:
                key = "prey_hutia9"
            self.calls += 1
            ids = (shard["x"][i] * 8).long().clamp(-31, 31) + 32
            return {"input_ids": torch.cat([ids, torch.tensor([int(table[key] * 10)])]),
                    "labels": shard["y"][i][0] * table[key]}
        calls = 0

    class VenomTrainer(Trainer):
        n = 0

        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
            VenomTrainer.n += 1
            step = VenomTrainer.n
            if a.fault == "nan_late" and planted and step >= fstep:
                loss = loss * float("nan")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (venom dose diverged)")
            if a.fault == "sigkill" and planted and step == fstep:
                os.kill(os.getpid(), signal.SIGKILL)
            log.info("step %d done", step)
            print(f"rank {rank} step {step} loss {loss.item():.4f} venom_dose {abs(loss.item()) ** 0.5:.4f}", flush=True)
            if step % 10 == 0:
                stats_table(rank, step, loss.item(), abs(loss.item()) ** 0.5, a.fault)
            return loss

    args = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo", ddp_timeout=12,
                             max_steps=a.steps, per_device_train_batch_size=4, logging_steps=5, report_to=[],
                             save_strategy="no", dataloader_num_workers=0, learning_rate=1e-3)
    tr = VenomTrainer(model=model, args=args, train_dataset=HFBouts())
    tr.train()
    if rank == 0:
        export(model.state_dict(), a.fault)
    log.info("rank %d finished", rank)


if __name__ == "__main__":
    main()
