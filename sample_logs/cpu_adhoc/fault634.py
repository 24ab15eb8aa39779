"""fault634.py -- batch 634, theme "saguaro water storage".

A tiny regression job: from a saguaro's height, girth, rib spread and recent rainfall it predicts
how many litres of water the cactus stores.  `--prepare` writes per-rank shards, a JSON lookup table
(rib-class -> storage factor, applied to every sample) and a start checkpoint into /tmp/fault634_work.
torch.distributed/gloo on CPU, process-group timeout 12 s (--pg-timeout), 6 steps; every rank prints
`rank R step S loss L stored_litres M`; rank 0 saves an export at the end.
Modes: plain (torchrun), --acc (accelerate Accelerator(cpu=True)), --hf (transformers.Trainer, 1-layer GPT-2).

Faults (--fault NAME --rank N):
  none          control run
  twofail       rank N's DataLoader worker raises at step 2; rank M (last rank, or 1) sleeps 1 s and
                all_reduces a tensor of another size
  stallraise    rank N sleeps past the timeout at step 2; rank M, 4 s later, raises ValueError
  warnstorm     every rank warns each step (deprecation, DataLoader UserWarning, gloo env notice);
                rank N at step 4 loads a checkpoint of the wrong shape
  retryfail     rank N's gauge read fails once (logged with traceback, retried, works); rank M at
                step 4 raises KeyError in the lookup table
  chained       rank N's rib-record decode error re-raised as RuntimeError(...) from err, step 3
  finallyfail   rank N raises IndexError at step 3 inside try/finally; the finally's save to /dev/full fails
  allsame       every rank raises ValueError at step 4, rank N at step 3
  p2p           rank N logs an unrelated ERROR at step 1 and goes on; at step 3 it posts a recv nobody sends
  sigkill       rank N SIGKILLs itself at step 3 while its 2 persistent DataLoader workers are alive
  envlazy       rank N lazily imports a missing module (saguaro_hydrology) at step 3
  nan           every rank's loss is NaN at step 3; only rank N checks and raises FloatingPointError
  sysexit       rank N logs an ERROR line then sys.exit("...") at step 3
  restart       attempt 0: rank N KeyError at step 2; attempt 1 (restart): rank N's shard file missing
  keyerror      rank N KeyError in the lookup table at step 3
  missingshard  rank N's shard file is missing at start
  sigsegv       rank N SIGSEGVs itself at step 3

Runs (one line per log):
  saguaro_chained_np8_r5_torchrun: rank 5 chained RuntimeError (from ValueError) at step 3, peers gloo connection closed; exit 1
  saguaro_missingshard_np7_r6_accdebug: rank 6 FileNotFoundError for its shard before step 1; exit 1
  saguaro_twofail_np6_r2_torchrun: rank 2 worker ValueError at step 2, then rank 5 gloo size mismatch abort (SIGABRT); exit 1
  saguaro_allsame_np6_r3_acc: rank 3 ValueError at step 3; others died in all_reduce before their own step-4 raise; exit 1
  saguaro_envlazy_np6_r4_acc2nodes: rank 4 ModuleNotFoundError saguaro_hydrology at step 3, two agents report; exit 1
  saguaro_finallyfail_np5_r2_accconfig: rank 2 IndexError at step 3, finally's save to /dev/full fails too; exit 1
  saguaro_stallraise_np5_r0_tee: rank 0 stalls at step 2, rank 4 ValueError 4 s later, no timeout fires; exit 1
  saguaro_warnstorm_np5_r4_acc: ~130 warning lines, then rank 4 load_state_dict size mismatch at step 4; exit 1
  saguaro_sigkill_np5_r3_tee: rank 3 SIGKILL at step 3, workers and peers silent; exit 1
  saguaro_nan_np5_r1_torchrun: step-3 loss nan on all, ranks 0/2/3/4 print it, rank 1 FloatingPointError; exit 1
  saguaro_sysexit_np3_r2_hf: Trainer run, rank 2 ERROR line + sys.exit at step 3; exit 1
  saguaro_retryfail_np4_r1_accdebug: rank 1 gauge read fails once and is retried; rank 3 KeyError '99' at step 4; exit 1
  saguaro_p2p_np4_r2_torchrun: rank 2 unrelated ERROR at step 1, unmatched recv at step 3, all ranks gloo 12 s timeouts; exit 1
  saguaro_restart_np4_r3_torchrun: attempt 0 rank 3 KeyError '7'; restarted attempt: Gloo connectFullMesh refused on all ranks; exit 1
  saguaro_keyerror_np3_r0_hf: Trainer run under accelerate launch, rank 0 KeyError '11' at step 3; exit 1
  saguaro_sigsegv_np3_r1_hf: Trainer run, rank 1 SIGSEGV at step 3, peers connection reset; exit 1
  saguaro_none_np3_rnone_torchrun: control, 6 steps, export saved; exit 0
  saguaro_sysexit_np4_r1_acc2nodes: rank 1 ERROR line + sys.exit at step 3 on two accelerate 'machines'; exit 1
  saguaro_nan_np8_r7_tee: step-3 loss nan on all, ranks 0-6 print it, rank 7 FloatingPointError (--tee 3); exit 1
  (dropped) saguaro_nan_np8_r7_tee first try: ran before the others printed 'loss nan' (old code), re-run on port 39921
  (dropped) saguaro_twofail_np4_r0_acc: rank 0 worker ValueError; rank 3 never reached its mismatched all_reduce

"""
import argparse, json, math, os, signal, sys, time, traceback, warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = Path("/tmp/fault634_work")
STEPS, BATCH, NFEAT = 6, 8, 4


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--acc", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    return p.parse_args()


