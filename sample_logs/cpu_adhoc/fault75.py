"""A seventy-fifth hand-run batch: RESUMING A RUN FROM ITS CHECKPOINTS. A tiny DDP loop on gloo (Net: Linear(8,H)-ReLU
[-Linear(H,H)-ReLU]*(L-2)-Linear(H,4), H=16 and L=2 unless the checkpoint's config says otherwise, Adam + OneCycleLR,
batch 16 of synthetic per-rank data, PG timeout 10 s unless --pg-timeout) printing `rank R world W ready`,
`rank R step S loss L lr X` and `rank R done`. No @record.

A FIRST RUN writes checkpoints (`torchrun ... fault75.py --fault first --ckpt-dir D`): every --save-every steps rank 0
writes D/step_<S>.pt ({model, optim, sched, step, samples_seen, config, world_size, rng: every rank's CPU RNG state
concatenated}), then D/step_<S>.pt.complete, points D/latest (a symlink) and D/latest.txt at it, and keeps the last
two files (retention sorts the names as strings); every rank writes D/shard_rank<R>.pt (its RNG state and data
position); with --dcp every rank also joins a torch.distributed.checkpoint save of the model into D/dcp_step_<S>/.
`python fault75.py --prep-index W --ckpt-dir D` is the data-preparation job: the corpus' shuffled order (slow, pure
Python), one D/data_index_rank<R>.pt per rank, which a resume with --data-index loads (or rebuilds when missing).
Options of the first run: --hidden, --layers, --save-wrapped (saves the DDP wrapper's state_dict, keys 'module.*'),
--save-args (stores the argparse Namespace in the checkpoint), --cache (every rank also keeps a node-local copy in
D/cache/rank<R>/latest.pt).
`python fault75.py --damage NAME --ckpt-dir D [--rank N]` then does to D what a killed run or a clean-up left behind.
Every other --fault RESUMES from D: resolve D/latest (or D/latest.txt with --pointer txt), torch.load it (on every
rank, or with --load-on rank0 on rank 0 and broadcast_object_list to the others), build the model from its config,
load model, optimizer and scheduler state, restore each rank's RNG state from its shard file, wrap in DDP, train on.

Faults (resume runs; --damage names in brackets):
  none          control: resumes from the latest checkpoint and trains to --steps (exit 0)
  fresh         control: the checkpoint folder is empty (the first run wrote elsewhere): the warning 'no checkpoint
                found in D, starting fresh from step 0' and a full run from step 0 (exit 0)
  truncated     [truncate] the latest file was cut when the first run was killed while rank 0 saved it: torch.load
                raises (for this file) OSError: [Errno 22] Invalid argument (every rank, or rank 0 with --load-on rank0)
  latest_deleted the first run saved steps 4, 8, 12: retention sorted 'step_12.pt' < 'step_4.pt' < 'step_8.pt' and
                deleted step_12.pt, the file D/latest and D/latest.txt name: FileNotFoundError in torch.load
  shards_world  resumed with more ranks than the first run had: a rank >= the old world size finds no
                shard_rank<R>.pt (FileNotFoundError on those ranks)
  rng_world     the RNG states are restored from the checkpoint's concatenated 'rng' with .chunk(world)[rank]: under
                another world size set_rng_state gets a wrong-size tensor (RuntimeError on every rank)
  optim_layers  the first run had --layers 3; the resume builds 2 layers, loads the model with strict=False, then the
                optimizer: ValueError: loaded state dict contains a parameter group that doesn't match (every rank)
  sched_key     the scheduler is rebuilt for a new total with last_epoch from ckpt['samples_seen'] (should be 'step'):
                OneCycleLR raises ValueError: Tried to step N times (every rank)
  sched_order   the scheduler is built with last_epoch=step BEFORE the optimizer state is loaded: KeyError: "param
                'initial_lr' is not specified in param_groups[0] when resuming scheduler ..." (every rank)
  renamed       the code renamed the model's modules (fc/out -> encoder/head): load_state_dict(strict=True) raises
                Missing key(s) / Unexpected key(s) (every rank, or rank 0 with --load-on rank0)
  ddp_prefix    the first run (--save-wrapped) saved the wrapper's state_dict: Unexpected key(s) 'module.fc.0.weight'
  args_pickled  the first run (--save-args) stored its argparse Namespace: torch.load's default weights_only=True
                refuses it (UnpicklingError: Weights only load failed ... argparse.Namespace)
  stale_cache   rank N prefers its node-local copy D/cache/rank<N>/latest.pt, which an earlier experiment with
                hidden 32 and more ranks left there (this one had fewer ranks and did not overwrite it): rank N
                builds a wider model and DDP's parameter check fails
  wait_complete [uncomplete] the resume waits until D/step_<S>.pt.complete exists (the first run was killed while
                rank 0 wrote the file: cut, no marker): every rank waits forever (with --load-on rank0: rank 0
                waits, the others time out in broadcast_object_list)
  index_rebuild [drop_index] (--data-index) rank N's data_index_rank<N>.pt is gone: it rebuilds the shuffled
                order (about 10 s), the others time out in DDP's constructor (run with --pg-timeout 8)
  dcp_nometa    [dcp_nometa] the model from the torch.distributed.checkpoint folder whose .metadata the killed first
                run never wrote: dcp.load fails on every rank (CheckpointException)
  final_race    no damage: after training, rank 0 evaluates and then saves D/final.pt; rank N (the export rank)
                loads final.pt at once, without a barrier: FileNotFoundError on rank N
"""
import argparse, datetime, glob, os, random, sys, time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--total-steps", type=int, default=24)
p.add_argument("--save-every", type=int, default=2)
p.add_argument("--pg-timeout", type=int, default=10)
p.add_argument("--ckpt-dir", default="/tmp/fault75_work/ckpt")
p.add_argument("--load-on", default="all", choices=["all", "rank0"])
p.add_argument("--pointer", default="symlink", choices=["symlink", "txt"])
p.add_argument("--hidden", type=int, default=16)
p.add_argument("--layers", type=int, default=None)
p.add_argument("--arch", default="v1")
p.add_argument("--save-wrapped", action="store_true")
p.add_argument("--save-args", action="store_true")
p.add_argument("--cache", action="store_true")
p.add_argument("--dcp", action="store_true")
p.add_argument("--data-index", action="store_true")
p.add_argument("--prep-index", type=int, default=0, help="data preparation: write the index files for W ranks")
p.add_argument("--damage", default=None)
args = p.parse_args()
D = args.ckpt_dir


