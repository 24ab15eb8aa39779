"""Batch 623 fault job: bromeliad tank pools.

A tiny regressor predicts the water volume held in each bromeliad leaf-axil tank pool from
synthetic features (leaf span, rosette height, rainfall, pool species code looked up through
a JSON table). `--prepare` writes per-rank shards, the species lookup table and a start
checkpoint into /tmp/fault623_work. Training: gloo on CPU, 6 steps, every rank prints
`rank R step S loss L pool_ml M`; rank 0 saves an export at the end.

Modes: `--mode trainer` (LightningModule + L.Trainer with DDPStrategy over gloo) and
`--mode fabric` (lightning.fabric.Fabric with its own loop). Process-group timeout 12 s
(`--pg-timeout`).

Faults (`--fault NAME --rank N`):
  none            control run
  uneven          rank N's shard has 3 batches; it leaves the loop early and goes to the final barrier
  slow_eval       rank 0 alone runs a slow evaluation (sleeps past the timeout) before the final barrier
  ckpt_rank0      rank 0 loads a truncated start checkpoint before broadcasting it
  unpicklable     rank N puts a lambda into the all_gather_object summary
  p2p_tag         ring send/recv where rank N sends with the wrong tag
  mbarrier        rank N never reaches dist.monitored_barrier(timeout=6 s)
  thread_exc      rank N's background prefetch thread raises; the main loop waits on its queue
  watchdog        rank N stalls; its heartbeat watchdog prints and SIGKILLs its own process
  save_full       rank N saves its end-of-training state to /dev/full
  subproc         rank N runs a helper command that exits 2 (subprocess.run check=True)
  new_group       rank N calls dist.new_group with a different rank list
  env_missing     the job reads BROMELIAD_TANK_DIR, which the bash launcher leaves out for rank N
  keyerror        rank N's shard names a pool species missing from the lookup table
  nan             rank N's loss becomes NaN at step 3; the script's check raises FloatingPointError
  sigsegv         rank N dereferences a null pointer at step 3
  ext_stop        (launcher) the launcher PID is sent SIGTERM a few seconds into training

Runs (one line per log):
  bromeliad_none_np5_rnone_plfabric: Control run: all 5 ranks print 6 steps, rank 0 saves the export, exit 0.
  bromeliad_subproc_np6_r5_pltorchrun: After 6 steps rank 5's calibration helper exits 2 and subprocess.run raises CalledProcessError; ranks 0-4 fail in all_gather_object with gloo 'Connection closed by peer' and torchrun SIGTERMs the rest.
  bromeliad_nan_np8_r7_pltorchrun: Rank 7's loss is NaN at step 3 and the script's check raises FloatingPointError; the other ranks fail in DDP's gradient all_reduce with 'Connection closed by peer' or 12 s gloo recv timeouts.
  bromeliad_uneven_np5_r2_plfabric: Rank 2's shard has 3 batches; it goes to all_gather_object after step 2 while the others enter step 3's gradient all_reduce, and all five ranks time out after 12 s in gloo send/recv.
  bromeliad_unpicklable_np6_r3_plfabric: After 6 steps rank 3's all_gather_object summary holds a lambda: AttributeError Can't pickle local object; the other ranks fail in all_gather_object with 'Connection closed by peer'.
  bromeliad_ckpt_rank0_np4_r0_pltee: Rank 0 loads a truncated start checkpoint in setup (PytorchStreamReader failed finding central directory) before broadcasting it; ranks 1-3 fail in broadcast with 'Connection closed by peer'. Output prefixed by --tee 3.
  bromeliad_mbarrier_np5_r4_plfabric: Rank 4 sleeps before dist.monitored_barrier(timeout=6 s); rank 0 reports 'Rank 4 failed to pass monitoredBarrier in 6000 ms', ranks 1-3 report errors waiting on rank 0.
  bromeliad_env_missing_np5_r3_plbashloop: The bash loop leaves BROMELIAD_TANK_DIR out for rank 3, which raises KeyError in os.environ while building its dataloader; the other ranks fail with 'Connection closed by peer' and the loop reports every rank exiting 1.
  bromeliad_p2p_tag_np3_r2_plloglevel: Rank 2 sends its ring token to rank 0 with tag 5 instead of 0; rank 0 times out in recv and rank 2 in send.wait after 12 s, rank 1 in Lightning's post_setup barrier. LOGLEVEL=INFO torchrun lines included.
  bromeliad_thread_exc_np5_r1_pltorchrun: Rank 1's prefetch thread raises RuntimeError ('Exception in thread pool-prefetch-1') and its training_step waits on the thread's queue; ranks 0,2,3,4 time out after 12 s in gloo, rank 1 fails in Lightning's SIGTERM handler after torchrun's SIGTERM.
  bromeliad_watchdog_np4_r3_plfabric: Rank 3 stalls at step 2; its watchdog prints 'no training progress for 4.5s' and SIGKILLs its own process (torchrun: exitcode -9), ranks 0 and 2 fail with 'Connection closed by peer'.
  bromeliad_keyerror_np3_r1_plown: Lightning launched its own 3 processes; rank 1's shard names 'Catopsis', missing from the species table, and load_shard raises KeyError; ranks 0 and 2 fail with 'Connection closed by peer'.
  bromeliad_slow_eval_np5_r0_plfabric: After step 5 rank 0 alone runs a slow evaluation past the 12 s timeout; ranks 1-4 time out in all_gather_object (gloo send/recv), rank 0 has no error and is SIGTERMed.
  bromeliad_save_full_np3_r2_plfabric: Rank 2's end-of-training torch.save to /dev/full raises 'RuntimeError: basic_ios::clear: iostream error'; ranks 0 and 1 fail in the final barrier with 'Connection closed by peer'.
  bromeliad_ext_stop_np4_rnone_plfabric: The torchrun PID was sent SIGTERM from outside; the 6 steps and the export had already finished, torchrun prints 'Received 15 death signal', SIGTERMs the workers and raises SignalException.
  bromeliad_new_group_np4_r1_plfabric: After step 5 rank 1 calls new_group([0,1]) while the others call new_group([0,1,2,3]); output stops with no error until the outer 60 s timeout SIGTERMs torchrun (SignalException), exit 124.
  bromeliad_sigsegv_np6_r0_plfabric: Rank 0 dereferences a null pointer at step 3 and dies by SIGSEGV (torchrun exitcode -11, no Python traceback); ranks 1 and 5 fail with gloo 'Connection reset by peer'.
  bromeliad_ext_stop_np5_rnone_pltorchrun: Control Trainer run; the torchrun PID was sent SIGINT from outside after step 0; torchrun forwards SIGINT to the workers (Lightning: 'Detected KeyboardInterrupt') and raises SignalException: got signal: 2.
  bromeliad_mbarrier_np7_r3_pltee: Trainer run; rank 3 sleeps before monitored_barrier(timeout=6 s) in on_train_end; rank 0 reports 'Rank 3 failed to pass monitoredBarrier in 6000 ms', the others report errors waiting on rank 0; rank 3 ends with Connection closed by peer.
  (unused)
  (unused)
  (unused)
"""
import argparse, ctypes, json, math, os, queue, signal, subprocess, sys, threading, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault623_work"
SPECIES = ["Guzmania", "Vriesea", "Aechmea", "Neoregelia", "Tillandsia", "Billbergia"]
STEPS = 6
BATCH = 8

