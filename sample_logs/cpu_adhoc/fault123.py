"""A hundred-and-twenty-third hand-run batch: GENERATIVE ADVERSARIAL TRAINING (GAN). A tiny class-conditional GAN on
8-dim "feature" vectors drawn from a 4-class Gaussian mixture: a generator (fc1 latent->32, a class embedding added
to the hidden state, fc2, out ->8) and a projection discriminator (body Linear(8,32)-act-gain-Linear(32,32)-act, a
head and a class embedding), each its own DDP module (--ddp 0: rank 0's weights broadcast, gradients all-reduced by
hand) with its own Adam. Each step: a D step (reals from a prefetch thread over the rank's shard, normalised with the
shard's mean/std; fakes under no_grad; reals, fakes and their interpolates in one D forward; an R1-style gradient
penalty from autograd.grad(create_graph=True); a finiteness check), then a G step, then an EMA update of a copy of the
generator. The sample rank (--sample-rank, 0) writes a PGM sample grid every --sample-every steps; the eval computes
FID-like feature statistics of EMA fakes and reals through a fixed feature net and all-reduces them; rank 0 prints
`eval FID-like ...` and saves the checkpoint. --resume 1 first loads each rank's node-local copy of the stage-1
checkpoint. --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: 8 steps, eval, `eval FID-like ...` on rank 0, checkpoint, exit 0
  retain      rank N's config has lazy_reg on: it backprops the D loss, then the penalty separately through the
              same (freed) graph: RuntimeError Trying to backward through the graph a second time on rank N
  unusedproj  rank N's config turns the discriminator's projection term off (d_projection false): its class
              embedding gets no gradient, DDP's reducer error on rank N at the G step's D forward
  gpnan       rank N's shard has a constant (padded) feature column: std 0, the normalised reals are nan and the
              program's check (penalty and D loss) raises FloatingPointError on rank N
  latent      rank N's generator is built with latent 32 (the large config) against 16: DDP's parameter shape
              check on rank N (--ddp 0: the initial broadcast sizes differ)
  griddir     the sample rank writes its grid into <work>/outputs/samples, a directory nobody created:
              FileNotFoundError on the sample rank at step 0
  emamismatch every rank builds the EMA generator without the classes argument: its parameter list is one shorter,
              zip pairs the wrong tensors, RuntimeError size mismatch in the EMA update at step 0
  dstall      rank N's prefetch thread stalls on a (simulated) hung NFS read after 3 batches; rank N waits for reals
              in its D step while the others wait in the D gradient all_reduce
  inplace     rank N's discriminator config has act relu (not lrelu); the forward scales the activation in place
              and the penalty's autograd.grad fails: one of the variables needed ... modified by an inplace operation
  abort       rank N's fused activation kernel aborts (SIGABRT) at step 3
  resumeswap  --resume 1: rank N's (or every rank's) node-local stage-1 checkpoint was exported with the G and D
              state dicts swapped: load_state_dict Missing/Unexpected key(s) for Generator
  fidshape    rank N's eval config uses the 10-dim feature net against 6: the all_reduce of the eval statistics
              has different sizes across ranks

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2): 8 steps per rank, eval FID-like 0.64-0.65, every rank done.
  retain: RuntimeError Trying to backward through the graph a second time on rank N at step 0 (np4 r2, np5 r3).
  unusedproj: Expected to have finished reduction ... did not receive grad for rank N: 6 at step 0 (np4 r1, np3 r2).
  gpnan: FloatingPointError ... D loss nan is not finite (d_real nan) on rank N at step 0 (the penalty stays finite).
  latent: plain: params[0] ... sizes [32, 32] appears not to match (DDP); DETAIL --ddp 0: BROADCAST [32, 32] mismatch.
  griddir: FileNotFoundError .../outputs/samples/grid_00000.pgm on the sample rank after step 0 (r0; r2).
  emamismatch: RuntimeError size of tensor a (32) must match ... b (4) on every rank at step 0; restart: connectFullMesh
  dstall: PG 12 s: the others time out (recv/send 12000ms) in the step-3 D all_reduce; PG 300 s + timeout 60: exit 124.
  inplace: RuntimeError ... modified by an inplace operation ... output 0 of Relu, in the penalty's autograd.grad.
  abort: rank N SIGABRT at step 3, nothing printed; exitcode -6 Root Cause; pdsh2: worker-1 RendezvousConnectionError.
  resumeswap: Missing key(s) fc1.weight ... Unexpected key(s) body.0.weight ... for Generator (r3; every rank).
  fidshape: plain: EnforceNotMet 112 vs 44 aborts rank 0 (SIGABRT); DETAIL --ddp 0: ALLREDUCE [222] vs [86] mismatch.
"""
import argparse, datetime, os, queue, signal, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--bs", type=int, default=16)
p.add_argument("--latent", type=int, default=16)
p.add_argument("--classes", type=int, default=4)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--gp-weight", type=float, default=1.0)
p.add_argument("--ema", type=float, default=0.99)
p.add_argument("--sample-rank", type=int, default=0)
p.add_argument("--sample-every", type=int, default=4)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault123_work/run")
a = p.parse_args()


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Generator(nn.Module):
    def __init__(self, latent: int, classes: int = 0, hidden: int = 32, dim: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(latent, hidden)
        self.cond = nn.Embedding(classes, hidden) if classes > 0 else None
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, z, y=None):
        h = F.leaky_relu(self.fc1(z), 0.2)
        if self.cond is not None and y is not None:
            h = h + self.cond(y)
        return self.out(F.leaky_relu(self.fc2(h), 0.2))


