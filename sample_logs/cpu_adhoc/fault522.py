"""Batch 522 fault script: calligraphy quill stroke recognition (prefix `quill_`).

A small distributed training job: each rank reads its shard of synthetic quill-stroke
feature vectors (pen pressure, nib angle, ink flow ... 32 features per stroke sample),
maps stroke-family names to class ids through a lookup table, starts from a checkpoint,
trains a small MLP stroke classifier for 6 steps under DDP (gloo, CPU only) and rank 0
saves an export at the end. Every rank prints `rank R step S loss L stroke_acc M`.

`--prepare` writes the data into /tmp/fault522_work. `--hf` runs the same data through a
transformers.Trainer with a tiny config-built model instead of the Accelerate loop.

Faults (`--fault NAME --rank N`):
  none            control, no fault
  keyerror        rank N's shard names a stroke family ("swash_flourish") missing from the lookup table -> KeyError
  missing_shard   rank N opens a shard file that does not exist -> FileNotFoundError
  ckpt_size       rank N builds its model with hidden width 48, the checkpoint has 64 -> load_state_dict size mismatch
  gather_shape    rank N all_gathers a stroke histogram of 11 bins, the others 10 -> gloo size error
  slow            rank N does pure-Python work (~45 s) before step 3; the peers time out after --pg-timeout s
                  (with --pg-timeout 300 the job just hangs until `timeout` ends it)
  nan             rank N's nib-pressure features turn inf at step 3; the script's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 2
  exit4           rank N prints its own ERROR line (stroke-order table checksum) and calls sys.exit(4)
  shape_all       every rank reshapes its batch to 31 features (off-by-one slice) -> matmul shape RuntimeError
  worker_crash    rank N's DataLoader worker SIGKILLs itself while loading a batch
  host_alloc      rank N asks for a huge host buffer for its stroke-image cache -> DefaultCPUAllocator error

What happened:
  none            clean in all three controls (accelerate np3, Trainer under torchrun np3, Trainer under accelerate np4), exit 0
  keyerror        rank N raises KeyError: 'swash_flourish' (accelerate loop under torchrun np4; Trainer under torchrun np4), the rest are SIGTERMed, exit 1
  missing_shard   rank 4 raises FileNotFoundError for shard_4_strokes_v2.pt before any step (accelerate --debug np5), exit 1
  ckpt_size       rank 1 load_state_dict RuntimeError size mismatch (accelerate --config_file np3), exit 1
  gather_shape    rank N: ProcessGroupGloo::allgather invalid tensor size (expected (11), got (10)); peers see Connection closed by peer (np6 acc; np4 two-machine acc), exit 1
  slow            pg-timeout 12: peers time out after 12000 ms in gloo send/recv, launcher blames a peer (torchrun --tee np4, exit 1);
                  pg-timeout 300: output stops after step 2 and `timeout` ends the launcher at 60 s (exit 124)
  nan             rank N raises FloatingPointError (loss is nan) at step 3; on rank 0 (np5 torchrun) the process then aborts (-6), rank 7 (np8 acc) exits 1
  sigsegv         rank N dies with exitcode -11 and no traceback; peers see gloo connection reset/closed (tee np4; two-machine acc np6)
  exit4           rank N prints its ERROR line and exits 4; peers see Connection closed by peer (acc np8; torchrun np5)
  shape_all       every rank: mat1 and mat2 shapes cannot be multiplied (8x31 and 32x64) at step 0 (accelerate --debug np4), exit 1
  worker_crash    rank 1's DataLoader worker is killed by signal: Killed -> RuntimeError on rank 1; peers see Connection closed (torchrun np3), exit 1
  host_alloc      rank 2: DefaultCPUAllocator can't allocate memory (4503599627370496 bytes) (accelerate --config_file np5), exit 1
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

WORK = "/tmp/fault522_work"
FEAT, NCLS, HID = 32, 10, 64
FAMILIES = ["hairline", "downstroke", "upstroke", "oval", "ascender", "descender",
            "serif", "loop", "crossbar", "dot"]


def prepare():
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(522)
    table = {f: i for i, f in enumerate(FAMILIES)}
    with open(os.path.join(WORK, "stroke_families.json"), "w") as f:
        json.dump(table, f)
    for r in range(8):
        x = torch.randn(64, FEAT, generator=g)
        fam = [FAMILIES[int(i)] for i in torch.randint(0, NCLS, (64,), generator=g)]
        torch.save({"features": x, "families": fam}, os.path.join(WORK, f"shard_{r}.pt"))
    model = make_model(HID)
    torch.save(model.state_dict(), os.path.join(WORK, "init_ckpt.pt"))
    print("prepared", WORK)


def make_model(hid):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(FEAT, hid), nn.ReLU(), nn.Linear(hid, NCLS))


class StrokeSet:
    def __init__(self, x, y, crash=False):
        self.x, self.y, self.crash = x, y, crash

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash and i >= 8:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def load_shard(rank, fault, frank):
    import torch
    with open(os.path.join(WORK, "stroke_families.json")) as f:
        table = json.load(f)
    name = f"shard_{rank}.pt"
    if fault == "missing_shard" and rank == frank:
        name = f"shard_{rank}_strokes_v2.pt"
    d = torch.load(os.path.join(WORK, name))
    fam = list(d["families"])
    if fault == "keyerror" and rank == frank:
        fam[17] = "swash_flourish"
    y = torch.tensor([table[f] for f in fam])
    return d["features"], y


def main_accel(a):
    import torch, torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    fault, fr = a.fault, a.rank
    torch.manual_seed(0)
    if fault == "host_alloc" and rank == fr:
        cache = torch.empty((1 << 22, 1 << 22, 64), dtype=torch.float32)  # stroke-image cache
    x, y = load_shard(rank, fault, fr)
    hid = 48 if (fault == "ckpt_size" and rank == fr) else HID
    model = make_model(hid)
    sd = torch.load(os.path.join(WORK, "init_ckpt.pt"))
    model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = StrokeSet(x, y, crash=(fault == "worker_crash" and rank == fr))
    nw = 1 if (fault == "worker_crash" and rank == fr) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=nw)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(6):
        xb, yb = next(it)
        if fault == "slow" and rank == fr and step == 3:
            t0, s = time.time(), 0
            while time.time() - t0 < a.slow_s:
                s += sum(i * i for i in range(20000))  # re-rasterising strokes in pure Python
        if fault == "nan" and rank == fr and step == 3:
            xb = xb.clone(); xb[:, 0] = float("inf")  # nib pressure sensor saturates
        if fault == "sigsegv" and rank == fr and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit4" and rank == fr and step == 1:
            print(f"ERROR: rank {rank}: stroke-order table checksum mismatch (expected 0x5a22, got 0x5a2f); refusing to train", flush=True)
            sys.exit(4)
        if fault == "shape_all" and step == 0:
            xb = xb[:, 1:]  # drop the 'pen-down' flag column, off by one
        out = model(xb)
        loss = torch.nn.functional.cross_entropy(out, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite stroke logits)")
        acc.backward(loss)
        opt.step(); opt.zero_grad()
        accm = (out.argmax(1) == yb).float().mean().detach()
        dist.all_reduce(accm); accm /= world
        bins = 11 if (fault == "gather_shape" and rank == fr) else 10
        hist = torch.bincount(out.argmax(1), minlength=bins)[:bins].float()
        outl = [torch.zeros(10) for _ in range(world)]
        dist.all_gather(outl, hist)
        print(f"rank {rank} step {step} loss {loss.item():.4f} stroke_acc {accm.item():.4f}", flush=True)
    acc.wait_for_everyone()
    if rank == 0:
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(WORK, "quill_export.pt"))
        print("rank 0 saved export", os.path.join(WORK, "quill_export.pt"), flush=True)
    acc.end_training()


def main_hf(a):
    import torch
    from transformers import Trainer, TrainingArguments, BertConfig, BertForSequenceClassification
    rank = int(os.environ.get("RANK", "0"))
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, num_labels=NCLS, max_position_embeddings=64)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    x, y = load_shard(rank, a.fault, a.rank)

    class DS(torch.utils.data.Dataset):
        def __len__(self): return len(y)
        def __getitem__(self, i):
            ids = ((x[i] * 8).long() % 64).abs()
            return {"input_ids": ids, "labels": y[i]}

    args = TrainingArguments(output_dir=os.path.join(WORK, f"hf_out_{a.tag}"), use_cpu=True, ddp_backend="gloo",
                             ddp_timeout=a.pg_timeout, report_to=[], max_steps=6, per_device_train_batch_size=8,
                             logging_steps=1, save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=DS()).train()
    if rank == 0:
        print("rank 0 finished quill stroke trainer run", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--tag", default="run")
    p.add_argument("--slow-s", type=float, default=45)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accel(a)
