"""A hundred-and-twelfth hand-run batch: LOCAL SGD, PERIODIC MODEL AVERAGING AND FEDERATED-STYLE ROUNDS.
A tiny regression model (Linear(8,16)-ReLU-Linear(16,1), Adam, gloo) trained for --steps steps. Each rank reads its
own client's batches through a prefetch thread (a queue of 2; --step-s sleep stands in for the read) and prints
`rank R step S loss L`; with --log-every 1 the loss is also all-reduced each step and rank 0 prints
`step S global loss L`. Every rank reads its node's config (period K, lr scale, frozen layers, ...), in this script
the dict returned by node_config(). Three ways to average (--avg):
  periodic  DDP with post_localSGD_hook (global gradient all_reduce for --warmup steps, then subgroups of one rank,
            i.e. purely local steps) and PeriodicModelAverager(period=K, warmup_steps=--warmup) after opt.step()
  manual    no DDP: gradients all-reduced by hand during warm-up, then every K steps a hand-written average
            (all_reduce of each parameter, then divide by the world size; --avg-opt 1: Adam's state as well)
  fed       federated-style rounds of K local steps: sample counts all-reduced first, then each client's update,
            normalised by its number of local steps (FedNova) and weighted by its sample count, is all-reduced;
            the new global model is checked for non-finite values after every round
Before each averaging the parameter distance from the last global model is checked (drift: warning past half of
--drift-max, RuntimeError past it). --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s).

Faults:
  none        control, exit 0 (any --avg)
  period      rank N's node config says K=3 where the others have K=2: it skips the others' second averaging and
              its per-step loss all_reduce pairs with their averaging all_reduce
  zerocount   (fed) rank N's client is left with 0 samples after the dedup filter: 0 local steps, its update is
              0/0 = NaN, and NaN times its weight 0 is still NaN: the whole global model is NaN after round 0
  extraparam  rank N's node runs the model variant with a learnable output scale (one extra parameter at the end):
              the hand-written averaging/gradient loops walk different parameter lists
  frozen      rank N's node config freezes the first layer (a fine-tuning leftover); the averaging skips frozen
              parameters (requires_grad False), so rank N averages a shorter list
  fp16        the averaging traffic (counts and updates) is sent in float16 to halve the bytes (-1: every rank);
              each client's count fits in float16 but the all-reduced total (> 65504) overflows to inf
  badbatch    rank N's client shard has a truncated record at local step --at: 12 labels for 16 inputs (mse_loss
              warns about the target size, then fails to broadcast) while the others wait at the next collective
  drift       rank N's lr is scaled by its local batch size (8x): the drift check warns at the first averaging and
              raises RuntimeError at a later one, while the others wait in the averaging all_reduce
  stale       resume: every rank loads its node-local copy of the last checkpoint (staged by this script in
              --workdir); rank N's copy is stale (an older step, the last sync to its node failed); the resume
              check all-gathers the steps and refuses to go on, on every rank
  hookcpu     (periodic, -1) every rank builds PostLocalSGDState(subgroup=None) as in the docs' example: the hook
              calls dist.new_subgroups() with its default group size at the first local step, which needs CUDA
  prefetch    rank N's prefetch thread hits an unparsable record at step --at and dies (printed by the threading
              excepthook); the main thread waits on the queue forever, the others wait in the next all_reduce
  optstate    (manual, --avg-opt 1) rank N's node config turns on amsgrad: its Adam state has an extra
              max_exp_avg_sq per parameter, so the optimizer-state averaging walks a longer list

What happened (filled in after the runs):
  none: exit 0 (periodic np4; fed on two emulated nodes, np6).
  period: rank N's loss all_reduce met the others' averaging all_reduce: gloo EnforceNotMet, rank N SIGABRT.
  zerocount: NaN global model after round 0; FloatingPointError on every rank (rank N printed 'no samples').
  extraparam: manual: gloo EnforceNotMet in the warm-up gradient loop at step 0, rank N SIGABRT.
  frozen: (manual, --warmup 0) gloo EnforceNotMet at the first average (step 0), rank N SIGABRT.
  fp16: (-1) total inf, NaN model, FloatingPointError everywhere; (rank N only) EnforceNotMet '4 vs 2' at once.
  badbatch: UserWarning (target size) then RuntimeError on rank N at step 3; the others Connection closed.
  drift: RuntimeError at the first averaging already (drift 2.140 > 1.0), no warning came first.
  stale: every rank raised 'ranks resumed from different steps [6, 6, 6, 2]' naming rank N.
  hookcpu: ValueError from new_subgroups() inside DDP's backward at step 2 on every rank.
  prefetch: 'Exception in thread prefetch-N' (ValueError), then the others' 12 s gloo timeouts.
  optstate: gloo EnforceNotMet at the first averaging; the SIGABRT landed on a peer (rank 1), not rank N.
"""
import argparse, datetime, math, os, queue, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--avg", default="periodic", choices=["periodic", "manual", "fed"])
p.add_argument("--steps", type=int, default=10)
p.add_argument("--period", type=int, default=2)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--at", type=int, default=3)
p.add_argument("--log-every", type=int, default=1)
p.add_argument("--avg-opt", type=int, default=0)
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--drift-max", type=float, default=1.0)
p.add_argument("--step-s", type=float, default=0.2)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault112_work")
a = p.parse_args()


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


