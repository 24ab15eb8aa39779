"""Batch 528: WHITEWATER KAYAK ROUTE DIFFICULTY FROM RIVER GAUGES. A small classifier predicts the difficulty
class (I..VI, 6 classes) of a river section from gauge readings (discharge m3/s, stage m, 24 h change, water
temperature) joined with a lookup table of gauge stations (section gradient m/km, width m). `--prepare` writes
synthetic data into --workdir: a shard per rank (gauges_r{R}.pt: gauge ids + readings + labels), stations.json,
and a checkpoint to start from (init.pt). Training: gloo, CPU, MLP(6->32->6) wrapped in DDP (or, with
--sync manual, gradients all_reduced by hand), SGD, batch 16 from a DataLoader (1 worker), --steps steps (6), PG
timeout --pg-timeout (12 s). Each step every rank all_gathers its 4 per-section mean-discharge statistics and
prints `rank R step S loss L acc M`; rank 0 saves export.pt at the end. No @record.

Faults (--fault NAME --rank N):
  none         control (exit 0)
  gaugekey     rank N's shard names gauge station 'G-9931', not in stations.json: KeyError while joining
  noshard      rank N reads its shard from node_cache/, which the data sync never filled: FileNotFoundError
  ckptsize     rank N starts from init_v1.pt (an older model with 24 hidden units): load_state_dict size mismatch
  weightsonly  rank N's checkpoint also pickles a RatingCurve object: torch.load (weights_only=True) refuses it
  gathersize   rank N has a 5th section gauge and all_gathers 5 statistics where the others gather 4
  slowrank     at step 3 rank N refits its rating curve in pure Python (minutes): the others time out in the
               next collective (with --pg-timeout 300 it is a hang that an outer `timeout` ends)
  nanflow      rank N's step 4 batch has a stage of -1.3 m (a sensor fault); log1p of the stage -> NaN; the
               script's own finiteness check raises FloatingPointError
  segv         rank N's native gauge decoder crashes: the rank sends itself SIGSEGV at step 2
  errexit      rank N finds its gauge feed stale, prints its own ERROR line and calls sys.exit(4)
  shapeall     every rank appends the 'width' column twice (7 features into a 6-input model): mat1/mat2 shapes
  hostmem      rank N (memory limit 1.5 GiB via RLIMIT_AS) builds a dense 24000x24000 float64 gauge-distance
               matrix: the CPU allocator fails (RuntimeError, can't allocate memory)
  workerkill   rank N's DataLoader worker is SIGKILLed at its 40th sample (worker killed by signal)

What happened (runs of 2026-12-07, torch 2.13.0+cpu):
  none         exit 0, six steps per rank, export saved
  gaugekey     KeyError: 'G-9931' on the planted rank before step 1 (tee np5 r3; wrapper np3 r1), exit 1
  noshard      FileNotFoundError on rank 4, only in its redirected stderr.log (redirects np6), exit 1
  ckptsize     load_state_dict size mismatch on rank 2 (pymodule np4), exit 1
  weightsonly  UnpicklingError (Weights only load failed, __main__.RatingCurve) on rank 5 (tee_trainer np6), exit 1
  gathersize   DETAIL: 'Detected mismatch between collectives' on every rank, shapes 4 vs 5 (np5 r2);
               plain: rank 3 'allgather: invalid tensor size', peers 'Connection closed by peer' (np4), exit 1
  slowrank     pg-timeout 12: peers time out after 12000ms in the all_reduce (loglevel np6 r5), exit 1;
               pg-timeout 300: output stops at step 2/3, the outer timeout ends it (prefix np3 r1), exit 124
  nanflow      FloatingPointError loss is nan at step 4 on rank 6 (pdsh2 np8), exit 1
  segv         exitcode -11 for filtered-out rank 4 (filter np5), exit 1; the restart run (np4 r1) ran past
               its 100 s timeout and was dropped
  errexit      the rank's own ERROR line, exitcode 4 (prefix np7 r5; pymodule np4 r0), exit 1
  shapeall     mat1 and mat2 shapes cannot be multiplied (16x7 and 6x32) on all five ranks (tee np5), exit 1
  hostmem      not kept (run cut for time)
  workerkill   not kept (runs cut for time)
"""
import argparse, datetime, json, math, os, resource, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--sync", default="ddp", choices=["ddp", "manual"])
p.add_argument("--workdir", default="/tmp/fault528_work")
p.add_argument("--prepare", action="store_true")
a = p.parse_args()
BATCH, NSEC = 16, 4


class RatingCurve:  # stage -> discharge fit of one gauge (pickled by an old exporter)
    def __init__(self, a, b, c):
        self.a, self.b, self.c = a, b, c


def make_model(hidden=32):
    return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 6))


