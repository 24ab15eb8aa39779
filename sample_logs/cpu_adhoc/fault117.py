"""A hundred-and-seventeenth hand-run batch: PARAMETER-EFFICIENT FINE-TUNING (LORA / ADAPTERS). A tiny "base model"
(Linear(8,32) embedding, one transformer block with q/k/v/o projections and a 32-64-32 MLP, a 4-class head and an
unused pretraining aux_head) is written once as the hub's base checkpoint by rank 0 at start; every rank "downloads" it
into its node-local cache (cache_node<R>), loads it, freezes it and injects LoRA adapters (A: r x in, B: out x r,
scaling alpha/r kept as a float16 tensor) into the target modules of its adapter config (q_proj, v_proj, fc1; r=4,
alpha=8). `--resume 1` continues from the stage-1 adapter (written by rank 0 at start, loaded strictly). DDP over the
trainable parameters (`--ddp 0`: the flattened adapter gradients are all-reduced by hand), SGD, --steps steps
(`rank R step S loss L`), a finiteness check of the loss before backward. After the loop rank 0 saves the adapter
(adapter_model.pt + adapter_config.json), dist.barrier(), the merger rank (--merger, 0) merges the adapter into the
base (W += B @ A * scaling) and evaluates the merged model; dist.barrier(), `rank R done`, destroy_process_group().
--rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none      control: adapter saved and merged, `rank R done`, exit 0 on every rank
  target    rank N's adapter config (a per-node override) has a typo in target_modules ("v_porj"): get_submodule
            raises AttributeError on rank N while the others wait in DDP's construction
  rankr     rank N's adapter config has r=8 where the others have 4: DDP's parameter shape check at construction;
            with --ddp 0 the hand-written flat gradient all_reduce has a different length on rank N
  unfrozen  rank N's config has freeze_base false: its base parameters stay trainable and DDP sees more parameters
  unused    every rank targets "all-linear", which includes the pretraining aux_head that the fine-tuning forward
            never calls; DDP without find_unused_parameters fails at the second step on every rank
  fanout    the adapter config says fan_in_fan_out (copied from a GPT-2 Conv1D config): the merger transposes B @ A
            before adding it to nn.Linear weights; square q/v pass, fc1 (64x32) raises a size mismatch on the merger
  prefix    (--resume 1) the stage-1 adapter was saved from the DDP-wrapped model: every key starts with "module.";
            every rank's strict load raises missing/unexpected keys
  int8      every rank loads the base "in 8 bit" (weights cast to int8, the scale kept aside) and the frozen
            Linear layers run F.linear on float inputs with int8 weights: a dtype error on every rank at step 0
  alpha     rank N's sweep value for alpha is 2**18 instead of 2**3: alpha/r = 65536 overflows the float16 scaling
            buffer to inf, B = 0 at init gives 0 * inf = nan; the loss check raises FloatingPointError on rank N
  download  rank N's node cache holds base_model.pt.incomplete from another job's download; rank N waits for it
            to finish while the others wait in DDP's construction and time out (PG 300 s: hung until killed)
  abort     rank N dies by SIGABRT at step 4 (the fused LoRA kernel's assertion), no Python traceback
  label     rank N's shard holds the annotators' "other" label (index 4) in a 4-class head: cross_entropy's
            IndexError (Target 4 is out of bounds) on rank N at step 3
  nobase    rank N's node runs with HF_HUB_OFFLINE=1 and an empty cache: torch.load of the base raises
            FileNotFoundError on rank N

What happened (filled in after the runs):
  none: exit 0 (np4 plain; np3 LOGLEVEL=INFO with --resume 1): adapter saved, merged, eval acc 0.547 / 0.562.
  target: AttributeError: Block has no attribute `v_porj` on rank N (np4 r1 tee, np4 r2 two agents).
  rankr: DDP: `[2]: params[0] ... sizes [8, 32] appears not to match`; --ddp 0 + DETAIL: mismatch [1792] vs [896].
  unfrozen: every rank: DDP expects same model across all ranks, but Rank 1 has 28 params ... 6 params.
  unused: every rank at step 1: Expected to have finished reduction ... indices 14 15 (np4, np3).
  fanout: the merger's RuntimeError: The size of tensor a (32) must match ... (64); the others Connection closed.
  prefix: every rank: Missing key(s) / Unexpected key(s) "module.block..."; the restart died in connectFullMesh.
  int8: every rank at step 0: RuntimeError: self and mat2 must have the same dtype, but got Float and Char.
  alpha: FloatingPointError: rank N: non-finite loss nan at step 0 (the first take, a buffer synced by DDP: exit 0).
  download: PG 12 s: 12000ms timeouts in DDP's construction on the others; PG 300 s + timeout 60: hung, exit 124.
  abort: rank N exitcode -6 (SIGABRT) after step 4; peers Connection reset; the restart died in connectFullMesh.
  label: IndexError: Target 4 is out of bounds. on rank N at step 3 (np5 r3 filter, np4 r1 pymodule).
  nobase: FileNotFoundError: [Errno 2] ... cache_node<N>/base_model.pt on rank N (np4 r3, np5 r0).
"""
import argparse, datetime, json, math, os, shutil, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--merger", type=int, default=0)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--bs", type=int, default=8)
p.add_argument("--lr", type=float, default=0.2)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--work", default="/tmp/fault117_work/run")
a = p.parse_args()
NUM_CLASSES, SEQ, D = 4, 6, 32
DTYPES = {"float16": torch.float16, "float32": torch.float32}


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