def damage(name):
    latest = os.path.realpath(os.path.join(D, "latest"))
    if name == "truncate":  # what a SIGKILL in the middle of rank 0's torch.save leaves
        n = os.path.getsize(latest)
        with open(latest, "r+b") as f:
            f.truncate(int(n * 0.55))
    elif name == "uncomplete":
        os.remove(latest + ".complete")
        with open(latest, "r+b") as f:
            f.truncate(int(os.path.getsize(latest) * 0.55))
    elif name == "drop_index":
        os.remove(os.path.join(D, f"data_index_rank{args.rank}.pt"))
    elif name == "dcp_nometa":
        for m in glob.glob(os.path.join(D, "dcp_step_*", ".metadata")):
            os.remove(m)
    print(f"damage {name} done in {D}")


class Net(nn.Module):
    def __init__(self, hidden=16, layers=2, arch="v1"):
        super().__init__()
        body = [nn.Linear(8, hidden), nn.ReLU()]
        for _ in range(layers - 2):
            body += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.names = ("fc", "out") if arch == "v1" else ("encoder", "head")
        setattr(self, self.names[0], nn.Sequential(*body))
        setattr(self, self.names[1], nn.Linear(hidden, 4))

    def forward(self, x):
        return getattr(self, self.names[1])(getattr(self, self.names[0])(x))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + (x[:, 4:].sum(1) > 0).long()