def node_config(rank: int) -> dict:
    cfg = {"period": a.period, "lr_scale": 1.0, "freeze": [], "logit_scale": False, "amsgrad": False,
           "avg_dtype": torch.float32, "samples": 40000 + 6000 * rank}
    if faulty(rank, "period"):
        cfg["period"] = 3
    if faulty(rank, "zerocount"):
        cfg["samples"] = 0
    if faulty(rank, "extraparam"):
        cfg["logit_scale"] = True
    if faulty(rank, "frozen"):
        cfg["freeze"] = ["body.0"]
    if faulty(rank, "fp16"):
        cfg["avg_dtype"] = torch.float16
    if faulty(rank, "drift"):
        cfg["lr_scale"] = 8.0
    if faulty(rank, "optstate"):
        cfg["amsgrad"] = True
    return cfg


class Net(nn.Module):
    def __init__(self, logit_scale: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        if logit_scale:
            self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        out = self.body(x)
        return out * self.scale if hasattr(self, "scale") else out


def parse_record(line: str) -> torch.Tensor:
    return torch.tensor([float(v) for v in line.split(",")])


def prefetch(rank, n_steps, q):
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(n_steps):
        time.sleep(a.step_s)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True) * 0.1
        if faulty(rank, "prefetch") and step == a.at:
            x[3] = parse_record("0.12,-1.3,0.88,,0.4,1.1,-0.2,0.05")  # a record with an empty field
        if faulty(rank, "badbatch") and step == a.at:
            y = y[:12]  # the shard was truncated mid-write
        q.put((x, y))


def param_list(model):
    return [prm for prm in model.parameters() if prm.requires_grad]  # frozen ones never change: skip them


def drift_check(rank, step, model, ref):
    d = math.sqrt(sum(float((prm.data - r).pow(2).sum()) for prm, r in zip(model.parameters(), ref)))
    if d > a.drift_max:
        raise RuntimeError(f"rank {rank}: parameter drift {d:.3f} from the last global model exceeds "
                           f"drift_max={a.drift_max} at step {step}; local steps diverged (lr too high?)")
    if d > 0.5 * a.drift_max:
        print(f"WARNING rank {rank}: parameter drift {d:.3f} at step {step} is over half of drift_max="
              f"{a.drift_max}", flush=True)


def average_manual(model, opt, world):
    for prm in param_list(model):
        dist.all_reduce(prm.data)
        prm.data /= world
    if a.avg_opt:
        for prm in param_list(model):
            for k, v in sorted(opt.state[prm].items()):
                if torch.is_tensor(v) and v.dim() > 0:
                    dist.all_reduce(v)
                    v /= world


