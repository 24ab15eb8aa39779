"""A hundred-and-sixty-eighth hand-run batch: ADVERSARIAL TRAINING (FGSM / PGD).

A small MLP classifier (64 -> 48 -> 10) on synthetic 8x8 "images" trained with DDP on gloo (or with
`--ddp 0`: gradients all_reduced by hand) on PGD adversarial examples: per batch a few PGD steps compute
input gradients with torch.autograd.grad on the bare module, take a signed step of size alpha, project
the perturbation onto an L-inf epsilon ball and clamp to [0, 1]; epsilon ramps up linearly (an epsilon
schedule). Clean and robust correct counts are all_gathered at steps 2 and 5 for an accuracy line, the
robust loss is all_reduced for a `mean` line. `--init` loads a pretrained clean model; rank 0 saves
/tmp/job_work/adv.pt at the end. `--export PATH --classes K` writes a clean checkpoint (no dist).

Faults:
- nograd: rank N builds its step-2 attack input without requires_grad (a detach left in): RuntimeError.
- epsinf: rank N reads eps_max = inf from a config override; the perturbed input is inf, loss NaN (check).
- stepsfloat: every rank computes pgd_steps = budget / alpha_ratio = 4.0 (a float): TypeError in range().
- projshape: every rank projects with a per-class (10,) eps vector on 64 features: broadcast RuntimeError.
- backtwice: rank N also calls backward on the attack loss after autograd.grad freed its graph (step 3).
- robustlen: rank N all_gathers 3 accuracy counts (adds its batch size) while the others send 2.
- attackhang: rank N's step-3 attack loops until the loss stops changing, with tolerance 0 (never stops).
- ckptmissing: rank N loads the pretrained model from a node-local cache that was never filled.
- ckptclasses: every rank loads a pretrained checkpoint exported with 12 classes into a 10-class model.
- diverged: rank N reads eps_max = 8 in pixel units (no /255) and skips the [0,1] clamp: loss explodes, exit 1.
- sigbus: rank N dies by SIGBUS after step 2 (a truncated memory-mapped shard).
- none: control, no fault.

What happened (filled in after the runs):
- nograd: RuntimeError "One of the differentiated Tensors does not require grad" on rank N at step 2 (np3 r1, np4 r2).
- epsinf: rank N prints eps_max inf; FloatingPointError "robust loss is not finite at step 0: loss=nan" (np4 r3, np3 r0).
- stepsfloat: every rank: TypeError "'float' object cannot be interpreted as an integer" at range(steps) (np3).
- projshape: every rank: RuntimeError "size of tensor a (64) must match ... tensor b (10)" in project (np4, np3).
- backtwice: rank N: RuntimeError "Trying to backward through the graph a second time"; a rank aborts -6.
- robustlen: rank N: RuntimeError "ProcessGroupGloo::allgather: invalid tensor size ... (expected (3), got (2))".
- attackhang: 12 s: peers "Timed out waiting 12000ms" in DDP backward; 300 s under timeout 60: killed, exit 124.
- ckptmissing: rank N: FileNotFoundError .../pretrained_local/clean.pt (np4 r1 wrapper; np3 r2 restart).
- ckptclasses: every rank: load_state_dict size mismatch for 2.weight [12, 48] vs [10, 48] (np3).
- diverged: rank N: "ERROR rank N: attack diverged at step 1: robust loss ..." then exit 1 (np3 r2, np4 pdsh2).
- sigbus: rank N dies by SIGBUS after step 2: exitcode -7 (np3 r1, np4 r3).
- none: control: all steps, accuracy lines, adv.pt saved, exit 0 (np3).
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def build_model(num_classes):
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, num_classes))


def make_batch(rank, step, batch=32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    y = torch.randint(0, 10, (batch,), generator=g)
    proto = torch.linspace(0.1, 0.9, 10)[y].unsqueeze(1)
    x = (proto + 0.15 * torch.randn(batch, 64, generator=g)).clamp(0, 1)
    return x, y


def project(delta, eps, eps_vec=None):
    if eps_vec is not None:
        return torch.max(torch.min(delta, eps_vec), -eps_vec)
    return delta.clamp(-eps, eps)


def pgd_attack(net, x, y, eps, alpha, steps, a, rank, step):
    delta = torch.zeros_like(x)
    eps_vec = torch.full((10,), eps) if (a.fault == "projshape" and a.hit) else None
    for _ in range(steps):
        if a.fault == "nograd" and a.hit and step == 2:
            x_adv = (x + delta).detach()
        else:
            x_adv = (x + delta).detach().requires_grad_(True)
        loss_a = F.cross_entropy(net(x_adv), y)
        (g,) = torch.autograd.grad(loss_a, [x_adv])
        if a.fault == "backtwice" and a.hit and step == 3:
            loss_a.backward()
        delta = project(delta + alpha * g.sign(), eps, eps_vec)
        if torch.isfinite(delta).all() and a.clamp01:
            delta = (x + delta).clamp(0, 1) - x
    if a.fault == "attackhang" and a.hit and step == 3:
        prev, it = None, 0
        while True:
            x_adv = (x + delta).detach().requires_grad_(True)
            loss_a = F.cross_entropy(net(x_adv), y)
            if prev is not None and abs(prev - loss_a.item()) < a.attack_tol:
                break
            prev, it = loss_a.item(), it + 1
            (g,) = torch.autograd.grad(loss_a, [x_adv])
            delta = project(delta + 0.5 * alpha * g.sign(), eps)
            time.sleep(0.2)
    return (x + delta).detach()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--eps-max", type=float, default=8 / 255)
    p.add_argument("--attack-budget", type=int, default=10)
    p.add_argument("--init", default="")
    p.add_argument("--export", default="")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--attack-tol", type=float, default=0.0)
    a = p.parse_args()
    if a.export:
        torch.manual_seed(0)
        torch.save({"model": build_model(a.classes).state_dict(), "classes": a.classes}, a.export)
        print(f"exported clean model with {a.classes} classes to {a.export}")
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    a.hit = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    model = build_model(10)
    if a.init:
        path = a.init
        if a.fault == "ckptmissing" and a.hit:
            path = os.path.join("/tmp/fault168/pretrained_local", os.path.basename(a.init))
        if a.fault == "ckptclasses":
            path = a.init.replace("clean.pt", "clean_c12.pt")
        state = torch.load(path, map_location="cpu")
        model.load_state_dict(state["model"])
        print(f"rank {rank} loaded pretrained clean model from {path}", flush=True)
    net = model
    if a.ddp:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eps_max = a.eps_max
    if a.fault == "epsinf" and a.hit:
        eps_max = float("inf")
    ratio = 2.5
    pgd_steps = a.attack_budget // 2 if a.fault != "stepsfloat" else a.attack_budget / ratio
    a.clamp01 = not (a.fault == "diverged" and a.hit)
    if not a.clamp01:
        eps_max = 8.0
    print(f"rank {rank}/{world} ready: eps_max {eps_max:.4f} pgd_steps {pgd_steps} ddp {a.ddp}", flush=True)
    for step in range(a.steps):
        eps = eps_max * min(1.0, (step + 1) / 4)
        alpha = 2.5 * eps / max(1, a.attack_budget // 2)
        x, y = make_batch(rank, step)
        x_adv = pgd_attack(net, x, y, eps, alpha, pgd_steps, a, rank, step)
        opt.zero_grad()
        out = model(x_adv)
        loss = F.cross_entropy(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"robust loss is not finite at step {step}: loss={loss.item()} (eps={eps})")
        if loss.item() > 3.0 * 2.3026:
            print(f"ERROR rank {rank}: attack diverged at step {step}: robust loss {loss.item():.1f} "
                  f"(alpha {alpha:.3g}, eps {eps:.4f})", flush=True)
            sys.exit(1)
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        print(f"rank {rank} step {step} eps {eps:.4f} loss {loss.item():.4f} mean {mean.item() / world:.4f}", flush=True)
        if step in (2, 5):
            with torch.no_grad():
                clean = (net(x).argmax(1) == y).sum().float()
                robust = (out.argmax(1) == y).sum().float()
            counts = torch.stack([clean, robust])
            if a.fault == "robustlen" and a.hit:
                counts = torch.cat([counts, torch.tensor([float(len(y))])])
            got = [torch.zeros(2) for _ in range(world)]
            dist.all_gather(got, counts)
            tot = torch.stack(got).sum(0)
            if rank == 0:
                n = len(y) * world
                print(f"step {step} clean acc {tot[0] / n:.3f} robust acc {tot[1] / n:.3f}", flush=True)
        if a.fault == "sigbus" and a.hit and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
    if rank == 0:
        torch.save({"model": net.state_dict(), "classes": 10}, "/tmp/fault168_work/adv.pt")
        print("saved /tmp/fault168_work/adv.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
