"""Loess plateau gully erosion: a small sediment-yield regression trained data-parallel on CPU (gloo).

Each rank reads its own shard of gully survey plots (slope, rainfall intensity, vegetation cover,
gully density, gully id), looks the gully's loess erodibility up in a table, starts from a shared
checkpoint and trains a small MLP for 6 steps.  Every step it all-gathers the per-rank sediment
MAE and prints `rank R step S loss L sediment_mae M`; rank 0 writes an export at the end.

  python fault554.py --prepare                      # synthetic data into /tmp/fault554_work
  accelerate launch --multi_gpu --num_processes W fault554.py [--fault NAME --rank N]
  torchrun --nproc-per-node W fault554.py --hf [--fault NAME --rank N]   # transformers.Trainer form

Faults (--fault NAME --rank N; one per run):
  none          control, nothing planted
  keyerror      rank N's shard names a gully id the erodibility table lacks -> KeyError
  missing_shard rank N's survey shard file is gone -> FileNotFoundError
  ckpt_size     rank N loads a checkpoint whose first layer has 5 inputs, not 6 -> size mismatch in load_state_dict
  weights_only  rank N loads a checkpoint that pickles a SurveyMeta object -> torch.load weights_only refusal
  wrong_size    rank N all-gathers a 3-element metric where peers send 2 -> size error on rank N, peers stuck
  slow          rank N recomputes a gully-network index in pure Python for minutes -> peers' collective times out
                (with --pg-timeout 300 nobody times out: the job hangs until `timeout` ends it)
  nan           rank N's rainfall intensity holds a NaN; the script's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 3
  exit4         rank N prints its own ERROR line about a survey checksum and calls sys.exit(4)
  shape_all     every rank appends a 7th feature column the model does not take -> mat1/mat2 shape error everywhere
  worker_crash  rank N's DataLoader worker is SIGKILLed while loading a batch -> DataLoader worker killed

What happened (batch 554 runs, CPU, torch 2.13.0+cpu, gloo):
  none          4 ranks (accelerate) and 8 ranks (two accelerate launchers, --num_machines 2): all steps, export, exit 0
  keyerror      KeyError: '417' on the planted rank (accelerate np5 r2; Trainer under torchrun np3 r1), peers: gloo connection closed
  missing_shard FileNotFoundError for survey_shard_N_wuding.pt before step 0 (accelerate --debug np6 r4; torchrun --tee np3 r2)
  ckpt_size     load_state_dict size mismatch for 0.weight [32, 5] vs [32, 6] on rank 3 (torchrun np4)
  weights_only  UnpicklingError: Weights only load failed, Unsupported global __main__.SurveyMeta on rank 0 (accelerate config np3)
  wrong_size    ProcessGroupGloo::allgather: invalid tensor size on the planted rank at step 3 (np5 r1; np8 r6 with --tee 3)
  slow          np4 r2: peers time out after 12000ms in gloo send/recv; np3 r1 with --pg-timeout 300: output stops, timeout 60 ends it (124)
  nan           FloatingPointError from the script's own check at step 2 (two-machine accelerate np6 r5; torchrun np3 r0)
  sigsegv       the rank dies with exitcode -11 (SIGSEGV), peers get gloo connection reset (torchrun np5 r3; Trainer np3 r2)
  exit4         the rank's own ERROR line, then exitcode 4, no traceback (accelerate np7 r4; Trainer under torchrun np4 r1)
  shape_all     every rank: mat1 and mat2 shapes cannot be multiplied (8x7 and 6x32) (torchrun --tee 3 np4)
  worker_crash  RuntimeError: DataLoader worker (pid N) is killed by signal: Killed on rank 2 (accelerate --debug np5)
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

WORK = "/tmp/fault554_work"
NFEAT = 6
STEPS = 6
BATCH = 8


def prepare():
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(554)
    table = {str(i): round(0.2 + 0.05 * (i % 13), 3) for i in range(40)}
    json.dump(table, open(f"{WORK}/erodibility.json", "w"))
    for r in range(8):
        n = STEPS * BATCH
        feats = torch.rand(n, 4, generator=g)
        gid = torch.randint(0, 40, (n,), generator=g)
        torch.save({"feats": feats, "gully_id": gid}, f"{WORK}/survey_shard_{r}.pt")
    model = make_model()
    torch.save(model.state_dict(), f"{WORK}/init.pt")
    bad = make_model(nin=NFEAT - 1)
    torch.save(bad.state_dict(), f"{WORK}/init_v0_5feat.pt")
    print("prepared", WORK)


def make_model(nin=NFEAT):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(nin, 32), nn.Tanh(), nn.Linear(32, 1))


class SurveyMeta:
    def __init__(self, basin):
        self.basin = basin


def build_dataset(rank, fault, frank):
    import torch
    path = f"{WORK}/survey_shard_{rank}.pt"
    if fault == "missing_shard" and rank == frank:
        path = f"{WORK}/survey_shard_{rank}_wuding.pt"
    shard = torch.load(path, weights_only=True)
    table = json.load(open(f"{WORK}/erodibility.json"))
    feats, gid = shard["feats"].clone(), shard["gully_id"].clone()
    if fault == "keyerror" and rank == frank:
        gid[2 * BATCH + 3] = 417
    if fault == "nan" and rank == frank:
        feats[2 * BATCH + 5, 1] = float("nan")

    class Plots(torch.utils.data.Dataset):
        def __len__(self):
            return len(feats)

        def __getitem__(self, i):
            if fault == "worker_crash" and rank == frank and i == 2 * BATCH:
                os.kill(os.getpid(), signal.SIGKILL)
            k = table[str(int(gid[i]))]
            x = torch.cat([feats[i], torch.tensor([k, float(gid[i]) / 40.0])])
            if fault == "shape_all":
                x = torch.cat([x, torch.tensor([feats[i, 0] * k])])
            y = (feats[i, 0] * feats[i, 1] * k * 3.0 + (1 - feats[i, 2])).unsqueeze(0)
            return x, y
    return Plots()


def load_start(model, rank, fault, frank):
    import torch
    path = f"{WORK}/init.pt"
    if fault == "ckpt_size" and rank == frank:
        path = f"{WORK}/init_v0_5feat.pt"
    if fault == "weights_only" and rank == frank:
        path = f"{WORK}/init_with_meta.pt"
        sd = torch.load(f"{WORK}/init.pt", weights_only=True)
        torch.save({"state": sd, "meta": SurveyMeta("wuding")}, path)
        obj = torch.load(path)
        sd = obj["state"]
    else:
        sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd)


def fault_step(step, rank, fault, frank):
    if rank != frank or step != 3:
        return
    if fault == "sigsegv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "exit4":
        print(f"ERROR rank {rank}: survey checksum mismatch in survey_shard_{rank}.pt (gully plots 16-23), refusing to continue", flush=True)
        sys.exit(4)
    if fault == "slow":
        t0 = time.time()
        acc = 0
        while time.time() - t0 < 400:   # pure-Python gully network index
            for j in range(200000):
                acc = (acc * 31 + j) % 1000003


def main_accelerate(args):
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(0)
    ds = build_dataset(rank, args.fault, args.rank)
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False,
                                     num_workers=1 if args.fault == "worker_crash" else 0)
    model = make_model()
    load_start(model, rank, args.fault, args.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(STEPS):
        x, y = next(it)
        fault_step(step, rank, args.fault, args.rank)
        if not torch.isfinite(x).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite value in survey batch (rainfall intensity column)")
        pred = model(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        mae = (pred.detach() - y).abs().mean()
        m = torch.stack([mae, loss.detach()])
        if args.fault == "wrong_size" and rank == args.rank and step == 3:
            m = torch.cat([m, torch.tensor([float(step)])])
        out = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(out, m)
        mean_mae = torch.stack(out)[:, 0].mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} sediment_mae {mean_mae:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export_sediment_mlp.pt")
        print("rank 0 exported", f"{WORK}/export_sediment_mlp.pt", flush=True)
    acc.end_training()


def main_hf(args):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, TrainerCallback
    rank = int(os.environ.get("RANK", 0))
    ds_plots = build_dataset(rank, args.fault, args.rank)

    class Tok(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds_plots)

        def __getitem__(self, i):
            x, y = ds_plots[i]
            ids = (x[:NFEAT] * 10).long().clamp(0, 63).repeat(2)
            return {"input_ids": ids, "labels": ids.clone()}

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg)

    class Faults(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            fault_step(state.global_step, rank, args.fault, args.rank)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} sediment_mae {logs.get('grad_norm', 0.0):.4f}", flush=True)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", per_device_train_batch_size=BATCH, max_steps=STEPS,
                              logging_steps=1, save_strategy="no", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], disable_tqdm=True, dataloader_num_workers=0)
    tr = Trainer(model=model, args=targs, train_dataset=Tok(), callbacks=[Faults()])
    tr.train()
    if rank == 0:
        tr.save_model(f"{WORK}/export_sediment_gpt")
        print("rank 0 exported", f"{WORK}/export_sediment_gpt", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)
