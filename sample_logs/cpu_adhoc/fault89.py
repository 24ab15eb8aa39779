"""An eighty-ninth hand-run batch: THE KEY-VALUE STORE AND OBJECT COLLECTIVES USED FOR COORDINATION. A tiny DDP job on
gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16 of synthetic per-rank data, --steps steps, PG timeout 15 s unless
--pg-timeout) whose ranks coordinate by hand before training: through the process group's store
(`_get_default_store()`: a leader's run id, config and ready flag, node leaders' host keys, a lock taken with
`compare_set` for building a shared vocab, a hand-rolled barrier built from `add`), through object collectives
(`broadcast_object_list` of the config, `scatter_object_list` of the shard assignment, `all_gather_object` of each
rank's stats) and through a metrics TCPStore of the leader's own on --store-port. It prints `rank R world W node G
fault F`, `rank R config run_id ... lr ...`, `rank R shards [...]`, `rank R step S loss L`, `rank R done`. Store waits
use --wait-s (10 s) as their timeout. No @record.

Faults (--rank N is the rank that goes wrong):
  none         control: every phase, every step, `rank R done` (exit 0)
  neverset     rank N is the leader; a refactor moved its `store.set("job/ready")` into the resume branch, and this is
               a fresh run: the others' `store.wait(["job/ready"])` times out (DistStoreError), N waits in DDP's init
  keytypo      rank N is the eval rank; it waits for "job/eval-config" while the leader (rank 0) set "job/eval_config":
               rank N's wait times out, the others wait in DDP's init
  keyname      node leaders publish their host under f"node/{LOCAL_RANK}/host" instead of the node's index (GROUP_RANK):
               right on one node; on two nodes the second node's leader overwrites node/0 and node/1 is never set,
               so every rank's wait for the host map times out (run with two agents)
  leadercrash  rank N takes the vocab lock (compare_set) and raises KeyError building the vocab from a config without
               a "tokenizer" section; the others wait for "vocab/done"
  addskip      rank N returns early from prepare_data() ("shard already cached") before the hand-rolled `add` barrier:
               the others' wait for the barrier's done key times out, N waits in DDP's init
  addall       the `add` barrier counts to the config's world size (--world-cfg, 8) instead of the real one on every
               rank: every rank's wait times out (with --poll: every rank polls the counter forever, a hang)
  pickle       rank N's stats for all_gather_object carry its open shard file: TypeError: cannot pickle
               '_io.TextIOWrapper' object; the others wait in the all-gather
  scatterlen   rank N is the leader and builds the shard assignment for ranks 1..W-1 only (an off-by-one):
               scatter_object_list raises on it (`Incorrect input list size`), the others wait in the scatter
  storeport    rank N (the leader) starts its metrics TCPStore(is_master=True) on --store-port, which another process
               holds: the bind fails on rank N, the others wait in the barrier after it
  storemaster  the same with the port taken from MASTER_PORT (torchrun's own store already listens there)
  afterdestroy rank N (the leader) marks the run complete in the default store after destroy_process_group():
               ValueError: Default process group has not been initialized; the others exit 0
"""
import argparse, datetime, json, os, socket, sys, time, uuid
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--wait-s", type=int, default=10)
p.add_argument("--world-cfg", type=int, default=8)
p.add_argument("--store-port", type=int, default=0)
p.add_argument("--poll", action="store_true")
p.add_argument("--workdir", default="/tmp/fault89_work")
a = p.parse_args()
BATCH = 16


