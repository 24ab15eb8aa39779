"""Batch 582 fault script: a small tephra-thickness regressor for cinder cones.

Each rank reads its own shard of synthetic cinder-cone survey samples (vent features,
vent ids), looks vent elevations up in a shared table, starts from a checkpoint, trains
6 steps under DDP (gloo, CPU only, via accelerate, or a transformers.Trainer with --hf)
and prints `rank R step S loss L scoria_mae M` each step; rank 0 saves an export.

Faults (--fault NAME --rank N):
  none            control, nothing planted
  keyerror        rank N meets vent id "CC-999" missing from the elevation table (KeyError)
  missing_shard   rank N's survey shard file does not exist (FileNotFoundError at load)
  ckpt_size       rank N loads a checkpoint built with a wider hidden layer (size mismatch)
  weights_only    rank N loads a checkpoint holding a pickled CraterMeta object (weights_only refusal)
  allgather_size  rank N sends 5 values instead of 4 into the per-step stats all_gather
  slow            rank N runs a pure-Python cone-volume integration before the loss all_reduce
                  (peers time out at --pg-timeout; with --pg-timeout 300 the job hangs)
  nan             rank N's features get an inf, the loss turns NaN, the script's own check raises
  sigsegv         rank N sends itself SIGSEGV at step 3
  error_exit      rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       every rank appends a crater-rim feature at step 2 (matmul shape bug)
  hostmem         rank N caps its address space and then asks for an 8 GB ash grid
  worker_crash    rank N's DataLoader worker SIGKILLs itself while reading a sample

What happened (20 runs, 2026-12-07, torch 2.13.0+cpu, gloo, ports 34700-34719):
  none            np4 acc and np3 hf (Trainer): all steps, export saved, exit 0.
  keyerror        np4 r2 acc, np6 r5 torchrun, np4 r3 hf: KeyError 'CC-999' on the planted rank, peers "Connection closed by peer", launcher names the planted rank; exit 1.
  missing_shard   np5 r3 accdebug: FileNotFoundError for shard_3_rim_east.pt before step 0; exit 1.
  ckpt_size       np4 r1 tee: load_state_dict size mismatch (48 vs 32) on rank 1 before step 0; exit 1.
  weights_only    np6 r4 accconfig: "Weights only load failed ... Unsupported global __main__.CraterMeta" on rank 4; exit 1.
  allgather_size  np5 r2 acc, np8 r6 acc2nodes: the next rank (3 / 7) aborts on gloo::EnforceNotMet "Received data size doesn't match" (SIGABRT) and the launcher blames it; exit 1.
  slow            np4 r3 torchrun: ranks 0-2 gloo "Timed out waiting 12000ms", launcher blames rank 0, exit 1; np6 r1 acc with --pg-timeout 300: output stops after step 2, timeout 60 ends it, exit 124.
  nan             np7 r4 accconfig: FloatingPointError "tephra loss is nan" on rank 4; exit 1.
  sigsegv         np5 r1 tee, np8 r7 acc: exitcode -11 (SIGSEGV) on the planted rank, no traceback; exit 1.
  error_exit      np3 r1 accdebug, np3 r2 hfacc: the planted rank's own ERROR line, exitcode 4; exit 1.
  shape_all       np6 acc2nodes: every rank "mat1 and mat2 shapes cannot be multiplied (4x10 and 9x32)" at step 2; exit 1.
  hostmem         np4 r0 acc: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000000 bytes" on rank 0; exit 1.
  worker_crash    np5 r4 torchrun: "DataLoader worker (pid N) is killed by signal: Killed." on rank 4; exit 1.
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault582_work"
FEAT, HID = 8, 32


class CraterMeta:  # pickled into the weights_only checkpoint
    def __init__(self, name):
        self.name = name


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(582)
    table = {f"CC-{i:02d}": float(1200 + 37 * i) for i in range(24)}
    json.dump(table, open(f"{WORK}/vent_elevation.json", "w"))
    for r in range(world):
        x = torch.randn(64, FEAT, generator=g)
        vents = [f"CC-{(r * 5 + i) % 24:02d}" for i in range(64)]
        y = x.sum(1, keepdim=True) * 0.1
        torch.save({"x": x, "y": y, "vents": vents}, f"{WORK}/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(Model(HID).state_dict(), f"{WORK}/start.pt")
    torch.save(Model(48).state_dict(), f"{WORK}/start_wide.pt")
    torch.save({"model": Model(HID).state_dict(), "meta": CraterMeta("Paricutin")}, f"{WORK}/start_meta.pt")
    print("prepared", world, "shards in", WORK)


class Model(nn.Module):
    def __init__(self, hid=HID):
        super().__init__()
        self.l1 = nn.Linear(FEAT + 1, hid)
        self.l2 = nn.Linear(hid, 1)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class Samples(torch.utils.data.Dataset):
    def __init__(self, shard, crash):
        self.x, self.y, self.vents, self.crash = shard["x"], shard["y"], shard["vents"], crash

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.crash and i >= 12:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i], i


def cone_volume(n):  # pure-Python work, holds the rank
    acc = 0.0
    for k in range(n):
        acc += (k % 97) * 1e-9
    return acc


def main_acc(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    me = a.rank == rank
    print(f"rank {rank}/{world} cinder-cone tephra run on {acc.device}, fault={a.fault}", flush=True)
    table = json.load(open(f"{WORK}/vent_elevation.json"))
    shard_path = f"{WORK}/shard_{rank}.pt"
    if a.fault == "missing_shard" and me:
        shard_path = f"{WORK}/shard_{rank}_rim_east.pt"
    shard = torch.load(shard_path)
    model = Model(HID)
    ck = f"{WORK}/start.pt"
    if a.fault == "ckpt_size" and me:
        ck = f"{WORK}/start_wide.pt"
    if a.fault == "weights_only" and me:
        state = torch.load(f"{WORK}/start_meta.pt")["model"]
    else:
        state = torch.load(ck)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = Samples(shard, a.fault == "worker_crash" and me)
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1 if (a.fault == "worker_crash" and me) else 0)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(6):
        x, y, idx = next(it)
        vents = [shard["vents"][int(i)] for i in idx]
        if a.fault == "keyerror" and me and step == 2:
            vents[1] = "CC-999"
        elev = torch.tensor([[table[v] / 1000.0] for v in vents])
        if a.fault == "error_exit" and me and step == 2:
            print(f"ERROR: [rank {rank}] rim survey for vent {vents[0]} has 0 valid tephra samples; refusing to train", flush=True)
            sys.exit(4)
        if a.fault == "nan" and me and step == 3:
            x = x.clone(); x[0, 0] = float("inf")
        if a.fault == "sigsegv" and me and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "hostmem" and me and step == 2:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (6 * 1024**3, 6 * 1024**3))
            grid = torch.zeros(2_000_000_000, dtype=torch.float32)  # 8 GB ash grid
        inp = torch.cat([x, elev], 1)
        if a.fault == "shape_all" and step == 2:
            inp = torch.cat([inp, torch.ones(len(x), 1)], 1)  # crater-rim flag
        pred = model(inp)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: tephra loss is {loss.item()} (non-finite)")
        acc.backward(loss)
        opt.step(); opt.zero_grad()
        stats = torch.tensor([loss.item(), float(len(x)), pred.mean().item(), pred.std().item()])
        if a.fault == "allgather_size" and me and step == 3:
            stats = torch.cat([stats, torch.tensor([1.0])])
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        if a.fault == "slow" and me and step == 3:
            cone_volume(400_000_000 if a.pg_timeout < 100 else 10**11)
        l = loss.detach().clone()
        dist.all_reduce(l)
        mae = (pred - y).abs().mean().item()
        print(f"rank {rank} step {step} loss {l.item() / world:.4f} scoria_mae {mae:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export_tephra.pt")
        print("rank 0 saved export", f"{WORK}/export_tephra.pt", flush=True)
    acc.end_training() if hasattr(acc, "end_training") else None
    dist.destroy_process_group() if dist.is_initialized() else None


def main_hf(a):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, TrainerCallback
    rank = int(os.environ.get("RANK", 0))
    me = a.rank == rank
    table = json.load(open(f"{WORK}/vent_elevation.json"))

    class Seqs(torch.utils.data.Dataset):
        def __init__(self):
            self.n = 0
        def __len__(self):
            return 256
        def __getitem__(self, i):
            self.n += 1
            vent = f"CC-{i % 24:02d}"
            if a.fault == "keyerror" and me and self.n > 10:
                vent = "CC-999"
            if a.fault == "error_exit" and me and self.n > 10:
                print(f"ERROR: [rank {rank}] rim survey for vent {vent} has 0 valid tephra samples; refusing to train", flush=True)
                sys.exit(4)
            h = int(table[vent])
            ids = torch.tensor([(h + 7 * k) % 64 for k in range(16)])
            return {"input_ids": ids, "labels": ids}

    class Print(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} scoria_mae {abs(logs['loss']) ** 0.5:.4f}", flush=True)

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    tr = Trainer(model=model, args=args, train_dataset=Seqs(), callbacks=[Print()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export_hf")
        print("rank 0 saved export", f"{WORK}/export_hf", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--hf", action="store_true")
    a, _ = p.parse_known_args()
    if a.prepare:
        prepare(a.world)
    elif a.hf:
        main_hf(a)
    else:
        main_acc(a)
