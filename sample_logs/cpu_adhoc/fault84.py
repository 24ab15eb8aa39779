"""An eighty-fourth hand-run batch: LOADING PRETRAINED WEIGHTS (from elsewhere, not the run's own checkpoint) into a
tiny model before or after wrapping it in DDP on gloo. Model: backbone Linear(8,32)-ReLU-Linear(32,16)-ReLU, head
Linear(16,4); SGD lr 0.05, batch 16, synthetic per-rank data, --steps steps (default 20), `rank R step S loss L`
every 5 steps, then dist.barrier() and `rank R done`. PG timeout 12 s unless --pg-timeout. No @record.

A "model hub" folder (<workdir>/hub) is written once (atomically) by whichever rank comes first: pretrained.pt (a
plain state dict), pretrained_ddp.pt (the same saved from a DDP-wrapped model: `module.` prefixes),
pretrained_10cls.pt (a 10-class head), pretrained_full.pt ({"model", "args": argparse.Namespace, "epoch"}: a
pickled object), pretrained.npz / pretrained_f64.npz / pretrained_flax.npz (numpy exports: float32, float64, and
kernels stored (in, out) as JAX/Flax does). Each rank fetches the weights into its own cache folder
<workdir>/run<MASTER_PORT>/cache/rank<R> (per-node: node<GROUP_RANK>, with --cache node, where local rank 0 fetches
and the node's ranks wait in a barrier) and loads them from there; a file already in the cache is not fetched again.
--rank N puts the faulty file into rank N's cache before the fetch (it stands in for a stale or half-finished
download left there by an earlier job); --rank -1 makes --weights itself the faulty file (every rank); --bad-node K puts
it into node K's cache (with --cache node). --load-on rank0: only rank 0 loads (the others rely on DDP's broadcast).

Faults:
  none        control: everyone loads pretrained.pt strictly, trains, done
  nonstrict   control: the faulty file is pretrained_ddp.pt but the load uses strict=False: rank N loads nothing
              (prints the missing/unexpected key counts) and DDP's broadcast from rank 0 overwrites its parameters
  ddpprefix   pretrained_ddp.pt loaded strictly into the bare model: Missing key(s) / Unexpected key(s)
  headsize    pretrained_10cls.pt: size mismatch for head.weight / head.bias (also with --nonstrict)
  headauto    the head size is read from the checkpoint (`sd["head.weight"].shape[0]`): rank N builds a 10-class
              head from pretrained_10cls.pt and DDP's constructor compares the ranks' parameter shapes
  pickled     pretrained_full.pt read with torch.load's default weights_only=True: Unsupported global argparse.Namespace
  truncated   the first 55% of pretrained.pt (a download cut short): PytorchStreamReader failed reading zip archive
  mapcuda     torch.load(..., map_location=f"cuda:{LOCAL_RANK}") copied from a GPU script, on a CPU-only machine
  nofile      --weights names a file that is not there (with --rank -1 a typo; with --bad-node K / --rank N the file
              was staged only to the other nodes' / ranks' local disk: <workdir>/run<PORT>/local/<key>/)
  npzdtype    pretrained_f64.npz assigned with `p.data = torch.from_numpy(arr)`: rank N's parameters are float64
  npzlayout   pretrained_flax.npz (kernels (in, out)): with --npz-assign, `p.data = ...` gives rank N transposed
              weights that DDP's constructor checks; without it, load_state_dict says size mismatch
  bcastshape  rank 0 alone loads pretrained_10cls.pt, sizing its head from it, then broadcasts every parameter by
              hand (dist.broadcast) to the others, built with 4 classes
  waitfile    ranks other than local rank 0 wait for a `.done` marker that local rank 0 writes after its fetch;
              rank N looks for it under a wrong name (`pretrained.pt.done` vs `pretrained.done`) and waits forever
              (--wait-max seconds, 0 = no limit); use with --cache node: the others wait for it in the barrier
              after the node's fetch
  dlrace      local rank 0 downloads pretrained.pt into a shared cache in 1 KiB chunks straight to the final path;
              the others only wait until the path exists, then load what is there
"""
import argparse, datetime, os, shutil, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=None)
p.add_argument("--bad-node", type=int, default=None)
p.add_argument("--cache", choices=["rank", "node"], default="rank")
p.add_argument("--load-on", choices=["all", "rank0"], default="all")
p.add_argument("--nonstrict", action="store_true")
p.add_argument("--npz-assign", action="store_true")
p.add_argument("--weights", default=None)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--wait-max", type=int, default=0)
p.add_argument("--workdir", default="/tmp/fault84_work")
a = p.parse_args()