p = argparse.ArgumentParser()
p.add_argument("--prepare", action="store_true")
p.add_argument("--mode", default="fabric", choices=["trainer", "fabric"])
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--devices", type=int, default=0)
p.add_argument("--pg-timeout", type=float, default=12.0)
args = p.parse_args()


def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    json.dump({s: i for i, s in enumerate(SPECIES)}, open(f"{WORK}/species.json", "w"))
    g = torch.Generator().manual_seed(623)
    for r in range(world):
        n = STEPS * BATCH
        rows = [{"leaf_span": float(torch.rand(1, generator=g)) * 40, "height": float(torch.rand(1, generator=g)) * 30,
                 "rain": float(torch.rand(1, generator=g)) * 10, "species": SPECIES[i % len(SPECIES)]} for i in range(n)]
        json.dump(rows, open(f"{WORK}/shard_{r}.json", "w"))
        json.dump(rows[: 3 * BATCH], open(f"{WORK}/shard_{r}_short.json", "w"))
    model = make_model()
    torch.save(model.state_dict(), f"{WORK}/start.pt")
    data = open(f"{WORK}/start.pt", "rb").read()
    open(f"{WORK}/start_truncated.pt", "wb").write(data[: len(data) // 2])
    print("prepared", WORK)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3 + len(SPECIES), 16), nn.Tanh(), nn.Linear(16, 1))


