"""A hundred-and-twenty-ninth hand-run batch: DIFFUSION MODELS. A tiny class-conditional denoising diffusion model
on 8x8 synthetic images (each class a bar pattern plus noise, per-image normalised), gloo. The denoiser is an MLP
over the flattened noisy image, a learned timestep embedding and a class embedding (10 classes; classifier-free
guidance drops the label to a learned null vector with p 0.1). A noise schedule of T=1000 betas (linear, or cosine),
random timesteps per sample, an MSE loss on the predicted noise, DDP (--ddp 0: rank 0's weights broadcast and the
gradients all-reduced by hand), an EMA copy of the weights. Each step prints `rank R step S loss L`; then every rank
samples --n-samples images from the EMA model with a strided 20-step sampler and guidance, the samples' statistics
are computed in --dtype, and the samples are all_gathered (`eval: ...` on rank 0). Each rank saves its EMA snapshot
to node-local scratch, rank 0 saves last.pt, barrier, `rank R done`. --resume 1 first loads the EMA weights from
the node's checkpoint (written by --fault prep). --rank N picks the faulty rank (-1: every rank). No @record.

Faults:
  none        control: 8 steps, sampling, all_gather of the samples, snapshots, checkpoint, exit 0
  cosine      rank N's node config selects the cosine schedule without the max-beta clip: the last beta is 1,
              alphas_cumprod reaches 0 and the program's schedule check raises FloatingPointError on rank N
  tbound      rank N's config adds the terminal timestep to every batch as t=T (1000) instead of T-1: the
              alphas_cumprod lookup raises IndexError index 1000 is out of bounds ... size 1000 on rank N at step 0
  label       rank N's shard was exported with labels 0..10 (an 11th "unknown" class) while the class embedding
              has 10 rows: IndexError index out of range in self inside the embedding on rank N
  emakey      --resume 1: rank N's node checkpoint is the old trainer's, whose EMA keys carry a `module.` prefix:
              load_state_dict raises RuntimeError Missing key(s) / Unexpected key(s) on rank N
  samplewait  rank N's sampler waits for FID reference statistics at a node-local path nobody writes: the others
              wait in the all_gather of the samples and time out (with --pg-timeout 300 under timeout: a hang)
  gathershape rank N's config has n_samples 6 (the others 8): the all_gather of the samples has another shape
              on rank N (a collective mismatch)
  bf16        every rank's config has dtype bf16: the sample statistics' eigvalsh refuses BFloat16 on CPU
              (NotImplementedError on every rank at eval)
  sigkill     rank N is SIGKILLed (os.kill) at step 4, before its backward; nothing printed by it
  guidance    every rank reads guidance_scale from the config text without float(): str * Tensor in the guided
              sampler raises TypeError on every rank at eval
  diskfull    rank N's node-local scratch is full: it prints its own `disk full` error and exits with sys.exit(2)
              while saving its EMA snapshot (the others wait in the barrier)
  nanpix      rank N's shard has blank (constant) images: the per-image normalisation divides by std 0, the loss is
              nan and the program's loss check raises FloatingPointError on rank N at step 0

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2): 8 steps per rank, eval of 24 / 32 samples, every rank done.
  cosine: FloatingPointError ... not finite from t=999 (alphas_cumprod[999]=0) on rank N before step 0.
  tbound: IndexError index 1000 is out of bounds ... size 1000 on rank N at step 0; others closed.
  label: IndexError index out of range in self (class embedding) on rank N at step 0 (r2 Root Cause: 0).
  emakey: RuntimeError Missing key(s) ... Unexpected key(s) "module.null" ... on rank N at resume.
  samplewait: PG 12 s: the others time out (12000ms) in all_gather; PG 300 s + timeout 60: exit 124.
  gathershape: DETAIL: mismatch RuntimeError on every rank (Rank 1 [6,1,8,8]); plain: rank N SIGABRT.
  bf16: NotImplementedError "linalg_eigh_cpu" not implemented for 'BFloat16' on every rank at eval.
  sigkill: rank N exitcode -9 (SIGKILL) at step 4, the others Connection reset by peer.
  guidance: TypeError only integer tensors ... to an index on every rank; restart: connectFullMesh refused.
  diskfull: rank N's own `error: disk full: cannot write ...` then exitcode 2; others closed in barrier.
  nanpix: FloatingPointError rank N step 0: loss is nan; the others Connection closed by peer.
"""
import argparse, copy, math, os, shutil, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--bs", type=int, default=32)
p.add_argument("--T", type=int, default=1000)
p.add_argument("--schedule", default="linear")
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--ema", type=float, default=0.995)
p.add_argument("--n-samples", type=int, default=8)
p.add_argument("--dtype", default="fp32")
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault129_work/run")
a = p.parse_args()
NCLS = 10


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


