"""Chinchilla dust-bath grooming model: a small distributed CPU training job with one planted fault.

Every rank reads its own shard of dust-bath sessions (fur features + the dust type used), maps the dust
type through a lookup table (dust -> index, grit in micrometres), and trains a tiny MLP that predicts the
fur-cleanliness score after the bath. Gloo backend, CPU only, 6 steps; rank 0 saves an export at the end.
`--prepare` writes the synthetic data into /tmp/fault602_work. `--hf` runs the same data through a
transformers.Trainer with a tiny config-built GPT-2 instead of the hand-written loop.

Faults (`--fault NAME --rank N`):
  none            control, nothing planted
  keyerror        rank N meets a dust type the lookup table does not have (KeyError in the dataset)
  missing_shard   rank N reads its shard from a stale path that does not exist (FileNotFoundError)
  ckpt_size       rank N resumes from a checkpoint of a wider model (load_state_dict size mismatch)
  allreduce_size  rank N all-reduces a grit metric of 3 values where the others send 2 (collective size mismatch)
  slow            rank N does pure-Python "dust sifting" for --slow-s seconds at step 2; the peers wait in the
                  gradient all-reduce (PG timeout --pg-timeout, default 12 s)
  nan             rank N's batch at step 3 is scaled by inf; the script's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 3
  logged_exit     rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_all       every rank concatenates the features without the dust embedding at step 2 (matmul shape error)
  worker_crash    rank N's DataLoader worker is killed (SIGKILL) while loading step 3's batch
  hostmem         rank N caps its address space and allocates a 3 GiB dust histogram (CPU allocator fails)

What happened (one line per fault, from the runs of 2026-12-07):
  none            np4 acc: all ranks finish 6 steps, rank 0 saves the export, exit 0.
  keyerror        np5 acc r3 / np4 Trainer r1: KeyError 'chinchilla_playsand' on the planted rank, peers die of gloo "Connection closed by peer".
  missing_shard   np3 torchrun r2 / np6 accconfig r4: FileNotFoundError for shards_v2/bath_shard_N.pt before step 0; others SIGTERMed.
  ckpt_size       np4 accdebug r2: load_state_dict "size mismatch" for fc1/fc2 before step 0.
  allreduce_size  np5 acc r1 / np3 tee r2: gloo raises no size error; the ranks fall out of step and all time out after 12000 ms.
  slow            np4 acc r3: peers time out in the gradient all-reduce (12 s); np3 torchrun r1 with --pg-timeout 300: output stops, `timeout` ends it (124).
  nan             np6 acc2nodes r5 / np3 Trainer r0: FloatingPointError from the script's check; machine 1's summary blames rank 4 (SIGABRT).
  sigsegv         np8 torchrun r6 / np4 accconfig r2: exitcode -11 with no traceback; peers see connection reset/closed.
  logged_exit     np5 tee r0 / np4 acc2nodes r3 / np3 Trainer r2: the rank's own ERROR line, exitcode 4, no traceback.
  shape_all       np4 accdebug / np7 tee: every rank raises "mat1 and mat2 shapes cannot be multiplied (8x13 and 17x32)".
  worker_crash    np4 acc r1: "DataLoader worker (pid N) is killed by signal: Killed." raised inside step 0's backward (prefetch).
  hostmem         np5 torchrun r2: DefaultCPUAllocator can't allocate 3221225472 bytes (error 12).
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault602_work"
DUSTS = ["volcanic_pumice", "sepiolite", "blue_cloud", "calcium_carbonate", "zeolite", "attapulgite"]
STEPS = 6
BATCH = 8


class Groomer(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.dust_emb = nn.Embedding(len(DUSTS), 4)
        self.fc1 = nn.Linear(12 + 4 + 1, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, feats, dust, grit, skip_emb=False):
        parts = [feats, grit.unsqueeze(1)] if skip_emb else [feats, self.dust_emb(dust), grit.unsqueeze(1)]
        return self.fc2(torch.relu(self.fc1(torch.cat(parts, dim=1)))).squeeze(1)


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(602)
    for r in range(8):
        torch.save({"feats": torch.randn(64, 12, generator=g),
                    "dust": [DUSTS[(r + 3 * i) % len(DUSTS)] for i in range(64)],
                    "score": torch.rand(64, generator=g)}, f"{WORK}/bath_shard_{r}.pt")
    with open(f"{WORK}/dust_lookup.json", "w") as f:
        json.dump({d: {"index": i, "grit_um": 2.0 + 3.5 * i} for i, d in enumerate(DUSTS)}, f, indent=1)
    torch.manual_seed(0)
    torch.save(Groomer().state_dict(), f"{WORK}/coat_start.pt")
    torch.save(Groomer(hidden=48).state_dict(), f"{WORK}/coat_start_wide.pt")
    print("prepared", WORK)


class BathSet(torch.utils.data.Dataset):
    def __init__(self, shard, lookup, rank, fault, frank):
        self.s, self.lookup, self.rank, self.fault, self.frank = shard, lookup, rank, fault, frank

    def __len__(self):
        return len(self.s["dust"])

    def __getitem__(self, i):
        dust = self.s["dust"][i]
        if self.rank == self.frank and i == 2 * BATCH + 3:
            if self.fault == "keyerror":
                dust = "chinchilla_playsand"
            if self.fault == "worker_crash":
                os.kill(os.getpid(), signal.SIGKILL)
        info = self.lookup[dust]
        return self.s["feats"][i], info["index"], torch.tensor(info["grit_um"] / 20.0), self.s["score"][i]


def load_data(rank, fault, frank):
    path = f"{WORK}/bath_shard_{rank}.pt"
    if fault == "missing_shard" and rank == frank:
        path = f"{WORK}/shards_v2/bath_shard_{rank}.pt"
    shard = torch.load(path)
    with open(f"{WORK}/dust_lookup.json") as f:
        lookup = json.load(f)
    return BathSet(shard, lookup, rank, fault, frank)


def plant_step(a, rank, step):
    """faults that happen inside the step (shared by the plain loop and the Trainer run)"""
    if rank != a.rank:
        return
    if a.fault == "slow" and step == 2:
        end, acc = time.time() + a.slow_s, 0
        while time.time() < end:
            acc += sum(i * i for i in range(20000)) % 7
    if a.fault == "sigsegv" and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if a.fault == "logged_exit" and step == 2:
        print(f"[rank{rank}] ERROR: dust bath sensor log for step {step} failed its checksum "
              f"(expected 64 sessions, found 0); aborting this rank", flush=True)
        sys.exit(4)
    if a.fault == "hostmem" and step == 2:
        import resource
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        hist = torch.zeros(3 << 28)  # 3 GiB of float32 dust-particle histogram
        print(hist.sum())


def train(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    print(f"rank {rank}/{world} dust bath groomer starting (backend {dist.get_backend() if dist.is_initialized() else 'none'})", flush=True)
    ds = load_data(rank, a.fault, a.rank)
    nw = 1 if (a.fault == "worker_crash" and rank == a.rank) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)
    torch.manual_seed(0)
    model = Groomer()
    ck = f"{WORK}/coat_start_wide.pt" if (a.fault == "ckpt_size" and rank == a.rank) else f"{WORK}/coat_start.pt"
    model.load_state_dict(torch.load(ck, weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(STEPS):
        feats, dust, grit, score = next(it)
        plant_step(a, rank, step)
        if a.fault == "nan" and rank == a.rank and step == 3:
            feats = feats * float("inf")
        pred = model(feats, dust, grit, skip_emb=(a.fault == "shape_all" and step == 2))
        loss = ((pred - score) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (dust bath batch)")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        n = 3 if (a.fault == "allreduce_size" and rank == a.rank and step == 3) else 2
        m = torch.tensor([grit.mean().item(), float(len(grit))] + [0.0] * (n - 2))
        dist.all_reduce(m)
        print(f"rank {rank} step {step} loss {loss.item():.4f} grit_um {m[0].item() / world * 20:.3f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        out = f"{WORK}/export_{os.environ.get('MASTER_PORT', 'x')}.pt"
        acc.save(acc.unwrap_model(model).state_dict(), out)
        print(f"rank 0 saved export {out}", flush=True)
    acc.end_training()


def train_hf(a):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))
    ds = load_data(rank, a.fault, a.rank)

    class TokSet(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            f, d, g, s = ds[i]
            ids = torch.tensor([d, int(g * 20) % 32, int(s * 31)] + [(d + k) % 32 for k in range(5)])
            return {"input_ids": ids, "labels": ids.clone()}

    class BathTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step
            plant_step(a, rank, step)
            if a.fault == "nan" and rank == a.rank and step == 3:
                inputs = dict(inputs)
                out = model(**inputs)
                loss = out.loss * float("nan")
            else:
                out = model(**inputs)
                loss = out.loss
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (dust bath batch)")
            print(f"rank {rank} step {step} loss {loss.item():.4f} grit_um {float(inputs['input_ids'][:, 1].float().mean()):.3f}", flush=True)
            return (loss, out) if return_outputs else loss

    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(output_dir=f"{WORK}/hf_{os.environ.get('MASTER_PORT', 'x')}", use_cpu=True,
                             ddp_backend="gloo", ddp_timeout=a.pg_timeout, report_to=[], max_steps=STEPS,
                             per_device_train_batch_size=BATCH, logging_steps=1, save_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True)
    tr = BathTrainer(model=model, args=args, train_dataset=TokSet())
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/hf_export_{os.environ.get('MASTER_PORT', 'x')}")
        print("rank 0 saved export", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=40.0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        train_hf(a)
    else:
        train(a)
