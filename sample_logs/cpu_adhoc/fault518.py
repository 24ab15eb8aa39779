"""Bird song dialect clustering from field recordings: a small distributed training job (batch 518).

Each rank reads its own shard of synthetic song-syllable feature vectors (recorded at field sites), maps each
recording's site code to a dialect id through a lookup table, warm-starts a small encoder from a checkpoint,
and trains it with a prototype (cluster-centre) loss; prototypes are averaged across ranks every step with an
all_reduce. Each step every rank prints `rank R step S loss L purity P`. Rank 0 saves an export at the end.

Usage:  python fault518.py --prepare [--world W]           (write data into /tmp/fault518_work)
        python fault518.py [--fault NAME --rank N] [--pg-timeout S] [--hf]   (under a launcher)

Faults (--fault NAME, planted on --rank N):
  none          control, no fault
  keyerror      rank N meets a site code missing from the site->dialect lookup table (KeyError)
  missing_shard rank N's shard file is absent (FileNotFoundError)
  ckpt_size     rank N warm-starts from a checkpoint whose encoder has another width (size mismatch)
  weights_only  rank N loads a checkpoint that pickles a custom object; torch.load(weights_only=True) refuses it
  wrong_size    rank N contributes a prototype tensor of the wrong length to all_gather
  slow          rank N does pure-Python spectrogram "cleaning" for 90 s; peers' collectives time out
                (with --pg-timeout 300: the job hangs until `timeout` ends it)
  nan           rank N's features contain NaN; the script's own finiteness check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line and calls sys.exit(4)
  shape_all     every rank builds the projection head with the wrong input width (RuntimeError in matmul)
  worker_crash  a DataLoader worker on rank N dies (os._exit inside the worker)
  sigkill       rank N sends itself SIGKILL at step 3

What happened (batch 518 runs, torch 2.13.0+cpu, gloo, PG timeout 12 s):
  none          np3 acc and np4 hfacc (Trainer): all steps, rank 0 saves the export, exit 0
  keyerror      np4 torchrun r2 and np6 hf (Trainer) r4: KeyError 'site05' on the planted rank; peers SIGTERMed or Gloo connection closed; exit 1
  missing_shard np5 accdebug r3 and np4 acc2nodes r1: FileNotFoundError shard_N_denoised.pt; exit 1 (both launchers on 2 machines)
  ckpt_size     np6 accconfig r5: load_state_dict RuntimeError, size mismatch for 0.weight [40,24] vs [32,24]; exit 1
  weights_only  np4 tee r0: _pickle.UnpicklingError Weights only load failed (SiteMeta); exit 1
  wrong_size    np5 acc r2 and np8 torchrun r6: ProcessGroupGloo::allgather invalid tensor size (6,29) vs (6,32); exit 1
  slow          np4 acc r1: peers time out after 12000 ms in all_gather, launcher blames rank 0; exit 1.
                np3 tee r2 with --pg-timeout 300: no progress after step 1, `timeout` ends it at 60 s; exit 124
  nan           np5 accdebug r4 and np3 torchrun r1: FloatingPointError from the script's own check; exit 1
  segv          np6 acc r3: exitcode -11 (SIGSEGV), peers Gloo connection reset; exit 1
  exit4         np8 accconfig r5 and np6 acc2nodes r4: own ERROR line, exit 4, peers Gloo connection closed; launcher exit 1
  shape_all     np4 torchrun: every rank RuntimeError mat1 and mat2 shapes cannot be multiplied (10x32 and 36x6); exit 1
  worker_crash  np5 acc r1: RuntimeError DataLoader worker exited unexpectedly with exit code 3; exit 1
  sigkill       np6 tee r2: exitcode -9 (SIGKILL), no message; exit 1
"""
import argparse, os, sys, time, json, signal
from datetime import timedelta

WORK = "/tmp/fault518_work"
FEAT, HID, NPROTO, STEPS, NPER = 24, 32, 6, 6, 64


def prepare(world):
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(518)
    sites = [f"site{i:02d}" for i in range(12)]
    json.dump({s: i % NPROTO for i, s in enumerate(sites)}, open(f"{WORK}/site_dialect.json", "w"))
    for r in range(world):
        x = torch.randn(NPER, FEAT, generator=g)
        codes = [sites[(r * 7 + i) % 12] for i in range(NPER)]
        torch.save({"x": x, "codes": codes}, f"{WORK}/shard_{r}.pt")
    enc = torch.nn.Sequential(torch.nn.Linear(FEAT, HID), torch.nn.ReLU(), torch.nn.Linear(HID, HID))
    torch.save(enc.state_dict(), f"{WORK}/encoder_init.pt")
    bad = torch.nn.Sequential(torch.nn.Linear(FEAT, HID + 8), torch.nn.ReLU(), torch.nn.Linear(HID + 8, HID))
    torch.save(bad.state_dict(), f"{WORK}/encoder_wide.pt")
    print("prepared", world, "shards in", WORK)


class SiteMeta:  # a custom object pickled into one checkpoint (weights_only fault)
    def __init__(self, site):
        self.site = site