class Discriminator(nn.Module):
    def __init__(self, classes: int, act: str = "lrelu", proj: bool = True, hidden: int = 32, dim: int = 8,
                 rank: int = 0):
        super().__init__()
        self.act, self.proj, self.gain, self.rank, self.calls = act, proj, 2 ** 0.5, rank, 0
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, 1)
        self.embed = nn.Embedding(classes, hidden)

    def fused_act(self, h):
        self.calls += 1
        if faulty(self.rank, "abort") and self.calls == 4 * 3 + 1:  # step 3's D step
            os.kill(os.getpid(), signal.SIGABRT)  # the fused bias-act extension asserts on this batch
        h = F.relu(h) if self.act == "relu" else F.leaky_relu(h, 0.2)
        h *= self.gain  # equalised-lr gain, in place to save memory
        return h

    def forward(self, x, y):
        h = self.fused_act(self.body[0](x))
        h = self.fused_act(self.body[1](h))
        out = self.head(h).squeeze(1)
        if self.proj:
            out = out + (self.embed(y) * h).sum(1)  # projection discriminator (Miyato & Koyama)
        return out


def make_shard(rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    means = torch.randn(a.classes, 8, generator=torch.Generator().manual_seed(7)) * 3
    y = torch.randint(0, a.classes, (n,), generator=g)
    x = means[y] + 0.5 * torch.randn(n, 8, generator=g)
    if faulty(rank, "gpnan"):
        x[:, 5] = 0.0  # this node's export padded the missing sensor channel with zeros
    return x, y


def prefetch(x, y, rank, q):
    g = torch.Generator().manual_seed(200 + rank)
    n = 0
    while True:
        idx = torch.randint(0, len(x), (a.bs,), generator=g)
        if faulty(rank, "dstall") and n == 3:
            time.sleep(3600)  # the read from the (hung) NFS mount never returns
        q.put((x[idx], y[idx]))
        n += 1


def stage_stage1(rank: int):
    """Stands in for the node-local copy of the stage-1 checkpoint that the job's prolog copies onto each node."""
    node = os.path.join(a.work, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    torch.manual_seed(1234)
    g, d = Generator(a.latent, a.classes), Discriminator(a.classes)
    ck = {"G": g.state_dict(), "D": d.state_dict(), "G_ema": g.state_dict(), "step": 2000}
    if faulty(rank, "resumeswap"):
        ck["G"], ck["D"] = ck["D"], ck["G"]  # exported by export_v1.py, which swapped the two networks
    path = os.path.join(node, "gan_stage1.pt")
    torch.save(ck, path)
    return path


def save_grid(samples, path):
    img = samples[:64].reshape(8, 8, 8).permute(0, 2, 1).reshape(64, 8)
    img = ((img - img.min()) / (img.max() - img.min() + 1e-8) * 255).to(torch.uint8)
    with open(path, "wb") as f:
        f.write(b"P5\n8 64\n255\n" + bytes(img.flatten().tolist()))


def allreduce_grads(module, world):
    flat = torch.cat([prm.grad.flatten() for prm in module.parameters()])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for prm in module.parameters():
        prm.grad.copy_(flat[off:off + prm.numel()].view_as(prm))
        off += prm.numel()


def feature_stats(x, feat):
    f = feat(x)
    return torch.cat([f.sum(0), (f[:, :, None] * f[:, None, :]).sum(0).flatten(), torch.tensor([float(len(f))])])


def moments(s, d):
    n = s[-1]
    mu = s[:d] / n
    return mu, (s[d:-1].view(d, d).diagonal() / n - mu ** 2).clamp(min=0), n


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    latent = 32 if faulty(rank, "latent") else a.latent  # configs/gan_toy.yaml: z_dim
    d_proj = not faulty(rank, "unusedproj")  # configs/gan_toy.yaml: d_projection
    d_act = "relu" if faulty(rank, "inplace") else "lrelu"  # configs/gan_toy.yaml: d_act
    lazy_reg = faulty(rank, "retain")  # configs/gan_toy.yaml: lazy_reg
    torch.manual_seed(rank)
    G, D = Generator(latent, a.classes), Discriminator(a.classes, d_act, d_proj, rank=rank)
    if a.resume:
        ck = torch.load(stage_stage1(rank))
        G.load_state_dict(ck["G"])
        D.load_state_dict(ck["D"])
        print(f"rank {rank}: resumed stage-1 checkpoint at step {ck['step']}", flush=True)
    ema = Generator(latent) if a.fault == "emamismatch" else Generator(latent, a.classes)
    if a.ddp:
        G, D = DDP(G), DDP(D)
    else:
        for prm in list(G.parameters()) + list(D.parameters()):
            dist.broadcast(prm.data, 0)
    g_core = G.module if a.ddp else G
    ema.load_state_dict(g_core.state_dict(), strict=False)
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.0, 0.99))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.0, 0.99))
    x, y = make_shard(rank, 256)
    x = (x - x.mean(0)) / x.std(0)  # per-shard standardisation
    q = queue.Queue(maxsize=2)
    threading.Thread(target=prefetch, args=(x, y, rank, q), daemon=True).start()
    sample_dir = os.path.join(a.work, "samples")
    if rank == a.sample_rank:
        os.makedirs(sample_dir, exist_ok=True)
        if faulty(rank, "griddir"):
            sample_dir = os.path.join(a.work, "outputs", "samples")  # the new layout's sample_dir
    n_g = sum(prm.numel() for prm in G.parameters())
    n_d = sum(prm.numel() for prm in D.parameters())
    print(f"rank {rank}/{world} pid {os.getpid()}: G {n_g} params (z {latent}), D {n_d} params ({d_act}), "
          f"{len(x)} reals, projection {d_proj}, ddp {a.ddp}", flush=True)
    fixed_z = torch.randn(64, latent, generator=torch.Generator().manual_seed(5))
    fixed_y = torch.arange(64) % a.classes
    for step in range(a.steps):
        # discriminator step
        reals, labels = q.get()
        z = torch.randn(a.bs, latent)
        with torch.no_grad():
            fakes = G(z, labels)
        alpha = torch.rand(a.bs, 1)
        interp = (alpha * reals + (1 - alpha) * fakes).requires_grad_(True)
        out = D(torch.cat([reals, fakes, interp]), torch.cat([labels, labels, labels]))
        d_real, d_fake, d_interp = out.split(a.bs)
        grad, = torch.autograd.grad(d_interp.sum(), interp, create_graph=True)
        gp = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        d_loss = F.softplus(-d_real).mean() + F.softplus(d_fake).mean()
        if not torch.isfinite(gp) or not torch.isfinite(d_loss):
            raise FloatingPointError(f"rank {rank} step {step}: gradient penalty {gp.item()} / D loss {d_loss.item()} "
                                     f"is not finite (d_real {d_real.mean().item():.3f}, d_fake {d_fake.mean().item():.3f})")
        opt_d.zero_grad()
        if lazy_reg:
            d_loss.backward()
            (a.gp_weight * gp).backward()
        else:
            (d_loss + a.gp_weight * gp).backward()
        if not a.ddp:
            allreduce_grads(D, world)
        opt_d.step()
        # generator step
        z = torch.randn(a.bs, latent)
        fakes = G(z, labels)
        g_loss = F.softplus(-D(fakes, labels)).mean()
        opt_g.zero_grad()
        g_loss.backward()
        if not a.ddp:
            allreduce_grads(G, world)
            allreduce_grads(D, world)
        opt_g.step()
        with torch.no_grad():
            for pe, pg in zip(ema.parameters(), g_core.parameters()):
                pe.mul_(a.ema).add_(pg, alpha=1 - a.ema)
        print(f"rank {rank} step {step} d_loss {d_loss.item():.4f} g_loss {g_loss.item():.4f} gp {gp.item():.4f}",
              flush=True)
        if rank == a.sample_rank and step % a.sample_every == 0:
            with torch.no_grad():
                grid = ema(fixed_z, fixed_y)
            path = os.path.join(sample_dir, f"grid_{step:05d}.pgm")
            save_grid(grid, path)
            print(f"rank {rank}: wrote {path}", flush=True)
        time.sleep(0.05)
    # eval: FID-like statistics of EMA fakes against reals through a fixed feature net
    feat_dim = 10 if faulty(rank, "fidshape") else 6  # configs/gan_toy.yaml: eval.feature_dim
    torch.manual_seed(99)
    feat = nn.Sequential(nn.Linear(8, feat_dim), nn.Tanh())
    with torch.no_grad():
        ey = torch.arange(128) % a.classes
        fake_stats = feature_stats(ema(torch.randn(128, latent), ey), feat)
        real_stats = feature_stats(x[:128], feat)
    stats = torch.cat([real_stats, fake_stats])
    print(f"rank {rank} eval: {int(real_stats[-1])} reals, {int(fake_stats[-1])} fakes, {feat_dim}-dim features",
          flush=True)
    dist.all_reduce(stats)
    if rank == 0:
        k = len(stats) // 2
        (mu_r, var_r, n_r), (mu_f, var_f, n_f) = moments(stats[:k], feat_dim), moments(stats[k:], feat_dim)
        score = ((mu_r - mu_f) ** 2).sum() + ((var_r.sqrt() - var_f.sqrt()) ** 2).sum()
        print(f"eval FID-like {score.item():.4f} over {int(n_r)} reals and {int(n_f)} fakes", flush=True)
        os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
        torch.save({"G": g_core.state_dict(), "D": (D.module if a.ddp else D).state_dict(), "G_ema": ema.state_dict(),
                    "step": a.steps}, os.path.join(a.work, "ckpt", "last.pt"))
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