def make_schedule(kind: str, T: int):
    if kind == "linear":
        betas = torch.linspace(1e-4, 0.02, T)
    elif kind in ("cosine", "cosine_clipped"):
        s = 0.008
        f = torch.cos((torch.arange(T + 1) / T + s) / (1 + s) * math.pi / 2) ** 2
        ac = f / f[0]
        betas = 1 - ac[1:] / ac[:-1]
        if kind == "cosine_clipped":
            betas = betas.clamp(max=0.999)
    else:
        raise ValueError(f"unknown schedule {kind!r}")
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    sqrt_recip = torch.sqrt(1.0 / alphas_cumprod)
    if not torch.isfinite(sqrt_recip).all():
        bad = int((~torch.isfinite(sqrt_recip)).nonzero()[0])
        raise FloatingPointError(f"noise schedule {kind}: sqrt(1/alphas_cumprod) is not finite from t={bad} "
                                 f"(alphas_cumprod[{bad}]={alphas_cumprod[bad].item():.3g})")
    return betas, alphas_cumprod


class Denoiser(nn.Module):
    def __init__(self, T: int, h: int = 128):
        super().__init__()
        self.t_emb = nn.Embedding(T, 32)
        self.c_emb = nn.Embedding(NCLS, 32)
        self.null = nn.Parameter(torch.zeros(32))
        self.net = nn.Sequential(nn.Linear(64 + 64, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 64))

    def forward(self, x, t, y, drop):
        c = self.c_emb(y)
        c = torch.where(drop[:, None], self.null.expand_as(c), c)
        return self.net(torch.cat([x.flatten(1), self.t_emb(t), c], 1)).view_as(x)