def adapter_config(rank: int) -> dict:
    # configs/lora.yaml, then the per-node overrides of the sweep (alpha = 2**k)
    cfg = {"r": 4, "lora_alpha": 2 ** 3, "target_modules": ["q_proj", "v_proj", "fc1"], "scale_dtype": "float16",
           "fan_in_fan_out": a.fault == "fanout", "freeze_base": True, "load_in_8bit": a.fault == "int8"}
    if faulty(rank, "target"):
        cfg["target_modules"] = ["q_proj", "v_porj", "fc1"]
    if faulty(rank, "rankr"):
        cfg["r"] = 8
    if faulty(rank, "unfrozen"):
        cfg["freeze_base"] = False
    if a.fault == "unused":
        cfg["target_modules"] = "all-linear"
    if faulty(rank, "alpha"):
        cfg["lora_alpha"] = 2 ** 18
    return cfg


class Block(nn.Module):
    def __init__(self, d=D, ff=64):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        h = self.norm1(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.o_proj(att @ v)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class BaseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.block = Block()
        self.head = nn.Linear(D, NUM_CLASSES)
        self.aux_head = nn.Linear(D, 8)  # pretraining objective (reconstruction), unused when fine-tuning

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(1))


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: float, scale_dtype):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = torch.tensor(alpha / r, dtype=scale_dtype)  # a plain attribute, like peft's scaling dict

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def inject(model: nn.Module, cfg: dict) -> list:
    targets = cfg["target_modules"]
    if targets == "all-linear":
        targets = sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)} - {"head"})
    names = [n for n, m in model.named_modules() if n.split(".")[-1] in targets]
    for t in targets:  # every target must exist (peft: "Target modules ... not found in the base model")
        if not any(n.split(".")[-1] == t for n in names):
            model.get_submodule(f"block.{t}")
    torch.manual_seed(1)  # same adapter init on every rank
    for n in names:
        parent_name, _, child = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), cfg["r"], cfg["lora_alpha"],
                                          DTYPES[cfg["scale_dtype"]]))
    return names


def quantize_8bit(model: nn.Module) -> dict:
    scales = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            s = m.weight.detach().abs().max() / 127
            m.weight = nn.Parameter(torch.round(m.weight.detach() / s).to(torch.int8), requires_grad=False)
            scales[n] = s
    return scales


def fetch_base(rank: int) -> dict:
    hub = os.path.join(a.work, "hub", "base_model.pt")
    cache = os.path.join(a.work, f"cache_node{rank}")
    os.makedirs(cache, exist_ok=True)
    local = os.path.join(cache, "base_model.pt")
    if faulty(rank, "download"):
        open(local + ".incomplete", "w").close()  # stands in for another job's download on this node
    offline = faulty(rank, "nobase")  # this node's environment has HF_HUB_OFFLINE=1
    t0 = time.monotonic()
    while os.path.exists(local + ".incomplete"):
        if int(time.monotonic() - t0) % 10 == 0:
            print(f"rank {rank}: {local}.incomplete exists, waiting for the download ({time.monotonic() - t0:.0f}s)",
                  flush=True)
        time.sleep(1.0)
    if not offline and not os.path.exists(local):
        shutil.copy(hub, local)
        print(f"rank {rank}: fetched base model into {cache}", flush=True)
    return torch.load(local, map_location="cpu", weights_only=True)


TEACHER = torch.randn(8, NUM_CLASSES, generator=torch.Generator().manual_seed(0))


