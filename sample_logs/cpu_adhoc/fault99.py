"""A ninety-ninth hand-run batch: BUFFERS AND NORMALIZATION STATE ACROSS RANKS. A tiny classifier under DDP on gloo:
an input normalizer (buffers feat_mean/feat_var updated with momentum 0.1 in train mode, plus a step counter),
Linear(8,16)-BatchNorm1d(16)-ReLU-Linear(16,4) and an auxiliary head Linear(16,4) that is only used in train mode
(the model returns (logits, aux) when training, logits in eval mode, as torchvision's Inception does). SGD, batch 16,
--steps steps (6) over a synthetic per-rank shard, a finite-loss check, PG timeout --pg-timeout (12 s). DDP keeps
broadcast_buffers=True unless the fault says otherwise. Every 2 steps the main rank (--rank for the eval faults,
else 0) evaluates a validation batch with model.module in eval mode under no_grad and puts the model back in train
mode. No @record.

Faults:
  none       control: `rank R done` at the end (exit 0)
  nobcast    control: broadcast_buffers=False and an all_reduce (average) of every BatchNorm/normalizer buffer
             each 3 steps on every rank (exit 0)
  syncbn     every rank converts the model with nn.SyncBatchNorm.convert_sync_batchnorm (the GPU recipe) and runs it
             on CPU: DDP's construction raises ValueError
  syncbn1    only rank N converts (its node's SYNC_BN=1 in the environment file)
  bn1        rank N's shard has 16*(steps-1)+1 samples, batched without drop_last: its last batch holds one sample,
             and BatchNorm in train mode raises `Expected more than 1 value per channel when training`
  bufone     rank N registers an extra `act_hist` buffer (its node has DEBUG_ACT_HIST=1): DDP's construction
             broadcasts params and buffers from rank 0 with differing tensor lists
  bufdtype   rank N's input-normalizer statistics are computed with NumPy (its stats cache is missing) and stored as
             float64 buffers; the other ranks load float32 tensors from the cache
  bufshape   a MoCo-style queue buffer whose length comes from the rank's config: rank N's says 48, the others 64
  emaname    the main rank (N) keeps an EMA of model.module's state_dict and updates it from the DDP wrapper's
             state_dict, whose keys carry `module.`: KeyError
  evalone    the main rank's (N) validation hook forgets model.train(): from the next step rank N runs in eval mode,
             its aux head gets no gradient, and DDP (find_unused_parameters=False) raises on the following step
  valgrad    the main rank (N) evaluates through the DDP wrapper (model(x) instead of model.module(x)): DDP's
             pre-forward buffer broadcast runs on rank N only, and the ranks' collectives go out of step
  skipsync   broadcast_buffers=False; the BatchNorm stats all_reduce is placed inside the main rank's (N) logging
             branch, so only rank N runs it
  precisebn  at step 2 the main rank (N) recomputes precise BatchNorm statistics over 150 calibration batches read
             from disk (0.1 s each) before evaluating; the others go on to step 3
  pbnhang    as precisebn, but rank N's calibration prefetch thread yields only 20 of the 150 batches it waits for:
             rank N waits forever on the queue (use a long --pg-timeout and an outer `timeout`)
  nanbuf     rank N's sample 5 of step 3 carries a sensor reading of 1e39 (inf in float32): the input normalizer's
             running mean/var become inf/nan and the loss is nan; the finite-loss check raises FloatingPointError
  ckptbuf    every rank initialises from a float16 export whose exporter kept floating tensors only, dropping the
             integer buffers (`seen`; BN fills in its num_batches_tracked): load_state_dict: missing key "seen"
"""
import argparse, copy, datetime, math, os, queue, threading, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault99_work")
a = p.parse_args()
BATCH = 16


class Net(nn.Module):
    def __init__(self, queue_len=64):
        super().__init__()
        self.fc1, self.bn, self.fc2, self.aux = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.register_buffer("feat_mean", torch.zeros(8))
        self.register_buffer("feat_var", torch.ones(8))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        if a.fault == "bufshape":
            self.register_buffer("queue", torch.zeros(queue_len, 16))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.feat_mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.feat_var.mul_(0.9).add_(0.1 * x.var(0, unbiased=False))
                self.seen += x.shape[0]
        x = (x - self.feat_mean) / torch.sqrt(self.feat_var + 1e-5)
        h = F.relu(self.bn(self.fc1(x)))
        if self.training:
            return self.fc2(h), self.aux(h)
        return self.fc2(h)


def make_shard(rank: int, n: int):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, 8, generator=g) * 2 + 1
    y = torch.randint(0, 4, (n,), generator=g)
    return x, y


def sync_stats(model: nn.Module, world: int):
    for name, buf in model.named_buffers():
        if buf.is_floating_point():
            dist.all_reduce(buf)
            buf.div_(world)


