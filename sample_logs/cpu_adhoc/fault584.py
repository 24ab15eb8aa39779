"""Batch 584, theme PIKA HAYPILES. Each rank owns the survey shard of a few talus slopes: per site six features
(forage cover, slope, altitude, distance to meadow, snow days, burrow count) plus the dominant plant species of the
haypile. A lookup table (species -> dryness coefficient) scales the forage cover by the plant's dryness. A small
regressor Linear(7,32)-ReLU-Linear(32,1) predicts the haypile mass; it starts from the checkpoint `--prepare`
writes (init.pt). gloo, CPU only, PG timeout --pg-timeout (12 s), --steps (6) steps of batch 16, gradients
all_reduced by hand (no DDP wrapper), one all_gather of per-rank haypile counts per step, a finite-loss check.
Every rank prints `rank R step S loss L haymass_g M` per step; rank 0 saves an export at the end.
`--prepare` writes the synthetic data into --workdir (shards for 8 ranks, species table, checkpoints).

Faults (planted on rank --rank unless said otherwise):
  none         control (exit 0)
  species      rank N's shard, step 2, names a species the lookup table lacks ('Carex sp. nov.'): KeyError
  missing      rank N reads its shard from a v2 file name that was never written: FileNotFoundError
  ckptsize     rank N starts from the legacy checkpoint with a 24-wide hidden layer: load_state_dict size mismatch
  weightsonly  rank N's checkpoint also pickles its survey config (a SurveyConfig object): torch.load
               (weights_only=True) refuses it with UnpicklingError
  gathersize   rank N gathers 4 haypile counts per step (it counts a 4th talus class), the others 3
  slow         rank N recounts --stalks haystalks in pure Python before step 3's all_reduce (~40 s); peers time out
               (with --pg-timeout 300 --stalks 1000000000 a hang that only the outer `timeout` ends)
  nan          rank N's lookup of one species at step 3 returns dryness 0.0: cover/dryness is inf, the loss nan,
               and the program's own check raises FloatingPointError
  segv         rank N sends itself SIGSEGV at step 3
  logexit      rank N finds its talus slope ids duplicated, prints its own ERROR line and calls sys.exit(4) at step 2
  shapeall     every rank builds the feature matrix without the dryness column (6 instead of 7): matmul shape error
  memblow      rank N builds a site-by-site distance matrix over every survey site ever (2e6 x 2e6 floats):
               the CPU allocator refuses it (kept small: nothing is really allocated)
  workercrash  DataLoader with one worker on every rank; rank N's worker is SIGKILLed at its 3rd batch

What happened (see the logs in sample_logs/cpu_adhoc/pika_*):
  none         pika_none_np4_rnone_plain, pika_none_np6_rnone_pdsh2: 6 steps on every rank, export saved, exit 0.
  species      np4 r2 tee: KeyError 'Carex sp. nov.' on rank 2 before step 1; np8 r5 filter: traceback filtered out,
               only the agent's summary names rank 5 (exit 1).
  missing      np3 r1 redirects: console shows the agent only, FileNotFoundError in rank 1's stderr.log;
               np5 r4 loglevel: FileNotFoundError talus_4_v2.pt on rank 4 among INFO agent lines.
  ckptsize     np4 r3 pymodule: load_state_dict size mismatch RuntimeError on rank 3.
  weightsonly  np6 r2 tee_trainer: UnpicklingError 'Weights only load failed' (SurveyConfig) on rank 2.
  gathersize   np5 r1 detail: every rank raises 'Detected mismatch between collectives' ([4] vs [3]), agent names rank 0;
               np4 r3 plain: 'ProcessGroupGloo::allgather: invalid tensor size' on rank 3, peers Connection closed.
  slow         np4 r2 tee: peers time out after 12000 ms in step 3's all_reduce, agent names rank 3;
               np3 r1 wrapper (--pg-timeout 300): output stops after 'recounting haystalks', timeout 60 ends it (124).
  nan          np6 r4 prefix: FloatingPointError 'haypile loss is nan at step 3' on rank 4.
  segv         np5 r3 restart: -11 on rank 3, the restarted group fails in gloo connectFullMesh; np7 r6 tee: -11 on rank 6.
  logexit      np4 r1 wrapper: ERROR line + exit 4 on rank 1; np6 r5 filter: ERROR line filtered, agent shows exitcode 4.
  shapeall     np4 rall loglevel: 'mat1 and mat2 shapes cannot be multiplied (16x6 and 7x32)' on all ranks.
  memblow      np3 r2 prefix: DefaultCPUAllocator can't allocate 16000000000000 bytes on rank 2.
  workercrash  np4 r1 pdsh2: 'DataLoader worker (pid N) is killed by signal: Killed.' on rank 1; the second agent
               then loses the c10d store (RendezvousConnectionError); the wrapper's bare wait returned 0.
"""
import argparse, datetime, json, math, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault584_work")
p.add_argument("--prepare", action="store_true")
p.add_argument("--stalks", type=int, default=60_000_000)
a = p.parse_args()
BATCH = 16
SPECIES = ["Carex nigricans", "Festuca ovina", "Trifolium parryi", "Geum rossii", "Polygonum bistortoides",
           "Salix arctica", "Sibbaldia procumbens", "Deschampsia cespitosa"]


