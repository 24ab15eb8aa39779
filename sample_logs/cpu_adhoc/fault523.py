"""Irrigation sluice gate scheduling: a small distributed training job (gloo, CPU).

Each rank reads its own shard of gate telemetry (upstream/downstream level, inflow, hour, gate id),
looks the gate's capacity up in a shared table, starts from a common checkpoint and trains a small
MLP that predicts the gate opening. Every step all ranks all-reduce their gate MAE and all-reduce a
per-gate flow total (12 gates). Rank 0 saves an export at the end. 6 steps.

  --prepare                 write synthetic data into /tmp/fault523_work
  --form plown|pltorchrun|pltee|plloglevel|plbashloop   (Lightning Trainer)   |  plfabric (Fabric loop)
  --fault NAME --rank N     plant one fault (--pg-timeout, default 12 s)

Faults:
  none          control, nothing planted
  badgate       rank N's shard names gate G-41, which the lookup table no longer has (KeyError in the dataset)
  missingshard  rank N's shard file is missing (FileNotFoundError at setup)
  ckptsize      rank N loads a stale checkpoint with hidden size 24 instead of 32 (load_state_dict size mismatch)
  weightsonly   rank N loads the checkpoint that pickles a GateSchedule object; torch.load(weights_only=True) refuses it
  wrongsize     rank N all-reduces a flow-total tensor of 13 gates instead of 12 (collective size mismatch)
  slowgate      rank N spends 90 s of pure-Python work at step 3; peers time out in the gradient all-reduce
                (with --pg-timeout 300 it is a hang that `timeout` ends)
  nanflow       rank N's inflow reading is NaN at step 3; the script's own finiteness check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 3 (stand-in for a native gate-driver crash)
  selferror     rank N prints its own ERROR line (infeasible schedule) and calls sys.exit(4) at step 3
  shapebug      every rank drops the capacity column at step 3 (matmul shape error on all ranks)
  workercrash   rank N's DataLoader worker is SIGKILLed while loading step 3's batch
  hostmem       rank N, under a small address-space limit, builds a dense minute-by-minute schedule table (CPU alloc fails)

What happened (Lightning 2.6.6, torch 2.13.0+cpu, gloo, 2-core shared host):
  none          np3 torchrun: six steps on every rank, max_steps=6 reached, rank 0 saved the export; exit 0
  badgate       np5 r3 torchrun / np3 r1 bash loop: KeyError 'G-41' in the planted rank's dataset; peers get gloo "Connection closed by peer"
  missingshard  np6 r4 torchrun --tee 3: FileNotFoundError for shards_v2/shard_r4.jsonl; peers get connection closed
  ckptsize      np4 r2 Fabric: load_state_dict size mismatch (24 vs 32) on rank 2; peers get connection closed
  weightsonly   np5 r1 LOGLEVEL=INFO torchrun: UnpicklingError "Unsupported global: GLOBAL __main__.GateSchedule" on rank 1
  wrongsize     np4 r3 torchrun: gloo enforce "Received data size doesn't match expected size", terminate called, local_rank 3 exit -6
  slowgate      np4 r1 torchrun: peers time out after 12000 ms in the gradient all-reduce; np3 r2 with --pg-timeout 300: hang, timeout 60 ended it (137)
  nanflow       np5 r4 bash loop / np7 r6 torchrun: FloatingPointError from the script's own check on the planted rank
  segv          np8 r5 torchrun --tee 3: rank 5 dies with SIGSEGV (-11, root cause in torchrun's summary); peers time out / connection closed
  selferror     np6 r3 LOGLEVEL=INFO torchrun: rank 3's ERROR line, exit 4 without traceback; peers get connection closed
  shapebug      np4 all Fabric: every rank raises "mat1 and mat2 shapes cannot be multiplied (8x5 and 6x32)"
  workercrash   np3 r2 torchrun: "DataLoader worker (pid N) is killed by signal: Killed" on rank 2
  hostmem       np3 r1 bash loop: "DefaultCPUAllocator: can't allocate memory ... 4246732800 bytes" on rank 1
  (--form plown, Lightning starting its own ranks, never got past start-up on this host and was dropped.)
"""
import argparse, json, os, random, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault523_work"
N_GATES = 12
BATCH = 8
STEPS = 6
FAULT_STEP = 3


class GateSchedule:
    def __init__(self, gates):
        self.gates = gates


def make_model(hidden=32):
    return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare(world_max=8):
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(523)
    table = {f"G-{g:02d}": {"capacity": round(2.0 + 0.6 * g, 2)} for g in range(N_GATES)}
    json.dump(table, open(f"{WORK}/gates.json", "w"))
    for r in range(world_max):
        with open(f"{WORK}/shard_r{r}.jsonl", "w") as f:
            for i in range(BATCH * STEPS):
                g = rng.randrange(N_GATES)
                up, down, inflow = rng.uniform(2, 5), rng.uniform(0.5, 2), rng.uniform(1, 9)
                rec = {"gate": f"G-{g:02d}", "up": up, "down": down, "inflow": inflow, "hour": rng.randrange(24),
                       "opening": min(1.0, inflow / table[f"G-{g:02d}"]["capacity"] / 3)}
                f.write(json.dumps(rec) + "\n")
    torch.manual_seed(0)
    torch.save(make_model(32).state_dict(), f"{WORK}/init.pt")
    torch.save(make_model(24).state_dict(), f"{WORK}/init_h24.pt")
    torch.save({"model": make_model(32).state_dict(), "schedule": GateSchedule(list(table))}, f"{WORK}/init_sched.pt")
    print("prepared", WORK)


