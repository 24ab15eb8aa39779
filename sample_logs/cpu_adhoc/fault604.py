"""fault604.py - batch 604 hand-run fault job, theme "tombolo sand spits".

A tiny DDP regression job (gloo, CPU only) that predicts how far a tombolo sand spit grows
from wave/sediment features.  `--prepare` writes synthetic data into /tmp/fault604_work:
per-rank shards (shard_R.pt), a JSON lookup table of sediment factors per spit id
(sediment_lookup.json) that every sample goes through, and a start checkpoint (start.pt).
Each rank trains 6 steps and prints `rank R step S loss L spit_len_m M` (flush=True);
rank 0 saves an export at the end.  Process-group timeout 12 s (`--pg-timeout`).

Faults (`--fault NAME --rank N`):
  none            control run
  zerodiv         rank N divides by a zero spit count at step 3 (ZeroDivisionError)
  jsondecode      rank N reads a truncated copy of the lookup table (json.JSONDecodeError)
  loaderworker    rank N's dataset raises IndexError inside a DataLoader worker (num_workers=1)
  ckpttrunc       rank N loads a truncated copy of the start checkpoint (torch.load fails)
  savedir         rank 0 saves its export into a directory that does not exist
  skipallreduce   rank N skips the loss all_reduce at step 3
  dtype           rank N all_reduces a float64 tensor where the others use float32 (step 2)
  quietexit       rank N calls os._exit(0) at step 3
  exit3           rank N calls os._exit(3) at step 2 without printing anything
  sigkill         rank N sends itself SIGKILL at step 4
  sigabrt         rank N calls os.abort() at step 2 (SIGABRT)
  anomaly         rank N adds sqrt(negative) to its loss at step 3 under set_detect_anomaly(True)
  ddpunused       every rank: the model has an unused 'spare_head' and DDP has no find_unused_parameters
  stall           rank N sleeps 900 s at step 2 (others wait in the collective)
  nofile          rank N caps RLIMIT_NOFILE and opens tide-gauge files at step 2 (EMFILE)
  hostmem         rank N caps RLIMIT_AS and allocates a 4 GiB sediment grid at step 2
  modnotfound     rank N imports a module that does not exist (tombolo_hydrodynamics)
  shapeall        every rank builds inputs with 9 features for an 8-feature model
  (port in use is a launcher fault; the script runs with --fault none)

Runs (one line per log; 'ddpunused' became the 'sparehead' run; dropped runs at the end):
  tombolo_none_np3_rnone_plain: Control run: 3 ranks print 6 steps each (two rank lines run together on one line at step 0), rank 0 saves the export; exit 0; exit 0.
  tombolo_zerodiv_np5_r4_tee: Rank 4 raises ZeroDivisionError in the spit-length metric at step 3; ranks 0-3 fail in dist.barrier with Gloo 'Connection closed by peer'; the agent names rank 4 (exitcode 1) as root cause; exit 1.
  tombolo_jsondecode_np4_r2_tee_trainer: Rank 2 ([trainer2]) fails in json.load of a half-written copy of the sediment lookup table before any step; the other ranks are sent SIGTERM; root cause rank 2 exitcode 1; exit 1.
  tombolo_loaderworker_np5_r1_redirects: Console holds only the agent's lines (ranks redirected to files): rank 1 exitcode 1 as root cause, the others SIGTERM. The rank files (folder beside the log) show rank 1's 'IndexError: Caught IndexError in DataLoader worker process 0' and the others' Gloo connection-closed errors; exit 1.
  tombolo_ckpttrunc_np6_r5_pymodule: Rank 5 fails in torch.load of a half-length copy of start.pt ('PytorchStreamReader failed reading zip archive: failed finding central directory') before step 0; the agent SIGTERMs ranks 0-4; exit 1.
  tombolo_savedir_np3_r0_loglevel: All 3 ranks train 6 steps; rank 0's torch.save of the export fails with 'RuntimeError: Parent directory /tmp/job_work/exports_missing/2026-12/tombolo does not exist.'; ranks 1-2 are SIGTERMed; INFO agent lines around it; exit 1.
  tombolo_exit3_np5_r4_filter: Rank 4 calls os._exit(3) at step 2 with no output (and is filtered off the console anyway); rank 0 shows a Gloo 'Connection reset by peer' in backward; the agent's summary names rank 4, exitcode 3, as root cause; exit 1.
  tombolo_sigkill_np8_r7_wrapper: Wrapper banner and env line, then rank 7 SIGKILLs itself at step 4; ranks 0 and 6 report Gloo 'Connection closed by peer' in backward, the agent names rank 7 exitcode -9 (SIGKILL) as root cause and set -e skips the done line; exit 1.
  tombolo_anomaly_np4_r3_pdsh2: Two torchrun agents (2 ranks each) piped through sed as worker-0/worker-1; on worker-1 rank 3's anomaly detection reports 'Function 'SqrtBackward0' returned nan values in its 0th output' at step 3, then ranks 0-2 fail with Gloo connection-closed errors and both agents print ChildFailedError; exit 1.
  tombolo_sparehead_np3_rall_restart: Meant as an unused DDP parameter, but add_module put 'spare_head' into the nn.Sequential, so every rank fails at step 0 with 'mat1 and mat2 shapes cannot be multiplied (8x1 and 16x1)'; --max-restarts 1 restarts the group, whose rank 0 then fails in init_process_group with 'Gloo connectFullMesh failed ... Connection refused', and the agent gives up; exit 1.
  tombolo_stall_np5_r2_plain: pg-timeout 300: all 5 ranks print steps 0-1, then rank 2 sleeps and the rest wait in the gradient all_reduce; nothing more until timeout 60 SIGTERMs torchrun ('Received 15 death signal', SignalException); exit 124; exit 124.
  tombolo_stall_np6_r3_tee: Rank 3 sleeps at step 2; after the 12 s process-group timeout ranks 0,1,2,4,5 fail in backward with Gloo 'Timed out waiting 12000ms for recv/send operation to complete'; rank 3 prints nothing and is SIGTERMed by the agent; exit 1.
  tombolo_portinuse_np3_rall_plain: A plain python socket held 127.0.0.1:36915 (listening, never answering); the agent connected to it as a TCPStore client, sat in TCPStore::ping for about 90 s until the holder's own 100 s sleep ended, then 'recvValue failed ... Connection reset by peer', DistNetworkError and RendezvousConnectionError; no worker started; exit 1.
  tombolo_nofile_np5_r3_loglevel: INFO agent lines, then at step 2 rank 3 raises 'OSError: [Errno 24] Too many open files' opening its sixth tide-gauge file; ranks 2 and 4 get Gloo connection-closed errors; root cause rank 3 exitcode 1; exit 1.
  tombolo_sigabrt_np8_r0_restart: Rank 0 calls os.abort() at step 2: ranks 1 and 7 report Gloo 'Connection reset by peer' and the agent logs 'failed (exitcode: -6) local_rank: 0'; --max-restarts 1 restarts all 8, but the new group fails in init_process_group ('Gloo connectFullMesh failed ... Connection refused' on ranks 3, 5, 6) and the final summary names rank 5 (exitcode 1) as root cause; exit 1.
  tombolo_modnotfound_np4_r3_wrapper: Wrapper banner and env line, then rank 3 raises "ModuleNotFoundError: No module named 'tombolo_hydrodynamics'" right after init_process_group; ranks 0-2 are SIGTERMed, root cause rank 3 exitcode 1, and set -e skips the done line; exit 1.
  tombolo_shapeall_np6_rall_tee: Every one of the 6 ranks raises 'RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x9 and 8x16)' in the DDP forward at step 0; the agent names one of them as root cause; exit 1.
  tombolo_skipallreduce_np5_r3_plain: At step 3 rank 3 skips the loss all_reduce, prints its own un-averaged loss (0.1980) and waits in dist.barrier; after 12 s ranks 0,1,2,4 fail in dist.all_reduce and rank 3 in dist.barrier, all with Gloo 'Timed out waiting 12000ms'; exit 1.
  tombolo_dtype_np4_r1_detail: TORCH_DISTRIBUTED_DEBUG=DETAIL, run with --no-ddp (DDP under DETAIL segfaults here, see README): at step 2 every rank raises 'RuntimeError: Detected mismatch between collectives on ranks', each naming Rank 1 as the one running ALLREDUCE with a Double tensor where the rest use Float; exit 1.
  tombolo_quietexit_np6_r2_prefix: Prefix template '[${role_name}${rank}]:' via TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (renders like the default '[default1]:'). Rank 2 calls os._exit(0) after step 2 with no message; ranks 0,1,3,4 fail in backward with Gloo 'Connection reset by peer'/'Connection closed by peer'; rank 2 is absent from the failure list (exit 0) and the root cause names rank 3, a follow-on; exit 1.
  tombolo_hostmem_np6_r1_prefix: Prefix template via TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE with --tee 3. At step 2 rank 1 (RLIMIT_AS capped) fails 'DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes. Error code 12'; ranks 0 and 2 get Gloo connection-closed errors; root cause rank 1 exitcode 1; exit 1.
  dropped: dtype under DDP + TORCH_DISTRIBUTED_DEBUG=DETAIL (every rank SIGSEGV in DDP init, exit 1, port 36907);
  dropped: quietexit/hostmem with --log-line-prefix-template (torchrun 2.13 has no such option: usage error, exit 2, ports 36908/36917).
"""
import argparse, json, os, sys, time, signal, resource
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader

