"""Sundew leaf-trap classifier: a small DDP training job (gloo, CPU) for batch 599.

Each rank reads its own shard of synthetic sundew leaf-trap observations
(tentacle gland readings per trap), looks every trap up in a shared gland
table, starts from a checkpoint, trains 6 steps and all-reduces a
"capture_rate" metric on a side process group (timeout --pg-timeout, 12 s).
Rank 0 writes an export at the end.

Forms: --form trainer (Lightning Trainer; plown / under torchrun / bash loop)
       --form fabric  (lightning.fabric.Fabric with its own loop)

Faults (--fault NAME --rank N):
  none          control, nothing planted
  bad_trap_id   rank N meets a trap id missing from the gland table at step 3 (KeyError)
  missing_shard rank N's shard file is absent at setup (FileNotFoundError)
  ckpt_size     rank N loads a checkpoint saved with 48 hidden units instead of 32 (size mismatch)
  weights_only  rank N loads a checkpoint that pickles a custom TrapCensus object (weights_only refusal)
  wrong_size    rank N all-gathers 7 values where its peers gather 4 (gloo invalid tensor size)
  slow_rank     rank N does 45 s of pure-Python digestion bookkeeping at step 3; peers time out
  stuck_rank    like slow_rank but forever (run with --pg-timeout 300: a hang ended by `timeout`)
  nan_loss      rank N's digestion rate overflows to inf at step 3; the script's own check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 3
  error_exit    rank N prints its own ERROR line and calls sys.exit(4) at step 3
  shape_all     every rank flattens the tentacle readings wrongly at step 2 (matmul shape error)
  host_oom      rank N caps its address space, then asks for a 4 GB gland atlas at step 3 (host alloc failure)

What happened (runs of 2026-12-07, torch 2.13.0+cpu, Lightning 2.6.6, gloo):
  none          np3 torchrun and np5 Fabric finish 6 steps, rank 0 saves the export, exit 0
                (an np8 plown control finished its steps but never exited; dropped)
  bad_trap_id   KeyError: 'DR-9917' on rank N, peers "Connection closed by peer" (np4 torchrun, np6 plown)
  missing_shard FileNotFoundError .../shard_9N.json in setup on rank N, peers connection closed (np3 tee, np5 bash loop)
  ckpt_size     load_state_dict size mismatch [48,16] vs [32,16] on rank 3 (np4 LOGLEVEL=INFO torchrun)
  weights_only  _pickle.UnpicklingError Weights only load failed (TrapCensus) on rank N (np3 plown, np5 Fabric)
  wrong_size    "ProcessGroupGloo::allgather: invalid tensor size" on rank N; Fabric rank also SIGABRTs at exit
  slow_rank     peers "Timed out waiting 12000ms" in all_gather; np3 bash loop ended by timeout (124)
  stuck_rank    no output after step 2, `timeout` SIGTERMs torchrun at 60 s, group killed (137)
  nan_loss      FloatingPointError "loss is inf at step 3" on rank N (np7 plown, np4 Fabric)
  segv          rank N dies silently, torchrun reports exitcode -11 SIGSEGV (np5, np8)
  error_exit    rank N's own "ERROR rank N: tentacle sensor array ..." line, exit 4 (np6 tee, np3 bash loop)
  shape_all     every rank: "mat1 and mat2 shapes cannot be multiplied (8x32 and 16x32)" at step 2
  host_oom      DefaultCPUAllocator: can't allocate memory (4294967296 bytes) on rank 1 (np5 torchrun)
"""
import argparse, json, os, random, resource, signal, sys, time
from datetime import timedelta

WORK = "/tmp/fault599_work"
FEAT, HID, NCLS = 16, 32, 4


class TrapCensus:  # a custom object pickled into one checkpoint (weights_only fault)
    def __init__(self, n):
        self.n = n


def prepare(world):
    import torch
    os.makedirs(WORK, exist_ok=True)
    rnd = random.Random(599)
    table = {f"DR-{i:04d}": round(0.5 + rnd.random(), 4) for i in range(200)}
    json.dump(table, open(f"{WORK}/gland_table.json", "w"))
    for r in range(world):
        rows = []
        for j in range(96):
            tid = f"DR-{rnd.randrange(200):04d}"
            rows.append({"trap": tid, "glands": [rnd.gauss(0, 1) for _ in range(FEAT)], "prey": rnd.randrange(NCLS)})
        json.dump(rows, open(f"{WORK}/shard_{r}.json", "w"))
    torch.manual_seed(599)
    m = build_model(HID)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    torch.save(build_model(48).state_dict(), f"{WORK}/start_h48.pt")
    torch.save({"model": m.state_dict(), "census": TrapCensus(96)}, f"{WORK}/start_census.pt")
    print("prepared", WORK)