class GateShard(Dataset):
    def __init__(self, rank, fault, frank, worker_fault):
        path = f"{WORK}/shard_r{rank}.jsonl"
        if fault == "missingshard" and rank == frank:
            path = f"{WORK}/shards_v2/shard_r{rank}.jsonl"
        self.recs = [json.loads(l) for l in open(path)]
        self.table = json.load(open(f"{WORK}/gates.json"))
        self.bad = fault == "badgate" and rank == frank
        self.nan = fault == "nanflow" and rank == frank
        self.kill = worker_fault

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        rec = dict(self.recs[i])
        if i == FAULT_STEP * BATCH + 2:
            if self.bad:
                rec["gate"] = "G-41"
            if self.nan:
                rec["inflow"] = float("nan")
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
        cap = self.table[rec["gate"]]["capacity"]
        h = rec["hour"] / 24 * 6.2832
        x = torch.tensor([rec["up"], rec["down"], rec["inflow"], float(torch.sin(torch.tensor(h))),
                          float(torch.cos(torch.tensor(h))), cap])
        return x, torch.tensor([rec["opening"]]), int(rec["gate"][2:])


def load_start(model, rank, fault, frank):
    path = f"{WORK}/init.pt"
    if fault == "ckptsize" and rank == frank:
        path = f"{WORK}/init_h24.pt"
    if fault == "weightsonly" and rank == frank:
        path = f"{WORK}/init_sched.pt"
    sd = torch.load(path, map_location="cpu")
    if "model" in sd:
        sd = sd["model"]
    model.load_state_dict(sd)


def before_step(rank, step, args, x):
    if step != FAULT_STEP:
        return x
    f, n = args.fault, args.rank
    if f == "slowgate" and rank == n:
        t0, acc = time.time(), 0
        while time.time() - t0 < 90:
            acc = sum(i * i for i in range(20000)) % 7 + acc
    if f == "segv" and rank == n:
        os.kill(os.getpid(), signal.SIGSEGV)
    if f == "selferror" and rank == n:
        print(f"ERROR [sluice-ctl rank {rank}] gate G-05 schedule infeasible at step {step}: "
              f"demand 14.2 m3/s exceeds capacity 5.0 m3/s; aborting", flush=True)
        sys.exit(4)
    if f == "hostmem" and rank == n:
        import resource
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        table = torch.zeros(N_GATES * 1440, 60, 1024)  # minute-by-minute dense schedule (~4 GB)
        x = x + table.sum() * 0
    if f == "shapebug":
        x = x[:, :5]
    return x


def after_loss(rank, step, args, loss, mae, gates, x):
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (gate inflow check)")
    n = N_GATES + 1 if (args.fault == "wrongsize" and rank == args.rank and step == FAULT_STEP) else N_GATES
    flows = torch.zeros(n)
    flows.index_add_(0, gates, x[:, 2].detach())
    dist.all_reduce(flows)
    m = mae.detach().clone()
    dist.all_reduce(m)
    return (m / dist.get_world_size()).item()


def dl(rank, args):
    wf = args.fault == "workercrash" and rank == args.rank
    return DataLoader(GateShard(rank, args.fault, args.rank, wf), batch_size=BATCH, shuffle=False,
                      num_workers=1 if wf else 0)


def wait_for_peers(world):
    # start-up gate: on a busy 2-core host the ranks import Lightning slowly, so wait until every local
    # process has finished its imports before the (12 s) process-group rendezvous starts.
    d = f"{WORK}/ready/{os.environ.get('MASTER_PORT', '0')}"
    os.makedirs(d, exist_ok=True)
    open(f"{d}/{os.environ.get('LOCAL_RANK', '0')}", "w").close()
    t0 = time.time()
    while len(os.listdir(d)) < world and time.time() - t0 < 120:
        time.sleep(0.2)


def export(rank, model):
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/gate_sched.pt")
        print("rank 0 saved export", f"{WORK}/export/gate_sched.pt", flush=True)


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy as _DDP

    class DDPStrategy(_DDP):
        def setup_distributed(self):
            wait_for_peers(args.devices)
            super().setup_distributed()

    class GateModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(32)

        def setup(self, stage):
            load_start(self.net, self.global_rank, args.fault, args.rank)

        def train_dataloader(self):
            return dl(self.global_rank, args)

        def training_step(self, batch, i):
            x, y, g = batch
            r = self.global_rank
            x = before_step(r, i, args, x)
            pred = self.net(x)
            loss = nn.functional.mse_loss(pred, y)
            mae = (pred - y).abs().mean()
            m = after_loss(r, i, args, loss, mae, g, x)
            print(f"rank {r} step {i} loss {loss.item():.4f} gate_mae {m:.4f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            export(self.global_rank, self.net)

    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(GateModule())


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    wait_for_peers(args.devices)
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    r = fabric.global_rank
    model = make_model(32)
    load_start(model, r, args.fault, args.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    for i, (x, y, g) in enumerate(dl(r, args)):
        if i >= STEPS:
            break
        x = before_step(r, i, args, x)
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        mae = (pred - y).abs().mean()
        m = after_loss(r, i, args, loss, mae, g, x)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        print(f"rank {r} step {i} loss {loss.item():.4f} gate_mae {m:.4f}", flush=True)
    export(r, model.module if hasattr(model, "module") else model)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--form", default="pltorchrun")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.prepare:
        prepare()
    elif a.form == "plfabric":
        run_fabric(a)
    else:
        run_trainer(a)