def F(name, rank):
    return args.fault == name and (args.rank == rank or args.rank == -1)


def load_shard(rank):
    if F("env_missing", rank) or args.fault == "env_missing":
        base = os.environ["BROMELIAD_TANK_DIR"]
    else:
        base = os.environ.get("BROMELIAD_TANK_DIR", WORK)
    fn = f"{base}/shard_{rank}_short.json" if F("uneven", rank) else f"{base}/shard_{rank}.json"
    rows = json.load(open(fn))
    table = json.load(open(f"{WORK}/species.json"))
    if F("keyerror", rank):
        rows[5]["species"] = "Catopsis"
    xs, ys = [], []
    for row in rows:
        code = table[row["species"]]
        onehot = [0.0] * len(SPECIES)
        onehot[code] = 1.0
        xs.append([row["leaf_span"] / 40, row["height"] / 30, row["rain"] / 10] + onehot)
        ys.append([0.02 * row["leaf_span"] * row["rain"] + 0.5 * code])
    return torch.tensor(xs), torch.tensor(ys)


def start_checkpoint(model, rank):
    # rank 0 reads the start checkpoint and broadcasts it
    if rank == 0:
        path = f"{WORK}/start_truncated.pt" if F("ckpt_rank0", 0) else f"{WORK}/start.pt"
        model.load_state_dict(torch.load(path))
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)


def ring_exchange(rank, world):
    token = torch.tensor([float(rank)])
    got = torch.zeros(1)
    tag = 5 if F("p2p_tag", rank) else 0
    s = dist.isend(token, dst=(rank + 1) % world, tag=tag)
    dist.recv(got, src=(rank - 1) % world, tag=0)
    s.wait()
    print(f"rank {rank} ring token from {int(got.item())}", flush=True)


class Prefetch:
    def __init__(self, rank):
        self.q = queue.Queue()
        self.rank = rank

    def start(self):
        threading.Thread(target=self.run, name=f"pool-prefetch-{self.rank}", daemon=True).start()

    def run(self):
        for step in range(STEPS):
            if step == 2 and F("thread_exc", self.rank):
                raise RuntimeError(f"pool sensor feed for rank {self.rank} returned an empty reading at step {step}")
            self.q.put(step)


