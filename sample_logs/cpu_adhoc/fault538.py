"""Jade carving tool wear: a small distributed (gloo, CPU) regressor for diamond-burr wear.

Every rank reads its own shard of carving passes (spindle rpm, feed, depth, jade hardness,
coolant flow, pass length, grit code), maps the grit code through a lookup table to an
embedding, predicts burr wear in microns, and all-reduces the loss each step
(`rank R step S loss L wear_mae M`). It resumes from a starting checkpoint; rank 0 saves
an export at the end. `--prepare` writes the synthetic data to /tmp/fault538_work.
`--hf` runs the same data through a transformers.Trainer with a tiny config-built GPT-2.

Faults (`--fault NAME --rank N`), one per run:
  none            control, nothing planted
  grit_keyerror   rank N's shard holds a mistyped grit code ("G60O"): KeyError in the lookup
  missing_shard   rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size       rank N resumes from a checkpoint whose wear head is wider (size mismatch)
  weights_only    rank N resumes from a checkpoint that pickles a custom BurrProfile object
                  (torch.load weights_only refusal)
  allgather_shape rank N all-gathers 4 wear statistics where its peers send 3
  slow_rank       rank N re-fits its wear curve in pure Python (4x the PG timeout) at step 3;
                  its peers time out in the loss all-reduce (with --pg-timeout 300: a hang)
  nan_check       rank N's coolant-flow column turns to inf at step 3; the script's own
                  finiteness check raises FloatingPointError
  segv            rank N sends itself SIGSEGV at step 2
  error_exit      rank N prints its own ERROR line (sensor drift) and calls sys.exit(4) at step 4
  shape_all       every rank drops the coolant column ("refactor"): matmul shape error on all ranks
  host_mem        rank N caps its address space (RLIMIT_AS) and then allocates a 4 GiB
                  wear-history buffer at step 2: DefaultCPUAllocator cannot allocate
  worker_crash    the DataLoader runs one worker per rank; rank N's worker SIGKILLs itself
  hang            = slow_rank run with --pg-timeout 300 (the refit outlasts the 60 s `timeout`)

What happened (one line per fault; labels in the jade_*.expect.toml files, see readme_538.md):
  none            all ranks ran 6 steps, rank 0 saved the export, exit 0 (acc np4; hf Trainer np3)
  grit_keyerror   KeyError: 'G60O' on rank N (lookup at step 2 / Trainer's first batch); peers got gloo
                  "Connection closed by peer"; np6 torchrun: rank 0 then aborted and the Root Cause named rank 0; exit 1
  missing_shard   FileNotFoundError for shard_rN_v2.pt on rank N before step 0; launcher SIGTERMed the rest, exit 1
  ckpt_size       load_state_dict RuntimeError "size mismatch for head.0.weight ..." on rank N before step 0, exit 1
  weights_only    _pickle.UnpicklingError "Weights only load failed ... __main__.BurrProfile" on rank N, exit 1
  allgather_shape "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4), got (3))" on rank N, exit 1
  slow_rank       peers raised gloo "Timed out waiting 12000ms for recv/send" at step 3; Root Cause named a peer (SIGABRT), exit 1
  hang            (slow_rank with --pg-timeout 300) output stopped after step 2; timeout's SIGTERM ended it, exit 124
  nan_check       FloatingPointError "rank N step 3: non-finite wear loss nan", exit 1
  segv            rank N died with exitcode -11 (SIGSEGV) at step 2, no traceback; peers got connection errors, exit 1
  error_exit      rank N printed its ERROR line and exited 4 (accelerate np8 at step 4, Trainer np3 at step 3), exit 1
  shape_all       every rank raised "mat1 and mat2 shapes cannot be multiplied (16x9 and 10x32)" at step 0, exit 1
  host_mem        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes" on rank N, exit 1
  worker_crash    "DataLoader worker (pid X) is killed by signal: Killed." on rank N, exit 1
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

WORK = "/tmp/fault538_work"
GRITS = ["G60", "G80", "G120", "G180", "G240", "G320", "G400", "G600"]
NFEAT = 6  # rpm, feed, depth, hardness, coolant, pass_len


class BurrProfile:
    """A custom object a careless exporter pickled beside the weights."""

    def __init__(self, grit, radius_mm):
        self.grit = grit
        self.radius_mm = radius_mm


def build_model(torch, head_width=16):
    nn = torch.nn

    class WearNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.grit = nn.Embedding(len(GRITS), 4)
            self.body = nn.Sequential(nn.Linear(NFEAT + 4, 32), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(32, head_width), nn.ReLU(), nn.Linear(head_width, 1))

        def forward(self, x, g):
            return self.head(self.body(torch.cat([x, self.grit(g)], dim=1))).squeeze(1)

    return WearNet()


def prepare(world):
    import json
    import torch

    os.makedirs(WORK, exist_ok=True)
    gen = torch.Generator().manual_seed(538)
    with open(os.path.join(WORK, "grit_table.json"), "w") as f:
        json.dump({g: i for i, g in enumerate(GRITS)}, f)
    for r in range(world):
        x = torch.rand(64, NFEAT, generator=gen)
        gi = torch.randint(0, len(GRITS), (64,), generator=gen)
        wear = 3.0 * x[:, 0] * x[:, 2] + 1.5 * x[:, 3] - 0.8 * x[:, 4] + 0.1 * gi.float()
        torch.save({"x": x, "grit": [GRITS[i] for i in gi.tolist()], "wear_um": wear},
                   os.path.join(WORK, f"shard_r{r}.pt"))
    torch.manual_seed(538)
    torch.save(build_model(torch).state_dict(), os.path.join(WORK, "start.pt"))
    torch.save(build_model(torch, head_width=24).state_dict(), os.path.join(WORK, "start_wide.pt"))
    sd = build_model(torch).state_dict()
    sd["burr_profile"] = BurrProfile("G400", 1.2)
    torch.save(sd, os.path.join(WORK, "start_profiled.pt"))
    print(f"prepared {world} shards, grit table, checkpoints in {WORK}")


class ShardSet:
    def __init__(self, shard, crash_at=None):
        self.s = shard
        self.crash_at = crash_at

    def __len__(self):
        return len(self.s["grit"])

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.s["x"][i], self.s["grit"][i], self.s["wear_um"][i]


def burr_curve_refit(seconds):
    # pure-Python least squares over a long synthetic wear history (holds the GIL, no collective)
    end = time.time() + seconds
    acc = 0.0
    n = 0
    while time.time() < end:
        for k in range(20000):
            acc += (k % 97) * 1e-6
        n += 1
    return acc / max(n, 1)


def train(args):
    import json
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, InitProcessGroupKwargs

    accel = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = accel.process_index, accel.num_processes
    mine = args.fault != "none" and (args.rank == rank or args.fault == "shape_all")
    torch.manual_seed(538 + rank)

    with open(os.path.join(WORK, "grit_table.json")) as f:
        grit_table = json.load(f)
    shard_path = os.path.join(WORK, f"shard_r{rank}.pt")
    if mine and args.fault == "missing_shard":
        shard_path = os.path.join(WORK, f"shard_r{rank}_v2.pt")
    shard = torch.load(shard_path)
    if mine and args.fault == "grit_keyerror":
        shard["grit"][37] = "G60O"
        shard["grit"][41] = "G60O"

    model = build_model(torch)
    ckpt = os.path.join(WORK, "start.pt")
    if mine and args.fault == "ckpt_size":
        ckpt = os.path.join(WORK, "start_wide.pt")
    if mine and args.fault == "weights_only":
        ckpt = os.path.join(WORK, "start_profiled.pt")
    state = torch.load(ckpt)
    model.load_state_dict(state)
    print(f"rank {rank}/{world} resumed from {os.path.basename(ckpt)}, shard {len(shard['grit'])} passes", flush=True)

    crash_at = 40 if (mine and args.fault == "worker_crash") else None
    loader = torch.utils.data.DataLoader(ShardSet(shard, crash_at), batch_size=16, shuffle=False,
                                         num_workers=1 if args.fault == "worker_crash" else 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accel.prepare(model, opt)

    step = 0
    while step < args.steps:
        for x, codes, y in loader:
            if step >= args.steps:
                break
            if mine and args.fault == "segv" and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            if mine and args.fault == "error_exit" and step == 4:
                print(f"ERROR rank {rank}: burr wear sensor drift 0.41 um/pass exceeds 0.25, "
                      f"refusing to train on uncalibrated wear labels", flush=True)
                sys.exit(4)
            if mine and args.fault == "slow_rank" and step == 3:
                burr_curve_refit(4 * args.pg_timeout)
            if mine and args.fault == "host_mem" and step == 2:
                import resource
                with open("/proc/self/status") as f:
                    vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:")][0]
                resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
                history = torch.zeros(1 << 30, dtype=torch.float32)  # 4 GiB wear history
                del history
            g = torch.tensor([grit_table[c] for c in codes])
            if args.fault == "shape_all":
                x = torch.cat([x[:, :4], x[:, 5:]], dim=1)  # "coolant is constant, drop it"
            if mine and args.fault == "nan_check" and step == 3:
                x = x.clone()
                x[:, 4] = float("inf")
            pred = model(x, g)
            loss = torch.nn.functional.mse_loss(pred, y)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: non-finite wear loss {loss.item()}")
            opt.zero_grad()
            accel.backward(loss)
            opt.step()
            stats = torch.stack([loss.detach(), (pred - y).abs().mean().detach()])
            dist.all_reduce(stats)
            stats /= world
            if step == 3:
                local = torch.tensor([y.mean(), y.std(), y.max()])
                if mine and args.fault == "allgather_shape":
                    local = torch.cat([local, y.min().reshape(1)])
                outs = [torch.zeros(3) for _ in range(world)]
                dist.all_gather(outs, local)
            print(f"rank {rank} step {step} loss {stats[0].item():.4f} wear_mae {stats[1].item():.4f}", flush=True)
            step += 1
    accel.wait_for_everyone()
    if rank == 0:
        out = os.path.join(WORK, "export_wearnet.pt")
        torch.save(accel.unwrap_model(model).state_dict(), out)
        print(f"rank 0 saved export {out}", flush=True)
    accel.end_training()


def train_hf(args):
    import json
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    rank = int(os.environ.get("RANK", "0"))
    mine = args.fault != "none" and args.rank == rank
    with open(os.path.join(WORK, "grit_table.json")) as f:
        grit_table = json.load(f)
    shard = torch.load(os.path.join(WORK, f"shard_r{rank}.pt"))
    codes = list(shard["grit"])
    if mine and args.fault == "grit_keyerror":
        for i in range(0, len(codes), 5):
            codes[i] = "G60O"

    class StrokeSet(torch.utils.data.Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            # a carving pass as tokens: grit token, then 7 quantised wear-feature tokens
            q = (shard["x"][i] * 7).long() + 8
            ids = torch.cat([torch.tensor([grit_table[codes[i]]]), q, (shard["wear_um"][i:i + 1] * 4).long().clamp(0, 7) + 16])
            return {"input_ids": ids, "labels": ids.clone()}

    class WearTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
            loss = out[0] if return_outputs else out
            step = self.state.global_step
            if mine and args.fault == "error_exit" and step == 3:
                print(f"ERROR rank {rank}: burr wear sensor drift 0.41 um/pass exceeds 0.25", flush=True)
                sys.exit(4)
            print(f"rank {rank} step {step} loss {loss.item():.4f} wear_ppl {torch.exp(loss).item():.3f}", flush=True)
            return out

    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(538)
    model = GPT2LMHeadModel(cfg)
    targs = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=4, logging_steps=2, save_strategy="no",
                              dataloader_num_workers=0, disable_tqdm=True)
    trainer = WearTrainer(model=model, args=targs, train_dataset=StrokeSet())
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(os.path.join(WORK, "hf_export"))
        print(f"rank 0 saved export {os.path.join(WORK, 'hf_export')}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    if args.prepare:
        prepare(args.world)
    elif args.hf:
        train_hf(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