def build_model(hid):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(FEAT, hid), nn.ReLU(), nn.Linear(hid, NCLS))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--form", default="trainer", choices=["trainer", "fabric"])
    ap.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare(8)
        return
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class TrapShard(Dataset):
        def __init__(self, rank):
            self.rows = json.load(open(f"{WORK}/shard_{rank}.json"))
        def __len__(self):
            return len(self.rows)
        def __getitem__(self, i):
            r = self.rows[i]
            return r["trap"], torch.tensor(r["glands"]), r["prey"]

    state = {}

    def setup_rank(rank):
        state["side"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
        state["table"] = json.load(open(f"{WORK}/gland_table.json"))
        shard_rank = rank
        if a.fault == "missing_shard" and rank == a.rank:
            shard_rank = 90 + rank  # shard_9N.json was never prepared
        state["ds"] = TrapShard(shard_rank)
        ck = f"{WORK}/start.pt"
        if a.fault == "ckpt_size" and rank == a.rank:
            ck = f"{WORK}/start_h48.pt"
        if a.fault == "weights_only" and rank == a.rank:
            ck = f"{WORK}/start_census.pt"
        sd = torch.load(ck, map_location="cpu")
        if "model" in sd:
            sd = sd["model"]
        return sd

    def step_body(model, batch, rank, step):
        tids, x, y = batch
        world = dist.get_world_size()
        if a.fault == "bad_trap_id" and rank == a.rank and step == 3:
            tids = list(tids)
            tids[5] = "DR-9917"
        density = torch.tensor([state["table"][t] for t in tids])
        x = x * density[:, None]
        if a.fault == "shape_all" and step == 2:
            x = x.reshape(-1, FEAT * 2)
        out = model(x)
        loss = F.cross_entropy(out, y)
        if a.fault == "nan_loss" and rank == a.rank and step == 3:
            digestion = torch.tensor(3.0e38) * torch.tensor(10.0)
            loss = loss * digestion
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (digestion rate overflowed)")
        if a.fault == "segv" and rank == a.rank and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "error_exit" and rank == a.rank and step == 3:
            print(f"ERROR rank {rank}: tentacle sensor array reports 0 glands on trap {tids[0]}; aborting", flush=True)
            sys.exit(4)
        if a.fault == "host_oom" and rank == a.rank and step == 3:
            vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))
            atlas = torch.empty(4 * 2**30, dtype=torch.uint8)
            atlas.fill_(1)
        if a.fault in ("slow_rank", "stuck_rank") and rank == a.rank and step == 3:
            t0, acc = time.time(), 0
            while a.fault == "stuck_rank" or time.time() - t0 < 45:
                for k in range(20000):
                    acc = (acc * 31 + k) % 1000003
        acc_ = (out.argmax(1) == y).float().mean().detach()
        n = 4
        if a.fault == "wrong_size" and rank == a.rank and step == 3:
            n = 7
        gath = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(gath, torch.full((n,), float(acc_)), group=state["side"])
        cap = torch.stack(gath)[:, 0].mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} capture_rate {cap:.4f}", flush=True)
        return loss

    init_to = timedelta(seconds=120)
    if a.form == "trainer":
        class SundewModule(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = build_model(HID)
            def setup(self, stage):
                self.net.load_state_dict(setup_rank(self.global_rank))
            def train_dataloader(self):
                return DataLoader(state["ds"], batch_size=16, shuffle=False, num_workers=0)
            def training_step(self, batch, batch_idx):
                return step_body(self.net, batch, self.global_rank, batch_idx + 1)
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)
            def on_train_end(self):
                if self.global_rank == 0:
                    torch.save(self.net.state_dict(), f"{WORK}/export_sundew.pt")
                    print("rank 0 saved export", f"{WORK}/export_sundew.pt", flush=True)

        trainer = L.Trainer(accelerator="cpu", devices=a.devices, num_nodes=1, max_steps=a.steps,
                            strategy=DDPStrategy(process_group_backend="gloo", timeout=init_to),
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
        trainer.fit(SundewModule())
    else:
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy as FDDP
        fabric = Fabric(accelerator="cpu", devices=a.devices, strategy=FDDP(process_group_backend="gloo", timeout=init_to))
        fabric.launch()
        rank = fabric.global_rank
        model = build_model(HID)
        model.load_state_dict(setup_rank(rank))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = fabric.setup(model, opt)
        dl = fabric.setup_dataloaders(DataLoader(state["ds"], batch_size=16), use_distributed_sampler=False)
        for step, batch in enumerate(dl, start=1):
            if step > a.steps:
                break
            opt.zero_grad()
            loss = step_body(model, batch, rank, step)
            fabric.backward(loss)
            opt.step()
        if rank == 0:
            torch.save(model.state_dict(), f"{WORK}/export_sundew.pt")
            print("rank 0 saved export", f"{WORK}/export_sundew.pt", flush=True)
    dist.barrier(group=state["side"])
    dist.destroy_process_group(state["side"])
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