class Watchdog:
    def __init__(self, rank, limit=4.0):
        self.rank, self.limit, self.beat = rank, limit, time.time()
        threading.Thread(target=self.run, name="heartbeat", daemon=True).start()

    def run(self):
        while True:
            time.sleep(0.5)
            if time.time() - self.beat > self.limit:
                print(f"[watchdog rank {self.rank}] no training progress for {time.time() - self.beat:.1f}s "
                      f"(limit {self.limit}s); killing this process with SIGKILL", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def step_faults(rank, step, loss, pre):
    if step == 2 and F("watchdog", rank):
        time.sleep(60)
    if step == 3 and F("sigsegv", rank):
        ctypes.string_at(0)
    if step == 3 and F("nan", rank):
        loss = loss * float("nan")
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
    if pre is not None:
        pre.q.get()
    return loss


def end_of_training(model, rank, world):
    if F("slow_eval", 0) and rank == 0:
        print("rank 0 evaluating pool volumes on the held-out tanks", flush=True)
        time.sleep(args.pg_timeout + 10)
    if F("subproc", rank):
        subprocess.run(["bash", "-c", "echo 'pool gauge calibration: sensor offline' >&2; exit 2"], check=True)
    if args.fault == "new_group":
        ranks = [0, 1] if F("new_group", rank) else list(range(world))
        g = dist.new_group(ranks)
        dist.all_reduce(torch.ones(1), group=g)
    if args.fault == "mbarrier":
        if F("mbarrier", rank):
            time.sleep(20)
        dist.monitored_barrier(timeout=timedelta(seconds=6))
    summary = {"rank": rank, "pool_ml": float(sum(p.sum() for p in model.parameters()))}
    if F("unpicklable", rank):
        summary["scorer"] = lambda v: v * 2
    gathered = [None] * world
    dist.all_gather_object(gathered, summary)
    if F("save_full", rank):
        torch.save(model.state_dict(), "/dev/full")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_pools.pt")
        print(f"rank 0 saved export {WORK}/export_pools.pt", flush=True)


def train_fabric():
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    world = int(os.environ.get("WORLD_SIZE", args.devices or 1))
    fabric = Fabric(accelerator="cpu", devices=world,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    x, y = load_shard(rank)
    model = make_model()
    start_checkpoint(model, rank)
    ring_exchange(rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    pre = Prefetch(rank); pre.start()
    wd = Watchdog(rank) if F("watchdog", rank) else None
    nb = len(x) // BATCH
    for step in range(min(STEPS, nb)):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        loss = nn.functional.mse_loss(model(xb), yb)
        loss = step_faults(rank, step, loss, pre)
        opt.zero_grad(); fabric.backward(loss); opt.step()
        m = torch.tensor([float(model(xb).mean())])
        dist.all_reduce(m)
        if wd: wd.beat = time.time()
        print(f"rank {rank} step {step} loss {loss.item():.4f} pool_ml {m.item() / world:.4f}", flush=True)
    end_of_training(model.module if hasattr(model, "module") else model, rank, world)
    dist.destroy_process_group()


def train_trainer():
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class PoolModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.pre = None
            self.wd = None

        def setup(self, stage):
            self.r, self.w = dist.get_rank(), dist.get_world_size()
            start_checkpoint(self.net, self.r)
            ring_exchange(self.r, self.w)

        def train_dataloader(self):
            x, y = load_shard(dist.get_rank())
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)

        def on_train_start(self):
            self.pre = Prefetch(self.r); self.pre.start()
            self.wd = Watchdog(self.r) if F("watchdog", self.r) else None

        def training_step(self, batch, i):
            xb, yb = batch
            loss = nn.functional.mse_loss(self.net(xb), yb)
            loss = step_faults(self.r, i, loss, self.pre)
            m = torch.tensor([float(self.net(xb).mean())])
            dist.all_reduce(m)
            if self.wd: self.wd.beat = time.time()
            print(f"rank {self.r} step {i} loss {loss.item():.4f} pool_ml {m.item() / self.w:.4f}", flush=True)
            return loss

        def on_train_end(self):
            end_of_training(self.net, self.r, self.w)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    world = args.devices or int(os.environ.get("WORLD_SIZE", 1))
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    trainer.fit(PoolModule())


if __name__ == "__main__":
    if args.prepare:
        prepare()
    elif args.mode == "fabric":
        train_fabric()
    else:
        train_trainer()
