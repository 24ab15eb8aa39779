"""A ninetieth hand-run batch: SEVERAL MODELS AND OPTIMIZERS IN ONE JOB, on gloo. Four small set-ups (PG timeout 12 s
unless --pg-timeout, --steps 8 quick steps, batch 16 of synthetic per-rank data, a finite-loss check before backward):
  gan      generator G = Linear(4,16)-ReLU-Linear(16,8) and discriminator D = Linear(8,16)-ReLU-Linear(16,1), each in
           its own DDP, two Adam optimizers; per step --n-critic D updates (real vs G(z).detach()), then one G update
           through D (D's DDP reduces D's gradients there too; they are zeroed before D's next update).
           Prints `rank R step S loss_d X loss_g Y`.
  distill  a frozen teacher Linear(8,32)-ReLU-Linear(32,4) loaded from the rank's local cache
           (WORKDIR/cache/rankR/teacher.pt, copied there from WORKDIR/teacher.pt when missing), a DDP student
           Linear(8,16)-ReLU-Linear(16,4), SGD; loss = CE + KL(student/T || teacher/T). Prints `rank R step S loss X kd Y`.
  ac       actor Linear(6,16)-ReLU-Linear(16,3) and critic Linear(6,16)-ReLU-Linear(16,1), each in its own DDP, two
           optimizers; a synthetic one-step rollout per step (returns from a fixed reward), critic MSE, policy gradient
           with the detached advantage. Prints `rank R step S loss_a X loss_c Y`.
  ema      a DDP model Linear(8,16)-ReLU-Linear(16,4) plus a frozen copy (mean-teacher consistency target): a
           bias-corrected EMA shadow (zeros, decay 0.9, corrected by 1 - 0.9**t with t = step - ema_start) and a hard
           target network copied from model.module every --target-every steps. Prints `rank R step S loss X cons Y`.
At the end every rank prints `rank R done` (after a barrier). `--prepare` (run once before a job, not under torchrun)
writes WORKDIR/teacher.pt and, with --stale-rank N, puts a stale file into rank N's cache. A rank copies the teacher
into its cache when missing, writes teacher.ready, and waits for that marker before loading. No @record.

Faults (--fault NAME --rank N):
  nonegan, nonedist, noneac, noneema   controls of each set-up (exit 0)
  dtwice      gan: rank N runs two D updates per step (n_critic 2 from its node's config, the others 1), so its DDP
              all-reduces differ in count from step 1
  reqgrad     gan: rank N freezes D (`requires_grad_(False)`) around the G update, the others do not: D's reducer on
              rank N gets no gradients in the G step; its next D forward raises DDP's "Expected to have finished
              reduction in the prior iteration"
  freezeall   gan: every rank freezes D around the G update (the usual GAN recipe): DDP skips D's reduction on every
              rank alike, so the run completes (a control, exit 0)
  wrongopt    gan: the G optimizer is built over D.parameters() (a copy-paste slip) on every rank; G never changes, and
              the progress check after the loop raises AssertionError on every rank
  tsize       distill: rank N's cache holds a stale teacher with 24 hidden units (prepare --stale-rank N --stale size):
              load_state_dict's size mismatch on rank N
  tcorrupt    distill: rank N's cached teacher is a truncated copy (prepare --stale corrupt): torch.load fails on rank N
  tpoll       distill: rank N's cache holds teacher.pt without its teacher.ready marker (a copy on that node was
              interrupted; prepare --stale nomarker), so rank N polls for the marker forever while the others wait in
              the student's DDP construction (PG timeout, or a hang under `timeout`)
  tddp        distill: rank N's node config marks the teacher trainable, so rank N wraps it in DDP (before freezing it)
              ahead of the student: its DDP construction collectives meet the others' student construction
  tddpfrozen  distill: the same but rank N freezes the teacher first: DDP refuses a module with no trainable parameter
  retain      ac: rank N's batch at step --at has truncated episodes; that branch builds the advantage without
              .detach(), so the actor's backward goes through the critic's graph already freed by the critic's backward
  emanan      ema: rank N's node enables the EMA at step --at (ema_start = --at, the others 0); t = step - ema_start is 0
              there (off by one), the bias correction divides by zero and the consistency target is inf/NaN: the
              finite-loss check raises FloatingPointError on rank N at step --at
  targetsync  ema: rank N's node config copies the target network every 3 steps (the others every 2); the closing
              check compares each rank's target checksum with rank 0's broadcast one and rank N raises RuntimeError
"""
import argparse, copy, datetime, math, os, shutil, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="nonegan")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--at", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--target-every", type=int, default=2)
p.add_argument("--workdir", default="/tmp/fault90_work")
p.add_argument("--prepare", action="store_true")
p.add_argument("--stale-rank", type=int, default=-1)
p.add_argument("--stale", default="size")
a = p.parse_args()
BATCH = 16
MODE = {"nonegan": "gan", "dtwice": "gan", "reqgrad": "gan", "freezeall": "gan", "wrongopt": "gan",
        "nonedist": "distill", "tsize": "distill", "tcorrupt": "distill", "tpoll": "distill", "tddp": "distill", "tddpfrozen": "distill",
        "noneac": "ac", "retain": "ac", "noneema": "ema", "emanan": "ema", "targetsync": "ema"}[a.fault]


