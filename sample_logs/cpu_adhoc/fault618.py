"""fault618.py - saiga steppe migration: a tiny distributed job that predicts herd displacement (km/day).

--prepare writes /tmp/fault618_work: per-rank shards (shard_R.pt), a JSON lookup table (region -> pasture index),
and a start checkpoint (start.pt). Training: gloo on CPU, 6 steps, each rank prints
"rank R step S loss L herd_km M" (herd_km = all-reduced mean predicted migration distance). Rank 0 saves an export.
Modes: default = plain accelerate (Accelerator(cpu=True), InitProcessGroupKwargs timeout), --hf = transformers.Trainer.

Faults (--fault NAME --rank N):
  none          control run
  valueerror    rank N raises ValueError at step 3 (negative herd count)
  jsondecode    rank N reads a corrupted copy of the lookup table (json.JSONDecodeError at start)
  worker        rank N's DataLoader (num_workers=1) raises IndexError inside the worker
  ckpt_trunc    rank N loads a truncated start checkpoint (torch.load fails)
  ckpt_keys     rank N loads a start checkpoint with a renamed key (load_state_dict missing/unexpected keys)
  save_nodir    rank 0 saves the export into a directory that does not exist
  exit0         rank N calls os._exit(0) at step 3, quietly
  exit3         rank N calls os._exit(3) at step 3, printing nothing
  sigkill       rank N sends itself SIGKILL at step 3
  sigabrt       rank N sends itself SIGABRT at step 3
  clipnan       rank N's loss becomes inf at step 3; clip_grad_norm_(error_if_nonfinite=True) raises
  unused        meant as DDP unused parameters; BROKEN: model.spare on nn.Sequential joins the forward (shape error)
  stall         rank N sleeps 400 s at step 3 (others time out, or hang with --pg-timeout 300)
  shape_all     every rank builds the input with the wrong feature count (shape error on all ranks)
  zerodiv       rank N divides by an empty herd count (ZeroDivisionError) at step 2
  port          (launcher-level) the master port is held by another socket before launch

Runs (one line per log):
  saiga_valueerror_np8_r5_acc: rank 5 ValueError at step 3, others SIGTERMed; exit 1
  saiga_sigkill_np8_r7_torchrun: rank 7 SIGKILL (-9) at step 3, gloo connection reset on peers; exit 1
  saiga_none_np6_rnone_torchrun: control, 6 steps on 6 ranks, export saved; exit 0
  saiga_jsondecode_np6_r0_tee: rank 0 JSONDecodeError on the lookup table at start-up; exit 1
  saiga_save_nodir_np6_r0_acc: training done, rank 0 torch.save into missing dir fails; exit 1
  saiga_exit3_np5_r3_acc: rank 3 os._exit(3) silently, gloo connection errors on peers; exit 1
  saiga_clipnan_np5_r0_tee: inf loss on rank 0 spreads through DDP, all ranks clip_grad_norm_ non-finite; exit 1
  saiga_sigabrt_np4_r1_hf: HF Trainer, rank 1 SIGABRT (-6) after step 3; exit 1
  saiga_worker_np4_r3_accdebug: rank 3 'Caught IndexError in DataLoader worker process 0'; exit 1
  saiga_zerodiv_np3_r2_hf: HF Trainer (accelerate launch), rank 2 ZeroDivisionError at step 2; exit 1
  saiga_exit3_np4_r2_acc2nodes: two machines, rank 2 os._exit(3), two agent summaries; exit 1
  saiga_stall_np5_r2_torchrun: rank 2 sleeps, peers gloo 12000ms timeouts, agent names rank 4; exit 1
  saiga_port_np4_rnone_torchrun: master port held, torchrun TCPStore EADDRINUSE, no worker; exit 1
  saiga_valueerror_np3_r0_hf: HF Trainer, rank 0 ValueError after step 3; exit 1
  saiga_stall_np3_r1_torchrun: rank 1 sleeps, --pg-timeout 300, hangs until timeout 60; exit 124
  saiga_ckpt_trunc_np5_r2_accconfig: rank 2 torch.load of truncated ckpt (central directory); exit 1
  saiga_exit0_np5_r4_torchrun: rank 4 os._exit(0) quietly, peers gloo reset, agent names rank 3; exit 1
  saiga_shape_all_np5_rall_torchrun: all ranks mat1/mat2 shape RuntimeError at step 1; exit 1
  saiga_ckpt_keys_np3_r2_torchrun: rank 2 load_state_dict missing/unexpected keys; exit 1
  saiga_sigkill_np7_r0_acc: rank 0 SIGKILL (-9) at step 3; exit 1
  (dropped: unused - model.spare on nn.Sequential went into forward, shape error on all ranks)
  (dropped: first valueerror try and first accconfig try, see readme_618.md)
"""
import argparse, datetime, json, os, signal, sys, time
import torch
import torch.nn as nn

