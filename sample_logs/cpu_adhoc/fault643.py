"""Batch 643 fault job: "fynbos fire regrowth" (regrowth cover of fynbos plots after a fire).

A tiny regression of post-fire regrowth cover from plot features (years since fire, slope, aspect, rainfall)
plus a species fire-response class looked up in a JSON table. torch.distributed with gloo on CPU only, run
through Lightning (--mode trainer: L.Trainer + DDPStrategy; --mode fabric: lightning.fabric.Fabric, own loop).
`--prepare` writes /tmp/fault643_work: shard_<r>.pt per rank, species_lookup.json, start.pt.
Every rank prints `rank R step S loss L regrowth_cover M` each step; rank 0 exports at the end.
Side work: an evaluation at step 3 and a metrics/export phase after the last step.

Faults (`--fault NAME --rank N`; "all" faults hit every rank):
  none              control run
  eval_zerodiv      rank N evaluates an empty eval set alone: ZeroDivisionError in the mean metric, others at a barrier
  unpicklable_obj   rank N passes a dict holding a threading.Lock to all_gather_object (cannot pickle '_thread.lock')
  metrics_fsize     rank N writes its metrics file under RLIMIT_FSIZE: OSError [Errno 27] File too large
  metrics_sigxfsz   as metrics_fsize but with SIGXFSZ at its default action: the rank is killed by the signal
  export_missing    rank 0's final torch.save goes into a folder that does not exist
  export_json       rank 0 json.dumps a summary holding a tensor (Object of type Tensor is not JSON serializable)
  export_all        every rank saves its export into a missing folder (all fail alike)
  log_handler       rank N builds a logging.FileHandler into a missing folder at setup
  slow_save         rank 0 leaves the loop, its save sleeps past the pg timeout; the others wait at dist.barrier()
  monitored         rank N stalls in its metrics; rank 0's dist.monitored_barrier(timeout=8s) names it
  store_get         rank N does store.get() of a key no rank sets (store wait timeout); others at a barrier
  sigint_eval       rank N sends SIGINT to itself during evaluation (KeyboardInterrupt)
  warn_storm        rank N floods warnings from its metric code, then raises ValueError in the metric
  quiet_exit        rank N calls os._exit(0) after its evaluation, leaving the others at a collective
  lookup_key        rank N's shard holds a species the JSON lookup table lacks (KeyError)

Runs (one line per kept log; filled in after the runs):
  fynbos_none_np5_rnone_pltorchrun: control, 6 steps on 5 ranks, export written, exit 0
  fynbos_eval_zerodiv_np6_r0_pltee: rank 0 ZeroDivisionError in eval, ranks 1-5 gloo Connection closed at barrier, exit 1
  fynbos_unpicklable_obj_np5_r4_plfabric: rank 4 TypeError cannot pickle '_thread.lock', others Connection closed, exit 1
  fynbos_export_json_np3_r0_plown: rank 0 TypeError Tensor not JSON serializable at export, ranks 1-2 Connection closed, exit 1
  fynbos_slow_save_np5_r0_pltorchrun: rank 0 slow save, ranks 1-4 gloo Timed out waiting 12000ms at barrier, exit 1
  fynbos_monitored_np6_r3_plfabric: rank 0 monitored_barrier: Rank 3 failed to pass in 8000 ms, exit 1
  fynbos_store_get_np4_r1_plloglevel: rank 1 DistStoreError wait timeout 12000ms, others gloo timeouts, exit 1
  fynbos_sigint_eval_np5_r2_plfabric: rank 2 KeyboardInterrupt in eval (exitcode -2), others Connection closed, exit 1
  fynbos_warn_storm_np8_r7_pltorchrun: rank 7 40 RuntimeWarnings then ValueError in metric, others Connection closed, exit 1
  fynbos_quiet_exit_np4_r3_pltee: rank 3 os._exit(0) after eval, ranks 0-2 Connection closed/reset, torchrun blames rank 0
  fynbos_export_all_np3_rall_plbashloop: all 3 ranks RuntimeError Parent directory does not exist at export, exit 1
  fynbos_log_handler_np5_r1_plloglevel: rank 1 FileNotFoundError from logging.FileHandler in setup, exit 1
  fynbos_metrics_fsize_np4_r0_plfabric: rank 0 exits 1 silently (RLIMIT_FSIZE also blocks its stderr), exit 1
  fynbos_export_missing_np6_r0_pltorchrun: rank 0 RuntimeError Parent directory does not exist, others Connection closed
  fynbos_metrics_sigxfsz_np3_r2_plbashloop: rank 2 killed by SIGXFSZ (File size limit exceeded), exit 153
  fynbos_unpicklable_obj_np3_r0_pltee: rank 0 TypeError cannot pickle '_thread.lock', ranks 1-2 Connection closed, exit 1
  fynbos_lookup_key_np7_r3_plown: rank 3 KeyError 'Mimetes hottentoticus' in setup, six ranks Connection closed, exit 1
  fynbos_store_get_np3_r2_plfabric: rank 2 DistStoreError wait timeout, ranks 0-1 gloo timeouts, exit 1
  (dropped) first metrics_sigxfsz np3 r2 plbashloop on port 40803: the unlimited os.write wrote 64 bytes and never failed
  fynbos_quiet_exit_np3_r2_plfabric: rank 2 os._exit(0) after eval, ranks 0-1 Connection closed, exit 1
  (spare line)
  (spare line)
"""
import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

