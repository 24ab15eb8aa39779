"""A two-hundred-and-eighty-third hand-run batch: KNOWLEDGE GRAPH COMPLETION WITH ROTATE. One config bug at a time.

A synthetic knowledge graph (64 entities e0..e63, 6 named relations) is written as per-rank triple files
(`<work>/kg/triples_RR.tsv`, head<TAB>relation<TAB>tail, made by `--prep 1`, which also writes two embedding
checkpoints under `<work>/ckpt/`). Each rank trains RotatE (entity embeddings in the complex plane, 2*D real
numbers per entity, relations as D phases) with self-adversarial negative sampling and a margin loss, under DDP on
gloo; it prints `rank R step S loss L`, then ranks every entity for its test triples, all_gathers the per-rank
rank lists and all_reduces MRR and hits@10. `--spawn N` runs it under torch.multiprocessing.spawn; `--logfmt 1`
logs through Python logging with the rank in the format.
Faults:
  entidx      rank N's negative sampler draws from range(n_ent + 1): the embedding lookup raises IndexError
  advtemp     rank N's self-adversarial temperature is 0.0: weights are NaN, the program's loss check raises
  rankgather  rank N holds one test triple more; its rank list is all_gathered against shorter peers (gloo size)
  notriples   rank N reads its triples from kg_v2/, which does not exist: FileNotFoundError at startup
  relkey      rank N's triple file names a relation missing from the relation map: KeyError at startup
  dimshape    every rank builds entities with dim 12 for 8 relation phases (not twice): shape RuntimeError
  ckptent     with --resume, rank N loads a checkpoint of 80 entities into the 64-entity model: size mismatch
  fullrank    rank N evaluates without batching for --stall s before the all_reduce; the others wait and time out
  sigterm     rank N sends itself SIGTERM after step 2's optimizer step
  devtype     rank N builds its margin tensor on the meta device; .item() raises RuntimeError at step 0
  none        control: no fault
What happened (filled in after the runs):
  entidx      rank 1 (np4 bashloop): IndexError: index out of range in self at step 0; peers Connection closed by peer
  advtemp     rank 2 (np4 ranklabel): FloatingPointError loss is nan at step 0 (temperature 0.0); peers Connection closed
  rankgather  rank 1 (np3 mpitag): ProcessGroupGloo::allgather: invalid tensor size (expected (9), got (8)) after 5 steps
  notriples   rank 3 (np4 files): FileNotFoundError .../kg_v2/triples_03.tsv at startup; peers closed in DDP init
  relkey      rank 2 (np3 srunlabel): KeyError: 'located_in' at startup; peers Connection closed by peer
  dimshape    every rank (np3 bashloop): RuntimeError size of tensor a (6) must match ... b (8) at step 0
  ckptent     rank 2 (np4 legacy launch): state_dict size mismatch ent.weight [80, 16] vs [64, 16]; Root Cause rank 2
  fullrank    rank 1 (np3 logfmt torchrun): see README (the only fullrank run kept; the hung variant was not run)
  sigterm     not run (time limit)
  devtype     not run (time limit)
  none        not run (time limit)
"""
import argparse, logging, os, random, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--stall", type=float, default=40.0)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--prep", type=int, default=0)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--port", type=int, default=29500)
p.add_argument("--logfmt", type=int, default=0)
p.add_argument("--work", default="/tmp/fault283_work")
a = p.parse_args()
N_ENT, RELS, D, NEG, BATCH = 64, ["born_in", "works_for", "located_in", "part_of", "spouse_of", "capital_of"], 8, 16, 32


def prep():
    os.makedirs(f"{a.work}/kg", exist_ok=True); os.makedirs(f"{a.work}/ckpt", exist_ok=True)
    for r in range(8):
        rng = random.Random(r)
        with open(f"{a.work}/kg/triples_{r:02d}.tsv", "w") as f:
            for _ in range(200):
                f.write(f"e{rng.randrange(N_ENT)}\t{rng.choice(RELS)}\te{rng.randrange(N_ENT)}\n")
    for n in (64, 80):
        torch.save({"ent.weight": torch.randn(n, 2 * D), "rel.weight": torch.randn(len(RELS), D)}, f"{a.work}/ckpt/rotate_e{n}.pt")


