"""Batch 562 fault script: larch needle phenology (gloo, CPU only).

A small regression job that predicts the day of larch budburst / needle flush
from per-site growing-degree-day (GDD) features. `--prepare` writes synthetic
shards (one per rank), a site lookup table and a starting checkpoint into
/tmp/fault562_work. Each rank trains 6 steps and prints
`rank R step S loss L gdd_mae M`; rank 0 saves an export at the end.

Modes: `--mode acc` (accelerate Accelerator forced to CPU/gloo; also run under
torchrun) and `--mode hf` (transformers.Trainer with a tiny config-built BERT).

Faults (`--fault NAME --rank N`):
  none            control, nothing planted
  keyerror        rank N looks up a site id missing from the site table (KeyError)
  missing_shard   rank N opens a phenology shard file that does not exist
  ckpt_size       rank N builds its head 24 wide and loads the 16-wide checkpoint (size mismatch)
  weights_only    rank N torch.load()s a checkpoint holding a pickled PhenologyMeta object
  gather_shape    rank N all_gathers a 5-element GDD vector where the others send 4
  slow            rank N does pure-Python work for a long time at step 3 (peers time out);
                  with --pg-timeout 300 the job hangs until `timeout` ends it
  nan             rank N's chill-day feature turns NaN at step 3; the job's own check raises
  sigsegv         rank N sends itself SIGSEGV at step 2
  logged_exit     rank N prints its own ERROR line and sys.exit(4)
  shape_all       every rank feeds sequences longer than the position table (hf) / 9 features (acc)
  worker_crash    (hf) rank N's DataLoader worker SIGKILLs itself
  skip_collective rank N skips the gdd_mae all_reduce at step 4, ends early, peers wait

What happened (after the runs; 20 kept runs, 1 dropped):
  none            np6 acc: all ranks finish 6 steps, rank 0 saves the export, exit 0
  keyerror        np4 r2 acc / np6 r5 torchrun: KeyError 'LX-0{r}99' on the rank, peers see gloo Connection closed
  missing_shard   np3 r1 accdebug / np8 r7 accconfig: FileNotFoundError for larch_rankN_needleflush_2026.pt, launcher SIGTERMs the rest
  ckpt_size       np5 r3 accconfig: load_state_dict size mismatch for 0.weight ([16, 8] vs [24, 8])
  weights_only    np4 r1 tee: UnpicklingError 'Weights only load failed' (Unsupported global __main__.PhenologyMeta)
  gather_shape    np6 r4 acc: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank 4
  slow            np5 r3 acc: peers time out after 12000 ms in gloo; np3 r1 torchrun --pg-timeout 300: output stops, timeout ends it (124);
                  np4 r3 acc2nodes dropped (the two accelerate launchers never formed a rendezvous)
  nan             np5 r2 acc / np3 r0 accconfig: FloatingPointError 'non-finite loss nan' from the job's own check
  sigsegv         np8 r6 torchrun / np4 r1 accdebug: exitcode -11 (SIGSEGV) in the launcher summary, peers see gloo errors
  logged_exit     np7 r4 acc: the rank's own ERROR line, exitcode 4, no traceback
  shape_all       np4 hf: every rank 'expanded size of the tensor (40) must match ... (32)'; np3 tee: every rank 'mat1 and mat2 shapes cannot be multiplied (16x9 and 8x16)'
  worker_crash    np3 r2 hfacc / np4 r1 hf: 'DataLoader worker (pid N) is killed by signal: Killed.'
  skip_collective np5 r2 tee: rank 1 aborts with gloo EnforceNotMet '68 vs 4 ... collective mismatch' (SIGABRT), rank 2 prints nothing
"""
import argparse, json, os, sys, time, signal
from datetime import timedelta

WORK = "/tmp/fault562_work"


class PhenologyMeta:
    def __init__(self, season):
        self.season = season


def prepare():
    import torch
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(562)
    sites = {}
    for r in range(8):
        ids = [f"LX-{r:02d}{i:02d}" for i in range(16)]
        for sid in ids:
            sites[sid] = {"lat": 45.0 + r, "elev_m": 800 + 10 * r}
        x = torch.rand(6 * 16, 8, generator=g)
        y = (x[:, :3].sum(1, keepdim=True) * 0.2 + 1.1)  # budburst day / 100
        torch.save({"x": x, "y": y, "site_ids": ids * 6}, f"{WORK}/shards/larch_rank{r}.pt")
    with open(f"{WORK}/sites.json", "w") as f:
        json.dump(sites, f)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    torch.save(m.state_dict(), f"{WORK}/start_ckpt.pt")
    torch.save({"state": m.state_dict(), "meta": PhenologyMeta(2026)}, f"{WORK}/start_ckpt_meta.pt")
    print("prepared", WORK)