def prepare():
    os.makedirs(a.workdir, exist_ok=True)
    stations = {f"G-{1000 + i}": {"gradient_m_km": 2.0 + 1.5 * i, "width_m": 40.0 - 2 * i, "section": i % NSEC}
                for i in range(24)}
    json.dump(stations, open(f"{a.workdir}/stations.json", "w"), indent=1)
    for r in range(8):
        g = torch.Generator().manual_seed(528 + r)
        n = BATCH * 8
        ids = [f"G-{1000 + int(i)}" for i in torch.randint(0, 24, (n,), generator=g)]
        q = torch.rand(n, generator=g) * 300 + 5
        stage = torch.rand(n, generator=g) * 3 + 0.2
        d24 = torch.randn(n, generator=g) * 0.3
        temp = torch.rand(n, generator=g) * 15 + 2
        grad = torch.tensor([stations[i]["gradient_m_km"] for i in ids])
        y = ((q.log() * 0.4 + grad * 0.12 + stage * 0.3) - 2.0).clamp(0, 5.99).long()
        torch.save({"gauge": ids, "readings": torch.stack([q, stage, d24, temp], 1), "label": y},
                   f"{a.workdir}/gauges_r{r}.pt")
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), f"{a.workdir}/init.pt")
    torch.save(make_model(24).state_dict(), f"{a.workdir}/init_v1.pt")
    sd = make_model().state_dict()
    sd["rating_curve"] = RatingCurve(12.1, 1.7, 0.05)
    torch.save(sd, f"{a.workdir}/init_rc.pt")
    print("prepared", a.workdir)


class Gauges(torch.utils.data.Dataset):
    def __init__(self, x, y, kill_at=None):
        self.x, self.y, self.kill_at = x, y, kill_at

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.kill_at is not None and i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    print(f"rank {rank}/{world} fault {a.fault} sync {a.sync}: loading gauge shard", flush=True)
    src = a.workdir
    if a.fault == "noshard" and me:
        src = f"{a.workdir}/node_cache"  # this node reads its local cache, which the sync never filled
    shard = torch.load(f"{src}/gauges_r{rank}.pt")
    stations = json.load(open(f"{a.workdir}/stations.json"))
    if a.fault == "gaugekey" and me:
        shard["gauge"][37] = "G-9931"  # a station added upstream after the table was exported
    rows = []
    for gid, rd in zip(shard["gauge"], shard["readings"]):
        st = stations[gid]
        rows.append([math.log(rd[0]), math.log1p(rd[1]), rd[2], rd[3] / 10, st["gradient_m_km"] / 10,
                     st["width_m"] / 40] + ([st["width_m"] / 40] if a.fault == "shapeall" else []))
    x = torch.tensor(rows, dtype=torch.float32)
    y = shard["label"]
    sec = torch.tensor([stations[g]["section"] for g in shard["gauge"]])

    model = make_model()
    ck = f"{a.workdir}/init.pt"
    if me and a.fault == "ckptsize":
        ck = f"{a.workdir}/init_v1.pt"
    if me and a.fault == "weightsonly":
        ck = f"{a.workdir}/init_rc.pt"
    sd = torch.load(ck)
    sd.pop("rating_curve", None)
    model.load_state_dict(sd)
    print(f"rank {rank} initialised from {ck}", flush=True)
    if a.sync == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(Gauges(x, y, 40 if (me and a.fault == "workerkill") else None),
                                         batch_size=BATCH, num_workers=1)
    if a.fault == "hostmem" and me:
        resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
    it = iter(loader)
    for step in range(1, a.steps + 1):
        xb, yb = next(it)
        if a.fault == "nanflow" and me and step == 4:
            xb = xb.clone()
            xb[3, 1] = torch.log1p(torch.tensor(-1.3))  # stage -1.3 m from a faulty sensor: NaN
        if a.fault == "segv" and me and step == 2:
            print(f"rank {rank}: decoding telemetry packet from gauge {shard['gauge'][step]}", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "errexit" and me and step == 3:
            print(f"ERROR rank {rank}: gauge feed for {shard['gauge'][0]} is stale (last reading 5 days old); "
                  f"refusing to train on outdated levels", flush=True)
            sys.exit(4)
        if a.fault == "hostmem" and me and step == 2:
            print(f"rank {rank}: building dense gauge-distance matrix 24000x24000", flush=True)
            dmat = torch.empty(24000, 24000, dtype=torch.float64)
            dmat.fill_(0)
        if a.fault == "slowrank" and me and step == 3:
            print(f"rank {rank}: refitting rating curve for {shard['gauge'][0]} (pure Python)", flush=True)
            acc = 0.0
            t0 = time.time()
            while time.time() - t0 < 400:
                for k in range(20000):
                    acc += math.sin(k * 0.001) ** 2
        opt.zero_grad()
        out = model(xb)
        loss = F.cross_entropy(out, yb)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (non-finite gauge feature)")
        loss.backward()
        if a.sync == "manual":
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad.div_(world)
        opt.step()
        nsec = NSEC + 1 if (a.fault == "gathersize" and me) else NSEC
        stats = torch.stack([x[sec == s % NSEC, 0].mean() for s in range(nsec)])
        gathered = [torch.zeros(NSEC) for _ in range(world)]
        dist.all_gather(gathered, stats)
        accm = (out.argmax(1) == yb).float().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} acc {accm:.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        net = model.module if a.sync == "ddp" else model
        torch.save(net.state_dict(), f"{a.workdir}/export.pt")
        print(f"rank 0 saved {a.workdir}/export.pt", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    prepare() if a.prepare else main()
