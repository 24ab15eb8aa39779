"""fault606.py - pipit song flights: a tiny multi-rank CPU training job with planted faults.

Each rank trains a small MLP that predicts the height a meadow pipit reaches in its song flight
from synthetic song features (per-rank shards). Song types go through a JSON lookup table, the model
starts from a start checkpoint, and rank 0 saves an export at the end. Data comes from
`--prepare` (written into /tmp/fault606_work). Every step every rank prints
`rank R step S loss L trill_rate M` (trill_rate: mean predicted trills per second, all-reduced).

Modes: plain torch.distributed (torchrun, gloo, DDP), `--acc` (accelerate Accelerator(cpu=True), gloo,
InitProcessGroupKwargs timeout), `--hf` (transformers.Trainer, a 1-layer tiny BERT from a config,
use_cpu, ddp_backend gloo, ddp_timeout). Process-group timeout 12 s (`--pg-timeout`), 6 steps.

Faults (`--fault NAME --rank N`):
  none              control run
  value_error       rank N finds a song-flight height out of range and raises ValueError (step 3)
  loader_worker     rank N's DataLoader worker (num_workers=1) raises IndexError on a sample
  ckpt_truncated    rank N loads a truncated copy of the start checkpoint (torch.load fails)
  save_missing_dir  rank 0 saves its export into a directory that does not exist
  stall             rank N sleeps 40 s (600 s when --pg-timeout >= 40) before the step-3 all_reduce
  exit_quiet        rank N calls os._exit(0) at step 3, printing nothing
  exit3             rank N calls os._exit(3) at step 3, printing nothing
  sigkill           rank N sends itself SIGKILL at step 3
  sigabrt           rank N sends itself SIGABRT at step 3
  json_decode       rank N reads a corrupt copy of the lookup table (json.JSONDecodeError)
  anomaly_nan       rank N's loss becomes NaN at step 3 under set_detect_anomaly(True)
  ddp_unused        every rank's model has an unused layer, DDP without find_unused_parameters
  shape_all         every rank builds its head with the wrong input width (same bug on all ranks)
  port_in_use       (launcher) the master port is held by another socket before launch
  zero_div          rank N divides by a zero flight count at step 3 (ZeroDivisionError)

What happened in each run (one line per log) is appended below after the runs:
  pipit_none_np3_rnone_torchrun: Control run: all 3 ranks print 6 steps and rank 0 saves the export; exit 0. (exit 0)
  pipit_value_error_np5_r2_acc: Rank 2 raises ValueError at step 3; the others see gloo connection closed and the agent names rank 2. (accelerate 1.16 refuses --multi_gpu with --cpu and --cpu alone takes the MPI path, so the script's Accelerator(cpu=True) gives the CPU/gloo run.) (exit 1)
  pipit_loader_worker_np4_r3_tee: Rank 3's DataLoader worker raises IndexError (Caught IndexError in DataLoader worker process 0) at step 3; other ranks see connection closed. (exit 1)
  pipit_ckpt_truncated_np6_r5_accdebug: Rank 5 torch.loads a truncated start checkpoint: PytorchStreamReader failed finding central directory, before any step; the rest are SIGTERMed. (exit 1)
  pipit_save_missing_dir_np5_r0_accconfig: All 6 steps done, then rank 0's torch.save into a missing directory raises RuntimeError 'Parent directory ... does not exist'; the others fail in the final barrier. (exit 1)
  pipit_stall_np5_r2_torchrun: Rank 2 sleeps 40 s before the step-3 all_reduce; ranks 0,1,3,4 fail with gloo 'Timed out waiting 12000ms', rank 2 is SIGTERMed. (exit 1)
  pipit_exit_quiet_np6_r4_acc: Rank 4 calls os._exit(0) at step 3 silently; the others fail with gloo connection reset/closed and the agent blames rank 3 (rank 4's exit 0 is not a failure to it). (exit 1)
  pipit_exit3_np8_r7_torchrun: Rank 7 calls os._exit(3) at step 3 with no message; ranks 0 and 6 see connection reset and the agent names rank 7 with exitcode 3. (exit 1)
  pipit_sigkill_np6_r3_acc2nodes: Two accelerate launches as two 3-process machines; rank 3 (machine 1) SIGKILLs itself at step 3. Machine 1's agent names rank 3 (-9 SIGKILL), machine 0's agent blames rank 2 (connection reset); both launchers exit 1. (exit 1)
  pipit_json_decode_np3_r1_hf: --hf mode under torchrun: rank 1 reads a truncated lookup JSON and raises json.JSONDecodeError before the Trainer is built; the agent names rank 1. (exit 1)
  pipit_sigabrt_np5_r4_hf: --hf mode under accelerate launch: rank 4 sends itself SIGABRT at step 3 inside compute_loss; others see connection reset; agent names rank 4 (-6 SIGABRT). (exit 1)
  pipit_shape_all_np4_rall_hf: --hf mode: the model config has num_labels=2 for 4 song types on every rank; all 4 ranks raise IndexError 'Target N is out of bounds' on step 1. (exit 1)
  pipit_anomaly_nan_np6_r0_tee: Rank 0's loss goes NaN at step 3 under set_detect_anomaly(True): 'Function MseLossBackward0 returned nan values in its 0th output'; others see connection closed. (exit 1)
  pipit_ddp_unused_np3_rall_torchrun: Every rank's model has an unused layer under DDP without find_unused_parameters; all 3 ranks raise 'Expected to have finished reduction in the prior iteration' at step 2. (exit 1)
  pipit_port_in_use_np4_rnone_torchrun: Port 37116 held by a python socket before launch; torchrun fails in rendezvous with DistNetworkError EADDRINUSE and starts no worker. (exit 1)
  pipit_zero_div_np7_r6_accconfig: Rank 6 raises ZeroDivisionError at step 3; ranks 0 and 5 see connection closed; agent names rank 6. (exit 1)
  pipit_stall_np5_r1_torchrun: Rank 1 sleeps 600 s before the step-3 all_reduce with --pg-timeout 300: output stops after step 2, and the outer timeout 60 SIGTERMs torchrun (SignalException: got signal 15), which stops the workers; exit 124. (exit 124)
  pipit_zero_div_np3_r0_hf: --hf mode under torchrun: rank 0 raises ZeroDivisionError in compute_loss at step 3; ranks 1 and 2 see gloo connection closed; agent names rank 0. (exit 1)
  pipit_sigkill_np4_r1_torchrun: Rank 1 SIGKILLs itself at step 3; ranks 0 and 2 see connection closed; agent names rank 1 with exitcode -9 (SIGKILL). (exit 1)
  pipit_loader_worker_np5_r2_acc: Rank 2's DataLoader worker raises IndexError (Caught IndexError in DataLoader worker process 0) at step 3; ranks 1 and 3 see connection closed; agent names rank 2. (exit 1)
  pipit_exit3_np3_r1_hf: --hf mode under accelerate launch: rank 1 calls os._exit(3) at step 3 silently; rank 0 sees connection reset; agent names rank 1 with exitcode 3. (exit 1)
"""
import argparse, datetime, json, os, signal, sys, time

