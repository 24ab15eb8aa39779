"""Batch 575 fault script: "stoat winter coats".

A small distributed training job (gloo, CPU) that learns how white a stoat's winter coat turns
(whiteness) from four pelt features (air temperature, photoperiod, snow days, region code from a
lookup table). `--prepare` writes per-rank shards, the region lookup table and the starting
checkpoint into /tmp/fault575_work. Each rank trains 6 steps on its own shard and prints
`rank R step S loss L whiteness_mae M`; rank 0 saves an export at the end.

Forms: --mode trainer (Lightning Trainer + DDPStrategy gloo; started by Lightning itself with
--devices W, or by torchrun; a bash-loop launch stalled and was dropped) and --mode fabric (lightning.fabric.Fabric, own loop).

Faults (--fault NAME --rank N):
  none             control, nothing planted
  keyerror         rank N's shard has a record whose region ('high_tundra') is not in the lookup table
  missing_shard    rank N looks for its shard in a folder that does not exist (FileNotFoundError)
  ckpt_size        rank N starts from last season's checkpoint (hidden 24, model has 16): size mismatch
  weights_only     rank N loads a checkpoint that pickles a CoatSeason object: torch.load weights_only refuses
  allgather_shape  rank N all_gathers 3 metric values where the peers gather 2 (step 3)
  slow             rank N does pure-Python moult simulation for --slow-s seconds at step 3; peers time out
                   (with --pg-timeout 300 it is a hang that the outer `timeout` ends)
  nan              rank N's batch at step 3 holds NaN; the script's own finiteness check raises FloatingPointError
  sigsegv          rank N sends itself SIGSEGV at step 2
  exit4            rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_all        every rank appends a fifth feature at step 2: Linear(4) gets 5 columns
  worker_crash     rank N's DataLoader worker SIGKILLs itself on its 20th sample

What happened (Lightning 2.6.6, torch 2.13.0+cpu, gloo; one line per fault):
  none             np3 torchrun: 6 steps on every rank, export saved, exit 0
  keyerror         KeyError: 'high_tundra' on the planted rank after step 2; peers: gloo "Connection closed by peer"
  missing_shard    FileNotFoundError for shards_winter2026/shard_rN.json; peers fail in Lightning's train_dataloader() barrier
  ckpt_size        load_state_dict RuntimeError "size mismatch for 0.weight ..." on the planted rank; peers: connection closed
  weights_only     _pickle.UnpicklingError "Unsupported global: GLOBAL __main__.CoatSeason" on the planted rank
  allgather_shape  "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3), got (2))" on the planted rank
  slow             12 s PG timeout: peers "Timed out waiting 12000ms for send/recv"; torchrun's root cause names rank 0;
                   with --pg-timeout 300 the output stops after step 2 until timeout kills the group (exit 137)
  nan              FloatingPointError "non-finite loss nan at step 3" from the script's own check
  sigsegv          planted rank dies with exitcode -11 (SIGSEGV), no traceback; peers: connection reset/closed
  exit4            planted rank prints its ERROR line and exits 4; peers: connection closed
  shape_all        every rank: RuntimeError "mat1 and mat2 shapes cannot be multiplied (8x5 and 4x16)"
  worker_crash     "DataLoader worker (pid N) is killed by signal: Killed." on the planted rank
"""
import argparse, json, os, signal, sys, time, random, math
from datetime import timedelta

WORK = "/tmp/fault575_work"
REGIONS = {"lowland": 0.0, "upland": 0.4, "boreal": 0.7, "arctic": 1.0}


class CoatSeason:
    def __init__(self, year, moult_day):
        self.year, self.moult_day = year, moult_day


def prepare():
    import torch
    os.makedirs(WORK + "/shards", exist_ok=True)
    os.makedirs(WORK + "/ckpt", exist_ok=True)
    os.makedirs(WORK + "/export", exist_ok=True)
    rng = random.Random(575)
    for r in range(8):
        recs = []
        for i in range(64):
            reg = rng.choice(list(REGIONS))
            temp = rng.uniform(-25, 10); photo = rng.uniform(6, 16); snow = rng.uniform(0, 180)
            white = max(0.0, min(1.0, 0.5 - temp / 40 + REGIONS[reg] * 0.3 + snow / 600 - (photo - 11) / 20))
            recs.append({"pelt_id": f"r{r}p{i}", "region": reg, "temp": temp, "photoperiod": photo,
                         "snow_days": snow, "whiteness": white})
        json.dump(recs, open(f"{WORK}/shards/shard_r{r}.json", "w"))
    json.dump(REGIONS, open(f"{WORK}/region_lookup.json", "w"))
    torch.manual_seed(0)
    torch.save(make_model(16).state_dict(), f"{WORK}/ckpt/init.pt")
    torch.save(make_model(24).state_dict(), f"{WORK}/ckpt/last_season_h24.pt")
    torch.save({"state_dict": make_model(16).state_dict(), "season": CoatSeason(2025, 301)},
               f"{WORK}/ckpt/init_with_season.pt")
    print("prepared", WORK)


