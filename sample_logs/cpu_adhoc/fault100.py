"""A hundredth hand-run batch: FROZEN LAYERS, ADAPTERS AND TEACHER-STUDENT TRAINING, on gloo. A tiny "pretrained"
student (stem Linear(16,32) -> ReLU -> blocks.0 Linear(32,32) -> ReLU -> blocks.1 Linear(32,32) -> ReLU -> head
Linear(32,4), weights from torch.manual_seed(0), the same on every rank) is fine-tuned the usual adapter way: the whole
model requires_grad_(False), LoRA adapters (rank 4, alpha 8: lora_A [4,32], lora_B [32,4], B zero-init) injected into
blocks.0 and blocks.1, the head unfrozen; then DDP (find_unused_parameters False) and AdamW with two parameter groups
(adapters lr 1e-2, head lr 1e-3). Batches of 16 samples x[16,16] per rank and step, labels from a fixed random
"true" projection; loss = cross-entropy, plus with --distill 1 a frozen teacher (hidden 64, loaded from
{workdir}/teacher.pt, eval(), called under torch.no_grad(), not wrapped) and KL(student/T || teacher/T) * T^2, T=2.
6 steps, PG timeout --pg-timeout (12 s). --ddp 0 (for the TORCH_DISTRIBUTED_DEBUG=DETAIL runs: DDP's construction
segfaults under DETAIL on this build, as batches 94 and 98 found) replaces DDP by one all_reduce per trainable
parameter's gradient after backward (a hand-written `allreduce_grads`). `--prep 1` (no torchrun) writes the teacher
checkpoints into the work dir. It prints `rank R world W fault F`, `rank R trainable K params [names...]`,
`rank R step S loss L`, `step S mean loss L` (rank 0, an all_reduce of the losses) and `rank R done`. No @record.

Faults (--rank N is the rank whose code or files are odd, -1 = every rank; the step is --at, 3, unless said):
  none         control (exit 0); with --distill 1 the teacher-student control
  optbefore    the optimizer is built (over the trainable parameters) before the adapters are injected: only the head
               trains, the adapters stay at zero; no error (exit 0, a silent bug)
  freezediff   rank N's recipe leaves the stem trainable (a stale freeze list): 8 trainable parameters against 6 on
               the others, at DDP's construction check
  adapterrank  rank N injects its adapters with r=8 (its own default) instead of 4: the same number of parameters,
               different shapes, at DDP's construction check
  notrain      rank N (-1: every rank) unfreezes `classifier` (the old head name), not `head`, and its adapter list is
               empty: nothing requires a gradient when DDP wraps the model
  teacherddp   the frozen teacher is wrapped in DDP too (every rank): nothing in it requires a gradient
  teachershape rank N's teacher comes from {workdir}/teacher_v0.pt (a 6-class teacher of an older label set; the node's
               cache has it under the old name); the KL term meets logits [16,6] against [16,4] at step 1
  teacherckpt  rank N loads {workdir}/teacher_h48.pt (hidden 48) into the teacher built from the config (hidden 64):
               load_state_dict size mismatch
  latefreeze   at step --at rank N (-1: every rank) freezes the head (the "adapters-only" phase) after DDP wrapped the
               model: the reducer waits for the head's gradients; the error comes at the next forward
  rewrap       layer-wise unfreezing at the start of epoch 2: unfreeze blocks.1's base weight and re-wrap DDP. An epoch
               is len(shard)//16 steps of the rank's shard; rank N's shard is larger (it got the remainder), so it
               re-wraps a step later than the others
  unfreezeddp  (--ddp 0) at step --at rank N's schedule unfreezes the stem; its allreduce_grads now starts with the
               stem's weight [32,16] while the others start with blocks.0's lora_A [4,32]
  dupgroup     rank N (-1: every rank) adds a "blocks" group (lr 1e-4) built from names containing "blocks." that
               require grad, next to the adapter group: the adapters are in two groups
  emptyopt     rank N (-1: every rank) builds the optimizer before the adapters and the head are unfrozen:
               `optimizer got an empty parameter list`
  teachercache rank N (--distill 1) builds its teacher-logits cache for its shard at step --at, reading 40 shard files
               at 0.5 s each from slow storage, before its forward: the others wait in DDP's all-reduce
  teacherwait  (--distill 1) every rank waits for {workdir}/teacher_ready.flag before loading the teacher; rank 0 is
               meant to write it after exporting the teacher, but writes `teacher-ready.flag`: every rank polls forever
"""
import argparse, datetime, math, os, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault100_work")
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--distill", type=int, default=0)
p.add_argument("--prep", type=int, default=0)
a = p.parse_args()
B, D, C, T = 16, 16, 4, 2.0


class Net(nn.Module):
    def __init__(self, hidden=32, classes=C):
        super().__init__()
        self.stem = nn.Linear(D, hidden)
        self.blocks = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for blk in self.blocks:
            h = torch.relu(blk(h))
        return self.head(h)


class LoRALinear(nn.Module):
    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        self.base, self.scale = base, alpha / r
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def mine(rank):
    return a.rank in (rank, -1)


def inject(model, targets, r):
    for i in targets:
        model.blocks[i] = LoRALinear(model.blocks[i], r=r)


