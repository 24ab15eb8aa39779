"""Puffin burrow counts: a small distributed regression job (Lightning / Fabric, gloo, CPU).

Each rank trains an MLP that predicts the number of occupied puffin burrows per survey plot
from plot features, on its own shard of survey plots (one shard per rank, made by --prepare).
A colony lookup table scales each plot's count; every step the ranks all-reduce their burrow
totals (a "census sync", waited with --pg-timeout seconds). The model starts from a checkpoint;
rank 0 exports the trained weights at the end.

Faults (--fault NAME --rank N, planted at step 3 unless said otherwise):
  none          control, no fault
  keyerror      rank N's shard has plots of a colony the lookup table lacks -> KeyError
  missing_shard rank N reads a shard file whose colony name is misspelt -> FileNotFoundError
  ckpt_size     rank N starts from the wide (hidden 48) checkpoint -> load_state_dict size mismatch
  weights_only  rank N starts from a checkpoint that pickles a SurveyMeta object -> torch.load refuses it
  wrong_size    rank N sends a census tensor of 5 values instead of 4 -> gloo size mismatch
  slow          rank N does pure-Python work for pg_timeout+30 s before the census sync; peers time out
  nan           rank N's batch has an inf plot area -> the script's own finiteness check raises
  segv          rank N sends itself SIGSEGV
  exit4         rank N prints its own ERROR line and sys.exit(4)
  shape_all     every rank reshapes the features with the wrong width -> RuntimeError everywhere
  hostmem       rank N (RLIMIT_AS capped) allocates a 12 GB tensor -> allocator refuses
  worker_crash  rank N's DataLoader worker is SIGKILLed while loading step 3's plots

What happened (hand runs, 2026-12-07, Lightning 2.6.6, gloo, 12 s census wait, 120 s start-up timeout):
  none          np3 pltorchrun clean (exit 0); np7 plfabric trained all 6 steps but rank 1 aborted at exit
                ("terminate called without an active exception", SIGABRT) and torchrun exited 1
  keyerror      KeyError 'Sule_Skerry' on the planted rank at step 3, peers "Connection closed by peer"
  missing_shard FileNotFoundError for shard_Fair_Isles.pt before step 0, peers connection closed
  ckpt_size     load_state_dict size mismatch (48 vs 32) on the planted rank, peers connection closed
  weights_only  UnpicklingError "Weights only load failed" on the planted rank, peers connection closed
  wrong_size    no size error: peers went on, the planted rank's wait said "Operation timed out!", the job hung
                in teardown until the outer timeout (137)
  slow          peers "Operation timed out!" after 12 s, then hung until the outer timeout (137); with
                --pg-timeout 300 the output just stops after step 2 (hang, ended by timeout, 137)
  nan           FloatingPointError from the script's own check (loss inf / nan) on the planted rank
  segv          planted rank dies with SIGSEGV (exitcode -11), peers connection closed/reset
  exit4         the planted rank's own ERROR line, exit 4, no traceback; peers connection closed
  shape_all     RuntimeError shape '[-1, 7]' is invalid for input of size 64 on every rank
  hostmem       DefaultCPUAllocator: can't allocate memory (12000000000 bytes) on the planted rank
  worker_crash  "DataLoader worker (pid N) is killed by signal: Killed." on the planted rank
"""
import argparse, os, sys, time, signal, resource, dataclasses
from datetime import timedelta
import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault595_work"
FEAT = 8
STEPS = 6
BS = 8


@dataclasses.dataclass
class SurveyMeta:
    season: str
    surveyor: str


class Net(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)


def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(595)
    colonies = ["Skomer", "Lunga", "Fair_Isle", "Hermaness", "Farne", "Rathlin", "Staple", "Mingulay"]
    torch.save({c: 1.0 + 0.1 * i for i, c in enumerate(colonies)}, f"{WORK}/colony_table.pt")
    for r in range(world):
        n = BS * STEPS
        x = torch.randn(n, FEAT, generator=g)
        y = (x[:, :3].sum(1) * 4 + 20).clamp(min=0)
        col = [colonies[r]] * n
        torch.save({"x": x, "y": y, "colony": col}, f"{WORK}/shard_{colonies[r]}.pt")
    torch.manual_seed(1)
    torch.save(Net(32).state_dict(), f"{WORK}/init_ckpt.pt")
    torch.save(Net(48).state_dict(), f"{WORK}/init_ckpt_wide.pt")
    sd = Net(32).state_dict(); sd["meta"] = SurveyMeta("2026", "rspb")
    torch.save(sd, f"{WORK}/init_ckpt_meta.pt")
    print("prepared", WORK)


COLONIES = ["Skomer", "Lunga", "Fair_Isle", "Hermaness", "Farne", "Rathlin", "Staple", "Mingulay"]