def shuffled_order(n=4_000_000):
    # the corpus' shuffled sample order: a seeded Fisher-Yates in pure Python (slow on purpose: it is the real cost)
    rnd = random.Random(1234)
    idx = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rnd.randint(0, i)
        idx[i], idx[j] = idx[j], idx[i]
    return idx


def rank_index(order, rank, world):
    mine = order[rank::world]
    digest = 0
    for v in mine:
        digest = (digest * 1000003 + v) % (1 << 61)
    return {"order": torch.tensor(mine[:4096]), "digest": digest}


def find_latest():
    if args.pointer == "txt":
        ptr = os.path.join(D, "latest.txt")
        if os.path.exists(ptr):
            return os.path.join(D, open(ptr).read().strip())
        return None
    link = os.path.join(D, "latest")
    if os.path.lexists(link):
        return os.path.realpath(link)
    return None


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} world {world} ready", flush=True)
    first = args.fault == "first"
    cfg = {"hidden": args.hidden, "layers": args.layers or 2}
    start, ckpt = 0, None

    if not first:
        path = find_latest()
        if rank == 0 and args.fault != "stale_cache":
            print(f"rank 0 resuming from {path}", flush=True)
        cache = os.path.join(D, "cache", f"rank{rank}", "latest.pt")
        if args.fault == "stale_cache" and os.path.exists(cache):
            path = cache  # the node-local copy is faster to read than the shared folder
            print(f"rank {rank} resuming from node-local copy {path}", flush=True)
        if path is None:
            if rank == 0:
                print(f"WARNING: no checkpoint found in {D}, starting fresh from step 0", flush=True)
        else:
            if args.fault == "wait_complete" and (args.load_on == "all" or rank == 0):
                while not os.path.exists(path + ".complete"):
                    print(f"rank {rank} waiting for {path} to be complete", flush=True)
                    time.sleep(5)
            if args.load_on == "all" or rank == 0:
                ckpt = torch.load(path)
            if args.load_on == "rank0":
                box = [ckpt]
                dist.broadcast_object_list(box, src=0)
                ckpt = box[0]
            cfg = dict(ckpt["config"])
            if args.layers:
                cfg["layers"] = args.layers
            start = ckpt["step"]
        if args.fault == "dcp_nometa":
            import torch.distributed.checkpoint as dcp
            last = sorted(glob.glob(os.path.join(D, "dcp_step_*")))[-1]

    model = Net(cfg["hidden"], cfg["layers"], args.arch)
    if ckpt is not None:
        if args.fault == "dcp_nometa":
            sd = {"model": model.state_dict()}
            print(f"rank {rank} loading distributed checkpoint {last}", flush=True)
            dcp.load(sd, checkpoint_id=last)
            model.load_state_dict(sd["model"])
        else:
            model.load_state_dict(ckpt["model"], strict=args.fault != "optim_layers")
        print(f"rank {rank} restored model at step {start}", flush=True)

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if ckpt is not None and args.fault == "sched_order":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=args.total_steps,
                                                    last_epoch=start - 1)
    if ckpt is not None:
        opt.load_state_dict(ckpt["optim"])
    if ckpt is not None and args.fault == "sched_key":
        # new total for the longer schedule: rebuild OneCycleLR where the old one left off
        done = ckpt["samples_seen"]
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=args.total_steps,
                                                    last_epoch=done - 1)
    elif ckpt is None or args.fault != "sched_order":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=args.total_steps)
        if ckpt is not None:
            sched.load_state_dict(ckpt["sched"])

    if ckpt is not None:
        if args.fault == "rng_world":
            torch.set_rng_state(ckpt["rng"].chunk(world)[rank])
        else:
            shard = torch.load(os.path.join(D, f"shard_rank{rank}.pt"))
            torch.set_rng_state(shard["rng"])
    if args.data_index:
        ipath = os.path.join(D, f"data_index_rank{rank}.pt")
        if os.path.exists(ipath):
            index = torch.load(ipath)
        else:
            print(f"rank {rank}: {ipath} not found, rebuilding the data index (this can take a while)", flush=True)
            index = rank_index(shuffled_order(), rank, world)
        print(f"rank {rank} data index ok (digest {index['digest'] % 10000:04d})", flush=True)

    ddp = nn.parallel.DistributedDataParallel(model)
    if first and args.cache:
        os.makedirs(os.path.join(D, "cache", f"rank{rank}"), exist_ok=True)

    for step in range(start + 1, args.steps + 1):
        x, y = batch(rank, step)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.5f}", flush=True)
        if first and step % args.save_every == 0:
            save(step, rank, world, ddp, opt, sched, cfg)

    if args.fault == "final_race":
        if rank == 0:  # evaluate on the held-out set, then save the final weights
            with torch.no_grad():
                acc = 0.0
                for i in range(3000):
                    x, y = batch(99, i)
                    acc += (model(x).argmax(1) == y).float().mean().item()
            print(f"rank 0 eval acc {acc / 3000:.3f}", flush=True)
            torch.save({"model": model.state_dict(), "config": cfg, "step": args.steps}, os.path.join(D, "final.pt"))
            print(f"rank 0 saved {D}/final.pt", flush=True)
        elif rank == args.rank:  # the export rank turns the final weights into a scripted model
            final = torch.load(os.path.join(D, "final.pt"))
            export = Net(final["config"]["hidden"], final["config"]["layers"])
            export.load_state_dict(final["model"])
            torch.jit.script(export).save(os.path.join(D, "final_scripted.pt"))
        dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


