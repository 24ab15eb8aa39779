"""fault616.py - tepui tabletop mountains: a tiny multi-rank job that fits summit-plateau elevation.

Each rank reads its own shard of synthetic tepui survey points (/tmp/fault616_work/shard_R.pt), maps each
point's tepui id through a JSON lookup table (tepui_lookup.json: id -> plateau scale), trains a small MLP
for 6 steps from a start checkpoint (start.pt), all-reduces the gradients by hand (gloo, CPU), prints
`rank R step S loss L plateau_mae M` every step and rank 0 saves an export at the end.

Faults (--fault NAME --rank N):
  none            control run
  valueerror      rank N parses an elevation note "2810 m" with float() -> ValueError
  jsondecode      rank N reads a truncated copy of the lookup table -> json.JSONDecodeError
  loader_worker   rank N's DataLoader (num_workers=1) indexes past the lookup list -> IndexError in worker
  ckpt_truncated  rank N loads a truncated copy of start.pt -> torch.load fails
  ckpt_keys       rank N loads a checkpoint with renamed keys -> load_state_dict missing/unexpected keys
  save_nodir      rank N (0) saves the export into a directory that does not exist
  skip_allreduce  rank N skips the gradient all_reduce of step 3; the others wait for it
  exit_quiet      rank N calls sys.exit(0) at step 3
  exit3           rank N calls os._exit(3) at step 2 without printing anything
  sigkill         rank N sends itself SIGKILL at step 3
  sigabrt         rank N calls os.abort() at step 2
  anomaly         rank N adds sqrt(negative) to its loss with anomaly detection on -> NaN in backward
  clip_nonfinite  rank N's loss becomes inf; clip_grad_norm_(error_if_nonfinite=True) raises
  ddp_unused      every rank: DDP with a spare layer outside forward, no find_unused_parameters
  modnotfound     rank N imports a survey module that does not exist
  hostmem         rank N caps RLIMIT_AS then allocates 3 GiB
  shape_all       every rank: config says 9 features but the shards hold 8 -> matmul shape error
  zerodiv         rank N divides by the count of summits above 3000 m in its shard (none)
  assert_rows     rank N's own check that shard rows match lookup ids fails (AssertionError)
  stall           rank N sleeps 400 s at step 2 (the others wait in the all_reduce)

Runs (one line per log):
  tepui_none_np3_rnone_plain: control; 6 steps on 3 ranks, rank 0 saves the export, exit 0
  tepui_valueerror_np8_r7_tee: rank 7 ValueError float('2810 m'); peers 'Connection closed by peer'; exit 1
  tepui_exit3_np6_r5_filter: rank 5 os._exit(3) silently; torchrun names rank 5 exitcode 3; exit 1
  tepui_loader_worker_np6_r3_tee_trainer: 'Caught IndexError in DataLoader worker process 0' on rank 3; exit 1
  tepui_ckpt_truncated_np5_r2_redirects: rank 2 'failed finding central directory' (in its stderr.log); exit 1
  tepui_skip_allreduce_np5_r4_loglevel: rank 4 runs ahead, ranks time out after 12000 ms; summary names rank 0; exit 1
  tepui_sigkill_np5_r2_wrapper: rank 2 SIGKILL (-9); peers connection reset/closed; wrapper stops at set -e; exit 1
  tepui_jsondecode_np5_r0_prefix: rank 0 JSONDecodeError on the truncated lookup table before step 0; exit 1
  tepui_shape_all_np5_rall_tee: every rank 'mat1 and mat2 shapes cannot be multiplied (16x9 and 8x16)'; exit 1
  tepui_sigabrt_np7_r6_plain: rank 6 os.abort() -> exitcode -6 (SIGABRT); peers connection reset; exit 1
  tepui_save_nodir_np4_r0_pymodule: rank 0 export save 'Parent directory ... does not exist.' after 6 steps; exit 1
  tepui_anomaly_np4_r1_detail: rank 1 'SqrtBackward0 returned nan values'; rank 0 monitoredBarrier names rank 1; exit 1
  tepui_modnotfound_np4_r3_pdsh2: rank 3 (node 1) ModuleNotFoundError tepui_survey_kit; node 0 loses the store; exit 1
  tepui_hostmem_np3_r1_restart: rank 1 'DefaultCPUAllocator: can't allocate memory'; restart fails in connectFullMesh; exit 1
  tepui_exit_quiet_np6_r3_tee: rank 3 sys.exit(0) at step 3; peers 'Connection closed by peer'; rank 3 never listed; exit 1
  tepui_zerodiv_np5_r1_loglevel: rank 1 ZeroDivisionError before step 0; exit 1
  tepui_ddp_unused_np3_rall_plain: all ranks DDP 'Expected to have finished reduction in the prior iteration'; exit 1
  tepui_clip_nonfinite_np3_r2_plain: rank 2 clip_grad_norm_ 'total norm ... is non-finite'; exit 1
  tepui_ckpt_keys_np4_r3_plain: rank 3 load_state_dict missing/unexpected keys (inlet./outlet.); exit 1
  tepui_badpath_np3_rnone_plain: script path fault_616.py does not exist; 3x "can't open file" exit 2; torchrun exit 1
  tepui_stall_np3_r1_plain: rank 1 sleeps, all ranks stop after step 1; timeout 60 ends torchrun; exit 124
  -
  -
  -
"""
import argparse, json, os, signal, sys, time, datetime
import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault616_work"
FEATURES = 8
N_TEPUIS = 12


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(616)
    for r in range(8):
        x = torch.rand(64, FEATURES, generator=g)
        ids = torch.randint(0, N_TEPUIS, (64,), generator=g)
        elev = 1000 + 1800 * torch.rand(64, generator=g)
        torch.save({"x": x, "ids": ids, "elev": elev}, f"{WORK}/shard_{r}.pt")
    table = {"plateau_scale": [1.0 + 0.05 * i for i in range(N_TEPUIS)],
             "names": ["Roraima", "Kukenan", "Auyan", "Sarisarinama", "Chimanta", "Autana",
                       "Yuruani", "Wei-Assipu", "Ilu", "Tramen", "Karaurin", "Uei"],
             "elevation_note": "2810 m"}
    with open(f"{WORK}/tepui_lookup.json", "w") as f:
        json.dump(table, f)
    with open(f"{WORK}/tepui_lookup_partial.json", "w") as f:
        f.write(json.dumps(table)[:57])
    torch.manual_seed(0)
    model = make_model(FEATURES)
    torch.save({"model": model.state_dict(), "step": 0}, f"{WORK}/start.pt")
    raw = open(f"{WORK}/start.pt", "rb").read()
    open(f"{WORK}/start_truncated.pt", "wb").write(raw[: len(raw) // 2])
    sd = {k.replace("0.", "inlet.").replace("2.", "outlet."): v for k, v in model.state_dict().items()}
    torch.save({"model": sd, "step": 0}, f"{WORK}/start_renamed.pt")
    print("prepared", WORK)


def make_model(features):
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 1))


