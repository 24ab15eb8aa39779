"""fault638.py - tuatara burrow sharing: a tiny multi-rank CPU (gloo) training job with planted faults.

Each rank reads its shard of burrow surveys (features of a burrow: depth, width, temperature, ... -> how many
tuatara share it), maps the burrow-site code through a JSON lookup table (site -> occupancy prior), and trains a
small MLP to predict burrow sharing. Metric printed each step: `share_rate` (mean predicted sharers per burrow).
Rank 0 saves an export at the end.  `--prepare` writes the synthetic data into /tmp/fault638_work.

Modes: plain torch.distributed (torchrun: hand-written gradient all_reduce), `--acc` (accelerate, DDP through
accelerator.prepare), `--hf` (transformers.Trainer, 1-layer tiny GPT-2-style model built from a config).

Faults (`--fault NAME --rank N`):
  none            control run
  inplace         rank N modifies an activation autograd needs in place (sigmoid output *= 2 via mul_)
  backward_twice  rank N calls loss.backward() twice through the same graph
  no_grad         rank N computes its loss from a .detach()ed prediction (loss does not require grad)
  dtype           rank N feeds float64 features into the float32 model (matmul dtype mismatch)
  shape           rank N's target has the wrong shape ([7] vs [8, 1]: mse_loss only warns and broadcasts)
  param_group     rank N adds the model's parameters to the optimizer a second time
  anomaly         rank N runs with anomaly detection on and takes sqrt of a negative (NaN in backward)
  clip            rank N's gradients turn inf; clip_grad_norm_(error_if_nonfinite=True) raises
  extra_micro     rank N runs one more accumulation micro-batch than the others (its all_reduce count differs)
  view_all        every rank reshapes its batch with a wrong view (same loop bug everywhere)
  sigkill         rank N kills itself with SIGKILL mid-step
  segv            rank N dereferences NULL (ctypes.string_at(0)) mid-step
  keyerror        rank N looks up a burrow site that is not in the JSON table
  missing_shard   rank N's shard file is missing
  ckpt_size       rank N loads a start checkpoint whose layer sizes differ from the model

Runs (one line per kept log):
  tuatara_none_np3_rnone_torchrun: control; 6 steps on all 3 ranks, export saved, exit 0.
  tuatara_inplace_np6_r5_acc: rank 5 in-place modification RuntimeError in backward; peers gloo Connection closed.
  tuatara_segv_np8_r7_torchrun: rank 7 SIGSEGV (exitcode -11, no traceback); ranks 6, 0 gloo Connection reset.
  tuatara_no_grad_np8_r3_tee: rank 3 'element 0 of tensors does not require grad'; ranks 4, 2 Connection closed.
  tuatara_clip_np7_r6_tee: rank 6 clip_grad_norm_ non-finite total norm RuntimeError; rank 5 Connection closed.
  tuatara_sigkill_np6_r2_acc2nodes: rank 2 SIGKILL (-9) on machine 0; machine 1 names its rank 3 (exit 1).
  tuatara_backward_twice_np5_r0_torchrun: rank 0 'backward through the graph a second time'; peers closed.
  tuatara_shape_np5_r2_accconfig: rank 2 [7] vs [8, 1]: only a broadcasting UserWarning; run finishes, exit 0.
  tuatara_keyerror_np3_r1_hf: Trainer, rank 1 KeyError 'site_kawhia' in its dataset before step 0; peers closed.
  tuatara_dtype_np4_r3_accdebug: rank 3 'mat1 and mat2 must have the same dtype (Double and Float)'; peers closed.
  tuatara_param_group_np6_r0_torchrun: rank 0 ValueError parameters in more than one parameter group.
  tuatara_anomaly_np5_r4_acc: rank 4 anomaly warning + 'MseLossBackward0 returned nan values'; peers closed.
  tuatara_extra_micro_np4_r1_torchrun: gloo EnforceNotMet size mismatch (92 vs 4) aborts rank 0 (SIGABRT).
  tuatara_no_grad_np4_r2_hf: Trainer, rank 2 detached loss -> 'does not require grad' at step 2; peers closed.
  tuatara_view_all_np5_rall_accconfig: all 5 ranks 'mat1 and mat2 shapes cannot be multiplied (9x8 and 9x16)'.
  tuatara_sigkill_np5_r4_hf: Trainer, rank 4 SIGKILL (-9) at step 2; ranks 0, 3 gloo Connection reset.
  tuatara_missing_shard_np4_r0_accdebug: rank 0 FileNotFoundError burrows_shard0_v2.pt; others SIGTERMed.
  tuatara_ckpt_size_np5_r3_tee: rank 3 load_state_dict size mismatch (24 vs 16 wide) before any step.
  tuatara_extra_micro_np6_r5_acc: gloo EnforceNotMet size mismatch (60 vs 48) aborts rank 5 (SIGABRT).
  tuatara_clip_np4_r0_acc2nodes: rank 0 clip_grad_norm_ non-finite RuntimeError; two machine summaries.
  tuatara_backward_twice_np7_r3_acc: rank 3 second accelerator.backward -> graph freed RuntimeError; peers closed.
  tuatara_segv_np3_r1_hf: Trainer, rank 1 SIGSEGV (-11) at step 2; ranks 2, 0 gloo Connection reset.
"""
import argparse
import ctypes
import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault638_work"
NFEAT = 8
NSHARDS = 8
STEPS = 6
BATCH = 16