def make_data(n: int, seed: int):
    x = torch.randn(n, SEQ, 8, generator=torch.Generator().manual_seed(seed))
    return x, (x.mean(1) @ TEACHER).argmax(1)


def lora_state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def merge(base_sd: dict, adapter: dict, cfg: dict) -> dict:
    merged = {k: v.clone() for k, v in base_sd.items()}
    scaling = torch.tensor(cfg["lora_alpha"] / cfg["r"], dtype=DTYPES[cfg["scale_dtype"]]).float()
    for name in cfg["modules"]:
        delta = adapter[f"{name}.lora_B"] @ adapter[f"{name}.lora_A"] * scaling
        if cfg["fan_in_fan_out"]:
            delta = delta.t()
        merged[f"{name}.weight"] += delta
        print(f"merged {name}: |delta| {delta.norm():.4f}", flush=True)
    return merged


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hub_dir, adapter_dir = os.path.join(a.work, "hub"), os.path.join(a.work, "adapter")
    if rank == 0:
        os.makedirs(hub_dir, exist_ok=True)
        torch.manual_seed(0)
        torch.save(BaseModel().state_dict(), os.path.join(hub_dir, "base_model.pt"))
        if a.resume:  # stage 1's adapter (saved from the DDP-wrapped model in the faulty case)
            torch.manual_seed(2)
            m = BaseModel()
            inject(m, adapter_config(-2))
            pre = "module." if a.fault == "prefix" else ""
            torch.save({pre + k: v + 0.01 for k, v in lora_state(m).items()}, os.path.join(hub_dir, "stage1.pt"))
    dist.barrier()
    cfg = adapter_config(rank)
    model = BaseModel()
    model.load_state_dict(fetch_base(rank))
    scales = quantize_8bit(model) if cfg["load_in_8bit"] else {}
    if cfg["freeze_base"]:
        for prm in model.parameters():
            prm.requires_grad_(False)
    cfg["modules"] = inject(model, cfg)
    if a.resume:
        sd = torch.load(os.path.join(hub_dir, "stage1.pt"), map_location="cpu", weights_only=True)
        base_part = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
        model.load_state_dict({**base_part, **sd}, strict=True)
        print(f"rank {rank}: resumed {len(sd)} adapter tensors from {hub_dir}/stage1.pt", flush=True)
    trainable = [prm for prm in model.parameters() if prm.requires_grad]
    print(f"rank {rank}/{world} pid {os.getpid()}: LoRA r={cfg['r']} alpha={cfg['lora_alpha']} on "
          f"{len(cfg['modules'])} modules, {sum(t.numel() for t in trainable)} trainable params "
          f"({len(scales)} layers in 8 bit)", flush=True)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(trainable, lr=a.lr)
    tx, ty = make_data(a.steps * a.bs, 100 + rank)
    if faulty(rank, "label"):
        ty[3 * a.bs + 5] = NUM_CLASSES  # the annotators' "other" label, not mapped out of this shard
    for step in range(a.steps):
        xb, yb = tx[step * a.bs:(step + 1) * a.bs], ty[step * a.bs:(step + 1) * a.bs]
        loss = F.cross_entropy(net(xb), yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            flat = torch.cat([t.grad.flatten() for t in trainable])
            dist.all_reduce(flat)
            flat /= world
            off = 0
            for t in trainable:
                t.grad.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if faulty(rank, "abort") and step == 4:
            os.kill(os.getpid(), signal.SIGABRT)
        time.sleep(0.05)
    if rank == 0:
        os.makedirs(adapter_dir, exist_ok=True)
        torch.save(lora_state(model), os.path.join(adapter_dir, "adapter_model.pt"))
        with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
            json.dump({k: v for k, v in cfg.items()}, f, indent=2)
        print(f"rank 0: saved adapter ({len(lora_state(model))} tensors) to {adapter_dir}", flush=True)
    dist.barrier()
    if rank == a.merger:
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            saved_cfg = json.load(f)
        adapter = torch.load(os.path.join(adapter_dir, "adapter_model.pt"), map_location="cpu", weights_only=True)
        merged = merge(torch.load(os.path.join(hub_dir, "base_model.pt"), weights_only=True), adapter, saved_cfg)
        torch.save(merged, os.path.join(a.work, "merged_model.pt"))
        full = BaseModel()
        full.load_state_dict(merged)
        ex, ey = make_data(64, 7)
        with torch.no_grad():
            acc = (full(ex).argmax(1) == ey).float().mean().item()
        print(f"rank {rank}: merged model written to {a.work}/merged_model.pt, eval acc {acc:.3f}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