def run_acc(a):
    import torch, torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    me = a.fault_rank == rank
    with open(f"{WORK}/sites.json") as f:
        sites = json.load(f)
    shard = f"{WORK}/shards/larch_rank{rank}.pt"
    if a.fault == "missing_shard" and me:
        shard = f"{WORK}/shards/larch_rank{rank}_needleflush_2026.pt"
    data = torch.load(shard, weights_only=True)
    hidden = 24 if (a.fault == "ckpt_size" and me) else 16
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    if a.fault == "weights_only" and me:
        ck = torch.load(f"{WORK}/start_ckpt_meta.pt")
        model.load_state_dict(ck["state"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/start_ckpt.pt", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    for step in range(6):
        x = data["x"][step * 16:(step + 1) * 16].clone()
        y = data["y"][step * 16:(step + 1) * 16]
        ids = data["site_ids"][step * 16:(step + 1) * 16]
        if a.fault == "keyerror" and me and step == 2:
            ids = ids[:-1] + [f"LX-{rank:02d}99"]
        lat = torch.tensor([sites[s]["lat"] for s in ids]).unsqueeze(1)
        x[:, 7:8] = lat / 90.0
        if a.fault == "shape_all":
            x = torch.cat([x, lat / 90.0], dim=1)  # 9 features into an 8-wide layer
        if a.fault == "nan" and me and step == 3:
            x[5, 2] = float("nan")  # chill days from a broken logger
        if a.fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "logged_exit" and me and step == 2:
            print(f"ERROR rank {rank}: site {ids[0]} has no budburst observation for season 2026; refusing to fit phenology curve", flush=True)
            sys.exit(4)
        if a.fault == "slow" and me and step == 3:
            t_end = time.time() + a.slow_s
            acc_ = 0
            while time.time() < t_end:
                acc_ += sum(i * i for i in range(2000))
        pred = model(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (check chill-day features)")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        mae = (pred.detach() - y).abs().mean().reshape(1)
        if not (a.fault == "skip_collective" and me and step == 4):
            dist.all_reduce(mae)
        mae = mae / world
        if a.fault == "gather_shape" and step == 3:
            v = torch.full((5 if me else 4,), float(rank))
            out = [torch.zeros(4) for _ in range(world)]
            dist.all_gather(out, v)
        print(f"rank {rank} step {step} loss {loss.item():.4f} gdd_mae {mae.item():.4f}", flush=True)
    if a.fault == "skip_collective" and me:
        print(f"rank {rank} done", flush=True)
        return
    dist.barrier()
    if rank == 0:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/larch_export.pt")
        print("rank 0 saved export", f"{WORK}/larch_export.pt", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_hf(a):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))
    me = a.fault_rank == rank
    seq = 40 if a.fault == "shape_all" else 24

    class Ds(torch.utils.data.Dataset):
        def __len__(self):
            return 96
        def __getitem__(self, i):
            if a.fault == "worker_crash" and me and i >= 0 and torch.utils.data.get_worker_info() is not None and self.calls > 8:
                os.kill(os.getpid(), signal.SIGKILL)
            self.calls += 1
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(5, 60, (seq,), generator=g)
            return {"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": torch.tensor(float(ids[:3].sum()) / 100.0)}
    Ds.calls = 0

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=32, num_labels=1, problem_type="regression")
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)

    class T(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = model(**inputs)
            loss = out.loss
            mae = (out.logits.squeeze(-1) - inputs["labels"]).abs().mean()
            print(f"rank {rank} step {self.state.global_step} loss {loss.item():.4f} gdd_mae {mae.item():.4f}", flush=True)
            return (loss, out) if return_outputs else loss

    args = TrainingArguments(output_dir=f"{WORK}/hf_out_{a.tag}", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], max_steps=6, per_device_train_batch_size=4, logging_steps=100, save_strategy="no",
                             dataloader_num_workers=1 if a.fault == "worker_crash" else 0, disable_tqdm=True)
    tr = T(model=model, args=args, train_dataset=Ds())
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/hf_out_{a.tag}/export")
        print("rank 0 saved export", f"{WORK}/hf_out_{a.tag}/export", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="acc")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", dest="fault_rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--tag", default="x")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.prepare:
        return prepare()
    if a.mode == "hf":
        return run_hf(a)
    return run_acc(a)


if __name__ == "__main__":
    main()