class Survey(torch.utils.data.Dataset):
    def __init__(self, shard, scale, bad):
        self.x, self.ids, self.elev, self.scale, self.bad = shard["x"], shard["ids"], shard["elev"], scale, bad

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = int(self.ids[i]) + (N_TEPUIS if self.bad else 0)
        return self.x[i], self.elev[i] / 1000.0 * self.scale[tid]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--features", type=int, default=FEATURES)
    a = p.parse_args()
    if a.prepare:
        return prepare()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    f = a.fault
    print(f"rank {rank}/{world} tepui survey start fault={f} target={a.rank}", flush=True)
    if f == "modnotfound" and me:
        import tepui_survey_kit  # noqa: F401
    if f == "hostmem" and me:
        import resource
        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
    lookup = f"{WORK}/tepui_lookup_partial.json" if (f == "jsondecode" and me) else f"{WORK}/tepui_lookup.json"
    with open(lookup) as fh:
        table = json.load(fh)
    scale = table["plateau_scale"]
    shard = torch.load(f"{WORK}/shard_{rank}.pt")
    if f == "assert_rows" and me:
        shard["ids"] = shard["ids"][:-3]
    assert len(shard["ids"]) == len(shard["x"]), f"shard {rank}: {len(shard['ids'])} ids for {len(shard['x'])} rows"
    features = 9 if f == "shape_all" else a.features
    model = make_model(FEATURES)
    ck = f"{WORK}/start.pt"
    if f == "ckpt_truncated" and me:
        ck = f"{WORK}/start_truncated.pt"
    if f == "ckpt_keys" and me:
        ck = f"{WORK}/start_renamed.pt"
    state = torch.load(ck)
    model.load_state_dict(state["model"])
    if f == "shape_all":
        shard["x"] = torch.cat([shard["x"], torch.zeros(len(shard["x"]), features - FEATURES)], 1)
    if f == "ddp_unused":
        holder = nn.ModuleDict({"body": model, "spare": nn.Linear(16, 16)})
        holder.forward = lambda inp: holder["body"](inp)
        model = nn.parallel.DistributedDataParallel(holder)
    if f == "zerodiv" and me:
        high = int((shard["elev"] > 3000).sum())
        print(f"rank {rank} high-summit share {len(shard['elev']) / high}", flush=True)
    ds = Survey(shard, scale, f == "loader_worker" and me)
    dl = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=1 if f == "loader_worker" else 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if f == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    it = iter(dl)
    for step in range(6):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(dl)
            x, y = next(it)
        if me and step == 2:
            if f == "valueerror":
                y = y * float(table["elevation_note"])
            if f == "exit3":
                os._exit(3)
            if f == "sigabrt":
                os.abort()
            if f == "stall":
                time.sleep(400)
            if f == "hostmem":
                big = torch.empty(3 << 30, dtype=torch.uint8).fill_(1)
        if me and step == 3:
            if f == "exit_quiet":
                sys.exit(0)
            if f == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
        pred = model(x).squeeze(1)
        loss = ((pred - y) ** 2).mean()
        if f == "anomaly" and me and step == 2:
            loss = loss + 0.0 * torch.sqrt(pred.mean() - 1e6)
        if f == "clip_nonfinite" and me and step == 2:
            loss = loss * float("inf")
        opt.zero_grad()
        loss.backward()
        if f == "clip_nonfinite":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        if f != "ddp_unused" and not (f == "skip_allreduce" and me and step == 3):
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        mae = (pred - y).abs().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} plateau_mae {mae:.4f}", flush=True)
    dist.barrier()
    if rank == 0 or (f == "save_nodir" and me):
        out = f"{WORK}/exports_missing/tepui_export.pt" if (f == "save_nodir" and me) else f"{WORK}/tepui_export_r{rank}.pt"
        torch.save(model.state_dict(), out)
        print(f"rank {rank} saved export {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
