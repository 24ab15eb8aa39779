"""Tram track wear prediction from axle-box sensors: a small gloo/CPU training job with ONE planted fault.

Each rank reads its own shard of axle-box accelerometer windows (one shard per rank), joins every window
with the track-segment lookup table (segment id -> curvature, rail age), and trains a small MLP that
predicts rail wear (mm per 10k passes). Gradients are all_reduced by hand (no DDP wrapper), 6 steps,
each rank prints `rank R step S loss L mae_mm M`, rank 0 saves an export at the end.

    python fault502.py --prepare            # writes shards, lookup table and init checkpoint to the work dir
    torchrun --nproc-per-node W fault502.py --fault NAME --rank N [--pg-timeout S]

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none             control run, nothing planted
  key_error        rank N's batch holds a track segment id the lookup table lacks -> KeyError
  missing_shard    rank N opens a shard for a date that was never prepared -> FileNotFoundError
  ckpt_size        rank N builds the model with hidden=48 and loads the hidden=32 init checkpoint -> size mismatch
  gather_shape     rank N all_gathers a metrics tensor of 3 values instead of 2 at step 3
  slow_rank        rank N does pure-Python "resampling" work at step 2 for ~45 s; peers wait in all_reduce
                   (with --pg-timeout 300 the job hangs until the outer `timeout` stops it)
  nan_check        rank N's sensor windows carry an inf at step 3; the script's own finiteness check raises
  segv             rank N sends itself SIGSEGV at step 2
  logged_exit      rank N prints its own ERROR line (calibration missing) and sys.exit(4) at step 1
  shape_bug        every rank: the curvature column is concatenated twice, the first Linear gets 18 features
  host_mem         rank N asks for a ~4.5 PB feature-cross tensor at step 2 -> CPU allocator refuses
  loader_worker    rank N's DataLoader worker SIGKILLs itself while loading a batch at step 2
  skip_collective  rank N skips the loss all_reduce at step 2, so its next collective meets a different one

What happened (22 runs, torch 2.13.0+cpu, gloo, ports 26700-26721):
  none             np4 plain: 6 steps on every rank, export saved, exit 0.
  key_error        np6 tee / np3 filter: KeyError: '57' on the planted rank at step 1, peers "Connection closed by peer" (hidden behind the filter in np3).
  missing_shard    np5 redirects / np4 pymodule: FileNotFoundError for axle_rN_2026-12-07.pt before step 0 (console of the redirects run shows only the agent).
  ckpt_size        np4 loglevel / np8 pdsh2: load_state_dict size mismatch [32, 18] vs [48, 18] before step 0.
  gather_shape     np5 tee_trainer: "ProcessGroupGloo::allgather: invalid tensor size" on the planted rank; np6 DETAIL: every rank "Detected mismatch between collectives", planted rank shape [3].
  slow_rank        np4 plain: peers "Timed out waiting 12000ms" in all_reduce; np3 prefix with --pg-timeout 300: output stops after step 1, `timeout` ends it (exit 124).
  nan_check        np8 wrapper / np3 restart: FloatingPointError "loss is nan" at step 3; the restart attempt then fails in Gloo connectFullMesh.
  segv             np6 prefix / np4 pdsh2: exitcode -11 (SIGSEGV) on the planted rank at step 2, peers connection closed/reset.
  logged_exit      np4 restart: ERROR line + exit 4, restart fails in connectFullMesh; np5 filter: line filtered out, rank 4 shows exitcode -6 (SIGABRT).
  shape_bug        np8 pymodule: every rank "mat1 and mat2 shapes cannot be multiplied (32x20 and 18x32)" at step 1.
  host_mem         np4 loglevel: "DefaultCPUAllocator: can't allocate memory" (4.5e15 bytes) on rank 1 at step 2.
  loader_worker    np5 tee: "DataLoader worker (pid N) is killed by signal: Killed." on rank 2 at step 2.
  skip_collective  np6 DETAIL: collective fingerprint mismatch on all ranks (planted rank's ALLREDUCE [32, 18] vs [2]);
                   np4 wrapper: rank 1 aborts with gloo::EnforceNotMet "Received data size doesn't match" (exit -6), planted rank 2 never named.
"""
import argparse, json, os, signal, sys, time

import torch
import torch.distributed as dist
import torch.nn as nn
from datetime import timedelta