def mlp(i, h, o):
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o))


def check(rank, step, name, loss):
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"rank {rank}: {name} is {loss.item()} at step {step}, stopping")


def prepare():
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(7)
    torch.save(mlp(8, 32, 4).state_dict(), f"{a.workdir}/teacher.pt")
    if a.stale_rank >= 0:
        d = f"{a.workdir}/cache/rank{a.stale_rank}"
        os.makedirs(d, exist_ok=True)
        if a.stale == "size":  # last month's teacher, 24 hidden units
            torch.save(mlp(8, 24, 4).state_dict(), f"{d}/teacher.pt")
        elif a.stale == "corrupt":  # a copy cut short (the node's disk filled up during the copy)
            with open(f"{a.workdir}/teacher.pt", "rb") as fh:
                data = fh.read()
            with open(f"{d}/teacher.pt", "wb") as fh:
                fh.write(data[: len(data) // 2])
        else:  # nomarker: the copy was made but the job that made it died before writing the marker
            shutil.copy(f"{a.workdir}/teacher.pt", f"{d}/teacher.pt")
        if a.stale != "nomarker":
            open(f"{d}/teacher.ready", "w").close()
    print(f"prepared {a.workdir}/teacher.pt stale_rank {a.stale_rank} stale {a.stale}")


def node_cfg(rank):
    """Per-node settings (stand-in for a config file that differs on one node)."""
    odd = rank == a.rank
    return {"n_critic": 2 if (a.fault == "dtwice" and odd) else 1,
            "freeze_d": a.fault == "freezeall" or (a.fault == "reqgrad" and odd),
            "teacher_trainable": a.fault in ("tddp", "tddpfrozen") and odd,
            "ema_start": a.at if (a.fault == "emanan" and odd) else 0,
            "target_every": 3 if (a.fault == "targetsync" and odd) else a.target_every}


def run_gan(rank, cfg):
    torch.manual_seed(0)
    G = DDP(mlp(4, 16, 8))
    D = DDP(mlp(8, 16, 1))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    g_params = D.parameters() if a.fault == "wrongopt" else G.parameters()
    opt_g = torch.optim.Adam(g_params, lr=1e-3)
    g0 = [q.detach().clone() for q in G.parameters()]
    gen = torch.Generator().manual_seed(1000 + rank)
    ones, zeros = torch.ones(BATCH), torch.zeros(BATCH)
    for step in range(1, a.steps + 1):
        real = torch.randn(BATCH, 8, generator=gen) * 0.5 + 2.0
        for _ in range(cfg["n_critic"]):
            fake = G(torch.randn(BATCH, 4, generator=gen))
            logits = D(torch.cat([real, fake.detach()])).squeeze(1)
            loss_d = F.binary_cross_entropy_with_logits(logits, torch.cat([ones, zeros]))
            check(rank, step, "loss_d", loss_d)
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
        if cfg["freeze_d"]:
            D.requires_grad_(False)
        fake = G(torch.randn(BATCH, 4, generator=gen))
        loss_g = F.binary_cross_entropy_with_logits(D(fake).squeeze(1), ones)
        check(rank, step, "loss_g", loss_g)
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        if cfg["freeze_d"]:
            D.requires_grad_(True)
        print(f"rank {rank} step {step} loss_d {loss_d.item():.4f} loss_g {loss_g.item():.4f}", flush=True)
    moved = sum((q.detach() - q0).abs().sum().item() for q, q0 in zip(G.parameters(), g0))
    assert moved > 0, f"rank {rank}: generator weights did not change in {a.steps} steps (moved {moved})"


def run_distill(rank, cfg):
    cache = f"{a.workdir}/cache/rank{rank}"
    os.makedirs(cache, exist_ok=True)
    if not os.path.exists(f"{cache}/teacher.pt"):
        shutil.copy(f"{a.workdir}/teacher.pt", f"{cache}/teacher.pt")
        open(f"{cache}/teacher.ready", "w").close()
    while not os.path.exists(f"{cache}/teacher.ready"):  # a copy still under way on this node
        time.sleep(0.5)
    teacher = mlp(8, 32, 4)
    teacher.load_state_dict(torch.load(f"{cache}/teacher.pt", map_location="cpu"))
    print(f"rank {rank} teacher loaded from {cache}/teacher.pt", flush=True)
    if cfg["teacher_trainable"]:
        if a.fault == "tddpfrozen":
            teacher.requires_grad_(False)
        teacher = DDP(teacher)
    teacher.requires_grad_(False)
    teacher.eval()
    torch.manual_seed(0)
    student = DDP(mlp(8, 16, 4))
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(2000 + rank)
    T = 2.0
    for step in range(1, a.steps + 1):
        x = torch.randn(BATCH, 8, generator=gen)
        y = torch.randint(0, 4, (BATCH,), generator=gen)
        with torch.no_grad():
            t_logits = teacher(x)
        s_logits = student(x)
        kd = F.kl_div(F.log_softmax(s_logits / T, 1), F.softmax(t_logits / T, 1), reduction="batchmean") * T * T
        loss = F.cross_entropy(s_logits, y) + kd
        check(rank, step, "loss", loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} kd {kd.item():.4f}", flush=True)


def run_ac(rank, cfg):
    torch.manual_seed(0)
    actor, critic = DDP(mlp(6, 16, 3)), DDP(mlp(6, 16, 1))
    opt_a = torch.optim.Adam(actor.parameters(), lr=1e-3)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(3000 + rank)
    w = torch.tensor([1.0, -0.5, 0.25])
    for step in range(1, a.steps + 1):
        s = torch.randn(BATCH, 6, generator=gen)
        dist_ = torch.distributions.Categorical(logits=actor(s))
        act = dist_.sample()
        ret = w[act] * s[:, 0] + 0.1 * torch.randn(BATCH, generator=gen)
        truncated = a.fault == "retain" and rank == a.rank and step == a.at  # episodes cut by the time limit
        v = critic(s).squeeze(1)
        if truncated:
            ret = ret + 0.99 * v.detach().roll(1)  # bootstrap the cut episodes from the next state's value
            adv = ret - v
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        else:
            adv = (ret - v).detach()
        loss_c = F.mse_loss(v, ret)
        loss_a = -(dist_.log_prob(act) * adv).mean()
        check(rank, step, "loss_c", loss_c)
        opt_c.zero_grad()
        loss_c.backward()
        opt_c.step()
        opt_a.zero_grad()
        loss_a.backward()
        opt_a.step()
        print(f"rank {rank} step {step} loss_a {loss_a.item():.4f} loss_c {loss_c.item():.4f}", flush=True)


def run_ema(rank, cfg):
    torch.manual_seed(0)
    model = DDP(mlp(8, 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shadow = [torch.zeros_like(q) for q in model.module.parameters()]
    ema_net, target = copy.deepcopy(model.module), copy.deepcopy(model.module)
    ema_net.requires_grad_(False)
    target.requires_grad_(False)
    gen = torch.Generator().manual_seed(4000 + rank)
    decay = 0.9
    for step in range(1, a.steps + 1):
        x = torch.randn(BATCH, 8, generator=gen)
        y = torch.randint(0, 4, (BATCH,), generator=gen)
        if step >= cfg["ema_start"]:
            with torch.no_grad():
                t = step - cfg["ema_start"]
                for e, q, dst in zip(shadow, model.module.parameters(), ema_net.parameters()):
                    e.mul_(decay).add_(q.detach(), alpha=1 - decay)
                    dst.copy_(e / (1 - decay ** t))
        with torch.no_grad():
            t_out = 0.5 * (ema_net(x) + target(x))
        out = model(x + 0.1 * torch.randn(BATCH, 8, generator=gen))
        cons = F.mse_loss(F.softmax(out, 1), F.softmax(t_out, 1))
        loss = F.cross_entropy(out, y) + cons
        check(rank, step, "loss", loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % cfg["target_every"] == 0:
            with torch.no_grad():
                for dst, q in zip(target.parameters(), model.module.parameters()):
                    dst.copy_(q)
        print(f"rank {rank} step {step} loss {loss.item():.4f} cons {cons.item():.4f}", flush=True)
    csum = torch.tensor([sum(q.sum().item() for q in target.parameters())], dtype=torch.float64)
    ref = csum.clone()
    dist.broadcast(ref, 0)
    if abs(csum.item() - ref.item()) > 1e-9:
        raise RuntimeError(f"rank {rank}: target network out of sync: checksum {csum.item():.6f} "
                           f"vs rank 0's {ref.item():.6f}")


def main():
    if a.prepare:
        return prepare()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    cfg = node_cfg(rank)
    print(f"rank {rank} world {world} mode {MODE} fault {a.fault} cfg {cfg}", flush=True)
    {"gan": run_gan, "distill": run_distill, "ac": run_ac, "ema": run_ema}[MODE](rank, cfg)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
