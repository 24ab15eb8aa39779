"""fault617.py - oribi grassland grazing: a tiny multi-rank CPU training job with planted faults (batch 617).

Each rank reads its shard of synthetic paddock records (sward height, green biomass, rainfall, oribi
density), looks the paddock up in a JSON table (area, grass species), trains a small MLP under DDP
(gloo, CPU) for 6 steps to predict grazing offtake, and prints `rank R step S loss L grazed_kg M`.
Rank 0 saves an export at the end. `--prepare` writes the shards, the lookup table and start.pt.

Faults (--fault NAME --rank N; "every rank" where said):
  none         control run, nothing planted
  zerodiv      rank N's paddock has area 0 -> ZeroDivisionError in the stocking-rate computation (step 2)
  loader       rank N's Dataset raises IndexError inside its DataLoader worker (num_workers=1) at step 2
  ckpt_trunc   rank N truncates its copy of start.pt to half its bytes, then torch.load reads it
  save_nodir   rank 0 saves its export into a folder that does not exist
  exit_quiet   rank N calls os._exit(0) at step 3, printing nothing
  exit3        rank N calls os._exit(3) at step 2, printing nothing
  sigkill      rank N sends itself SIGKILL at step 3 (like the OOM killer)
  sigabrt      rank N calls os.abort() at step 2 (SIGABRT)
  anomaly      anomaly detection on; rank N takes sqrt of a negative biomass at step 2 -> NaN in backward
  ddp_shape    rank N builds its hidden layer 24 wide instead of 16, then wraps in DDP
  stall        rank N sleeps 200 s at step 3 (others time out after --pg-timeout s)
  all_shape    every rank builds the input layer for 5 features instead of 4 (config error)
  dtype        rank N all_reduces its grazed_kg metric as float64 instead of float32
  json_bad     rank N's lookup table copy is cut mid-file -> json.JSONDecodeError
  port_in_use  (launcher) another process holds MASTER_PORT before the job starts
Runs (one line per log):
  oribi_none_np5_rnone_bashloop: all 5 ranks finish 6 steps, export saved; exit 0
  oribi_sigkill_np8_r7_mpitag: rank 7 Killed at step 3; survivors' tagged output lost, timeout ends run; exit 124
  oribi_ddp_shape_np6_r3_legacy: rank 3 DDP param size mismatch [24, 4]; others Connection closed; exit 1
  oribi_loader_np5_r4_ranklabel: Caught IndexError in DataLoader worker process 0 on rank 4; exit 1
  oribi_sigabrt_np5_r2_logfmt: bash reports rank 2 Aborted; others Connection closed by peer; exit 1
  oribi_zerodiv_np3_r2_srunlabel: ZeroDivisionError on rank 2 at step 2; exit 1
  oribi_anomaly_np3_r1_spawn: PowBackward0 returned nan values on process 1; exit 1
  oribi_all_shape_np4_rall_pdsh2: mat1 and mat2 shapes cannot be multiplied on all 4 ranks; exit 1
  oribi_stall_np3_r1_tee: ranks 0, 2 gloo Timed out waiting 12000ms; exit 1
  oribi_ckpt_trunc_np5_r0_files: rank 0 PytorchStreamReader failed finding central directory; exit 1
  oribi_json_bad_np3_r0_mpitag: JSONDecodeError Unterminated string on rank 0; exit 1
  oribi_exit3_np3_r2_bashloop: rank 2 vanishes silently, others Connection reset; exit 1
  oribi_save_nodir_np3_r0_ranklabel: rank 0 torch.save Parent directory does not exist; exit 1
  oribi_exit_quiet_np4_r3_bashloop: rank 3 vanishes silently at step 3, others Connection reset; exit 1
  (not run for lack of time: port_in_use, dtype, the pg-timeout 300 hang)
  -
  -
  -
  -
  -
  -
  -
  -
  -
"""
import argparse, datetime, json, logging, os, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault617_work"
STEPS, BS, NSHARD = 6, 8, 8


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(617)
    for r in range(NSHARD):
        x = torch.rand(STEPS * BS, 4, generator=g)
        y = (0.6 * x[:, 1] + 0.3 * x[:, 3] - 0.2 * x[:, 2]).unsqueeze(1)
        pad = torch.randint(0, 12, (STEPS * BS,), generator=g)
        torch.save({"x": x, "y": y, "paddock": pad}, f"{WORK}/shard_{r}.pt")
    table = {str(p): {"area_ha": 2.0 + p, "grass": ["Themeda", "Hyparrhenia", "Eragrostis"][p % 3]} for p in range(12)}
    with open(f"{WORK}/paddock_lookup.json", "w") as f:
        json.dump(table, f, indent=1)
    torch.save(make_model(4, 16).state_dict(), f"{WORK}/start.pt")
    print("prepared", WORK)


