"""Batch 574 fault script: a small yucca-moth pollination model trained with gloo on CPU.

Each rank reads its own shard of field records (yucca flower visits by Tegeticula moths:
ovule counts, larval counts, pod set), maps the yucca species to its pollinator through a
lookup table, starts from a checkpoint and trains a tiny MLP that predicts pod survival.
Every step each rank prints `rank R step S loss L pollination M`; rank 0 saves an export.

Modes: `--mode acc` (Hugging Face accelerate, forced onto CPU + gloo) and `--mode hf`
(transformers.Trainer with a tiny config-built GPT-2, use_cpu=True, ddp_backend gloo).
`--prepare` writes the synthetic data into /tmp/fault574_work.

Faults (`--fault NAME --rank N`):
  none           control, nothing planted
  species_key    rank N's shard has a yucca species missing from the pollinator table -> KeyError at step 3
  missing_shard  rank N opens a shard file that does not exist -> FileNotFoundError before step 1
  ckpt_size      rank N loads the checkpoint of a wider model (hidden 48, not 32) -> load_state_dict size mismatch
  weights_only   rank N loads a checkpoint that pickles a SeasonMeta object -> torch.load weights_only refusal
  gather_size    rank N all_gathers 5 moth counts where the others send 4 at step 3 -> gloo size error, peers time out
  slow_rank      rank N spends ~45 s in pure-Python pod bookkeeping at step 2 -> peers' gloo collective times out
                 (with --pg-timeout 300 the job hangs instead and `timeout` ends it)
  nan_check      rank N reads an ovule count of NaN at step 3; the script's finiteness check raises FloatingPointError
  segv           rank N sends itself SIGSEGV at step 2
  error_exit     rank N prints its own ERROR line at step 3 and calls sys.exit(4)
  shape_all      every rank adds a 13th feature (moth_count) the 12-input model does not take -> shape error at step 1
  host_mem       rank N (address space capped) builds a 60000x60000 flower co-occurrence matrix -> allocation fails
  worker_crash   a DataLoader worker of rank N is killed (SIGKILL) while loading its 3rd batch

What happened:
  none           np3 acc: 6 steps on every rank, export saved, exit 0
  species_key    np5 r3 torchrun: KeyError 'Yucca jaegeriana' on rank 3 at step 3, peers see gloo connection closed, exit 1
                 (np3 r1 hf run: the Trainer's shuffled sampler never drew the planted record; run dropped, fault widened, not rerun)
  missing_shard  np4 r2 accdebug: FileNotFoundError on rank 2 before step 1, exit 1
  ckpt_size      np6 r4 accconfig: load_state_dict size mismatch on rank 4 before step 1, exit 1
  weights_only   np4 r1 tee: UnpicklingError Weights only load failed on rank 1 before step 1, exit 1
  gather_size    np5 r2 acc: ProcessGroupGloo::allgather invalid tensor size on rank 2 after step 2, exit 1
  slow_rank      np4 r3 torchrun: ranks 0-2 gloo timeout 12000ms, rank 3 silent, exit 1;
                 np3 r1 acc --pg-timeout 300: hung after step 1, ended by timeout 60, exit 124
  nan_check, segv, error_exit, shape_all, host_mem, worker_crash: not run (time ran out)
"""
import argparse, json, os, random, resource, signal, sys, time
from datetime import timedelta

WORK = "/tmp/fault574_work"
YUCCAS = ["Yucca filamentosa", "Yucca brevifolia", "Yucca glauca", "Yucca elata", "Yucca baccata", "Yucca schidigera"]
MOTHS = ["Tegeticula yuccasella", "Tegeticula synthetica", "Tegeticula yuccasella", "Tegeticula elatella",
         "Tegeticula baccatella", "Tegeticula mojavella"]
NFEAT, HIDDEN, STEPS, BATCH = 12, 32, 6, 8


class SeasonMeta:
    def __init__(self, season, site):
        self.season, self.site = season, site