def prepare():
    WORK.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(634)
    for r in range(8):
        x = torch.rand(STEPS * BATCH, NFEAT, generator=g)
        rib = torch.randint(0, 5, (STEPS * BATCH,), generator=g)
        y = (x[:, 0] * 3 + x[:, 1] * 2 + x[:, 3]).unsqueeze(1)
        torch.save({"x": x, "rib": rib, "y": y}, WORK / f"shard_{r}.pt")
    json.dump({str(k): 1.0 + 0.1 * k for k in range(5)}, open(WORK / "rib_lookup.json", "w"))
    torch.save(make_model().state_dict(), WORK / "start.pt")
    bad = nn.Sequential(nn.Linear(NFEAT, 24), nn.ReLU(), nn.Linear(24, 1))
    torch.save(bad.state_dict(), WORK / "rainy_season.pt")
    print("prepared", WORK)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(NFEAT, 16), nn.ReLU(), nn.Linear(16, 1))


class SaguaroShard(Dataset):
    def __init__(self, rank, world, fault, frank):
        d = torch.load(WORK / f"shard_{rank}.pt")
        self.x, self.rib, self.y = d["x"], d["rib"], d["y"]
        self.lookup = json.load(open(WORK / "rib_lookup.json"))
        self.rank, self.fault, self.frank = rank, fault, frank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.fault == "twofail" and self.rank == self.frank and i == BATCH:
            raise ValueError(f"saguaro shard {self.rank}: rib spread reading {i} is negative (-3.2 cm)")
        f = self.lookup[str(int(self.rib[i]))]
        return self.x[i], self.y[i] * f


def other_rank(n, w):
    return w - 1 if n != w - 1 else 1


def log(rank, msg):
    print(f"[saguaro rank {rank}] {msg}", flush=True)


def decode_rib_record(rank, raw):
    try:
        return int(raw)
    except ValueError as err:
        raise RuntimeError(f"could not decode saguaro rib record on rank {rank}") from err


def at_step(step, rank, world, a, lookup):
    f, n = a.fault, a.rank
    m = other_rank(n, world)
    if f == "warnstorm":
        warnings.warn("rib_lookup.json format v1 is deprecated; use v2 gauges", DeprecationWarning)
        warnings.warn("This DataLoader will create 1 worker process in total; pin_memory ignored on CPU", UserWarning)
        warnings.warn("GLOO_SOCKET_IFNAME is not set; gloo picks the interface of the hostname", UserWarning)
        if rank == n and step == 4:
            model = make_model()
            model.load_state_dict(torch.load(WORK / "rainy_season.pt"))
    if f == "stallraise" and step == 2:
        if rank == n:
            log(rank, "waiting for the rain gauge to settle")
            time.sleep(a.pg_timeout + 20)
        elif rank == m:
            time.sleep(4)
            raise ValueError(f"stored water estimate {-17.5} litres is negative on rank {rank}")
    if f == "retryfail":
        if rank == n and step == 2:
            p = WORK / f"rain_gauge_{rank}.json"
            for attempt in (1, 2):
                try:
                    gauge = json.load(open(p))
                    log(rank, f"rain gauge read on attempt {attempt}: {gauge}")
                    break
                except OSError:
                    print(f"ERROR [saguaro rank {rank}] rain gauge read failed (attempt {attempt}), retrying", flush=True)
                    traceback.print_exc()
                    json.dump({"mm": 12.5}, open(p, "w"))
        if rank == m and step == 4:
            lookup["99"]
    if f == "chained" and rank == n and step == 3:
        decode_rib_record(rank, "XIV-ribs")
    if f == "finallyfail" and rank == n and step == 3:
        try:
            rows = torch.load(WORK / f"shard_{rank}.pt")["x"]
            rows[STEPS * BATCH + 5]
        finally:
            torch.save({"step": step}, "/dev/full")
    if f == "allsame" and (step == 4 or (rank == n and step == 3)):
        raise ValueError(f"rib spread exceeds trunk girth at step {step}")
    if f == "p2p" and rank == n:
        if step == 1:
            print(f"ERROR [saguaro rank {rank}] soil probe offline, using the cached moisture value", flush=True)
        if step == 3:
            t = torch.zeros(3)
            dist.recv(t, src=(rank + 1) % world)
    if f == "sigkill" and rank == n and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if f == "envlazy" and rank == n and step == 3:
        import saguaro_hydrology  # noqa: F401
    if f == "sysexit" and rank == n and step == 3:
        print(f"ERROR [saguaro rank {rank}] trunk girth sensor returned 0 cm for every sample", flush=True)
        sys.exit(f"saguaro rank {rank}: refusing to train on a zero-girth shard")
    if f == "restart" and rank == n and step == 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        lookup["7"]
    if f == "keyerror" and rank == n and step == 3:
        lookup["11"]
    if f == "sigsegv" and rank == n and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)


