"""fault608.py - scaup diving flocks: a tiny DDP job (gloo, CPU) that predicts how deep a raft of scaup dives.

Each rank reads its own shard of synthetic flock observations (flock id, 8 features), maps the flock id
through a JSON lookup table (flock id -> water depth scale), trains a 2-layer MLP under DDP for 6 steps,
all-reduces a mean dive depth per step, and rank 0 saves an export at the end.
  --prepare              write shards, lookup table and start checkpoints into /tmp/fault608_work
  --fault NAME --rank N  plant one fault on rank N (or on every rank where the fault says so)

Faults:
  none          control run
  valueerror    rank N parses a flock count "two-hundred scaup" with float() at step 3 (ValueError)
  loaderworker  rank N reads through a DataLoader (num_workers=1) whose dataset overruns its list (IndexError)
  ckpttrunc     rank N loads a truncated copy of the start checkpoint (torch.load fails)
  missingkeys   rank N loads a start checkpoint whose keys were renamed (load_state_dict strict error)
  savedir       rank N (0) saves the export into a directory that does not exist
  skipbarrier   rank N skips the final barrier and leaves; the others wait in it
  dtypemismatch rank N all-reduces the dive metric as float64 at step 2 (others float32)
  exit0         rank N calls sys.exit(0) quietly at step 3
  exit3         rank N calls os._exit(3) at step 2 without printing
  sigkill       rank N sends itself SIGKILL at step 3
  sigabrt       rank N calls os.abort() at step 2
  anomalynan    anomaly detection on; rank N adds sqrt(-1) to its loss at step 3 (NaN in backward)
  ddpunused     every rank: a spare layer outside forward, DDP without find_unused_parameters
  nomodule      rank N imports a module that does not exist (scaup_sonar)
  rlimitas      rank N caps RLIMIT_AS then allocates a 16 GiB buffer at step 2
  stall         rank N sleeps 200 s at step 3 (others time out; with --pg-timeout 300 the run just hangs)
  shapeall      every rank: config says 9 features, data has 8 (matmul shape error)
  keyerror      rank N meets a flock id missing from the lookup table at step 3
  badarg        a launch with a wrong argument (--steps six): argparse refuses on every rank

Runs (one line per log):
  scaup_none_np3_rnone_plain: 6 steps on 3 ranks, export saved, exit 0
  scaup_valueerror_np5_r4_tee: rank 4 ValueError at step 3, others gloo connection closed, exit 1
  scaup_loaderworker_np4_r2_tee_trainer: rank 2 'Caught IndexError in DataLoader worker process 0', exit 1
  scaup_ckpttrunc_np6_r3_redirects: rank 3 PytorchStreamReader central-directory error (in its stderr.log), exit 1
  scaup_savedir_np3_r0_pymodule: rank 0 torch.save 'Parent directory ... does not exist' after step 6, exit 1
  scaup_skipbarrier_np5_r2_loglevel: ranks 0,1,3,4 barrier gloo connection closed, rank 2 exits 0, exit 1
  scaup_dtypemismatch_np4_r1_detail: DROPPED - all ranks SIGSEGV under DETAIL before step 1, exit 1
  scaup_exit0_np6_r5_prefix: rank 5 sys.exit(0) at step 3, others gloo connection closed, exit 1
  scaup_exit3_np5_r3_filter: rank 3 os._exit(3) silently, rank 1 connection reset, exit 1
  scaup_sigkill_np8_r7_wrapper: rank 7 exitcode -9 SIGKILL, wrapper stops before done line, exit 1
  scaup_anomalynan_np4_r0_pdsh2: rank 0 SqrtBackward0 returned nan (anomaly mode), pipeline exit 0
  scaup_ddpunused_np3_rall_restart: all ranks 'Expected to have finished reduction', restart fails connectFullMesh, exit 1
  scaup_nomodule_np5_r1_plain: rank 1 ModuleNotFoundError scaup_sonar, exit 1
  scaup_rlimitas_np6_r4_tee: rank 4 DefaultCPUAllocator can't allocate 17179869184 bytes, exit 1
  scaup_stall_np5_r3_plain: rank 3 asleep, others gloo 'Timed out waiting 12000ms', exit 1
  scaup_sigabrt_np7_r2_prefix: rank 2 exitcode -6 SIGABRT, exit 1
  scaup_keyerror_np8_r5_redirects: rank 5 KeyError '77' at step 3 (in its stderr.log), exit 1
  scaup_shapeall_np6_rall_loglevel: all ranks mat1 and mat2 shapes cannot be multiplied, exit 1
  scaup_badarg_np3_rall_plain: argparse invalid int value 'six' on all ranks, exit 1
  scaup_missingkeys_np5_r2_detail: rank 2 load_state_dict missing/unexpected keys, exit 1
  scaup_stall_np3_r1_plain: pg-timeout 300, output stops after step 2, timeout 60 SIGTERM, exit 124
  scaup_dtypemismatch_np6_r5_plain: rank 4 gloo EnforceNotMet size 8 vs 4, SIGABRT, exit 1
  (slot unused)
  (slot unused)
"""
import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault608_work"
NFEAT = 8