def prepare():
    import torch
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    rng = random.Random(574)
    for r in range(8):
        with open(f"{WORK}/shards/visits_{r:02d}.jsonl", "w") as f:
            for i in range(STEPS * BATCH * 2):
                rec = {"site": f"plot{r}-{i % 7}", "yucca": rng.choice(YUCCAS), "ovules": rng.randint(80, 220),
                       "eggs": rng.randint(0, 6), "larvae": rng.randint(0, 5), "pods": rng.randint(0, 3),
                       "petal_mm": round(rng.uniform(30, 60), 1), "night_temp": round(rng.uniform(8, 22), 1)}
                f.write(json.dumps(rec) + "\n")
    with open(f"{WORK}/pollinators.json", "w") as f:
        json.dump({y: i for i, y in enumerate(YUCCAS)}, f)
    torch.manual_seed(574)
    torch.save(make_model(HIDDEN).state_dict(), f"{WORK}/start.pt")
    torch.save(make_model(48).state_dict(), f"{WORK}/start_wide.pt")
    torch.save({"state": make_model(HIDDEN).state_dict(), "meta": SeasonMeta(2026, "Joshua Tree")}, f"{WORK}/start_meta.pt")
    print("prepared", WORK)


def make_model(hidden):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def load_records(rank, fault, frank):
    path = f"{WORK}/shards/visits_{rank:02d}.jsonl"
    if fault == "missing_shard" and rank == frank:
        path = f"{WORK}/shards/visits_{rank:02d}_2026.jsonl"
    with open(path) as f:
        recs = [json.loads(l) for l in f]
    if fault == "species_key" and rank == frank:
        recs[2 * BATCH + 3]["yucca"] = "Yucca jaegeriana"
    if fault == "nan_check" and rank == frank:
        recs[2 * BATCH + 1]["ovules"] = float("nan")
    return recs


def featurize(rec, table, extra):
    sp = table[rec["yucca"]]
    onehot = [1.0 if i == sp else 0.0 for i in range(6)]
    f = onehot + [rec["ovules"] / 200, rec["eggs"] / 6, rec["larvae"] / 5, rec["petal_mm"] / 60,
                  rec["night_temp"] / 22, 1.0]
    if extra:
        f.append(rec["eggs"] * 1.0)  # moth_count
    return f


class VisitSet:
    def __init__(self, recs, table, args, rank):
        self.recs, self.table, self.args, self.rank = recs, table, args, rank

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        import torch
        a = self.args
        if a.fault == "worker_crash" and self.rank == a.rank and i == 2 * BATCH + 2:
            os.kill(os.getpid(), signal.SIGKILL)
        rec = self.recs[i]
        x = torch.tensor(featurize(rec, self.table, a.fault == "shape_all"), dtype=torch.float32)
        y = torch.tensor([rec["pods"] / 3.0])
        return x, y


def pod_bookkeeping(seconds):
    t0, acc = time.time(), 0
    while time.time() - t0 < seconds:
        for k in range(20000):
            acc = (acc * 31 + k) % 1000003
    return acc