class RotatE(nn.Module):
    def __init__(self, n_ent, ent_dim, rel_dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, ent_dim); self.rel = nn.Embedding(len(RELS), rel_dim)
        nn.init.uniform_(self.ent.weight, -0.5, 0.5); nn.init.uniform_(self.rel.weight, -3.14, 3.14)

    def forward(self, h, r, t):  # distance of rotate(h, r) from t, per (h, t) pair, broadcast over negatives
        hr, hi = self.ent(h).chunk(2, dim=-1); tr, ti = self.ent(t).chunk(2, dim=-1)
        ph = self.rel(r)
        while ph.dim() < hr.dim(): ph = ph.unsqueeze(1)
        cr, ci = torch.cos(ph), torch.sin(ph)
        return ((hr * cr - hi * ci - tr) ** 2 + (hr * ci + hi * cr - ti) ** 2).add(1e-9).sqrt().sum(-1)


def worker(rank, world):
    faulty = a.rank in (-1, rank) and a.fault != "none"
    lg = logging.LoggerAdapter(logging.getLogger("kgc"), {"rank": rank})
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s")
    say = lg.info if a.logfmt else print
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    kgdir = "kg_v2" if (faulty and a.fault == "notriples") else "kg"
    relmap = {n: i for i, n in enumerate(RELS)}
    if faulty and a.fault == "relkey": relmap = {n: i for i, n in enumerate(RELS) if n != "located_in"}
    with open(f"{a.work}/{kgdir}/triples_{rank:02d}.tsv") as f:
        trip = [(int(h[1:]), relmap[r], int(t[1:])) for h, r, t in (ln.rstrip("\n").split("\t") for ln in f)]
    trip = torch.tensor(trip)
    n_test = 9 if (faulty and a.fault == "rankgather") else 8
    train, test = trip[:-n_test], trip[-n_test:]
    ent_dim = 12 if (faulty and a.fault == "dimshape") else 2 * D
    torch.manual_seed(0)
    model = RotatE(N_ENT, ent_dim, D)
    if a.resume:
        n = 80 if (faulty and a.fault == "ckptent") else 64
        say(f"rank {rank} resuming embeddings from ckpt/rotate_e{n}.pt")
        model.load_state_dict(torch.load(f"{a.work}/ckpt/rotate_e{n}.pt"))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.05)
    temp = 0.0 if (faulty and a.fault == "advtemp") else 1.0
    gamma = torch.tensor(6.0, device="meta" if (faulty and a.fault == "devtype") else "cpu")
    n_neg_ent = N_ENT + 1 if (faulty and a.fault == "entidx") else N_ENT
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        idx = torch.randint(0, len(train), (BATCH,), generator=g)
        h, r, t = train[idx].unbind(1)
        neg = torch.randint(0, n_neg_ent, (BATCH, NEG), generator=g)
        margin = gamma.item()
        pos = F.logsigmoid(margin - ddp(h, r, t))
        nd = ddp(h.unsqueeze(1).expand(-1, NEG), r, neg)
        w = torch.softmax((margin - nd) / temp, dim=1).detach()
        loss = -(pos.mean() + (w * F.logsigmoid(nd - margin)).sum(1).mean()) / 2
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (self-adversarial temperature {temp})")
        opt.zero_grad(); loss.backward(); opt.step()
        say(f"rank {rank} step {step} loss {loss.item():.4f}")
        if faulty and a.fault == "sigterm" and step == 2: os.kill(os.getpid(), signal.SIGTERM)
    with torch.no_grad():
        if faulty and a.fault == "fullrank":
            say(f"rank {rank} evaluating: ranking all {N_ENT} entities for every test triple (no batching)")
            t0 = time.time()
            while time.time() - t0 < a.stall:
                for hh, rr, tt in test.tolist():
                    for e in range(N_ENT): model(torch.tensor([hh]), torch.tensor([rr]), torch.tensor([e]))
        h, r, t = test.unbind(1)
        d = model(h.unsqueeze(1).expand(-1, N_ENT), r, torch.arange(N_ENT).expand(len(test), -1))
        ranks = (d < d.gather(1, t.unsqueeze(1))).sum(1).float() + 1
        allr = [torch.zeros(8) for _ in range(world)]
        dist.all_gather(allr, ranks)
        m = torch.tensor([(1.0 / ranks).sum().item(), (ranks <= 10).sum().item(), float(len(ranks))])
        dist.all_reduce(m)
    if rank == 0: say(f"rank 0 eval: MRR {m[0] / m[2]:.4f} hits@10 {m[1] / m[2]:.4f} over {int(m[2])} test triples; ranks {torch.cat(allr).int().tolist()[:8]}")
    dist.barrier()
    dist.destroy_process_group()


def spawned(i, n):
    os.environ.update(RANK=str(i), WORLD_SIZE=str(n), LOCAL_RANK=str(i), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    worker(i, n)


if __name__ == "__main__":
    if a.prep:
        prep()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawned, args=(a.spawn,), nprocs=a.spawn)
    else:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