WORK = "/tmp/fault618_work"
FEAT = 8


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(618)
    for r in range(world):
        x = torch.randn(48, FEAT, generator=g)
        region = torch.randint(0, 5, (48,), generator=g)
        torch.save({"x": x, "region": region}, f"{WORK}/shard_{r}.pt")
    table = {str(i): 0.2 * i for i in range(5)}
    with open(f"{WORK}/pasture.json", "w") as f:
        json.dump(table, f)
    with open(f"{WORK}/pasture_bad.json", "w") as f:
        f.write('{"0": 0.0, "1": 0.2, "2": ')
    m = build_model()
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    with open(f"{WORK}/start.pt", "rb") as f:
        data = f.read()
    with open(f"{WORK}/start_trunc.pt", "wb") as f:
        f.write(data[: len(data) // 2])
    sd = m.state_dict()
    sd["migration_head.weight"] = sd.pop("0.weight")
    torch.save(sd, f"{WORK}/start_keys.pt")
    print("prepared", WORK, flush=True)


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEAT, 16), nn.Tanh(), nn.Linear(16, 1))


class Herd(torch.utils.data.Dataset):
    def __init__(self, rank, table, bad=False, shape_bad=False):
        d = torch.load(f"{WORK}/shard_{rank}.pt")
        self.x, self.region, self.table, self.bad, self.shape_bad = d["x"], d["region"], table, bad, shape_bad

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.bad and i >= 8:
            i = [0, 1, 2][i]  # IndexError inside the worker
        x = self.x[i] if not self.shape_bad else torch.cat([self.x[i], self.x[i][:2]])
        y = self.table[str(int(self.region[i]))] + 0.1 * x[:FEAT].sum()
        return x, torch.tensor([y], dtype=torch.float32)


def step_fault(a, rank, step):
    if a.fault_rank_hit and step == 3:
        f = a.fault
        if f == "valueerror":
            raise ValueError(f"rank {rank}: negative herd count -37 in steppe region 2")
        if f == "exit0":
            os._exit(0)
        if f == "exit3":
            os._exit(3)
        if f == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f == "sigabrt":
            os.kill(os.getpid(), signal.SIGABRT)
        if f == "stall":
            time.sleep(400)
    if a.fault_rank_hit and step == 2 and a.fault == "zerodiv":
        herd = []
        print(f"rank {rank} mean herd size {sum(herd) / len(herd)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--hf", action="store_true")
    p.add_argument("--export-dir", default=WORK)
    a = p.parse_args()
    if a.prepare:
        prepare(a.prepare)
        return
    rank = int(os.environ.get("RANK", "0"))
    a.fault_rank_hit = a.rank == -1 or a.rank == rank
    table_path = f"{WORK}/pasture_bad.json" if (a.fault == "jsondecode" and a.fault_rank_hit) else f"{WORK}/pasture.json"
    with open(table_path) as f:
        table = json.load(f)
    ds = Herd(rank, table, bad=(a.fault == "worker" and a.fault_rank_hit), shape_bad=(a.fault == "shape_all"))
    if a.hf:
        return run_hf(a, rank, ds)
    from accelerate import Accelerator, InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))])
    model = build_model()
    ck = f"{WORK}/start.pt"
    if a.fault_rank_hit and a.fault == "ckpt_trunc":
        ck = f"{WORK}/start_trunc.pt"
    if a.fault_rank_hit and a.fault == "ckpt_keys":
        ck = f"{WORK}/start_keys.pt"
    model.load_state_dict(torch.load(ck, weights_only=True))
    if a.fault == "unused" and a.fault_rank_hit:
        model.spare = nn.Linear(16, 16)  # not in Sequential's forward
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=1 if a.fault == "worker" else 0)
    model, opt = acc.prepare(model, opt)  # shards are per rank already
    step = 0
    for x, y in dl:
        step += 1
        if step > 6:
            break
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        if a.fault == "clipnan" and a.fault_rank_hit and step == 3:
            loss = loss * float("inf")
        acc.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        opt.zero_grad()
        step_fault(a, rank, step)
        km = out.detach().mean().reshape(1) * 10
        torch.distributed.all_reduce(km)
        km = km.item() / acc.num_processes
        print(f"rank {rank} step {step} loss {loss.item():.4f} herd_km {km:.3f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{a.export_dir}/saiga_export.pt")
        print("rank 0 saved export", f"{a.export_dir}/saiga_export.pt", flush=True)
    acc.end_training() if hasattr(acc, "end_training") else None


def run_hf(a, rank, ds):
    from transformers import Trainer, TrainingArguments, TrainerCallback, BertConfig, BertForSequenceClassification

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            x, y = ds[i]
            ids = (x.abs() * 10).long().clamp(0, 31)
            return {"input_ids": ids, "labels": y}

    class Cb(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            step_fault(a, rank, state.global_step)
            print(f"rank {rank} step {state.global_step} loss {float(state.log_history[-1]['loss']) if state.log_history else float('nan'):.4f} herd_km {state.global_step * 1.7:.3f}", flush=True)

    cfg = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=1, max_position_embeddings=16)
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=a.export_dir + "/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                              max_steps=6, per_device_train_batch_size=8, logging_steps=1, save_strategy="no", report_to=[],
                              disable_tqdm=True, dataloader_num_workers=1 if a.fault == "worker" else 0)
    tr = Trainer(model=model, args=targs, train_dataset=DS(), callbacks=[Cb()])
    tr.train()
    if rank == 0:
        tr.save_model(a.export_dir + "/saiga_hf_export")
        print("rank 0 saved export", flush=True)


if __name__ == "__main__":
    main()
