"""fault642.py - serow cliff grazing: a tiny multi-rank CPU (gloo) training job with planted side-work faults.

Each rank reads its shard of cliff-ledge observations (slope, altitude, forage cover, ... -> minutes a serow
grazes on the ledge), maps the ledge code through a JSON lookup table (ledge -> forage prior), and trains a small
MLP. Metric printed each step: `graze_min` (mean predicted grazing minutes). Side work: a metrics file at step 1,
an all_gather_object of stats at step 2, an evaluation at step 3, a monitored_barrier / store check at step 4,
rank 0's export at the end. `--prepare` writes the synthetic data into /tmp/fault642_work.

Modes: plain torch.distributed (torchrun: hand-written gradient all_reduce), `--acc` (accelerate: Accelerator(cpu=True),
accelerator.prepare, accelerator.backward), `--hf` (transformers.Trainer, 1-layer tiny GPT-2-style model from a config).

Faults (`--fault NAME --rank N`):
  none          control run
  eval_zero     rank N (0) runs the evaluation on an empty eval set: ZeroDivisionError in the metric; others at barrier
  pickle_lock   rank N puts a threading.Lock into its all_gather_object stats (cannot pickle '_thread.lock')
  fsize         rank N sets RLIMIT_FSIZE to 64 bytes and writes its metrics file (SIGXFSZ)
  export_json   rank 0 json.dumps a tensor into its export summary (Object of type Tensor is not JSON serializable)
  export_all    every rank json.dumps the tensor export summary (all fail alike)
  export_dir    rank 0 torch.saves its export into a folder that does not exist
  log_handler   rank N sets up a logging.FileHandler into a missing folder (FileNotFoundError at setup)
  slow_save     rank 0 saves slowly (sleeps past the pg timeout) while the others wait at dist.barrier()
  monitored     rank N sleeps before dist.monitored_barrier(timeout=6 s): rank 0 names it
  store_get     rank N does store.get() of a key no rank set (times out)
  sigint_eval   rank N sends SIGINT to itself during its evaluation (KeyboardInterrupt)
  warn_storm    rank N's metric warns 40 times, then raises ValueError
  quiet_exit    rank N calls os._exit(0) after its evaluation; the others wait at the next collective
  keyerror      rank N looks up a ledge code not in the JSON table
  missing_shard rank N's shard file is missing

Runs (one line per kept log):
  serow_none_np3_rnone_torchrun: control; 6 steps on 3 ranks, eval and export on rank 0, exit 0.
  serow_eval_zero_np6_r0_acc: rank 0 ZeroDivisionError in the empty-set eval metric; ranks 1-5 Connection closed.
  serow_pickle_lock_np5_r4_torchrun: rank 4 TypeError cannot pickle '_thread.lock' in all_gather_object.
  serow_fsize_np8_r7_tee: rank 7 OSError [Errno 27] File too large (SIGXFSZ ignored); its tee'd traceback cut.
  serow_log_handler_np6_r5_accdebug: rank 5 FileNotFoundError from logging.FileHandler at setup; others SIGTERM.
  serow_monitored_np5_r3_tee: rank 0 'Rank 3 failed to pass monitoredBarrier in 6000 ms'; others lose rank 0.
  serow_keyerror_np3_r2_hf: Trainer, rank 2 KeyError 'ledge_goral_pass' in its DataLoader; peers closed.
  serow_warn_storm_np6_r2_acc2nodes: rank 2 40 UserWarnings then ValueError; two machine summaries.
  serow_quiet_exit_np5_r1_torchrun: rank 1 os._exit(0) after eval; peers Connection reset; summary names rank 3.
  serow_store_get_np4_r3_acc: rank 3 DistStoreError wait timeout after 12000ms; peers gloo timeouts.
  serow_sigint_eval_np4_r3_hf: Trainer, rank 3 KeyboardInterrupt in eval, exitcode -2 (SIGINT); peers closed.
  serow_export_all_np3_rall_torchrun: every rank TypeError Object of type Tensor is not JSON serializable.
  serow_slow_save_np4_r0_torchrun: ranks 1-3 gloo 'Timed out waiting 12000ms' at the last barrier; rank 0 SIGTERM.
  serow_export_dir_np3_r0_hf: Trainer finishes; rank 0 torch.save 'Parent directory ... does not exist.'
  serow_missing_shard_np7_r3_tee: rank 3 FileNotFoundError ledges_shard3_2026.pt before step 0; others SIGTERM.
  serow_sigint_eval_np5_r0_torchrun: rank 0 KeyboardInterrupt in eval, exitcode -2 (SIGINT); peers closed.
  serow_pickle_lock_np3_r1_accdebug: rank 1 TypeError cannot pickle '_thread.lock' in all_gather_object.
  serow_quiet_exit_np8_r4_acc: rank 4 os._exit(0) after eval; 7 peers reset/closed; summary names rank 2.
  serow_eval_zero_np3_r0_torchrun: rank 0 ZeroDivisionError in the empty-set eval metric; peers closed.
  serow_warn_storm_np4_r3_hf: Trainer, rank 3 40 UserWarnings then ValueError (4 != 1); peers closed.
  serow_export_json_np5_r0_accconfig: after 6 steps rank 0 TypeError Tensor is not JSON serializable.
  Dropped: first accconfig try (distributed_type MULTI_CPU config) - the process group was never
  initialised (ValueError from Accelerator() on every process), so the planted export_json never ran;
  rerun with a MULTI_GPU config. metrics_perm was not tried: the runs are root, chmod 0o444 stops nothing.
"""
import argparse
import datetime
import json
import logging
import os
import resource
import signal
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault642_work"
NFEAT = 6
NSHARDS = 8
STEPS = 6
BATCH = 8