def rank():
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


class PlotShard(torch.utils.data.Dataset):
    def __init__(self, r, args):
        name = COLONIES[r]
        if args.fault == "missing_shard" and r == args.rank:
            name = "Fair_Isles"  # typo in this rank's colony list
        d = torch.load(f"{WORK}/shard_{name}.pt")
        self.x, self.y, self.col = d["x"], d["y"], list(d["colony"])
        self.table = torch.load(f"{WORK}/colony_table.pt")
        self.r, self.args = r, args
        if args.fault == "keyerror" and r == args.rank:
            for i in range(3 * BS, 4 * BS):
                self.col[i] = "Sule_Skerry"
        if args.fault == "nan" and r == args.rank:
            self.x[3 * BS + 2, 0] = float("inf")

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if (self.args.fault == "worker_crash" and self.r == self.args.rank and i == 3 * BS
                and torch.utils.data.get_worker_info() is not None):
            os.kill(os.getpid(), signal.SIGKILL)
        scale = self.table[self.col[i]]
        return self.x[i], self.y[i] * scale


def make_loader(r, args):
    nw = 1 if (args.fault == "worker_crash" and r == args.rank) else 0
    return torch.utils.data.DataLoader(PlotShard(r, args), batch_size=BS, shuffle=False, num_workers=nw)


def load_start(net, r, args):
    path = f"{WORK}/init_ckpt.pt"
    if args.fault == "ckpt_size" and r == args.rank:
        path = f"{WORK}/init_ckpt_wide.pt"
    if args.fault == "weights_only" and r == args.rank:
        path = f"{WORK}/init_ckpt_meta.pt"
    sd = torch.load(path)
    net.load_state_dict(sd)
    print(f"rank {r} loaded start checkpoint {path}", flush=True)


def census_sync(x, y, step, args):
    r = rank()
    t = torch.tensor([float(len(y)), float(y.sum()), float(y.max()), float(step)])
    if args.fault == "wrong_size" and r == args.rank and step == 3:
        t = torch.cat([t, torch.tensor([0.0])])
    if args.fault == "slow" and r == args.rank and step == 3:
        end = time.time() + args.pg_timeout + 30
        acc = 0
        while time.time() < end:
            for k in range(20000):
                acc += k * k % 7
    work = dist.all_reduce(t, async_op=True)
    work.wait(timeout=timedelta(seconds=args.pg_timeout))
    return t


def step_body(net, batch, step, args):
    r = rank()
    x, y = batch
    if args.fault == "shape_all" and step == 3:
        x = x.view(-1, FEAT - 1)
    if args.fault == "segv" and r == args.rank and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "exit4" and r == args.rank and step == 3:
        print(f"ERROR rank {r}: survey plot 27 of colony {COLONIES[r]} has a negative burrow count (-3); refusing to train", flush=True)
        sys.exit(4)
    if args.fault == "hostmem" and r == args.rank and step == 3:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (6 * 1024 ** 3, hard))
        big = torch.empty(3_000_000_000, dtype=torch.float32)  # 12 GB burrow-density grid
        big.zero_()
    census_sync(x, y, step, args)
    pred = net(x)
    loss = nn.functional.mse_loss(pred, y)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {r} step {step}: loss is {loss.item()} (non-finite burrow-count loss)")
    mae = (pred - y).abs().mean().item()
    print(f"rank {r} step {step} loss {loss.item():.4f} mae {mae:.3f}", flush=True)
    return loss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    args = p.parse_args()
    if args.prepare:
        prepare(); return
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.fabric.strategies import DDPStrategy as FDDPStrategy
    torch.manual_seed(0)

    if args.mode == "fabric":
        fabric = L.Fabric(accelerator="cpu", devices=args.devices,
                          strategy=FDDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120)))
        fabric.launch()
        r = fabric.global_rank
        net = Net(32)
        load_start(net, r, args)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        net, opt = fabric.setup(net, opt)
        loader = make_loader(r, args)
        for step, batch in enumerate(loader):
            loss = step_body(net, batch, step, args)
            opt.zero_grad(); fabric.backward(loss); opt.step()
        if r == 0:
            torch.save(net.module.state_dict(), f"{WORK}/export.pt")
            print(f"rank 0 saved export to {WORK}/export.pt", flush=True)
        fabric.barrier()
        return

    class Burrows(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(32)

        def on_train_start(self):
            load_start(self.net, self.global_rank, args)

        def train_dataloader(self):
            return make_loader(self.global_rank, args)

        def training_step(self, batch, idx):
            return step_body(self.net, batch, self.global_step, args)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), f"{WORK}/export.pt")
                print(f"rank 0 saved export to {WORK}/export.pt", flush=True)

    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120)))
    trainer.fit(Burrows())


if __name__ == "__main__":
    main()