BAD = {"none": "pretrained.pt", "nonstrict": "pretrained_ddp.pt", "ddpprefix": "pretrained_ddp.pt",
       "headsize": "pretrained_10cls.pt", "headauto": "pretrained_10cls.pt", "pickled": "pretrained_full.pt",
       "truncated": "pretrained_trunc.pt", "mapcuda": "pretrained.pt", "nofile": "pretrained.pt",
       "npzdtype": "pretrained_f64.npz", "npzlayout": "pretrained_flax.npz", "bcastshape": "pretrained_10cls.pt",
       "waitfile": "pretrained.pt", "dlrace": "pretrained.pt"}


class Net(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def atomic_save(obj, path, saver):
    tmp = f"{path}.tmp{os.getpid()}"
    saver(obj, tmp)
    os.replace(tmp, path)


def make_hub(hub: str) -> None:
    if os.path.exists(f"{hub}/READY"):
        return
    os.makedirs(hub, exist_ok=True)
    torch.manual_seed(1234)
    net, net10 = Net(4), Net(10)
    sd = net.state_dict()
    atomic_save(sd, f"{hub}/pretrained.pt", torch.save)
    atomic_save({"module." + k: v for k, v in sd.items()}, f"{hub}/pretrained_ddp.pt", torch.save)
    atomic_save(net10.state_dict(), f"{hub}/pretrained_10cls.pt", torch.save)
    atomic_save({"model": sd, "args": argparse.Namespace(lr=0.1, epochs=90, arch="mlp"), "epoch": 90},
                f"{hub}/pretrained_full.pt", torch.save)
    with open(f"{hub}/pretrained.pt", "rb") as fh:
        blob = fh.read()
    atomic_save(blob[: int(len(blob) * 0.55)], f"{hub}/pretrained_trunc.pt", lambda b, f: open(f, "wb").write(b))
    for name, conv in (("pretrained.npz", lambda t: t.numpy()),
                       ("pretrained_f64.npz", lambda t: t.numpy().astype(np.float64)),
                       ("pretrained_flax.npz", lambda t: t.numpy().T.copy())):
        tmp = f"{hub}/{name}.tmp{os.getpid()}.npz"
        np.savez(tmp, **{k: conv(v) for k, v in sd.items()})
        os.replace(tmp, f"{hub}/{name}")
    atomic_save("ok\n", f"{hub}/READY", lambda t, f: open(f, "w").write(t))


def load_weights(model: nn.Module, path: str, local_rank: int) -> nn.Module:
    if path.endswith(".npz"):
        arrs = np.load(path)
        if a.npz_assign:
            for name, prm in model.named_parameters():
                prm.data = torch.from_numpy(arrs[name])  # zero-copy
        else:
            model.load_state_dict({k: torch.from_numpy(arrs[k]) for k in arrs.files})
        return model
    if a.fault == "mapcuda":
        obj = torch.load(path, map_location=f"cuda:{local_rank}")
    else:
        obj = torch.load(path)  # weights_only=True is the default
    sd = obj["model"] if "model" in obj else obj
    if a.fault in ("headauto", "bcastshape"):
        classes = sd["head.weight"].shape[0]
        if classes != model.head.out_features:
            model.head = nn.Linear(16, classes)
    res = model.load_state_dict(sd, strict=not (a.nonstrict or a.fault == "nonstrict"))
    if res.missing_keys or res.unexpected_keys:
        print(f"load_state_dict: {len(res.missing_keys)} missing, {len(res.unexpected_keys)} unexpected keys "
              f"(strict=False)", flush=True)
    return model


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, node = int(os.environ["LOCAL_RANK"]), int(os.environ.get("GROUP_RANK", "0"))
    port = os.environ["MASTER_PORT"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    hub, run = f"{a.workdir}/hub", f"{a.workdir}/run{port}"
    make_hub(hub)
    bad = BAD[a.fault]
    good = "pretrained.npz" if bad.endswith(".npz") else "pretrained.pt"
    weights = a.weights or (bad if a.rank == -1 else good)
    key = f"node{node}" if a.cache == "node" else f"rank{rank}"
    cache = f"{run}/cache/{key}"
    os.makedirs(cache, exist_ok=True)
    hit_me = (a.rank is not None and a.rank == rank) or (a.bad_node is not None and a.bad_node == node)
    print(f"rank {rank} world {world} node {node} fault {a.fault} weights {weights} cache {cache}", flush=True)
    fname = "pretrained.npz" if weights.endswith(".npz") else "pretrained.pt"
    dst = f"{cache}/{fname}"
    fetcher = a.cache == "rank" or local_rank == 0
    if a.fault == "nofile" and a.rank != -1:
        # staging copied the weights to every rank's (node's) local disk except the faulty one's
        local = f"{run}/local/{key}"
        os.makedirs(local, exist_ok=True)
        if fetcher and not hit_me:
            shutil.copy(f"{hub}/{weights}", f"{local}/{fname}")
        if a.cache == "node":
            dist.barrier()
        src = f"{local}/{fname}"
    elif a.fault == "dlrace":
        src = f"{run}/cache/shared/{fname}"
        os.makedirs(os.path.dirname(src), exist_ok=True)
        if local_rank == 0:
            with open(f"{hub}/{weights}", "rb") as fin, open(src, "wb") as fout:
                while chunk := fin.read(1024):
                    fout.write(chunk)
                    fout.flush()
                    time.sleep(0.2)  # the network
            print(f"rank {rank} downloaded {src} ({os.path.getsize(src)} bytes)", flush=True)
        else:
            while not os.path.exists(src):
                time.sleep(0.05)
    else:
        if hit_me and fetcher:
            shutil.copy(f"{hub}/{bad}", dst)  # a stale / partial file left in this cache by an earlier job
        if a.fault == "waitfile":
            marker = f"{cache}/pretrained.done"
            if local_rank == 0:
                if not os.path.exists(dst):
                    shutil.copy(f"{hub}/{weights}", dst)
                open(marker, "w").close()
            else:
                if hit_me:
                    marker = f"{dst}.done"  # this rank's copy of the wait loop names the marker differently
                t0 = time.time()
                while not os.path.exists(marker):
                    if a.wait_max and time.time() - t0 > a.wait_max:
                        raise TimeoutError(f"rank {rank}: weights marker {marker} did not appear in {a.wait_max}s")
                    time.sleep(0.5)
        elif fetcher and not os.path.exists(dst):
            shutil.copy(f"{hub}/{weights}", dst)
        if a.cache == "node":
            dist.barrier()  # the node's ranks wait for local rank 0's fetch
        src = dst if a.fault != "nofile" else f"{hub}/{weights}"
    torch.manual_seed(rank)  # each rank's random init differs; DDP broadcasts rank 0's
    model = Net(4)
    if a.load_on == "all" or rank == 0:
        model = load_weights(model, src, local_rank)
        print(f"rank {rank} loaded pretrained weights from {src}", flush=True)
    if a.fault == "bcastshape":
        for prm in model.parameters():
            dist.broadcast(prm.data, src=0)
        print(f"rank {rank} received rank 0's weights", flush=True)
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, a.steps + 1):
        x = torch.randn(16, 8, generator=g)
        y = torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % 5 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