def calib_loader(rank: int, n_batches: int, produce: int):
    q = queue.Queue(maxsize=8)

    def producer():
        for i in range(produce):
            time.sleep(0.1)  # reads one calibration batch from disk
            q.put(make_shard(rank + 500 + i, BATCH)[0])

    threading.Thread(target=producer, daemon=True, name="calib-prefetch").start()
    for _ in range(n_batches):
        yield q.get()


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    main_rank = a.rank if a.fault in ("emaname", "evalone", "valgrad", "skipsync", "precisebn", "pbnhang") else 0
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(0)
    net = Net(queue_len=48 if (a.fault == "bufshape" and me) else 64)
    print(f"rank {rank} world {world} fault {a.fault} buffers "
          + ",".join(f"{n}:{tuple(b.shape)}" for n, b in net.named_buffers()), flush=True)
    if a.fault == "ckptbuf":
        path = f"{a.workdir}/export_fp16.pt"
        if rank == 0:
            ref = Net()
            # the exporter keeps floating tensors only, to store them as float16
            torch.save({k: v.half() for k, v in ref.state_dict().items() if v.is_floating_point()}, path)
        dist.barrier()
        sd = {k: v.float() for k, v in torch.load(path).items()}
        net.load_state_dict(sd)
        print(f"rank {rank} initialised from {path}", flush=True)
    if a.fault == "bufone" and me:
        net.register_buffer("act_hist", torch.zeros(16, 10))  # DEBUG_ACT_HIST=1 on this node
        print(f"rank {rank}: DEBUG_ACT_HIST=1, registered act_hist buffer", flush=True)
    if a.fault == "bufdtype":
        x0, _ = make_shard(rank, 256)
        if me:  # stats cache missing on this node: recompute with NumPy
            arr = x0.numpy().astype(np.float64)
            net.feat_mean = torch.from_numpy(arr.mean(0))
            net.feat_var = torch.from_numpy(arr.var(0))
            print(f"rank {rank}: stats cache missing, computed input statistics with numpy", flush=True)
        else:
            net.feat_mean, net.feat_var = x0.mean(0), x0.var(0, unbiased=False)
    if a.fault == "syncbn" or (a.fault == "syncbn1" and me):
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        print(f"rank {rank}: SYNC_BN=1, converted BatchNorm to SyncBatchNorm", flush=True)
    if a.fault in ("nobcast", "skipsync"):
        model = nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)  # rank-local BN statistics
    else:
        model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = copy.deepcopy(model.module.state_dict()) if (a.fault == "emaname" and rank == main_rank) else None

    n = BATCH * (a.steps - 1) + 1 if (a.fault == "bn1" and me) else BATCH * a.steps
    xs, ys = make_shard(rank, n)
    xv, yv = make_shard(rank + 100, BATCH)
    for step in range(1, a.steps + 1):
        x, y = xs[(step - 1) * BATCH: step * BATCH], ys[(step - 1) * BATCH: step * BATCH]
        if a.fault == "nanbuf" and me and step == 3:
            raw = x.double()  # the shard's rows as parsed (float64)
            raw[5, 2] = 1e39  # a saturated sensor's reading
            x = raw.float()  # to the model's dtype: inf
        opt.zero_grad()
        res = model(x)
        if isinstance(res, tuple):
            loss = F.cross_entropy(res[0], y) + 0.3 * F.cross_entropy(res[1], y)
        else:
            loss = F.cross_entropy(res, y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}, stopping")
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} seen {int(model.module.seen)}", flush=True)
        if a.fault == "nobcast" and step % 3 == 0:
            sync_stats(model.module, world)
        if rank == main_rank and step % 2 == 0:
            if a.fault == "skipsync":
                sync_stats(model.module, world)
            print(f"rank {rank} step {step} bn running_mean[:3] {model.module.bn.running_mean[:3].tolist()}",
                  flush=True)
        if ema is not None:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    if v.is_floating_point():
                        ema[k].mul_(0.99).add_(0.01 * v)
        if rank == main_rank and step % 2 == 0:
            if a.fault in ("precisebn", "pbnhang") and step == 2:
                model.train()
                bn = model.module.bn
                bn.reset_running_stats()
                bn.momentum = None  # cumulative average
                produce = 20 if a.fault == "pbnhang" else 150
                print(f"rank {rank}: recomputing precise BN statistics over 150 batches", flush=True)
                with torch.no_grad():
                    for xb in calib_loader(rank, 150, produce):
                        model.module(xb)
                bn.momentum = 0.1
            model.eval()
            with torch.no_grad():
                if a.fault == "valgrad":
                    val = F.cross_entropy(model(xv), yv)  # through the DDP wrapper
                else:
                    val = F.cross_entropy(model.module(xv), yv)
            print(f"rank {rank} step {step} val_loss {val.item():.4f}", flush=True)
            if a.fault != "evalone":
                model.train()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