def load_teacher(rank):
    path = f"{a.workdir}/teacher.pt"
    if a.fault == "teachershape" and mine(rank):
        path = f"{a.workdir}/teacher_v0.pt"
    ck = torch.load(path)
    teacher = Net(**ck["config"])
    if a.fault == "teacherckpt" and mine(rank):
        ck = torch.load(f"{a.workdir}/teacher_h48.pt")
        teacher = Net(hidden=64)  # built from the run's config, not from the checkpoint's
    teacher.load_state_dict(ck["state_dict"])
    teacher.requires_grad_(False)
    return teacher.eval()


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(B, D, generator=g)
    w = torch.Generator().manual_seed(99)
    y = (x @ torch.randn(D, C, generator=w)).argmax(1)
    return x, y


def build_opt(model):
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    groups = [{"params": [q for n, q in named if "lora_" in n], "lr": 1e-2},
              {"params": [q for n, q in named if n.endswith(("head.weight", "head.bias"))], "lr": 1e-3}]
    if a.fault == "dupgroup" and mine(int(os.environ["RANK"])):
        groups.append({"params": [q for n, q in named if "blocks." in n], "lr": 1e-4})
    if a.fault == "optbefore" or (a.fault == "emptyopt" and mine(int(os.environ["RANK"]))):
        groups = [{"params": [q for n, q in named], "lr": 1e-2}]
    return torch.optim.AdamW([gr for gr in groups if gr["params"]] or groups[0]["params"], weight_decay=0.0)


def prep():
    os.makedirs(a.workdir, exist_ok=True)
    for name, cfg in (("teacher", dict(hidden=64)), ("teacher_v0", dict(hidden=64, classes=6)),
                      ("teacher_h48", dict(hidden=48))):
        torch.manual_seed(1)
        torch.save({"config": cfg, "state_dict": Net(**cfg).state_dict()}, f"{a.workdir}/{name}.pt")
    print("teacher checkpoints written to", a.workdir)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    print(f"rank {rank} world {world} fault {a.fault}", flush=True)
    torch.manual_seed(0)
    model = Net()  # the "pretrained" backbone
    model.requires_grad_(False)
    opt = None
    if a.fault == "optbefore" or (a.fault == "emptyopt" and mine(rank)):
        model.head.requires_grad_(a.fault == "optbefore")
        opt = build_opt(model)  # built before the adapters are in
    r = 8 if (a.fault == "adapterrank" and mine(rank)) else 4
    targets = [] if (a.fault == "notrain" and mine(rank)) else [0, 1]
    inject(model, targets, r)
    unfreeze = ["classifier"] if (a.fault == "notrain" and mine(rank)) else ["head"]
    if a.fault == "freezediff" and mine(rank):
        unfreeze.append("stem")  # a stale freeze list
    for n, q in model.named_parameters():
        if n.split(".")[0] in unfreeze:
            q.requires_grad_(True)
    names = [n for n, q in model.named_parameters() if q.requires_grad]
    print(f"rank {rank} trainable {len(names)} params {names}", flush=True)
    teacher = None
    if a.distill:
        if a.fault == "teacherwait":
            if rank == 0:
                open(f"{a.workdir}/teacher-ready.flag", "w").close()  # the exporter's name for it
            while not os.path.exists(f"{a.workdir}/teacher_ready.flag"):
                time.sleep(0.5)
        teacher = load_teacher(rank)
    if a.fault == "teacherddp":
        teacher = DDP(load_teacher(rank))
    ddp = DDP(model) if a.ddp else model
    if opt is None:
        opt = build_opt(model)
    shard = 3 * B + (B if (a.fault == "rewrap" and rank == a.rank) else 0)  # the remainder went to one rank
    epoch_len, cache = shard // B, None
    for step in range(1, a.steps + 1):
        if a.fault == "rewrap" and step == epoch_len + 1:  # epoch 2: unfreeze blocks.1 and re-wrap
            model.blocks[1].base.weight.requires_grad_(True)
            opt.add_param_group({"params": [model.blocks[1].base.weight], "lr": 1e-4})
            ddp = DDP(model)
            print(f"rank {rank} step {step} unfroze blocks.1.base.weight, re-wrapped DDP", flush=True)
        if a.fault == "latefreeze" and mine(rank) and step == a.at:
            model.head.requires_grad_(False)  # adapters-only phase
            print(f"rank {rank} step {step} froze the head", flush=True)
        if a.fault == "unfreezeddp" and rank == a.rank and step == a.at:
            model.stem.requires_grad_(True)
            opt.add_param_group({"params": list(model.stem.parameters()), "lr": 1e-4})
            print(f"rank {rank} step {step} unfroze the stem", flush=True)
        x, y = batch(rank, step)
        if a.fault == "teachercache" and step == a.at and cache is None:
            cache = {}
            for i in range(40 if rank == a.rank else 0):  # its shard files, from slow storage
                time.sleep(0.5)
                with torch.no_grad():
                    cache[i] = teacher(torch.randn(B, D))
            print(f"rank {rank} step {step} teacher cache {len(cache)} shards", flush=True)
        out = ddp(x)
        loss = F.cross_entropy(out, y)
        if teacher is not None:
            with torch.no_grad():
                t_logits = teacher(x)
            loss = loss + F.kl_div(F.log_softmax(out / T, -1), F.log_softmax(t_logits / T, -1),
                                   log_target=True, reduction="batchmean") * T * T
        opt.zero_grad()
        loss.backward()
        if not a.ddp:  # allreduce_grads
            for q in [q for q in model.parameters() if q.requires_grad]:
                dist.all_reduce(q.grad)
                q.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        lt = torch.tensor([loss.item()])
        dist.all_reduce(lt)
        if rank == 0:
            print(f"step {step} mean loss {lt.item() / world:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    prep() if a.prep else main()