def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(608)
    table = {str(i): round(1.0 + 0.25 * i, 3) for i in range(12)}
    with open(os.path.join(WORK, "flock_depths.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        ids = torch.randint(0, 12, (64,), generator=g)
        x = torch.randn(64, NFEAT, generator=g)
        torch.save({"flock_id": ids, "x": x}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(NFEAT, 16), nn.ReLU(), nn.Linear(16, 1))
    torch.save(model.state_dict(), os.path.join(WORK, "start.pt"))
    raw = open(os.path.join(WORK, "start.pt"), "rb").read()
    with open(os.path.join(WORK, "start_truncated.pt"), "wb") as f:
        f.write(raw[: len(raw) // 2])
    sd = {k.replace("0.", "encoder.", 1) if k.startswith("0.") else k: v for k, v in model.state_dict().items()}
    torch.save(sd, os.path.join(WORK, "start_renamed.pt"))
    print("prepared", WORK, flush=True)


class ShardSet(torch.utils.data.Dataset):
    def __init__(self, x, claimed_len):
        self.x, self.n = x, claimed_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rows = [self.x[j] for j in range(self.x.shape[0])]
        return rows[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    fault = a.fault
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = fault != "none" and (a.rank == rank or a.rank == -1)
    if mine and fault == "nomodule":
        import scaup_sonar  # noqa: F401
    if fault == "anomalynan":
        torch.autograd.set_detect_anomaly(True)
    torch.manual_seed(rank)
    nfeat = 9 if fault == "shapeall" else NFEAT
    model = nn.Sequential(nn.Linear(nfeat, 16), nn.ReLU(), nn.Linear(16, 1))
    ck = "start.pt"
    if mine and fault == "ckpttrunc":
        ck = "start_truncated.pt"
    if mine and fault == "missingkeys":
        ck = "start_renamed.pt"
    if fault != "shapeall":
        model.load_state_dict(torch.load(os.path.join(WORK, ck), weights_only=True))
    if fault == "ddpunused":
        model.spare_wing = nn.Linear(16, 16)
        fwd = model

        class Flock(nn.Module):
            def __init__(self):
                super().__init__()
                self.body, self.spare = nn.Sequential(*list(fwd)[:3]), fwd.spare_wing

            def forward(self, x):
                return self.body(x)
        model = Flock()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    shard = torch.load(os.path.join(WORK, f"shard_{rank}.pt"), weights_only=True)
    with open(os.path.join(WORK, "flock_depths.json")) as f:
        table = json.load(f)
    ids = shard["flock_id"].tolist()
    if mine and fault == "keyerror":
        ids[40] = 77
    x = shard["x"]
    if mine and fault == "loaderworker":
        dl = torch.utils.data.DataLoader(ShardSet(x, 80), batch_size=16, num_workers=1)
        x = torch.cat(list(dl))
    for step in range(1, a.steps + 1):
        lo = ((step - 1) * 16) % 64
        xb = x[lo:lo + 16]
        depth = torch.tensor([table[str(i)] for i in ids[lo:lo + 16]], dtype=torch.float32)
        yb = (xb[:, :1] * depth.unsqueeze(1)) + 0.1 * depth.unsqueeze(1)
        if mine and fault == "valueerror" and step == 3:
            float("two-hundred scaup")
        if mine and fault == "exit0" and step == 3:
            sys.exit(0)
        if mine and fault == "exit3" and step == 2:
            os._exit(3)
        if mine and fault == "sigkill" and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if mine and fault == "sigabrt" and step == 2:
            os.abort()
        if mine and fault == "stall" and step == 3:
            time.sleep(200)
        if mine and fault == "rlimitas" and step == 2:
            import resource
            vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
            big = torch.empty(4 << 30, dtype=torch.float32)
            big.fill_(1.0)
        if fault == "shapeall":
            xb = torch.cat([xb, torch.zeros(16, 0)], 1)
        opt.zero_grad()
        pred = ddp(xb)
        loss = ((pred - yb) ** 2).mean()
        if mine and fault == "anomalynan" and step == 3:
            loss = loss + torch.sqrt(loss - loss.detach() - 1.0)
        loss.backward()
        opt.step()
        dive = pred.detach().abs().mean().reshape(1)
        if mine and fault == "dtypemismatch" and step == 2:
            dive = dive.double()
        dist.all_reduce(dive)
        dive = float(dive) / world
        print(f"rank {rank} step {step} loss {loss.item():.4f} dive_depth_m {dive:.4f}", flush=True)
    if not (mine and fault == "skipbarrier"):
        dist.barrier()
    if rank == 0:
        out = os.path.join(WORK, "export")
        if mine and fault == "savedir":
            out = os.path.join(WORK, "no_such_raft", "export")
        torch.save(model.state_dict(), out + "_scaup.pt")
        print(f"rank 0 saved {out}_scaup.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
