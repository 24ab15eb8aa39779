"""A four-hundred-and-forty-fourth hand-run batch: AVALANCHE RISK FROM SNOWPACK PROFILES.

Synthetic snow-pit profiles: every profile is a stack of up to 12 layers, each with a grain type (looked up in
an 8-entry grain table: PP, DF, RG, FC, DH, SH, MF, IF), a density, a temperature, a hand hardness and a
thickness, plus a recorded weak-layer index and a danger level (1-5).  Every rank reads its profiles from
/tmp/fault444_work/profiles/station_R.pt, builds a [profiles, 12 features, 12 layers] tensor (shear proxy =
hardness / density), and trains SnowNet (Conv1d over the layers, flattened, a linear head over the 5 danger
levels) with cross-entropy, wrapped in DDP over gloo (or with gradients all_reduced by hand, --ddp 0).  The
model is initialised from ckpt/snownet_d5.pt.  Per-rank grain-type counts are all_gathered at the start, the
loss is all_reduced every step (with an accuracy), per-rank accuracies are all_gathered at the end, and rank 0
saves export/snownet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults:
  graintype   - rank N's profiles contain grain type "SHx" (a typo for surface hoar), not in the grain table (KeyError)
  noprofiles  - rank N reads profiles/winter/station_N.pt which does not exist (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/snownet_d6.pt, saved with 6 danger levels (size mismatch)
  ckptpickle  - rank N loads ckpt/snownet_meta.pt, pickled with a StationMeta object (weights_only refusal)
  gathershape - rank N all_gathers grain counts plus an "unknown" bin (9 vs 8 entries)
  layeridx    - at step 3 rank N looks up weak layer index 14 in a profile of at most 12 layers (IndexError)
  nanloss     - rank N's step-2 batch has a layer of density 0: shear proxy inf, the program's loss check
  slowstab    - rank N computes a stability index over every layer pair in Python before the step-2 all_reduce
  stall       - rank N waits for a field-observation flag file that never appears after step 1 (a hang)
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - after the last step rank N prints its own error line about an unrealistic profile and sys.exit(4)
  depthbins   - every rank: profiles padded to 14 layers, the head expects 12 (shape error in the first forward)
  none        - control, clean run

What happened (filled in after the runs):
  graintype   - KeyError: 'SHx' in featurise before the first all_gather; peers Connection closed by peer (np4 r1 tee, np6 r0 loglevel)
  noprofiles  - FileNotFoundError for profiles/winter/station_2.pt, only in the log-dir's attempt_0/2/stderr.log; console Root Cause rank 2 (np3 r2 redirects)
  ckptsize    - load_state_dict size mismatch for head.weight [6,96] vs [5,96] and head.bias (np4 r2 pymodule, np3 r0 wrapper)
  ckptpickle  - _pickle.UnpicklingError: Weights only load failed (StationMeta in the checkpoint) (np3 r1 tee_trainer)
  gathershape - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' (np4 r3 filter; np6 r2 restart,
                whose second attempt sat ~60 s in init and died with Gloo connectFullMesh 'Connect timeout', final Root Cause rank 0)
  layeridx    - IndexError: list index out of range after step 2 (np4 r0 pymodule; np8 r6 tee, where rank 5 then hit
                'terminate called without an active exception' and the Root Cause names rank 5 SIGABRT)
  nanloss     - 'non-finite loss nan at step 2' then FloatingPointError (np6 r4 prefix; np3 r2 detail, rank 0 monitoredBarrier names rank 2)
  slowstab    - rank 1 silent; ranks 0 and 2 'Timed out waiting 12000ms' for recv/send in the step-2 all_reduce; Root Cause rank 2 (np3 r1 plain)
  stall       - 'rank 2 waiting for field observation flag ...' after step 1, silence, killed by timeout at 60 s, exit 124 (np4 r2 loglevel)
  sigsegv     - no traceback, exitcode -11 after step 3 (np4 r1 pdsh2, worker-1 then RendezvousConnectionError; np3 r0 restart,
                second attempt died in Gloo connectFullMesh Connection refused)
  exit4       - rank N's ERROR line and exit 4 before the final all_gather; Root Cause exitcode 4 (np8 r5 wrapper, np3 r2 prefix)
  depthbins   - every rank 'mat1 and mat2 shapes cannot be multiplied (16x112 and 96x5)'; Root Cause rank 0 (np3 tee_trainer)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/snownet.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault444_work"
GRAINS = {"PP": 0, "DF": 1, "RG": 2, "FC": 3, "DH": 4, "SH": 5, "MF": 6, "IF": 7}
NLAYER = 12
FEAT = 12
NDANGER = 5
log = None


@dataclass
class StationMeta:
    name: str
    elevation_m: int
    aspect: str


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("snowpk")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class SnowNet(nn.Module):
    def __init__(self, ndanger=NDANGER, nlayer=NLAYER):
        super().__init__()
        self.conv = nn.Conv1d(FEAT, 16, 3, padding=1)
        self.conv2 = nn.Conv1d(16, 8, 3, padding=1)
        self.head = nn.Linear(8 * nlayer, ndanger)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        h = torch.relu(self.conv2(h))
        return self.head(h.flatten(1))


def make_profiles(n, seed):
    g = torch.Generator().manual_seed(seed)
    syms = list(GRAINS)
    profs = []
    for _ in range(n):
        nl = int(torch.randint(5, NLAYER + 1, (1,), generator=g))
        layers = []
        for k in range(nl):
            layers.append({
                "grain": syms[int(torch.randint(0, 8, (1,), generator=g))],
                "density": float(80 + 40 * k + 30 * torch.rand(1, generator=g)),
                "temp": float(-12 + k * 0.9 + torch.randn(1, generator=g)),
                "hardness": float(1 + k * 0.3 + torch.rand(1, generator=g)),
                "thick": float(2 + 20 * torch.rand(1, generator=g)),
            })
        weak = int(torch.randint(0, nl, (1,), generator=g))
        risk = 1 + (layers[weak]["grain"] in ("SH", "DH", "FC")) * 2 + int(nl > 9)
        profs.append({"layers": layers, "weak": weak, "danger": min(risk, 5) - 1})
    return profs


def prepare():
    os.makedirs(f"{WORK}/profiles", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/flags", exist_ok=True)
    for r in range(8):
        torch.save(make_profiles(96, 444 + r), f"{WORK}/profiles/station_{r}.pt")
    torch.manual_seed(0)
    torch.save(SnowNet(5).state_dict(), f"{WORK}/ckpt/snownet_d5.pt")
    torch.save(SnowNet(6).state_dict(), f"{WORK}/ckpt/snownet_d6.pt")
    torch.save({"model": SnowNet(5).state_dict(), "station": StationMeta("Weissfluhjoch", 2540, "SE")},
               f"{WORK}/ckpt/snownet_meta.pt")
    print("prepared", WORK)


def featurise(profs, nlayer):
    x = torch.zeros(len(profs), FEAT, nlayer)
    for p_i, p in enumerate(profs):
        for k, L in enumerate(p["layers"][:nlayer]):
            x[p_i, GRAINS[L["grain"]], k] = 1.0
            x[p_i, 8, k] = L["density"] / 400.0
            x[p_i, 9, k] = L["temp"] / -20.0
            x[p_i, 10, k] = (L["hardness"] / L["density"]) * 50.0 if L["density"] else float("inf")
            x[p_i, 11, k] = L["thick"] / 20.0
    y = torch.tensor([p["danger"] for p in profs])
    return x, y


def stability_index(profs):
    s = 0.0
    for p in profs:
        ls = p["layers"]
        for i in range(len(ls)):
            for j in range(len(ls)):
                for k in range(50):
                    s += (ls[i]["hardness"] * ls[j]["density"]) ** 0.5 / (1 + abs(i - j) + k)
    return s


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading snow profiles")
    sub = "winter/" if bad and a.fault == "noprofiles" else ""
    profs = torch.load(f"{WORK}/profiles/{sub}station_{rank}.pt")
    if bad and a.fault == "graintype":
        profs[7]["layers"][3]["grain"] = "SHx"
    if bad and a.fault == "nanloss":
        profs[2 * a.batch + 5]["layers"][1]["density"] = 0.0
    nlayer = 14 if a.fault == "depthbins" else NLAYER
    x, y = featurise(profs, nlayer)
    counts = x[:, :8, :].sum((0, 2))
    if bad and a.fault == "gathershape":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} layers {int(counts.sum())} global {int(sum(c.sum() for c in allc))} "
        f"surface-hoar {int(sum(c[5] for c in allc))}")
    model = SnowNet()
    if bad and a.fault == "ckptpickle":
        sd = torch.load(f"{WORK}/ckpt/snownet_meta.pt")["model"]
    else:
        ck = "snownet_d6.pt" if bad and a.fault == "ckptsize" else "snownet_d5.pt"
        sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    nb = len(profs) // a.batch
    for step in range(a.steps):
        sl = slice((step % nb) * a.batch, (step % nb + 1) * a.batch)
        xb, yb = x[sl], y[sl]
        if bad and a.fault == "layeridx" and step == 3:
            p = profs[sl.start]
            p["weak"] = 14
            wl = p["layers"][p["weak"]]
            say(f"rank {rank} weak layer grain {wl['grain']}")
        logits = net(xb)
        loss = F.cross_entropy(logits, yb)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(xb)).sum())} non-finite inputs in the batch)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if bad and a.fault == "slowstab" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.stab_budget:
                stability_index(profs)
                n += 1
            say(f"rank {rank} stability index computed {n} times")
        if bad and a.fault == "stall" and step == 1:
            flag = f"{WORK}/flags/field_obs_{rank}.ready"
            say(f"rank {rank} waiting for field observation flag {flag}")
            while not os.path.exists(flag):
                time.sleep(0.5)
        acc = (logits.argmax(1) == yb).float().mean()
        stat = torch.stack([loss.detach(), acc])
        dist.all_reduce(stat)
        say(f"rank {rank} step {step} loss {stat[0].item() / world:.4f} acc {stat[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"ERROR rank {rank}: profile 31 has a 212 cm layer colder than -40 C at 2540 m; "
            f"station data unrealistic, refusing to export", err=True)
        sys.exit(4)
    accs = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(accs, acc.reshape(1))
    say(f"rank {rank} final per-rank acc {[round(v.item(), 3) for v in accs]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/snownet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/snownet.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stab-budget", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()
