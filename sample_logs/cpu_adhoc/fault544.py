"""Batch 544 fault script: harbour wharf pile corrosion.

A small training job that regresses the section loss (mm) of steel wharf piles
from per-pile inspection features (tide zone, chloride, cathodic-protection
potential, pile age). `--prepare` writes synthetic shards (one per rank), a
pile-id -> zone lookup table and a starting checkpoint into /tmp/fault544_work.
gloo backend, CPU only, gradients all_reduced by hand, 6 steps; every rank prints
`rank R step S loss L corr_mm M`; rank 0 saves an export at the end.

Faults (`--fault NAME --rank N`):
  none          control, nothing planted
  keyerror      rank N meets a pile id missing from the zone lookup table (KeyError)
  missing_shard rank N's inspection shard file is deleted before it is opened (FileNotFoundError)
  ckpt_size     rank N loads a checkpoint whose head has the wrong width (load_state_dict size mismatch)
  weights_only  rank N loads a checkpoint holding a pickled survey object (weights_only refusal)
  wrong_size    rank N all_reduces a gradient bucket one element too long (collective size mismatch)
  slow          rank N recomputes the tide table in pure Python for minutes; peers time out
  nan           rank N's chloride reading becomes NaN; the script's finiteness check raises
  segv          rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line and sys.exit(4)
  shape_all     every rank builds the feature matrix one column short (matmul shape error)
  worker_crash  rank N's DataLoader worker dies (os._exit) while reading a batch

What happened (batch 544 runs, torch 2.13.0+cpu, gloo):
  none          4 ranks finish 6 steps, rank 0 saves the export, exit 0
  keyerror      KeyError: 'P047' on the planted rank; peers get gloo 'Connection closed by peer'; torchrun names it
  missing_shard FileNotFoundError for shard_N_missing.pt before step 0 (hidden entirely under --local-ranks-filter)
  ckpt_size     load_state_dict 'size mismatch for 2.weight/2.bias' on the planted rank
  weights_only  UnpicklingError 'Unsupported global: GLOBAL __main__.Survey' on the planted rank
  wrong_size    DETAIL: every rank raises 'Detected mismatch between collectives'; plain: a peer aborts on gloo 'Received data size doesn't match'
  slow          peers raise gloo 'Timed out waiting 12000ms'; with --pg-timeout 300 the job hangs after step 1 until timeout SIGTERMs torchrun
  nan           FloatingPointError from the script's own finiteness check at step 3
  segv          the planted rank dies with exitcode -11 (SIGSEGV), no traceback; peers lose the connection
  exit4         the planted rank prints its own ERROR line and exits 4 (the line is hidden under --local-ranks-filter)
  shape_all     every rank: 'mat1 and mat2 shapes cannot be multiplied (8x6 and 7x16)' at step 1
  worker_crash  the planted rank raises "DataLoader worker (pid(s) ...) exited unexpectedly" (worker exit code 9) at step 1
"""
import argparse, os, sys, time, signal, json
import torch
import torch.distributed as dist

WORK = "/tmp/fault544_work"
NFEAT = 6


class Survey:  # a non-tensor object pickled into a checkpoint (weights_only refuses it)
    def __init__(self, wharf):
        self.wharf = wharf


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(544)
    for r in range(8):
        x = torch.randn(64, NFEAT, generator=g)
        ids = torch.randint(0, 40, (64,), generator=g)
        y = (x @ torch.linspace(0.1, 0.6, NFEAT)).unsqueeze(1) + 0.05 * torch.randn(64, 1, generator=g)
        torch.save({"x": x, "pile_id": ids, "y": y}, f"{WORK}/shard_{r}.pt")
    with open(f"{WORK}/zones.json", "w") as f:
        json.dump({f"P{i:03d}": ["splash", "tidal", "immersed", "mud"][i % 4] for i in range(40)}, f)
    m = make_model()
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    bad = make_model(head=2)
    torch.save(bad.state_dict(), f"{WORK}/start_wide.pt")
    sd = m.state_dict(); sd["survey"] = Survey("north quay")
    torch.save(sd, f"{WORK}/start_survey.pt")
    print("prepared", WORK)


def make_model(head=1):
    return torch.nn.Sequential(torch.nn.Linear(NFEAT + 1, 16), torch.nn.Tanh(), torch.nn.Linear(16, head))


class PileSet(torch.utils.data.Dataset):
    def __init__(self, x, crash):
        self.x, self.crash = x, crash
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        if self.crash and i >= 4:
            os._exit(9)
        return self.x[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    a = ap.parse_args()
    if a.prepare:
        prepare(8); return
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault != "none" and rank == a.rank
    torch.manual_seed(0)
    shard = f"{WORK}/shard_{rank}.pt"
    if me and a.fault == "missing_shard":
        shard = f"{WORK}/shard_{rank}_missing.pt"
    data = torch.load(shard)
    zones = json.load(open(f"{WORK}/zones.json"))
    model = make_model()
    ck = f"{WORK}/start.pt"
    if me and a.fault == "ckpt_size":
        ck = f"{WORK}/start_wide.pt"
    if me and a.fault == "weights_only":
        ck = f"{WORK}/start_survey.pt"
    model.load_state_dict(torch.load(ck, weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    zone_code = {"splash": 0.0, "tidal": 1.0, "immersed": 2.0, "mud": 3.0}
    print(f"rank {rank}/{world} loaded {os.path.basename(shard)} ({len(data['x'])} piles)", flush=True)
    for step in range(6):
        lo = step * 8
        x = data["x"][lo:lo + 8].clone()
        y = data["y"][lo:lo + 8]
        ids = data["pile_id"][lo:lo + 8].tolist()
        if me and a.fault == "keyerror" and step == 2:
            ids[3] = 47
        z = torch.tensor([zone_code[zones[f"P{i:03d}"]] for i in ids]).unsqueeze(1)
        if me and a.fault == "worker_crash" and step == 1:
            dl = torch.utils.data.DataLoader(PileSet(x, True), batch_size=4, num_workers=1)
            for _ in dl:
                pass
        if me and a.fault == "nan" and step == 3:
            x[2, 1] = float("nan")
        feats = torch.cat([x, z], 1)
        if a.fault == "shape_all" and step == 1:
            feats = feats[:, :-1]
        if me and a.fault == "slow" and step == 2:
            t = 0
            for k in range(10 ** 10):
                t += (k * 7) % 13
        if me and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if me and a.fault == "exit4" and step == 3:
            print(f"ERROR rank {rank}: cathodic protection potential out of range for pile P{ids[0]:03d} (-420 mV), aborting", flush=True)
            sys.exit(4)
        if me and a.fault == "nan":
            if not torch.isfinite(feats).all():
                raise FloatingPointError(f"rank {rank}: non-finite chloride reading in batch at step {step}")
        pred = model(feats)
        loss = torch.nn.functional.mse_loss(pred, y)
        opt.zero_grad(); loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        if me and a.fault == "wrong_size" and step == 2:
            flat = torch.cat([flat, torch.zeros(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel(); p.grad.copy_(flat[off:off + n].view_as(p)); off += n
        opt.step()
        corr = loss.detach().sqrt().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} corr_mm {corr:.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_wharf.pt")
        print("rank 0 saved export", f"{WORK}/export_wharf.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