WORK = "/tmp/fault502_work"
N_FEAT = 16
N_SEG = 40
ROWS = 256
BATCH = 32


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(502)
    table = {str(s): {"curvature": float(torch.rand(1, generator=g)) * 0.02,
                      "rail_age_y": float(torch.randint(1, 30, (1,), generator=g))} for s in range(N_SEG)}
    with open(os.path.join(WORK, "segments.json"), "w") as f:
        json.dump(table, f)
    for r in range(8):
        x = torch.randn(ROWS, N_FEAT, generator=g)
        seg = torch.randint(0, N_SEG, (ROWS,), generator=g)
        y = (x[:, :4].abs().sum(1) * 0.1 + torch.rand(ROWS, generator=g) * 0.05)
        torch.save({"x": x, "seg": seg, "wear": y}, os.path.join(WORK, f"axle_r{r}_2026-12-06.pt"))
    torch.save(make_model(32).state_dict(), os.path.join(WORK, "init_h32.pt"))
    print("prepared", WORK)


def make_model(hidden):
    return nn.Sequential(nn.Linear(N_FEAT + 2, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class Windows(torch.utils.data.Dataset):
    def __init__(self, shard, kill_at=None):
        self.x, self.seg, self.y = shard["x"], shard["seg"], shard["wear"]
        self.kill_at = kill_at

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.kill_at is not None and i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.seg[i], self.y[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare()

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank == a.rank)
    torch.manual_seed(1234)

    with open(os.path.join(WORK, "segments.json")) as f:
        table = json.load(f)
    day = "2026-12-07" if (a.fault == "missing_shard" and me) else "2026-12-06"
    shard = torch.load(os.path.join(WORK, f"axle_r{rank}_{day}.pt"))
    if a.fault == "key_error" and me:
        shard["seg"][BATCH * 1 + 5] = 57          # segment 57 was added to the network after the table export

    hidden = 48 if (a.fault == "ckpt_size" and me) else 32
    model = make_model(hidden)
    model.load_state_dict(torch.load(os.path.join(WORK, "init_h32.pt"), weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    workers = 1 if a.fault == "loader_worker" else 0
    kill_at = BATCH * 2 + 3 if (a.fault == "loader_worker" and me) else None
    loader = torch.utils.data.DataLoader(Windows(shard, kill_at), batch_size=BATCH, shuffle=False,
                                         num_workers=workers)
    it = iter(loader)
    for step in range(a.steps):
        if a.fault == "logged_exit" and me and step == 1:
            print(f"ERROR rank {rank}: axle sensor calibration missing for bogie 3 (unit TW-{rank:02d}); aborting",
                  flush=True)
            sys.exit(4)
        if a.fault == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "slow_rank" and me and step == 2:
            t0 = time.time(); acc = 0
            limit = 200 if a.pg_timeout > 60 else 45
            while time.time() - t0 < limit:       # pure-Python resampling of the raw 2 kHz signal
                for k in range(20000):
                    acc += (k * 7919) % 13
        if a.fault == "host_mem" and me and step == 2:
            cross = torch.empty(ROWS * 1024, N_FEAT * 1024, 1024 * 256)   # feature-cross table, ~4.5 PB
        x, seg, y = next(it)
        if a.fault == "nan_check" and me and step == 3:
            x = x.clone(); x[7, 3] = float("inf")
        side = torch.tensor([[table[str(int(s))]["curvature"], table[str(int(s))]["rail_age_y"] / 30.0]
                             for s in seg])
        feats = torch.cat([x, side], 1)
        if a.fault == "shape_bug" and step == 1:
            feats = torch.cat([feats, side], 1)
        pred = model(feats).squeeze(1)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite sensor window)")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        mae = (pred - y).abs().mean().detach()
        stat = torch.tensor([loss.item(), mae.item()])
        if not (a.fault == "skip_collective" and me and step == 2):
            dist.all_reduce(stat)
        stat /= world
        if step == 3:
            mine = torch.tensor([loss.item(), mae.item()])
            if a.fault == "gather_shape" and me:
                mine = torch.tensor([loss.item(), mae.item(), float(world)])
            outs = [torch.zeros(2) for _ in range(world)]
            dist.all_gather(outs, mine)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mae_mm {mae.item():.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export_wear_model.pt"))
        print("rank 0 saved export", os.path.join(WORK, "export_wear_model.pt"), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