WORK = "/tmp/fault643_work"
SPECIES = ["Protea repens", "Leucadendron salignum", "Erica cerinthoides", "Restio festuciformis",
           "Watsonia borbonica", "Cyclopia genistoides"]
NFEAT = 4
STEPS = 6
BATCH = 8


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    return p.parse_args()


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(643)
    table = {s: i for i, s in enumerate(SPECIES)}
    with open(os.path.join(WORK, "species_lookup.json"), "w") as f:
        json.dump(table, f)
    for r in range(8):
        x = torch.rand(STEPS * BATCH, NFEAT, generator=g)
        sp = [SPECIES[int(i)] for i in torch.randint(0, len(SPECIES), (STEPS * BATCH,), generator=g)]
        y = (0.6 * x[:, 0] + 0.2 * x[:, 3] - 0.1 * x[:, 1]).unsqueeze(1)
        torch.save({"x": x, "species": sp, "y": y}, os.path.join(WORK, f"shard_{r}.pt"))
    model = make_model()
    torch.save(model.state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {WORK}: 8 shards, lookup table, start checkpoint", flush=True)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(NFEAT + len(SPECIES), 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def hit(args, rank):
    return args.rank == -1 or args.rank == rank


def load_shard(args, rank):
    d = torch.load(os.path.join(WORK, f"shard_{rank}.pt"))
    with open(os.path.join(WORK, "species_lookup.json")) as f:
        table = json.load(f)
    species = list(d["species"])
    if args.fault == "lookup_key" and hit(args, rank):
        species[13] = "Mimetes hottentoticus"
    ids = torch.tensor([table[s] for s in species])
    onehot = torch.nn.functional.one_hot(ids, len(SPECIES)).float()
    return torch.cat([d["x"], onehot], dim=1), d["y"]


def setup_logging(args, rank):
    log = logging.getLogger("fynbos")
    log.setLevel(logging.INFO)
    folder = os.path.join(WORK, "logs")
    if args.fault == "log_handler" and hit(args, rank):
        folder = os.path.join(WORK, "logs_postfire_missing")
    os.makedirs(os.path.join(WORK, "logs"), exist_ok=True)
    log.addHandler(logging.FileHandler(os.path.join(folder, f"rank{rank}.log")))
    return log


def evaluate(args, rank, model):
    """Evaluation at step 3 (side work)."""
    evalset = [] if (args.fault == "eval_zerodiv" and hit(args, rank)) else [0.41, 0.37, 0.52]
    if args.fault == "sigint_eval" and hit(args, rank):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    if args.fault == "warn_storm" and hit(args, rank):
        warnings.simplefilter("always")
        for i in range(40):
            warnings.warn(f"fynbos_metrics: plot {i} has no unburnt reference quadrat; cover ratio is ill-defined",
                          RuntimeWarning)
        raise ValueError("regrowth_cover_ratio: reference cover must be positive, got 0.0 for 40 plots")
    score = sum(evalset) / len(evalset)
    return score


def side_work(args, rank, world, step, model):
    """Called after each step; step 3 runs the evaluation and the object exchange."""
    if step != 3:
        return
    if args.fault == "eval_zerodiv":
        if hit(args, rank):
            evaluate(args, rank, model)
        dist.barrier()
        return
    score = evaluate(args, rank, model)
    if args.fault == "quiet_exit" and hit(args, rank):
        print(f"rank {rank} eval done, regrowth score {score:.3f}", flush=True)
        os._exit(0)
    obj = {"rank": rank, "eval_regrowth": score}
    if args.fault == "unpicklable_obj" and hit(args, rank):
        obj["plot_lock"] = threading.Lock()
    out = [None] * world
    dist.all_gather_object(out, obj)
    if args.fault == "store_get" and hit(args, rank):
        store = dist.distributed_c10d._get_default_store()
        store.get("fynbos_burn_scar_ready")
    dist.barrier()


def finish(args, rank, world, model):
    """Metrics file and export after the last step."""
    mdir = os.path.join(WORK, "metrics")
    os.makedirs(mdir, exist_ok=True)
    if args.fault in ("metrics_fsize", "metrics_sigxfsz") and hit(args, rank):
        import resource
        if args.fault == "metrics_sigxfsz":
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    if args.fault == "monitored" and hit(args, rank):
        time.sleep(30)
    with open(os.path.join(mdir, f"rank{rank}.csv"), "w") as fh:
        fh.write("plot,regrowth_cover\n" + "".join(f"{i},{0.3 + i / 100:.4f}\n" for i in range(20)))
        fh.flush()
    if args.fault == "monitored":
        dist.monitored_barrier(timeout=timedelta(seconds=8))
    if args.fault == "slow_save" and rank == 0:
        print("rank 0 saving export (slow shared disk)", flush=True)
        time.sleep(25)
    if rank == 0 or args.fault == "export_all":
        edir = os.path.join(WORK, "export")
        if args.fault in ("export_missing", "export_all"):
            edir = os.path.join(WORK, "export_season_missing", f"r{rank}")
        os.makedirs(os.path.join(WORK, "export"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(edir, "fynbos_regrowth.pt"))
        summary = {"steps": STEPS, "world": world}
        if args.fault == "export_json":
            summary["final_bias"] = model.state_dict()[list(model.state_dict())[-1]]
        with open(os.path.join(WORK, "export", "summary.json"), "w") as f:
            json.dump(summary, f)
        print(f"rank {rank} export written", flush=True)
    dist.barrier()


def step_print(rank, step, loss, pred):
    print(f"rank {rank} step {step} loss {loss:.4f} regrowth_cover {pred.mean().item():.4f}", flush=True)


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Regrowth(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.net.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))

        def setup(self, stage):
            self.log_ = setup_logging(args, self.global_rank)
            self.x, self.y = load_shard(args, self.global_rank)

        def train_dataloader(self):
            ds = torch.utils.data.TensorDataset(self.x, self.y)
            return torch.utils.data.DataLoader(ds, batch_size=BATCH)

        def training_step(self, batch, idx):
            x, y = batch
            pred = self.net(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            step_print(self.global_rank, idx, loss.item(), pred)
            side_work(args, self.global_rank, self.trainer.world_size, idx, self.net)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", strategy=DDPStrategy(process_group_backend="gloo",
                        timeout=timedelta(seconds=args.pg_timeout)), devices=args.devices, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    model = Regrowth()
    trainer.fit(model)
    finish(args, trainer.global_rank, trainer.world_size, model.net)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=DDPStrategy(
        process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    net = make_model()
    net.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    setup_logging(args, rank)
    x, y = load_shard(args, rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = fabric.setup(net, opt)
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        pred = model(xb)
        loss = torch.nn.functional.mse_loss(pred, yb)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        step_print(rank, step, loss.item(), pred)
        side_work(args, rank, world, step, net)
    finish(args, rank, world, net)


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    if args.mode == "trainer":
        run_trainer(args)
    else:
        run_fabric(args)


if __name__ == "__main__":
    main()
