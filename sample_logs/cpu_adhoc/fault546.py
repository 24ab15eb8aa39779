"""Hornet nest thermal imaging: a small distributed training job (CPU, gloo).

Each rank reads its own shard of synthetic thermal frames (8x8 patches around
suspected hornet nests, degrees C), looks up every frame's nest id in a site
table, starts from a shared checkpoint, trains a tiny CNN that flags active
nests for 6 steps (DDP through accelerate, or transformers.Trainer with --hf),
all-reduces a 32-bin hotspot histogram each step, and rank 0 writes an export.

  --prepare            write shards, lookup table and checkpoints into /tmp/fault546_work
  --fault NAME --rank N   plant one fault (on rank N; shape_all hits every rank)
  --pg-timeout S       process-group timeout (default 12 s)
  --hf                 run the transformers.Trainer variant (faults: keyerror, sigsegv, none)

Faults:
  none           control, nothing planted
  keyerror       rank N's shard holds a nest id missing from the site table -> KeyError
  missing_shard  rank N opens a re-calibrated shard file that was never written -> FileNotFoundError
  ckpt_size      rank N starts from the wide-head checkpoint -> load_state_dict size mismatch
  weights_only   rank N loads a checkpoint that pickles a calibration object -> torch.load weights_only refusal
  hist_size      rank N all-reduces a 33-bin hotspot histogram, the others 32 bins
  slow_rank      rank N re-registers frames in pure Python (~45 s) before step 3; peers time out (12 s)
  hang           as slow_rank but endless; run with --pg-timeout 300 under `timeout`
  nan            a dead pixel (NaN) in rank N's batch; the script's finiteness check raises FloatingPointError
  sigsegv        rank N sends itself SIGSEGV at step 3
  logged_exit    rank N prints its own ERROR line (calibration drift) and sys.exit(4)
  shape_all      a crop bug on every rank (7x7 frames into the 8x8 head) -> matmul shape error
  worker_crash   rank N's DataLoader worker is SIGKILLed while reading frames
  host_mem       rank N (address space capped) builds a full-resolution mosaic -> CPU allocator failure

What happened (batch 546 runs, gloo, PG timeout 12 s unless noted):
  none           np4 acc: 6 steps on every rank, rank 0 saved the export, exit 0
  keyerror       np4 tee: KeyError 'nest_9x1' re-raised from rank 2's DataLoader worker; np4 hfacc (Trainer): KeyError on rank 3
  missing_shard  np3 accconfig / np7 accdebug: FileNotFoundError for thermal_rankN_recal.pt on the planted rank before any step
  ckpt_size      np3 acc: load_state_dict size mismatch (48 vs 32) on rank 2 before any step
  weights_only   np4 acc2nodes: UnpicklingError 'Weights only load failed' (CalibrationMeta) on rank 3, machine 0's ranks lose the peer
  hist_size      np3 accdebug: gloo::EnforceNotMet 'Received data size doesn't match' aborts rank 0 (SIGABRT), launcher names rank 0
  slow_rank      np3 acc / np6 tee: peers time out after 12 s in gloo (recv/send), launcher names a peer, slow rank silent
  hang           np3 torchrun, PG timeout 300: steps 1-2 then silence until timeout 60 SIGTERMs torchrun (exit 124)
  nan            np5 torchrun / np4 acc2nodes: FloatingPointError 'loss is nan' at step 3 on the planted rank
  sigsegv        np3 hf (Trainer) / np8 acc: planted rank exits -11 after step 2, peers lose the connection
  logged_exit    np6 acc: rank 4's ERROR line, exitcode 4, no traceback
  shape_all      np3 torchrun: every rank 'mat1 and mat2 shapes cannot be multiplied (16x392 and 512x32)' at step 1
  worker_crash   np4 acc: 'DataLoader worker (pid N) is killed by signal: Killed' on rank 1
  host_mem       np3 accdebug: DefaultCPUAllocator can't allocate 10737418240 bytes on rank 2 after step 1
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.nn as nn

WORK = "/tmp/fault546_work"
NBINS = 32


class CalibrationMeta:  # pickled into init_meta.pt for the weights_only fault
    def __init__(self, camera, offset):
        self.camera, self.offset = camera, offset


class NestNet(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, hidden)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.head(torch.relu(self.fc(h)))


def prepare(max_world=8):
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(546)
    lookup = {f"nest_{i:03d}": {"site": f"orchard-{i % 7}", "height_m": 2 + i % 9} for i in range(200)}
    with open(f"{WORK}/nest_sites.json", "w") as f:
        json.dump(lookup, f)
    for r in range(max_world):
        n = 96
        frames = 18 + 6 * torch.rand(n, 1, 8, 8, generator=g)
        labels = torch.randint(0, 2, (n,), generator=g)
        frames[labels == 1, :, 3:5, 3:5] += 9.0  # warm core of an active nest
        ids = [f"nest_{(r * 37 + i) % 200:03d}" for i in range(n)]
        torch.save({"frames": frames, "labels": labels, "nest_ids": ids}, f"{WORK}/shards/thermal_rank{r}.pt")
    torch.manual_seed(0)
    torch.save(NestNet().state_dict(), f"{WORK}/init.pt")
    torch.save(NestNet(hidden=48).state_dict(), f"{WORK}/init_wide.pt")
    torch.save({"model": NestNet().state_dict(), "calib": CalibrationMeta("cam-3", 0.4)}, f"{WORK}/init_meta.pt")
    print("prepared", WORK)


class ThermalDataset(torch.utils.data.Dataset):
    def __init__(self, shard, lookup, rank, fault, fault_rank):
        self.frames, self.labels, self.ids = shard["frames"], shard["labels"], list(shard["nest_ids"])
        self.lookup, self.rank, self.fault, self.fault_rank = lookup, rank, fault, fault_rank
        if fault == "keyerror" and rank == fault_rank:
            self.ids[20] = "nest_9x1"  # unregistered nest from a new survey

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.fault_rank and i == 24:
            os.kill(os.getpid(), signal.SIGKILL)
        site = self.lookup[self.ids[i]]
        x = self.frames[i].clone()
        x = x - 0.01 * site["height_m"]  # altitude correction
        return x, self.labels[i]


def rank_of():
    return int(os.environ.get("RANK", "0"))


def main_accelerate(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(rank)
    shard_path = f"{WORK}/shards/thermal_rank{rank}.pt"
    if a.fault == "missing_shard" and rank == a.rank:
        shard_path = f"{WORK}/shards/thermal_rank{rank}_recal.pt"
    shard = torch.load(shard_path)
    with open(f"{WORK}/nest_sites.json") as f:
        lookup = json.load(f)
    model = NestNet()
    ckpt = f"{WORK}/init.pt"
    if a.fault == "ckpt_size" and rank == a.rank:
        ckpt = f"{WORK}/init_wide.pt"
    if a.fault == "weights_only" and rank == a.rank:
        state = torch.load(f"{WORK}/init_meta.pt")["model"]
    else:
        state = torch.load(ckpt)
    model.load_state_dict(state)
    ds = ThermalDataset(shard, lookup, rank, a.fault, a.rank)
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    lossf = nn.CrossEntropyLoss()
    step = 0
    for x, y in dl:
        step += 1
        if step > a.steps:
            break
        if a.fault == "shape_all":
            x = x[:, :, :7, :7]  # crop bug: border pixels dropped
        if a.fault == "nan" and rank == a.rank and step == 3:
            x[5, 0, 2, 6] = float("nan")  # dead pixel
        if a.fault == "sigsegv" and rank == a.rank and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "logged_exit" and rank == a.rank and step == 3:
            print(f"ERROR: rank {rank}: thermal calibration drift 7.3 K on camera cam-3 exceeds the 5.0 K limit; aborting", flush=True)
            sys.exit(4)
        if a.fault == "host_mem" and rank == a.rank and step == 2:
            import resource
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
            mosaic = torch.zeros(8 * 1024, 640, 512)  # full-resolution mosaic of all frames, 10 GiB
        if a.fault in ("slow_rank", "hang") and rank == a.rank and step == 3:
            t0, acc_sum = time.time(), 0
            while a.fault == "hang" or time.time() - t0 < 45:
                for i in range(200000):
                    acc_sum += (i * 7) % 13
        out = model(x)
        loss = lossf(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite thermal input?)")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        nb = NBINS + 1 if (a.fault == "hist_size" and rank == a.rank) else NBINS
        hist = torch.histc(x.detach().float(), bins=nb, min=15, max=35)
        dist.all_reduce(hist)
        hot = (out.argmax(1) == y).float().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} hotspot_acc {hot:.3f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/hornet_thermal.pt")
        print(f"rank 0 saved export {WORK}/export/hornet_thermal.pt", flush=True)
    acc.end_training()


def main_hf(a):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    rank = rank_of()
    shard = torch.load(f"{WORK}/shards/thermal_rank{rank}.pt")
    with open(f"{WORK}/nest_sites.json") as f:
        lookup = json.load(f)
    base = ThermalDataset(shard, lookup, rank, a.fault, a.rank); base.ids[20::4] = (["nest_9x1"] * len(base.ids[20::4])) if (a.fault == "keyerror" and rank == a.rank) else base.ids[20::4]

    class TokDS(torch.utils.data.Dataset):  # frames quantised to 0.5 K tokens
        def __len__(self):
            return len(base)

        def __getitem__(self, i):
            x, y = base[i]
            ids = ((x.flatten() - 15) * 2).clamp(0, 63).long()
            return {"input_ids": ids, "labels": y}

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)

    class T(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step + 1
            if a.fault == "sigsegv" and rank == a.rank and step == 3:
                os.kill(os.getpid(), signal.SIGSEGV)
            out = model(**inputs)
            hot = (out.logits.argmax(-1) == inputs["labels"]).float().mean().item()
            print(f"rank {rank} step {step} loss {out.loss.item():.4f} hotspot_acc {hot:.3f}", flush=True)
            return (out.loss, out) if return_outputs else out.loss

    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], max_steps=a.steps, per_device_train_batch_size=8, logging_steps=2,
                             save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    tr = T(model=model, args=args, train_dataset=TokDS())
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/hornet_thermal_hf")
        print(f"rank 0 saved export {WORK}/export/hornet_thermal_hf", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hf", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)