def td(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def publish_config(store, rank: int, leader: int) -> dict:
    if rank == leader:
        run_id = uuid.uuid4().hex[:8]
        cfg = {"run_id": run_id, "lr": 0.05, "batch": BATCH, "eval": {"every": 3}, "vocab_src": "chars"}
        if a.fault != "leadercrash":
            cfg["tokenizer"] = {"vocab_size": 64}
        store.set("job/run_id", run_id)
        store.set("job/config", json.dumps(cfg))
        store.set("job/eval_config", json.dumps(cfg["eval"]))
        ckpt = f"{a.workdir}/{run_id}/last.pt"
        if a.fault == "neverset":
            if os.path.exists(ckpt):  # resume: load the step counter, then tell the others
                store.set("job/step", str(torch.load(ckpt)["step"]))
                store.set("job/ready", "1")
        else:
            store.set("job/ready", "1")
    else:
        store.wait(["job/ready"], td(a.wait_s))
    cfg = json.loads(store.get("job/config"))
    if rank == (a.rank if a.fault == "keytypo" else dist.get_world_size() - 1):  # the eval rank
        key = "job/eval-config" if a.fault == "keytypo" else "job/eval_config"
        store.wait([key], td(a.wait_s))
        cfg["eval"] = json.loads(store.get(key))
    return cfg


def host_map(store, rank: int, world: int) -> dict:
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    nnodes = world // local_world
    if local_rank == 0:
        idx = local_rank if a.fault == "keyname" else int(os.environ["GROUP_RANK"])
        store.set(f"node/{idx}/host", f"{socket.gethostname()}:{os.getpid()}")
    keys = [f"node/{k}/host" for k in range(nnodes)]
    store.wait(keys, td(a.wait_s))
    return {k: store.get(k).decode() for k in keys}


def build_vocab(store, rank: int, world: int, cfg: dict) -> int:
    # ranks get here at different times (their data loads differ); rank N is first and takes the lock
    time.sleep(0.3 * ((rank - a.rank) % world))
    got = store.compare_set("lock/vocab", "", f"rank{rank}")
    if got == f"rank{rank}".encode():
        size = cfg["tokenizer"]["vocab_size"]
        store.set("vocab/size", str(size))
        store.set("vocab/done", "1")
        store.delete_key("lock/vocab")
    else:
        store.wait(["vocab/done"], td(a.wait_s))
    return int(store.get("vocab/size"))


def store_barrier(store, name: str, expected: int) -> None:
    n = store.add(f"barrier/{name}", 1)
    if n == expected:
        store.set(f"barrier/{name}/done", "1")
    if a.poll:
        while store.add(f"barrier/{name}", 0) < expected:
            time.sleep(0.5)
    else:
        store.wait([f"barrier/{name}/done"], td(a.wait_s))


def prepare_data(store, rank: int, world: int) -> None:
    os.makedirs(a.workdir, exist_ok=True)
    cache = f"{a.workdir}/shard{rank}.cache"
    if a.fault == "addskip" and rank == a.rank:
        open(cache, "w").close()
    if os.path.exists(cache) and a.fault == "addskip":
        return  # shard already cached, nothing to do
    with open(cache, "w") as fh:
        fh.write("\n".join(str(i) for i in range(rank, 256, world)))
    expected = a.world_cfg if a.fault == "addall" else world
    store_barrier(store, "data_ready", expected)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=td(a.pg_timeout))
    store = dist.distributed_c10d._get_default_store()
    leader = a.rank if a.fault in ("neverset", "scatterlen", "storeport", "storemaster", "afterdestroy") else 0
    print(f"rank {rank} world {world} node {os.environ.get('GROUP_RANK')} fault {a.fault}", flush=True)

    hosts = host_map(store, rank, world)
    cfg = publish_config(store, rank, leader)
    obj = [cfg if rank == leader else None]
    dist.broadcast_object_list(obj, src=leader)
    cfg = obj[0]
    print(f"rank {rank} config run_id {cfg['run_id']} lr {cfg['lr']} nodes {len(hosts)}", flush=True)
    vocab = build_vocab(store, rank, world, cfg)

    # the shard assignment: the leader decides, everyone gets its own list
    if rank == leader:
        first = 1 if a.fault == "scatterlen" else 0
        assign = [list(range(r, 64, world)) for r in range(first, world)]
    else:
        assign = None
    mine = [None]
    dist.scatter_object_list(mine, assign, src=leader)
    print(f"rank {rank} shards {mine[0][:4]}... vocab {vocab}", flush=True)
    prepare_data(store, rank, world)

    # the leader's metrics store, on a port of its own
    mport = int(os.environ["MASTER_PORT"]) if a.fault == "storemaster" else a.store_port
    mstore = None
    if mport:
        if rank == leader:
            mstore = dist.TCPStore(os.environ["MASTER_ADDR"], mport, world, is_master=True,
                                   timeout=td(a.wait_s), wait_for_workers=False)
        dist.barrier()
        if rank != leader:
            mstore = dist.TCPStore(os.environ["MASTER_ADDR"], mport, world, is_master=False, timeout=td(a.wait_s))

    shard = open(f"{a.workdir}/shard{rank}.cache")
    stats = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "samples": len(shard.readlines())}
    if a.fault == "pickle" and me:
        stats["reader"] = shard  # keep the reader around for the resume bookkeeping
    gathered = [None] * world
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        print(f"rank 0 stats samples {[g['samples'] for g in gathered]}", flush=True)

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, a.steps + 1):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if mstore is not None:
            mstore.set(f"metrics/{rank}/loss", f"{loss.item():.4f}")
        if rank == 0:
            store.set("progress/step", str(step))
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if a.fault == "afterdestroy" and me:
        dist.distributed_c10d._get_default_store().set("job/status", "complete")
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