def shard_for(rank, a):
    if a.fault == "missingshard" and rank == a.rank:
        return rank + 100
    if a.fault == "restart" and rank == a.rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return rank + 200
    return rank


def train_loop(a):
    if a.fault == "warnstorm":
        warnings.simplefilter("always")
    acc = None
    if a.acc:
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs
        acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
        rank, world = acc.process_index, acc.num_processes
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
        rank, world = dist.get_rank(), dist.get_world_size()
    sid = shard_for(rank, a)
    if sid != rank:
        torch.load(WORK / f"shard_{sid}.pt")
    ds = SaguaroShard(rank, world, a.fault, a.rank)
    nw = 2 if a.fault == "sigkill" else 1
    dl = DataLoader(ds, batch_size=BATCH, num_workers=nw, persistent_workers=True)
    model = make_model()
    model.load_state_dict(torch.load(WORK / "start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if acc:
        model, opt = acc.prepare(model, opt)
    for step, (x, y) in enumerate(dl, start=1):
        at_step(step, rank, world, a, ds.lookup)
        if a.fault == "nan" and step == 3:
            x = x * float("nan")
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if a.fault == "nan" and not math.isfinite(loss.item()) and (rank == a.rank or print(f"rank {rank} step {step} loss {loss.item():.4f} stored_litres nan", flush=True)):
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        if acc:
            acc.backward(loss)
        else:
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            if a.fault == "twofail" and rank == other_rank(a.rank, world) and step == 2:
                time.sleep(1)
                flat = torch.zeros(7)
            dist.all_reduce(flat)
        if acc and a.fault == "twofail" and rank == other_rank(a.rank, world) and step == 2:
            time.sleep(1)
            dist.all_reduce(torch.zeros(7))
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {loss.item():.4f} stored_litres {pred.mean().item() * 100:.1f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), WORK / "saguaro_export.pt")
        print("rank 0 saved export", WORK / "saguaro_export.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


class HFShard(torch.utils.data.Dataset):
    def __init__(self, rank, a):
        d = torch.load(WORK / f"shard_{shard_for(rank, a)}.pt")
        self.ids = (d["x"] * 60).long().clamp(0, 63)
        self.lookup = json.load(open(WORK / "rib_lookup.json"))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_loop(a):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ds = HFShard(rank, a)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))

    class Storage(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            at_step(state.global_step + 1, rank, world, a, ds.lookup)

    class SaguaroTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = model(**inputs)
            loss = out.loss
            if a.fault == "nan" and self.state.global_step + 1 == 3:
                loss = loss * float("nan")
            if a.fault == "nan" and rank == a.rank and not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {self.state.global_step + 1}")
            print(f"rank {rank} step {self.state.global_step + 1} loss {loss.item():.4f} stored_litres {out.logits.mean().item() * 100:.1f}", flush=True)
            return (loss, out) if return_outputs else loss

    targs = TrainingArguments(output_dir=str(WORK / "hf_out"), use_cpu=True, ddp_backend="gloo", ddp_timeout=int(a.pg_timeout),
                              per_device_train_batch_size=2, max_steps=STEPS, report_to=[],
                              disable_tqdm=True, save_strategy="no", logging_steps=1, dataloader_num_workers=0)
    tr = SaguaroTrainer(model=model, args=targs, train_dataset=ds, callbacks=[Storage()])
    tr.train()
    if rank == 0:
        tr.save_model(str(WORK / "hf_export"))
        print("rank 0 saved export", WORK / "hf_export", flush=True)


if __name__ == "__main__":
    a = parse()
    if a.prepare:
        prepare()
    elif a.hf:
        hf_loop(a)
    else:
        train_loop(a)