def make_model(h):
    import torch
    return torch.nn.Sequential(torch.nn.Linear(4, h), torch.nn.ReLU(), torch.nn.Linear(h, 1))


def build_dataset(args, rank):
    import torch
    lookup = json.load(open(f"{WORK}/region_lookup.json"))
    folder = f"{WORK}/shards"
    if args.fault == "missing_shard" and rank == args.rank:
        folder = f"{WORK}/shards_winter2026"
    recs = json.load(open(f"{folder}/shard_r{rank}.json"))
    if args.fault == "keyerror" and rank == args.rank:
        recs[20]["region"] = "high_tundra"
    crash = args.fault == "worker_crash" and rank == args.rank

    class PeltShard(torch.utils.data.Dataset):
        def __len__(self):
            return len(recs)

        def __getitem__(self, i):
            if crash and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            rec = recs[i]
            x = torch.tensor([rec["temp"] / 25, rec["photoperiod"] / 16, rec["snow_days"] / 180,
                              lookup[rec["region"]]], dtype=torch.float32)
            return x, torch.tensor([rec["whiteness"]], dtype=torch.float32)

    nw = 1 if args.fault == "worker_crash" else 0
    return torch.utils.data.DataLoader(PeltShard(), batch_size=8, shuffle=False, num_workers=nw)


def load_start(model, args, rank):
    import torch
    path = f"{WORK}/ckpt/init.pt"
    if args.fault == "ckpt_size" and rank == args.rank:
        path = f"{WORK}/ckpt/last_season_h24.pt"
    if args.fault == "weights_only" and rank == args.rank:
        sd = torch.load(f"{WORK}/ckpt/init_with_season.pt")["state_dict"]
    else:
        sd = torch.load(path)
    model.load_state_dict(sd)


def before_forward(args, rank, step, x):
    import torch
    if args.fault == "sigsegv" and rank == args.rank and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "exit4" and rank == args.rank and step == 2:
        print(f"ERROR [rank {rank}] moult calibration table out of range for step {step}: "
              f"whiteness curve has 0 knots, refusing to train", flush=True)
        sys.exit(4)
    if args.fault == "slow" and rank == args.rank and step == 3:
        t0 = time.time(); acc = 0.0
        while time.time() - t0 < args.slow_s:  # pure-Python moult simulation
            for d in range(20000):
                acc += math.sin(d) * math.cos(acc % 7)
    if args.fault == "nan" and rank == args.rank and step == 3:
        x = x.clone(); x[2, 1] = float("nan")
    if args.fault == "shape_all" and step == 2:
        x = torch.cat([x, (x[:, 1:2] ** 2)], dim=1)  # photoperiod^2 added, model still takes 4
    return x


def after_loss(args, rank, step, loss, mae):
    import torch, torch.distributed as dist
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (pelt batch)")
    if step == 3:
        vals = [mae.detach(), loss.detach()]
        if args.fault == "allgather_shape" and rank == args.rank:
            vals.append(torch.tensor(0.0))
        t = torch.stack(vals)
        out = [torch.zeros(2) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)


def export(model, rank):
    import torch
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export/stoat_coat_export.pt")
        print(f"rank 0 saved export {WORK}/export/stoat_coat_export.pt", flush=True)


def run_trainer(args):
    import torch
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class CoatModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(16)

        def setup(self, stage):
            load_start(self.net, args, self.global_rank)

        def train_dataloader(self):
            return build_dataset(args, self.global_rank)

        def training_step(self, batch, i):
            x, y = batch
            step = self.global_step + 1
            x = before_forward(args, self.global_rank, step, x)
            pred = self.net(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            mae = (pred - y).abs().mean()
            after_loss(args, self.global_rank, step, loss, mae)
            print(f"rank {self.global_rank} step {step} loss {loss.item():.4f} whiteness_mae {mae.item():.4f}",
                  flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    model = CoatModel()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, max_steps=6,
                        strategy=DDPStrategy(process_group_backend="gloo",
                                             timeout=timedelta(seconds=args.pg_timeout)),
                        use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False, logger=False, enable_checkpointing=False)
    trainer.fit(model)
    export(model.net, trainer.global_rank)


def run_fabric(args):
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    net = make_model(16)
    load_start(net, args, rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = fabric.setup(net, opt)
    loader = build_dataset(args, rank)
    step = 0
    for x, y in loader:
        step += 1
        x = before_forward(args, rank, step, x)
        pred = model(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        mae = (pred - y).abs().mean()
        after_loss(args, rank, step, loss, mae)
        opt.zero_grad(); fabric.backward(loss); opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} whiteness_mae {mae.item():.4f}", flush=True)
        if step == 6:
            break
    export(net, rank)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.mode == "fabric":
        run_fabric(a)
    else:
        run_trainer(a)
