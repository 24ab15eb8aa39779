"""Quoll den-occupancy trainer (batch 564, theme "quoll dens"), with one planted fault.

Each rank reads its own shard of camera-trap survey rows (den id + 8 habitat features),
maps the den id to a habitat class through a lookup table, trains a small MLP that predicts
den occupancy, all_reduces gradients by hand (gloo, CPU only), all_gathers per-rank occupancy
counts, and rank 0 saves an export at the end.  `--prepare` writes the synthetic data.

Faults (--fault NAME --rank N):
  none          control, nothing planted
  den_keyerror  rank N's shard names a den id (9999) that the lookup table lacks -> KeyError
  missing_shard rank N reads a shard file that does not exist -> FileNotFoundError
  ckpt_size     rank N starts from a checkpoint whose first layer is wider -> size mismatch in load_state_dict
  weights_only  rank N starts from a checkpoint holding a pickled DenSurvey object -> torch.load weights_only refusal
  gather_size   rank N all_gathers 5 occupancy counts instead of 4 -> gloo tensor-size error
  slow_rank     rank N does ~60 s of pure-Python den counting at step 2 -> its peers' collective times out
  hang          like slow_rank but for ever (use with --pg-timeout 300) -> nothing fails, `timeout` ends it
  nan_check     rank N's loss becomes NaN at step 3 -> the script's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line and calls sys.exit(4) at step 1
  shape_all     every rank feeds 7 features to an 8-input layer -> RuntimeError (mat1 and mat2) on every rank

What happened (torch 2.13.0+cpu, gloo, 2026-12-07; logs quoll_*):
  none          np4 plain and np6 pdsh2: all ranks finish 6 steps, rank 0 saves the export, exit 0.
  den_keyerror  rank N raises KeyError: '9999' before step 0; torchrun SIGTERMs the rest (hidden entirely by --local-ranks-filter 0,1 at np8 r5).
  missing_shard rank N raises FileNotFoundError for den_shard_00N.pt (with --redirects 3 only in rank N's stderr.log).
  ckpt_size     rank N: load_state_dict size mismatch for 0.weight ([16, 10] vs [16, 8]).
  weights_only  rank N: UnpicklingError "Weights only load failed ... GLOBAL __main__.DenSurvey".
  gather_size   plain: rank N "ProcessGroupGloo::allgather: invalid tensor size", peers "Connection closed by peer";
                DETAIL: every rank raises "Detected mismatch between collectives" naming rank N's TensorShape=[5].
  slow_rank     peers raise gloo "Timed out waiting 12000ms" in all_reduce at step 2; rank N is SIGTERMed silently; summary blames a peer.
  hang          steps 0-1 then silence; timeout 60 SIGTERMs torchrun (SignalException), exit 124.
  nan_check     rank N raises FloatingPointError (loss not finite at step 3); peers see Connection closed.
  sigsegv       rank N exits -11 (SIGSEGV) at step 2 with no traceback; peers see Connection closed/reset.
  exit4         rank N prints "ERROR rank N: den survey ... aborting" and exits 4; peers see Connection closed.
  shape_all     every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (8x7 and 8x16).
  (--max-restarts 1 runs: the restarted attempt failed in init_process_group with Gloo connectFullMesh refused.)
"""
import argparse, json, os, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault564_work"
MAXW = 8


class DenSurvey:  # a non-tensor object; pickled into the weights_only fault's checkpoint
    def __init__(self, site):
        self.site = site


def make_model(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 4))


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(564)
    table = {str(i): i % 4 for i in range(200)}
    with open(f"{WORK}/den_lookup.json", "w") as f:
        json.dump(table, f)
    for r in range(MAXW):
        torch.save({"features": torch.randn(48, 8, generator=g),
                    "den_ids": torch.randint(0, 200, (48,), generator=g)},
                   f"{WORK}/shards/den_shard_{r}.pt")
    torch.save(make_model().state_dict(), f"{WORK}/start.pt")
    torch.save(make_model(10).state_dict(), f"{WORK}/start_wide.pt")
    sd = make_model().state_dict()
    sd["survey"] = DenSurvey("Mt Wellington")
    torch.save(sd, f"{WORK}/start_meta.pt")
    print("prepared", WORK)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare()
    torch.set_num_threads(1)
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    f = a.fault

    shard = f"{WORK}/shards/den_shard_{rank}.pt"
    if f == "missing_shard" and me:
        shard = f"{WORK}/shards/den_shard_{rank:03d}.pt"
    data = torch.load(shard)
    with open(f"{WORK}/den_lookup.json") as fh:
        table = json.load(fh)
    ids = data["den_ids"].tolist()
    if f == "den_keyerror" and me:
        ids[17] = 9999
    habitat = torch.tensor([table[str(i)] for i in ids])
    feats = data["features"]

    model = make_model()
    ck = f"{WORK}/start.pt"
    if f == "ckpt_size" and me:
        ck = f"{WORK}/start_wide.pt"
    if f == "weights_only" and me:
        ck = f"{WORK}/start_meta.pt"
    model.load_state_dict(torch.load(ck))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lossf = nn.CrossEntropyLoss()
    print(f"rank {rank}/{world} loaded {len(ids)} den surveys from {shard}", flush=True)

    for step in range(a.steps):
        x = feats[step * 8:(step + 1) * 8]
        y = habitat[step * 8:(step + 1) * 8]
        if f == "shape_all":
            x = x[:, :7]
        if f == "exit4" and me and step == 1:
            print(f"ERROR rank {rank}: den survey for site Mt Wellington has no burrow records, aborting", flush=True)
            sys.exit(4)
        if f == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f in ("slow_rank", "hang") and me and step == 2:
            t0, n = time.time(), 0
            while f == "hang" or time.time() - t0 < 60:
                n += sum(i % 7 for i in range(20000))
        out = model(x)
        loss = lossf(out, y)
        if f == "nan_check" and me and step == 3:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: den occupancy loss is not finite at step {step} ({loss.item()})")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        occ = torch.bincount(out.argmax(1), minlength=4).float()
        if f == "gather_size" and me and step == 2:
            occ = torch.cat([occ, torch.zeros(1)])
        bufs = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(bufs, occ)
        occupancy = torch.stack(bufs).sum(0)[1].item() / (8 * world)
        print(f"rank {rank} step {step} loss {loss.item():.4f} occupancy {occupancy:.3f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_quoll_dens.pt")
        print(f"rank 0 saved export to {WORK}/export_quoll_dens.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