WORK = "/tmp/fault604_work"
NFEAT = 8


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(604)
    for r in range(8):
        x = torch.randn(64, NFEAT, generator=g)
        ids = torch.randint(0, 10, (64,), generator=g)
        y = x.sum(1, keepdim=True) * 0.3 + 1.0
        torch.save({"x": x, "spit_id": ids, "y": y}, f"{WORK}/shard_{r}.pt")
    lookup = {str(i): 0.5 + 0.1 * i for i in range(10)}
    with open(f"{WORK}/sediment_lookup.json", "w") as f:
        json.dump(lookup, f, indent=1)
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), f"{WORK}/start.pt")
    print("prepared", WORK)


def make_model(spare=False):
    m = nn.Sequential(nn.Linear(NFEAT, 16), nn.ReLU(), nn.Linear(16, 1))
    if spare:
        m.add_module("spare_head", nn.Linear(16, 1))
    return m


class SpitShard(Dataset):
    def __init__(self, rank, lookup, bad_index=None, nfeat=NFEAT):
        d = torch.load(f"{WORK}/shard_{rank}.pt")
        self.x, self.ids, self.y = d["x"], d["spit_id"], d["y"]
        self.lookup, self.bad_index, self.nfeat = lookup, bad_index, nfeat

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.bad_index is not None and i == self.bad_index:
            i = [0, 1, 2][i]  # IndexError inside the worker
        f = self.lookup[str(int(self.ids[i]))]
        x = self.x[i] * f
        if self.nfeat != NFEAT:
            x = torch.cat([x, torch.ones(self.nfeat - NFEAT)])
        return x, self.y[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6); ap.add_argument("--no-ddp", action="store_true")
    a = ap.parse_args()
    if a.prepare:
        prepare(); return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (a.rank == rank)
    fault = a.fault
    if fault == "modnotfound" and me:
        import tombolo_hydrodynamics  # noqa: F401  (does not exist)
    lookup_path = f"{WORK}/sediment_lookup.json"
    if fault == "jsondecode" and me:
        txt = open(lookup_path).read()
        lookup_path = f"{WORK}/sediment_lookup_r{rank}.json"
        with open(lookup_path, "w") as f:
            f.write(txt[: len(txt) // 2])
    with open(lookup_path) as f:
        lookup = json.load(f)
    model = make_model(spare=(fault == "ddpunused"))
    ck = f"{WORK}/start.pt"
    if fault == "ckpttrunc" and me:
        raw = open(ck, "rb").read()
        ck = f"{WORK}/start_r{rank}.pt"
        with open(ck, "wb") as f:
            f.write(raw[: len(raw) // 2])
    sd = torch.load(ck, map_location="cpu")
    model.load_state_dict(sd, strict=(fault != "ddpunused"))
    ddp = DDP(model) if not a.no_ddp else model  # --no-ddp: TORCH_DISTRIBUTED_DEBUG=DETAIL segfaults in DDP init on this build
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ds = SpitShard(rank, lookup, bad_index=(21 if fault == "loaderworker" and me else None),
                   nfeat=(9 if fault == "shapeall" else NFEAT))
    dl = DataLoader(ds, batch_size=8, shuffle=False, num_workers=(1 if fault == "loaderworker" else 0))
    if fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    it = iter(dl)
    for step in range(a.steps):
        x, y = next(it)
        if me and step == 2:
            if fault == "exit3":
                os._exit(3)
            if fault == "sigabrt":
                os.abort()
            if fault == "stall":
                time.sleep(900)
            if fault == "nofile":
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                nopen = len(os.listdir("/proc/self/fd"))
                resource.setrlimit(resource.RLIMIT_NOFILE, (nopen + 4, hard))
                gauges = []
                for g in range(64):
                    gauges.append(open(f"{WORK}/tide_gauge_r{rank}_{g}.csv", "w"))
            if fault == "hostmem":
                with open("/proc/self/status") as f:
                    vm = [l for l in f if l.startswith("VmSize")][0].split()[1]
                cap = int(vm) * 1024 + (512 << 20)
                resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
                grid = torch.zeros(1 << 30, dtype=torch.float32)  # 4 GiB sediment grid
                del grid
        if me and step == 3:
            if fault == "quietexit":
                os._exit(0)
        if me and step == 4 and fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        pred = ddp(x)
        loss = ((pred - y) ** 2).mean()
        if fault == "anomaly" and me and step == 3:
            loss = loss + torch.sqrt(pred.mean() * 0.0 - 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        lt = loss.detach().clone().reshape(1)
        if fault == "dtype" and me and step == 2:
            lt = lt.double()
        if not (fault == "skipallreduce" and me and step == 3):
            dist.all_reduce(lt)
        nspits = len(torch.unique(ds.ids))
        if fault == "zerodiv" and me and step == 3:
            nspits = 0
        spit_len = float(pred.detach().abs().sum()) * 120.0 / nspits
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f} spit_len_m {spit_len:.1f}", flush=True)
        dist.barrier()
    if rank == 0:
        out = f"{WORK}/export" if fault != "savedir" else f"{WORK}/exports_missing/2026-12/tombolo"
        torch.save(getattr(ddp, "module", ddp).state_dict(), f"{out}/spit_model.pt" if fault == "savedir" else f"{out}.pt")
        print("rank 0 saved export", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