def build_model(hidden=16):
    return nn.Sequential(nn.Linear(NFEAT + 1, hidden), nn.Sigmoid(), nn.Linear(hidden, 1))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(638)
    sites = {f"site{i:02d}": round(0.1 * i, 2) for i in range(10)}
    with open(os.path.join(WORK, "burrow_sites.json"), "w") as f:
        json.dump(sites, f)
    for r in range(NSHARDS):
        x = torch.rand(STEPS * BATCH * 3, NFEAT, generator=g)
        site = [f"site{(r + i) % 10:02d}" for i in range(x.shape[0])]
        y = (x[:, 0] * 2 + x[:, 1] + 0.5).unsqueeze(1)
        torch.save({"x": x, "y": y, "site": site}, os.path.join(WORK, f"burrows_shard{r}.pt"))
    torch.manual_seed(638)
    torch.save(build_model().state_dict(), os.path.join(WORK, "start.pt"))
    torch.save(build_model(hidden=24).state_dict(), os.path.join(WORK, "start_wide.pt"))
    print("prepared", WORK)


def load_shard(rank, fault, frank):
    name = f"burrows_shard{rank}.pt"
    if fault == "missing_shard" and rank == frank:
        name = f"burrows_shard{rank}_v2.pt"
    d = torch.load(os.path.join(WORK, name))
    with open(os.path.join(WORK, "burrow_sites.json")) as f:
        sites = json.load(f)
    codes = list(d["site"])
    if fault == "keyerror" and rank == frank:
        codes[5] = "site_kawhia"
    prior = torch.tensor([sites[c] for c in codes]).unsqueeze(1)
    return torch.cat([d["x"], prior], dim=1), d["y"]


def loss_of(model, xb, yb, rank, step, fault, frank):
    mine = rank == frank or fault == "view_all"
    if mine and step == 2:
        if fault == "dtype":
            xb = xb.double()
        if fault == "view_all":
            xb = xb.view(-1, NFEAT)
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "segv":
            ctypes.string_at(0)
    if mine and step == 2 and fault == "inplace":
        h = model[1](model[0](xb))
        h.mul_(2.0)
        pred = model[2](h)
    elif mine and step == 2 and fault == "anomaly":
        pred = model(xb)
        pred = torch.sqrt(pred - 100.0)
    else:
        pred = model(xb)
    if mine and step == 2 and fault == "no_grad":
        pred = pred.detach()
    target = yb
    if mine and step == 2 and fault == "shape":
        target = yb[:-1].squeeze(1)
    return pred, F.mse_loss(pred, target)


def sync_grads(model, world):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= world
    i = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(flat[i:i + n].view_as(p))
        i += n