def build_model():
    return nn.Sequential(nn.Linear(NFEAT + 1, 16), nn.Tanh(), nn.Linear(16, 1))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(os.path.join(WORK, "metrics"), exist_ok=True)
    g = torch.Generator().manual_seed(642)
    ledges = {f"ledge{i:02d}": round(0.2 + 0.07 * i, 2) for i in range(10)}
    with open(os.path.join(WORK, "cliff_ledges.json"), "w") as f:
        json.dump(ledges, f)
    for r in range(NSHARDS):
        x = torch.rand(STEPS * BATCH + 16, NFEAT, generator=g)
        ledge = [f"ledge{(r + i) % 10:02d}" for i in range(x.shape[0])]
        y = (x[:, 0] * 30 + x[:, 2] * 10 + 5).unsqueeze(1) / 10
        torch.save({"x": x, "y": y, "ledge": ledge}, os.path.join(WORK, f"ledges_shard{r}.pt"))
    torch.manual_seed(642)
    torch.save(build_model().state_dict(), os.path.join(WORK, "start.pt"))
    print("prepared", WORK)


def load_shard(rank, fault, frank):
    name = f"ledges_shard{rank}.pt"
    if fault == "missing_shard" and rank == frank:
        name = f"ledges_shard{rank}_2026.pt"
    d = torch.load(os.path.join(WORK, name))
    with open(os.path.join(WORK, "cliff_ledges.json")) as f:
        ledges = json.load(f)
    codes = list(d["ledge"])
    if fault == "keyerror" and rank == frank:
        codes[3] = "ledge_goral_pass"
    prior = torch.tensor([ledges[c] for c in codes]).unsqueeze(1)
    return torch.cat([d["x"], prior], dim=1), d["y"]


def graze_metric(pred, target, rank, fault, frank):
    """Mean absolute error in grazing minutes over an eval set (a hand-rolled 'metrics library')."""
    if fault == "warn_storm" and rank == frank:
        for i in range(40):
            warnings.warn(f"graze_metric: ledge {i} has fewer than 2 sightings, precision is ill-defined",
                          UserWarning, stacklevel=2)
        raise ValueError(f"graze_metric: y_true and y_pred have inconsistent lengths: {len(target)} != {len(target) - 3}")
    n = len(pred)
    return float((pred - target).abs().sum()) / n


def evaluate(model, x, y, rank, fault, frank):
    ex, ey = x[-16:], y[-16:]
    if fault == "eval_zero" and rank == frank:
        ex, ey = ex[:0], ey[:0]
    with torch.no_grad():
        pred = model(ex)
        if fault == "sigint_eval" and rank == frank:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
        m = graze_metric(pred, ey, rank, fault, frank)
    print(f"rank {rank} eval graze_mae {m:.3f}", flush=True)
    return m


def setup_logging(rank, fault, frank):
    folder = os.path.join(WORK, "logs")
    if fault == "log_handler" and rank == frank:
        folder = os.path.join(WORK, "logs_missing", "serow")
    os.makedirs(os.path.join(WORK, "logs"), exist_ok=True)
    log = logging.getLogger("serow")
    log.addHandler(logging.FileHandler(os.path.join(folder, f"rank{rank}.log")))
    log.setLevel(logging.INFO)
    return log


def write_metrics(rank, step, loss, fault, frank):
    if fault == "fsize" and rank == frank:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    line = json.dumps({"rank": rank, "step": step, "loss": loss, "note": "serow cliff grazing " * 8})
    with open(os.path.join(WORK, "metrics", f"metrics_rank{rank}.jsonl"), "a") as f:
        f.write(line + "\n")