class SurveyConfig:
    def __init__(self, slope, season):
        self.slope, self.season = slope, season


def net(hidden=32):
    return nn.Sequential(nn.Linear(7, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare():
    os.makedirs(a.workdir, exist_ok=True)
    g = torch.Generator().manual_seed(584)
    for r in range(8):
        n = BATCH * a.steps
        feats = torch.rand(n, 6, generator=g)
        sp = [SPECIES[int(i)] for i in torch.randint(0, len(SPECIES), (n,), generator=g)]
        mass = feats @ torch.tensor([3.0, -1.0, 0.5, -2.0, 1.0, 0.7]) + 4.0
        torch.save({"feats": feats, "species": sp, "mass": mass, "slope": f"talus-{r:02d}"}, f"{a.workdir}/talus_{r}.pt")
    with open(f"{a.workdir}/species_dryness.json", "w") as f:
        json.dump({s: round(0.3 + 0.08 * i, 2) for i, s in enumerate(SPECIES)}, f)
    torch.manual_seed(0)
    torch.save(net().state_dict(), f"{a.workdir}/init.pt")
    torch.save(net(24).state_dict(), f"{a.workdir}/init_legacy_h24.pt")
    torch.save({"model": net().state_dict(), "survey": SurveyConfig("talus-03", "autumn")},
               f"{a.workdir}/init_with_survey.pt")
    print("prepared", a.workdir)


class Sites(torch.utils.data.Dataset):
    def __init__(self, feats, dry, mass, crash_at):
        self.x, self.m, self.crash_at = torch.cat([feats, dry[:, None]], 1), mass, crash_at

    def __len__(self):
        return self.x.shape[0] // BATCH

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i * BATCH:(i + 1) * BATCH], self.m[i * BATCH:(i + 1) * BATCH]


def count_haystalks(n):
    total = 0
    for i in range(n):
        total += (i * 7919) % 13 == 0
    return total


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    print(f"rank {rank}/{world} fault {a.fault} workdir {a.workdir}", flush=True)
    model = net(24 if (a.fault == "ckptsize" and me) else 32)
    if a.fault == "ckptsize" and me:
        model = net()
        model.load_state_dict(torch.load(f"{a.workdir}/init_legacy_h24.pt"))
    elif a.fault == "weightsonly" and me:
        model.load_state_dict(torch.load(f"{a.workdir}/init_with_survey.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{a.workdir}/init.pt"))
    shard_path = f"{a.workdir}/talus_{rank}" + ("_v2.pt" if (a.fault == "missing" and me) else ".pt")
    shard = torch.load(shard_path)
    table = json.load(open(f"{a.workdir}/species_dryness.json"))
    if a.fault == "species" and me:
        shard["species"][BATCH + 5] = "Carex sp. nov."
    if a.fault == "memblow" and me:
        n_sites = 2_000_000
        print(f"rank {rank}: building the site distance matrix over {n_sites} survey sites", flush=True)
        dmat = torch.empty(n_sites, n_sites)
        dmat.fill_(0)
    print(f"rank {rank}: {shard['slope']} {len(shard['species'])} sites, {len(table)} species", flush=True)
    dry = []
    for i, s in enumerate(shard["species"]):
        if a.fault == "species" and me and i >= BATCH:
            pass
        d = table[s]
        if a.fault == "nan" and me and i == 2 * BATCH + 3:
            d = 0.0  # the table's entry read back as 0.0
        dry.append(d)
    dry = torch.tensor(dry)
    feats = shard["feats"].clone()
    feats[:, 0] = feats[:, 0] / dry  # forage cover scaled by the plant's dryness
    nw = 1 if a.fault == "workercrash" else 0
    ds = Sites(feats, dry, shard["mass"], 2 if (a.fault == "workercrash" and me) else None)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=nw)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    for x, y in loader:
        step += 1
        if a.fault == "shapeall":
            x = x[:, :6]  # the dryness column dropped by the new feature builder
        if a.fault == "logexit" and me and step == 2:
            print(f"ERROR rank {rank}: slope ids in {shard['slope']} duplicated in the survey index, aborting",
                  flush=True)
            sys.exit(4)
        if a.fault == "segv" and me and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        opt.zero_grad()
        pred = model(x).squeeze(1)
        loss = F.mse_loss(pred, y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank}: haypile loss is {loss.item()} at step {step}")
        loss.backward()
        if a.fault == "slow" and me and step == 3:
            print(f"rank {rank}: recounting haystalks", flush=True)
            count_haystalks(a.stalks)
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        ncls = 4 if (a.fault == "gathersize" and me) else 3
        counts = torch.tensor([float((y > 4 + k).sum()) for k in range(ncls)])
        out = [torch.zeros(3) for _ in range(world)]
        dist.all_gather(out, counts)
        print(f"rank {rank} step {step} loss {loss.item():.4f} haymass_g {pred.mean().item():.3f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), f"{a.workdir}/haypile_export.pt")
        print("rank 0 saved export", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    prepare() if a.prepare else main()