def save(step, rank, world, ddp, opt, sched, cfg):
    rngs = [torch.empty_like(torch.get_rng_state()) for _ in range(world)]
    dist.all_gather(rngs, torch.get_rng_state())
    torch.save({"rng": torch.get_rng_state(), "data_pos": step * 16, "step": step},
               os.path.join(D, f"shard_rank{rank}.pt"))
    state = {"model": (ddp if args.save_wrapped else ddp.module).state_dict(), "optim": opt.state_dict(),
             "sched": sched.state_dict(), "step": step, "samples_seen": step * 16 * world, "config": cfg,
             "world_size": world, "rng": torch.cat(rngs)}
    if args.save_args:
        state["args"] = args
    if args.cache:
        torch.save(state, os.path.join(D, "cache", f"rank{rank}", "latest.pt"))
    if args.dcp:
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": ddp.module.state_dict()}, checkpoint_id=os.path.join(D, f"dcp_step_{step}"))
    if rank == 0:
        name = f"step_{step}.pt"
        torch.save(state, os.path.join(D, name))
        open(os.path.join(D, name + ".complete"), "w").close()
        tmp = os.path.join(D, "latest.tmp")
        os.symlink(name, tmp)
        os.replace(tmp, os.path.join(D, "latest"))
        with open(os.path.join(D, "latest.txt"), "w") as f:
            f.write(name + "\n")
        kept = sorted(glob.glob(os.path.join(D, "step_*.pt")))
        for old in kept[:-2]:
            os.remove(old)
            os.remove(old + ".complete")
            print(f"rank 0 retention: removed {os.path.basename(old)}", flush=True)
        print(f"rank 0 saved {name}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    if args.prep_index:  # the data-preparation job: one shuffled order, one index file per rank
        os.makedirs(D, exist_ok=True)
        order = shuffled_order()
        for r in range(args.prep_index):
            torch.save(rank_index(order, r, args.prep_index), os.path.join(D, f"data_index_rank{r}.pt"))
        print(f"wrote {args.prep_index} index files to {D}")
        sys.exit(0)
    if args.damage:
        damage(args.damage)
        sys.exit(0)
    os.makedirs(D, exist_ok=True)
    main()