def make_loader(x, y, fault, rank, me, workers):
    import torch
    from torch.utils.data import DataLoader, TensorDataset, Dataset

    class Songs(Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            if fault == "worker_crash" and me == rank and i >= 20:
                os._exit(3)
            return x[i], y[i]

    return DataLoader(Songs(), batch_size=NPER // STEPS, num_workers=workers, drop_last=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--hf", action="store_true")
    a = ap.parse_args()
    if a.prepare:
        return prepare(a.world)
    if a.hf:
        return hf_main(a)
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    me, W = acc.process_index, acc.num_processes
    torch.manual_seed(0)
    table = json.load(open(f"{WORK}/site_dialect.json"))
    if a.fault == "keyerror" and me == a.rank:
        table.pop("site05")
    shard = f"{WORK}/shard_{me}.pt"
    if a.fault == "missing_shard" and me == a.rank:
        shard = f"{WORK}/shard_{me}_denoised.pt"
    data = torch.load(shard)
    x = data["x"]
    y = torch.tensor([table[c] for c in data["codes"]])
    if a.fault == "nan" and me == a.rank:
        x[17, 3] = float("nan")
    enc = torch.nn.Sequential(torch.nn.Linear(FEAT, HID), torch.nn.ReLU(), torch.nn.Linear(HID, HID))
    ck = f"{WORK}/encoder_init.pt"
    if a.fault == "ckpt_size" and me == a.rank:
        ck = f"{WORK}/encoder_wide.pt"
    if a.fault == "weights_only" and me == a.rank:
        sd = torch.load(ck)
        sd["_meta"] = SiteMeta("site05")
        ck = f"{WORK}/encoder_meta_{me}.pt"
        torch.save(sd, ck)
    enc.load_state_dict(torch.load(ck, weights_only=True))
    head_in = HID + 4 if a.fault == "shape_all" else HID
    head = torch.nn.Linear(head_in, NPROTO)
    model = torch.nn.ModuleDict({"enc": enc, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    inner = acc.unwrap_model(model)
    loader = make_loader(x, y, a.fault, a.rank, me, 1 if a.fault == "worker_crash" else 0)
    protos = torch.zeros(NPROTO, HID)
    for step, (xb, yb) in enumerate(loader):
        if not torch.isfinite(xb).all():  # the program's own check
            raise FloatingPointError(f"rank {me}: non-finite syllable features in batch {step} (recording {step * len(xb)}..)")
        if a.fault == "segv" and me == a.rank and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "sigkill" and me == a.rank and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault == "exit4" and me == a.rank and step == 1:
            print(f"ERROR rank {me}: recorder metadata for site05 lists sample rate 0 Hz; refusing to cluster", flush=True)
            sys.exit(4)
        if a.fault == "slow" and me == a.rank and step == 2:
            t0, acc_v = time.time(), 0.0
            while time.time() - t0 < 90:  # pure-Python "spectrogram cleaning"
                for i in range(20000):
                    acc_v += (i * 0.5) % 3.0
        z = inner["enc"](xb)
        logits = inner["head"](z)
        loss = torch.nn.functional.cross_entropy(logits, yb)
        acc.backward(loss)
        opt.step(); opt.zero_grad()
        with torch.no_grad():
            local = torch.stack([z[yb == k].mean(0) if (yb == k).any() else torch.zeros(HID) for k in range(NPROTO)])
            if a.fault == "wrong_size" and me == a.rank:
                local = local[:, : HID - 3].contiguous()
            gathered = [torch.zeros_like(protos) for _ in range(W)]
            dist.all_gather(gathered, local)
            protos = torch.stack(gathered).mean(0)
            purity = (logits.argmax(1) == yb).float().mean().item()
        print(f"rank {me} step {step} loss {loss.item():.4f} purity {purity:.3f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save({"model": inner.state_dict(), "protos": protos}, f"{WORK}/dialect_export.pt")
        print("rank 0 saved export", f"{WORK}/dialect_export.pt", flush=True)


def hf_main(a):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)
    table = json.load(open(f"{WORK}/site_dialect.json"))
    if a.fault == "keyerror" and rank == a.rank:
        table.pop("site05")
    data = torch.load(f"{WORK}/shard_{rank}.pt")
    tok = (data["x"].abs() * 10).long().clamp(0, 63)

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return NPER

        def __getitem__(self, i):
            return {"input_ids": tok[i], "labels": torch.tensor(table[data["codes"][i]])}

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=FEAT, num_labels=NPROTO)
    model = BertForSequenceClassification(cfg)
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=int(a.pg_timeout),
                             report_to=[], max_steps=STEPS, per_device_train_batch_size=8, logging_steps=1,
                             save_strategy="no", disable_tqdm=True)
    tr = Trainer(model=model, args=args, train_dataset=DS())
    tr.train()
    if rank == 0:
        tr.save_model(f"{WORK}/hf_out/export")
        print("rank 0 saved export", flush=True)


if __name__ == "__main__":
    main()