WORK = "/tmp/fault606_work"
STEPS = 6


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--acc", action="store_true")
    p.add_argument("--hf", action="store_true")
    return p.parse_args()


def prepare():
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(606)
    for r in range(8):
        x = torch.randn(64, 8, generator=g)
        song = torch.randint(0, 4, (64,), generator=g)
        y = (x[:, :3].sum(1, keepdim=True) * 0.5 + 2.0).abs()
        torch.save({"x": x, "song": song, "height": y}, f"{WORK}/shard_{r}.pt")
    lookup = {"0": "parachute", "1": "trill", "2": "seep", "3": "tsip"}
    with open(f"{WORK}/lookup.json", "w") as f:
        json.dump(lookup, f)
    with open(f"{WORK}/lookup_corrupt.json", "w") as f:
        f.write('{"0": "parachute", "1": "trill", "2": ')
    torch.manual_seed(0)
    m = make_model(False, 8)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    raw = open(f"{WORK}/start.pt", "rb").read()
    open(f"{WORK}/start_truncated.pt", "wb").write(raw[: len(raw) // 2])
    print("prepared", WORK)


def make_model(unused, in_width):
    import torch.nn as nn

    class Pipit(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(in_width if in_width != 8 else 16, 1)
            if unused:
                self.descent = nn.Linear(16, 1)

        def forward(self, x):
            return self.head(self.body(x).relu())

    return Pipit()


def fault_at(args, rank, step):
    if args.fault in ("none",) or step != 3:
        return
    if args.rank != rank:
        return
    if args.fault == "value_error":
        raise ValueError(f"song flight height 412.0 m out of range on rank {rank} (max 60 m)")
    if args.fault == "zero_div":
        flights = 0
        _ = 100 / flights
    if args.fault == "stall":
        time.sleep(40 if args.pg_timeout < 40 else 600)
    if args.fault == "exit_quiet":
        os._exit(0)
    if args.fault == "exit3":
        os._exit(3)
    if args.fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fault == "sigabrt":
        os.kill(os.getpid(), signal.SIGABRT)


class Shard:
    def __init__(self, rank, fault_rank, fault):
        import torch
        self.d = torch.load(f"{WORK}/shard_{rank}.pt")
        self.bad = fault == "loader_worker" and rank == fault_rank

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if self.bad and i >= 20:
            order = [0, 1, 2]
            i = order[i]
        return self.d["x"][i], self.d["height"][i]


def load_lookup(args, rank):
    path = f"{WORK}/lookup_corrupt.json" if (args.fault == "json_decode" and args.rank == rank) else f"{WORK}/lookup.json"
    with open(path) as f:
        return json.load(f)


def train(args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    acc = None
    if args.acc:
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs
        acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timeout)])
        rank, world = acc.process_index, acc.num_processes
    else:
        dist.init_process_group("gloo", timeout=timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
    lookup = load_lookup(args, rank)
    ckpt = f"{WORK}/start_truncated.pt" if (args.fault == "ckpt_truncated" and args.rank == rank) else f"{WORK}/start.pt"
    torch.manual_seed(rank)
    model = make_model(args.fault == "ddp_unused", 12 if args.fault == "shape_all" else 8)
    state = torch.load(ckpt)
    if args.fault != "shape_all":
        model.load_state_dict(state, strict=args.fault != "ddp_unused")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if acc is not None:
        model, opt = acc.prepare(model, opt)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    workers = 1 if args.fault == "loader_worker" else 0
    loader = torch.utils.data.DataLoader(Shard(rank, args.rank, args.fault), batch_size=8, num_workers=workers)
    it = iter(loader)
    if args.fault == "anomaly_nan":
        torch.autograd.set_detect_anomaly(True)
    for step in range(1, STEPS + 1):
        fault_at(args, rank, step)
        x, y = next(it)
        pred = model(x)
        if args.fault == "anomaly_nan" and args.rank == rank and step == 3:
            pred = torch.sqrt(pred - 1e6)
        loss = torch.nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        if acc is not None:
            acc.backward(loss)
        else:
            loss.backward()
        opt.step()
        trill = pred.detach().mean().reshape(1) * 0 + len(lookup) * 1.7 + loss.detach().reshape(1)
        dist.all_reduce(trill)
        print(f"rank {rank} step {step} loss {loss.item():.4f} trill_rate {trill.item() / world:.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        out = f"{WORK}/no_such_export_dir/pipit_export.pt" if args.fault == "save_missing_dir" else f"{WORK}/pipit_export.pt"
        m = acc.unwrap_model(model) if acc is not None else model.module
        torch.save(m.state_dict(), out)
        print(f"rank 0 saved export {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def train_hf(args):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, TrainerCallback
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    lookup = load_lookup(args, rank)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32,
                     num_labels=(2 if args.fault == "shape_all" else len(lookup)))
    model = BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(rank)
    ds = [{"input_ids": torch.randint(1, 64, (12,), generator=g), "labels": int(i % 4)} for i in range(96)]

    class PipitTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step + 1
            fault_at(args, self.args.process_index, step)
            out = super().compute_loss(model, inputs, return_outputs, **kw)
            loss = out[0] if return_outputs else out
            self._pipit_loss = loss.detach().item()
            return out

    class Printer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            t = trainer._pipit_loss
            print(f"rank {a.process_index} step {state.global_step} loss {t:.4f} trill_rate {len(lookup) * 1.7 + t:.3f}", flush=True)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=int(args.pg_timeout), max_steps=STEPS, per_device_train_batch_size=8,
                              report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                              disable_tqdm=True)
    trainer = PipitTrainer(model=model, args=targs, train_dataset=ds, callbacks=[Printer()])
    trainer.train()
    if trainer.is_world_process_zero():
        out = f"{WORK}/no_such_export_dir" if args.fault == "save_missing_dir" else f"{WORK}/hf_export"
        trainer.save_model(out)
        print(f"rank 0 saved export {out}", flush=True)


if __name__ == "__main__":
    a = parse()
    if a.prepare:
        prepare()
    elif a.hf:
        train_hf(a)
    else:
        train(a)