def make_model(nin, hidden):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(nin, hidden), nn.Tanh(), nn.Linear(hidden, 1))


class Paddocks(Dataset):
    def __init__(self, rank, table, bad):
        d = torch.load(f"{WORK}/shard_{rank}.pt")
        self.x, self.y, self.pad, self.table, self.bad = d["x"], d["y"], d["paddock"], table, bad
        self.species = ["Themeda", "Hyparrhenia", "Eragrostis"]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        sp = self.table[str(int(self.pad[i]))]["grass"]
        k = self.species.index(sp)
        if self.bad and i >= 2 * BS:
            k = self.species[k + 3]  # species list has 3 entries
        return self.x[i], self.y[i]


def main(rank, a):
    world = int(os.environ["WORLD_SIZE"])
    if a.logfmt:
        logging.basicConfig(format="%(asctime)s [rank %(rank)s] %(levelname)s %(message)s", level=logging.INFO, stream=sys.stdout)
        log = logging.LoggerAdapter(logging.getLogger("oribi"), {"rank": rank})
        say = log.info
    else:
        say = lambda m: print(m, flush=True)
    hit = a.fault != "none" and (a.rank == rank or a.fault == "all_shape")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=a.pg_timeout))
    say(f"rank {rank}/{world} joined gloo group, fault={a.fault if hit else 'none'}")
    lookup = f"{WORK}/paddock_lookup.json"
    if hit and a.fault == "json_bad":
        raw = open(lookup).read()
        lookup = f"{WORK}/paddock_lookup_r{rank}.json"
        open(lookup, "w").write(raw[: len(raw) // 2])
    with open(lookup) as f:
        table = json.load(f)
    ck = f"{WORK}/start.pt"
    if hit and a.fault == "ckpt_trunc":
        blob = open(ck, "rb").read()
        ck = f"{WORK}/start_r{rank}.pt"
        open(ck, "wb").write(blob[: len(blob) // 2])
    nin = 5 if (hit and a.fault == "all_shape") else 4
    hidden = 24 if (hit and a.fault == "ddp_shape") else 16
    model = make_model(nin, hidden)
    state = torch.load(ck)
    if nin == 4 and hidden == 16:
        model.load_state_dict(state)
    model = DDP(model)
    if a.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Paddocks(rank, table, hit and a.fault == "loader"), batch_size=BS, num_workers=1)
    it = iter(loader)
    for step in range(STEPS):
        x, y = next(it)
        if hit and step == 2 and a.fault == "exit3":
            os._exit(3)
        if hit and step == 2 and a.fault == "sigabrt":
            os.abort()
        if hit and step == 3 and a.fault == "exit_quiet":
            os._exit(0)
        if hit and step == 3 and a.fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and step == 3 and a.fault == "stall":
            time.sleep(200)
        if hit and step == 2 and a.fault == "anomaly":
            x = x.clone(); x[:, 1] = x[:, 1] - 5.0
        area = table[str(rank % 12)]["area_ha"] if not (hit and a.fault == "zerodiv" and step == 2) else 0
        stocking = 40.0 / area  # oribi per hectare
        pred = model(x)
        if a.fault == "anomaly":
            pred = pred + 0.01 * torch.sqrt(x[:, 1:2]).sum()
        loss = ((pred - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        grazed = torch.tensor([float(pred.detach().sum()) * stocking], dtype=torch.float64 if (hit and a.fault == "dtype") else torch.float32)
        dist.all_reduce(grazed)
        say(f"rank {rank} step {step} loss {loss.item():.4f} grazed_kg {grazed.item():.2f}")
    if rank == 0:
        out = f"{WORK}/no_such_exports/oribi_export.pt" if (hit and a.fault == "save_nodir") else f"{WORK}/oribi_export.pt"
        torch.save(model.module.state_dict(), out)
        say(f"rank 0 saved export {out}")
    dist.destroy_process_group()


def spawn_entry(i, a):
    os.environ.update(RANK=str(i), LOCAL_RANK=str(i))
    main(i, a)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(a.spawn))
        mp.spawn(spawn_entry, args=(a,), nprocs=a.spawn)
    else:
        main(int(os.environ["RANK"]), a)