def side_work(model, x, y, rank, world, step, loss, fault, frank):
    if step == 1:
        write_metrics(rank, step, loss, fault, frank)
    if step == 2:
        stats = {"rank": rank, "loss": loss}
        if fault == "pickle_lock" and rank == frank:
            stats["guard"] = threading.Lock()
        out = [None] * world
        dist.all_gather_object(out, stats)
        if rank == 0:
            print("rank 0 gathered stats", [round(s["loss"], 3) for s in out], flush=True)
    if step == 3:
        if rank == 0 or fault in ("sigint_eval", "warn_storm", "quiet_exit"):
            if rank == 0 or rank == frank:
                evaluate(model, x, y, rank, fault, frank)
        if fault == "quiet_exit" and rank == frank:
            os._exit(0)
        dist.barrier()
    if step == 4:
        if fault == "monitored" and rank == frank:
            time.sleep(10)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=6))
        if fault == "store_get" and rank == frank:
            store = dist.distributed_c10d._get_default_store()
            store.get("serow_eval_done")


def export(model, rank, fault, frank):
    if fault == "export_all" or rank == 0:
        w = model.state_dict()["2.weight"]
        if fault in ("export_json", "export_all"):
            with open(os.path.join(WORK, f"export_summary_rank{rank}.json"), "w") as f:
                json.dump({"ledges": 10, "final_weight": w}, f)
        path = os.path.join(WORK, "export_rank0.pt")
        if fault == "export_dir":
            path = os.path.join(WORK, "exports", "2026-12", "serow_export.pt")
        torch.save(model.state_dict(), path)
        if fault == "slow_save":
            time.sleep(25)
        print(f"rank {rank} saved export {path}", flush=True)


def sync_grads(model, world):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= world
    i = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(flat[i:i + n].view_as(p))
        i += n


def train(args, rank, world, backward=None, prepare_fn=None):
    fault, frank = args.fault, args.rank
    setup_logging(rank, fault, frank)
    x, y = load_shard(rank, fault, frank)
    model = build_model()
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    inner = model
    if prepare_fn is not None:
        model, opt = prepare_fn(model, opt)
    for step in range(STEPS):
        opt.zero_grad()
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        pred = model(xb)
        loss = F.mse_loss(pred, yb)
        if backward is None:
            loss.backward()
            sync_grads(model, world)
        else:
            backward(loss)
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        lv = lt.item() / world
        print(f"rank {rank} step {step} loss {lv:.4f} graze_min {pred.detach().mean().item() * 10:.2f}", flush=True)
        side_work(inner, x, y, rank, world, step, lv, fault, frank)
    export(inner, rank, fault, frank)
    dist.barrier()
    print(f"rank {rank} done", flush=True)


def main_torch(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    train(args, dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


def main_acc(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo",
                      timeout=datetime.timedelta(seconds=args.pg_timeout))])
    train(args, acc.process_index, acc.num_processes, backward=acc.backward, prepare_fn=acc.prepare)
    acc.end_training()


def main_hf(args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    fault, frank = args.fault, args.rank
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(WORK, "cliff_ledges.json")) as f:
        ledges = json.load(f)

    class Ledges(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            code = f"ledge{i % 10:02d}"
            if fault == "keyerror" and rank == frank and i >= 8:
                code = "ledge_goral_pass"
            fp = int(ledges[code] * 10)
            ids = torch.tensor([(fp + i + k) % 32 for k in range(12)])
            return {"input_ids": ids, "labels": ids.clone()}

    class LedgeTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step
            out = model(**inputs)
            loss = out.loss
            graze = out.logits.detach().softmax(-1).max(-1).values.mean().item() * 10
            print(f"rank {rank} step {step} loss {loss.item():.4f} graze_min {graze:.2f}", flush=True)
            if step == 3 and rank == frank and fault in ("warn_storm", "sigint_eval"):
                p = out.logits.detach()[:, -1, :1].float()
                evaluate(lambda t: t, p, p, rank, fault, frank)
            return (loss, out) if return_outputs else loss

    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg)
    ta = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                           ddp_timeout=int(args.pg_timeout), max_steps=STEPS, per_device_train_batch_size=4,
                           logging_steps=100, save_strategy="no", report_to=[], dataloader_num_workers=0,
                           disable_tqdm=True)
    tr = LedgeTrainer(model=model, args=ta, train_dataset=Ledges())
    tr.train()
    if tr.is_world_process_zero():
        path = os.path.join(WORK, "hf_export.pt")
        if fault == "export_dir":
            path = os.path.join(WORK, "exports", "2026-12", "serow_hf_export.pt")
        torch.save(tr.model.state_dict(), path)
        print("rank 0 saved export", path, flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--acc", action="store_true")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    a = ap.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    elif a.acc:
        main_acc(a)
    else:
        main_torch(a)