def stage_resume(rank, world, model, opt):
    """Stands in for the previous job's last checkpoint, copied to every node's local disk."""
    d = os.path.join(a.workdir, f"node{rank}")
    os.makedirs(d, exist_ok=True)
    step = 2 if faulty(rank, "stale") else 6
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(d, "last.pt"))
    return os.path.join(d, "last.pt")


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = node_config(rank)
    torch.manual_seed(0)
    model = Net(cfg["logit_scale"])
    for name, prm in model.named_parameters():
        if any(name.startswith(f + ".") for f in cfg["freeze"]):
            prm.requires_grad_(False)
    opt = torch.optim.Adam(param_list(model), lr=a.lr * cfg["lr_scale"], amsgrad=cfg["amsgrad"])
    start = 0
    if a.fault == "stale":
        path = stage_resume(rank, world, model, opt)
        ck = torch.load(path)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
        print(f"rank {rank} resumed from {path} at step {start}", flush=True)
        steps = [None] * world
        dist.all_gather_object(steps, start)
        if len(set(steps)) > 1:
            raise RuntimeError(f"ranks resumed from different steps {steps}: rank {steps.index(min(steps))} loaded "
                               f"an older checkpoint; refusing to average a stale model into the global one")
    K = cfg["period"]
    print(f"rank {rank}/{world} avg {a.avg} period {K} warmup {a.warmup} lr {a.lr * cfg['lr_scale']} "
          f"samples {cfg['samples']} avg dtype {str(cfg['avg_dtype']).split('.')[-1]}", flush=True)
    net, averager = model, None
    if a.avg == "periodic":
        net = DDP(model)
        if faulty(rank, "hookcpu"):
            sub = None  # as in the docs' example: one subgroup per node
        else:
            sub, _ = dist.new_subgroups(group_size=1)
        net.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=sub, start_localSGD_iter=a.warmup),
                               post_localSGD_hook)
        averager = PeriodicModelAverager(period=K, warmup_steps=a.warmup)
    n = cfg["samples"]
    tau = K if n > 0 else 0
    if a.avg == "fed":
        counts = torch.tensor([float(n), float(n * tau)], dtype=cfg["avg_dtype"])
        dist.all_reduce(counts)
        total, tau_eff = counts[0], counts[1] / counts[0]
        print(f"rank {rank}: {n} of {total.item():.0f} samples, weight {n / total.item():.4f}, "
              f"tau_eff {tau_eff.item():.3f}", flush=True)
    ref = [prm.detach().clone() for prm in model.parameters()]
    q = queue.Queue(maxsize=2)
    n_local = a.steps - start if a.avg != "fed" or tau else 0
    threading.Thread(target=prefetch, args=(rank, n_local, q), name=f"prefetch-{rank}", daemon=True).start()
    for step in range(start, a.steps):
        if a.avg == "fed" and not tau:
            loss = torch.zeros(())
            print(f"rank {rank} step {step}: client has no samples, no local step", flush=True)
        else:
            x, y = q.get()
            loss = F.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            if a.avg == "manual" and step < a.warmup:
                for prm in param_list(model):
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
            opt.step()
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        due = step >= a.warmup and (step - a.warmup) % K == 0
        if a.avg == "fed":
            due = (step + 1) % K == 0
        if due:
            drift_check(rank, step, model, ref)
        if a.avg == "periodic":
            averager.average_parameters(net.parameters())
        elif a.avg == "manual" and due:
            average_manual(model, opt, world)
        elif due:
            for prm, r in zip(model.parameters(), ref):
                upd = ((r - prm.data) / tau * (n / total)).to(cfg["avg_dtype"])
                dist.all_reduce(upd)
                prm.data = r - tau_eff.float() * upd.float()
            bad = [f"{nm}: {int((~torch.isfinite(prm)).sum())}/{prm.numel()}" for nm, prm in model.named_parameters()
                   if not torch.isfinite(prm).all()]
            if bad:
                raise FloatingPointError(f"round {step // K}: global model has non-finite values after "
                                         f"aggregation ({', '.join(bad)})")
        if due:
            ref = [prm.detach().clone() for prm in model.parameters()]
            print(f"rank {rank} step {step}: averaged ({a.avg})", flush=True)
        if a.log_every and a.avg != "fed" and step % a.log_every == 0:
            t = loss.detach().clone()
            dist.all_reduce(t)
            if rank == 0:
                print(f"step {step} global loss {t.item() / world:.4f}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