def main_torch(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    fault, frank = args.fault, args.rank
    if fault == "anomaly" and rank == frank:
        torch.autograd.set_detect_anomaly(True)
    x, y = load_shard(rank, fault, frank)
    model = build_model(24 if (fault == "ckpt_size" and rank == frank) else 16)
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        if fault == "param_group" and rank == frank and step == 2:
            opt.add_param_group({"params": list(model.parameters()), "lr": 0.01})
        opt.zero_grad()
        micro = 2 + (1 if (fault == "extra_micro" and rank == frank and step == 2) else 0)
        for m in range(micro):
            sl = slice((step * 3 + m) * BATCH // 2, (step * 3 + m + 1) * BATCH // 2)
            pred, loss = loss_of(model, x[sl], y[sl], rank, step, fault, frank)
            loss.backward()
            if fault == "backward_twice" and rank == frank and step == 2:
                loss.backward()
            sync_grads(model, world)
        if fault == "clip" and rank == frank and step == 2:
            for p in model.parameters():
                p.grad.fill_(float("inf"))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        share = pred.detach().mean().item()
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f} share_rate {share:.3f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export_rank0.pt"))
        print("rank 0 saved export", os.path.join(WORK, "export_rank0.pt"), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main_acc(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo",
                      timeout=datetime.timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    fault, frank = args.fault, args.rank
    if fault == "anomaly" and rank == frank:
        torch.autograd.set_detect_anomaly(True)
    x, y = load_shard(rank, fault, frank)
    model = build_model(24 if (fault == "ckpt_size" and rank == frank) else 16)
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    inner = acc.unwrap_model(model)
    for step in range(STEPS):
        if fault == "param_group" and rank == frank and step == 2:
            opt.add_param_group({"params": list(inner.parameters()), "lr": 0.01})
        opt.zero_grad()
        micro = 2 + (1 if (fault == "extra_micro" and rank == frank and step == 2) else 0)
        for m in range(micro):
            sl = slice((step * 3 + m) * BATCH // 2, (step * 3 + m + 1) * BATCH // 2)
            fwd = model if m == micro - 1 else inner
            pred, loss = loss_of(inner if fwd is inner else _Wrap(model), x[sl], y[sl], rank, step, fault, frank)
            acc.backward(loss)
            if fault == "backward_twice" and rank == frank and step == 2:
                acc.backward(loss)
            if m < micro - 1:
                for p in inner.parameters():
                    t = p.grad.clone()
                    dist.all_reduce(t)
        if fault == "clip" and rank == frank and step == 2:
            for p in inner.parameters():
                p.grad.fill_(float("inf"))
        torch.nn.utils.clip_grad_norm_(inner.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        lt = acc.reduce(loss.detach().clone(), reduction="mean")
        print(f"rank {rank} step {step} loss {lt.item():.4f} share_rate {pred.detach().mean().item():.3f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(inner.state_dict(), os.path.join(WORK, "export_rank0.pt"))
        print("rank 0 saved export", os.path.join(WORK, "export_rank0.pt"), flush=True)
    acc.end_training()


class _Wrap:
    """Indexable view of a DDP-wrapped Sequential whose __call__ goes through DDP."""
    def __init__(self, ddp):
        self.ddp = ddp

    def __getitem__(self, i):
        return self.ddp.module[i]

    def __call__(self, xb):
        return self.ddp(xb)


def main_hf(args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    fault, frank = args.fault, args.rank
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(WORK, "burrow_sites.json")) as f:
        sites = json.load(f)

    class Burrows(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            code = f"site{i % 10:02d}"
            if fault == "keyerror" and rank == frank and i >= 8:
                code = "site_kawhia"
            occ = int(sites[code] * 10)
            ids = torch.tensor([(occ + i + k) % 32 for k in range(12)])
            return {"input_ids": ids, "labels": ids.clone()}

    class BurrowTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step
            if rank == frank and step == 2:
                if fault == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault == "segv":
                    ctypes.string_at(0)
            out = model(**inputs)
            loss = out.loss
            if rank == frank and step == 2 and fault == "no_grad":
                loss = loss.detach()
            share = out.logits.detach().softmax(-1).max(-1).values.mean().item()
            print(f"rank {rank} step {step} loss {loss.item():.4f} share_rate {share:.3f}", flush=True)
            return (loss, out) if return_outputs else loss

    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg)
    ta = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                           ddp_timeout=args.pg_timeout, max_steps=STEPS, per_device_train_batch_size=4,
                           logging_steps=100, save_strategy="no", report_to=[], dataloader_num_workers=0,
                           disable_tqdm=True)
    tr = BurrowTrainer(model=model, args=ta, train_dataset=Burrows())
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(os.path.join(WORK, "hf_export"))
        print("rank 0 saved export", os.path.join(WORK, "hf_export"), flush=True)


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