def run_acc(args):
    import torch, torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    if rank == 0:
        print(f"yucca-moth pollination model: world {world}, backend {dist.get_backend()}, fault {args.fault}", flush=True)
    with open(f"{WORK}/pollinators.json") as f:
        table = json.load(f)
    recs = load_records(rank, args.fault, args.rank)
    ds = VisitSet(recs, table, args, rank)
    nw = 1 if args.fault == "worker_crash" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)
    model = make_model(HIDDEN)
    ck = f"{WORK}/start.pt"
    if args.fault == "ckpt_size" and rank == args.rank:
        ck = f"{WORK}/start_wide.pt"
    if args.fault == "weights_only" and rank == args.rank:
        sd = torch.load(f"{WORK}/start_meta.pt")["state"]
    else:
        sd = torch.load(ck)
    model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    if args.fault == "host_mem" and rank == args.rank:
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        n = 60000
        print(f"rank {rank} building flower co-occurrence matrix {n}x{n}", flush=True)
        cooc = torch.zeros(n, n)
    it = iter(dl)
    for step in range(1, STEPS + 1):
        x, y = next(it)
        if args.fault == "segv" and rank == args.rank and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if args.fault == "error_exit" and rank == args.rank and step == 3:
            print(f"ERROR yucca: rank {rank} pod sample plot{rank}-3 has 0 Tegeticula larvae in 40 fruits; "
                  f"field sheet inconsistent, aborting", flush=True)
            sys.exit(4)
        if args.fault == "slow_rank" and rank == args.rank and step == 2:
            pod_bookkeeping(45 if args.pg_timeout < 100 else 400)
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (ovule counts of the batch: "
                                     f"{x[:, 6].mul(200).tolist()})")
        acc.backward(loss)
        opt.step(); opt.zero_grad()
        counts = torch.tensor([float(v) for v in x[:4, 8].mul(5).tolist()])
        if args.fault == "gather_size" and rank == args.rank and step == 3:
            counts = torch.cat([counts, torch.tensor([1.0])])
        bufs = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(bufs, counts)
        poll = acc.reduce(out.detach().mean().reshape(1), "mean").item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} pollination {poll:.4f}", flush=True)
    acc.wait_for_everyone()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/yucca_pod_model.pt")
        print(f"rank 0 saved export {WORK}/export/yucca_pod_model.pt", flush=True)
    acc.end_training()


def run_hf(args):
    import torch, torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, TrainerCallback
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{WORK}/pollinators.json") as f:
        table = json.load(f)
    recs = load_records(rank, args.fault, args.rank)
    if args.fault == "species_key" and rank == args.rank:
        for i in range(4, len(recs), 9):  # the Trainer's sampler shuffles: plant the unknown species throughout
            recs[i]["yucca"] = "Yucca jaegeriana"

    class TokSet(torch.utils.data.Dataset):
        def __len__(self):
            return len(recs)

        def __getitem__(self, i):
            r = recs[i]
            ids = [table[r["yucca"]] + 1, 10 + r["eggs"], 20 + r["larvae"], 30 + r["pods"], 40 + int(r["ovules"]) % 20]
            return {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}

    class Steps(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            s = state.global_step
            if args.fault == "error_exit" and rank == args.rank and s == 3:
                print(f"ERROR yucca: rank {rank} pod sample plot{rank}-3 has 0 Tegeticula larvae in 40 fruits; "
                      f"field sheet inconsistent, aborting", flush=True)
                sys.exit(4)
            if args.fault == "gather_size" and s == 3:
                c = torch.ones(5 if rank == args.rank else 4)
                bufs = [torch.zeros(4) for _ in range(dist.get_world_size())]
                dist.all_gather(bufs, c)
            t = torch.tensor([float(s)])
            dist.all_reduce(t)
            print(f"rank {rank} step {s} loss {self.last:.4f} pollination {t.item() / dist.get_world_size():.4f}", flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            pass

        last = 0.0

    cb = Steps()

    class T(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = super().compute_loss(model, inputs, return_outputs, **kw)
            cb.last = (out[0] if return_outputs else out).item()
            return out

    cfg = GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg)
    ta = TrainingArguments(output_dir=f"{WORK}/hf_out_{os.environ.get('MASTER_PORT', '0')}", use_cpu=True,
                           ddp_backend="gloo", ddp_timeout=args.pg_timeout, report_to=[], max_steps=STEPS,
                           per_device_train_batch_size=BATCH, logging_steps=1, save_strategy="no", dataloader_num_workers=0)
    tr = T(model=model, args=ta, train_dataset=TokSet(), callbacks=[cb])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/hf_{os.environ.get('MASTER_PORT', '0')}")
        print(f"rank 0 saved export {WORK}/export/hf_{os.environ.get('MASTER_PORT', '0')}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="acc", choices=["acc", "hf"])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    a = p.parse_args()
    if a.prepare:
        return prepare()
    (run_hf if a.mode == "hf" else run_acc)(a)


if __name__ == "__main__":
    main()