def make_shard(rank: int, n: int, g: torch.Generator):
    hi = NCLS + 1 if faulty(rank, "label") else NCLS
    y = torch.randint(0, hi, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    for i in range(n):
        x[i, 0, int(y[i]) % 8, :] += 1.0
    if faulty(rank, "nanpix"):
        x[: n // 4] = 0.5
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    std = x.std(dim=(1, 2, 3), keepdim=True)
    x = (x - mean) / std
    return x, y


def main():
    if a.fault == "prep":
        os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
        m = Denoiser(a.T)
        torch.save({"step": 800, "ema": m.state_dict()}, os.path.join(a.work, "ckpt", "last.pt"))
        old = {"module." + k: v for k, v in m.state_dict().items()}
        torch.save({"step": 800, "ema": old}, os.path.join(a.work, "ckpt", "last_v1.pt"))
        print("prep: wrote", os.path.join(a.work, "ckpt"))
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(100 + rank)
    kind = "cosine" if faulty(rank, "cosine") else a.schedule
    betas, alphas_cumprod = make_schedule(kind, a.T)
    x_all, y_all = make_shard(rank, a.bs * a.steps, g)
    model = Denoiser(a.T)
    ema = copy.deepcopy(model).requires_grad_(False)
    if a.resume:
        name = "last_v1.pt" if faulty(rank, "emakey") else "last.pt"
        ck = torch.load(os.path.join(a.work, "ckpt", name), map_location="cpu")
        ema.load_state_dict(ck["ema"])
        model.load_state_dict(ema.state_dict())
        print(f"rank {rank} resumed EMA from step {ck['step']}", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
        net = model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    for step in range(a.steps):
        x0 = x_all[step * a.bs:(step + 1) * a.bs]
        y = y_all[step * a.bs:(step + 1) * a.bs]
        t = torch.randint(0, a.T, (a.bs,), generator=g)
        if faulty(rank, "tbound"):
            t[0] = a.T  # always train on the terminal step
        noise = torch.randn(x0.shape, generator=g)
        ac = alphas_cumprod[t].view(-1, 1, 1, 1)
        xt = ac.sqrt() * x0 + (1 - ac).sqrt() * noise
        drop = torch.rand(a.bs, generator=g) < 0.1
        loss = F.mse_loss(net(xt, t, y, drop), noise)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()}")
        if step == 4 and faulty(rank, "sigkill"):
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= ws
        opt.step()
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.mul_(a.ema).add_(pm, alpha=1 - a.ema)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)

    # guided sampling from the EMA model
    cfg_text = "guidance_scale=3.0 p_uncond=0.1 sample_steps=20"
    cfg = dict(kv.split("=") for kv in cfg_text.split())
    gscale = cfg["guidance_scale"] if faulty(rank, "guidance") else float(cfg["guidance_scale"])
    n = 6 if faulty(rank, "gathershape") else a.n_samples
    ts = torch.linspace(a.T - 1, 0, int(cfg["sample_steps"])).long()
    with torch.no_grad():
        x = torch.randn(n, 1, 8, 8, generator=g)
        y = torch.arange(n) % NCLS
        for i, tt in enumerate(ts):
            tv = torch.full((n,), int(tt))
            eps_c = ema(x, tv, y, torch.zeros(n, dtype=torch.bool))
            eps_u = ema(x, tv, y, torch.ones(n, dtype=torch.bool))
            eps = eps_u + gscale * (eps_c - eps_u)
            ac_t = alphas_cumprod[tt]
            ac_prev = alphas_cumprod[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0)
            x0_hat = ((x - (1 - ac_t).sqrt() * eps) / ac_t.sqrt()).clamp(-4, 4)
            x = ac_prev.sqrt() * x0_hat + (1 - ac_prev).sqrt() * eps
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}["bf16" if faulty(rank, "bf16") else a.dtype]
    flat = x.flatten(1).to(dtype)
    cov = torch.cov(flat.T)
    spread = torch.linalg.eigvalsh(cov).clamp(min=0).sqrt().sum().float()
    if faulty(rank, "samplewait"):
        ref = os.path.join("/tmp/fault129_work/node_local", f"fid_ref_{rank}.pt")
        while not os.path.exists(ref):
            time.sleep(0.5)
    gathered = [torch.zeros_like(x) for _ in range(ws)]
    dist.all_gather(gathered, x)
    allx = torch.cat(gathered)
    stats = torch.tensor([spread.item()])
    dist.all_reduce(stats)
    if rank == 0:
        print(f"eval: {allx.shape[0]} samples mean {allx.mean():.4f} std {allx.std():.4f} "
              f"spread {stats.item() / ws:.3f} guidance {gscale}", flush=True)

    scratch = os.path.join(a.work, f"scratch_{rank}")
    os.makedirs(scratch, exist_ok=True)
    free_mb = shutil.disk_usage(scratch).free // 2**20
    if faulty(rank, "diskfull"):
        free_mb = 0  # node-local scratch full
    if free_mb < 1:
        print(f"rank {rank}: error: disk full: cannot write {scratch}/ema_snapshot.pt "
              f"(1 MB needed, {free_mb} MB free)", file=sys.stderr, flush=True)
        sys.exit(2)
    torch.save(ema.state_dict(), os.path.join(scratch, "ema_snapshot.pt"))
    if rank == 0:
        torch.save({"step": a.steps, "model": model.state_dict(), "ema": ema.state_dict()},
                   os.path.join(a.work, "last.pt"))
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
