"""A tenth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault9.py)."""
import argparse, datetime, json, logging, os, sys, tempfile, threading, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
log = logging.getLogger("train")


def setup_logging(rank: int) -> None:
    """Progress lines in the forms real training scripts use."""
    if a.fault == "log_stall":
        fmt = "%(asctime)s [Rank %(rank)s] %(levelname)s %(message)s"
    elif a.fault == "kv_hang":
        fmt = "%(asctime)s %(levelname)s rank=%(rank)s %(message)s"
    else:
        return
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(fmt))
    h.addFilter(lambda r: setattr(r, "rank", rank) or True)
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(rank: int, msg: str) -> None:
    if a.fault in ("log_stall", "kv_hang"):
        log.info(msg)
        for h in log.handlers:
            h.flush()
    elif a.fault == "record_exc":
        print(f"[RANK {rank}] {msg}", flush=True)
    else:
        print(f"rank {rank} {msg}", flush=True)


def fault_at_step3(rank: int, world: int) -> None:
    hit = rank == a.rank
    if a.fault == "record_exc" and hit:
        metrics = {"train_loss": 0.5}
        print(f"[RANK {rank}] best so far {metrics['val_loss']:.4f}", flush=True)  # eval was skipped on this rank
    if a.fault == "log_stall" and hit:
        log.info("prefetching next shard from object store"); time.sleep(90)  # the fetch never returns
    if a.fault == "kv_hang" and hit:
        log.info("waiting for eval server ack"); threading.Event().wait()  # the ack never comes
    if a.fault == "a2a_splits":
        inp = torch.arange(2 * world, dtype=torch.float32) + 100 * rank
        send = [2] * world
        if hit:  # this rank's router sends one extra row to rank 0 and one fewer to rank 1
            send[0], send[1] = 3, 1
        out = torch.empty(2 * world)
        dist.all_to_all_single(out, inp, output_split_sizes=[2] * world, input_split_sizes=send)
    if a.fault == "np_alloc" and hit:
        n_bins = 1 << 22  # histogram bins from a config meant for a token-id range
        hist = np.zeros((n_bins, n_bins), dtype=np.float32)
    if a.fault == "cstack_segv" and hit:
        sys.setrecursionlimit(10 ** 7)  # raised so the nested config parses
        node = None
        for _ in range(2_000_000):
            node = [node]
        say(rank, f"config cache {len(json.dumps(node))} bytes")  # C encoder recursion, no limit hit
    if a.fault == "cuda_guard" and hit:  # meant to be `if torch.cuda.is_available()`, guarded by rank instead
        torch.cuda.reset_peak_memory_stats()
    if a.fault == "gather_nondst":
        t = torch.full((2,), float(rank))
        lst = [torch.empty(2) for _ in range(world)] if (rank == 0 or hit) else None  # every rank of this node
        dist.gather(t, gather_list=lst, dst=0)
    if a.fault == "unicode_shard" and hit:
        path = os.path.join(tempfile.gettempdir(), f"fault10_shard{rank}.idx")
        with open(path, "wb") as f:
            f.write(b"\x80\x04\x95" + os.urandom(64))  # this rank's index was written as a pickle
        with open(path, encoding="utf-8") as f:
            entries = f.read().splitlines()
    if a.fault == "dcp_mismatch":
        import torch.distributed.checkpoint as dcp
        ckpt = os.path.join(tempfile.gettempdir(), f"fault10_dcp_{os.environ.get('MASTER_PORT')}")
        dcp.save({"head.w": torch.ones(4), "step": torch.tensor(3)}, checkpoint_id=ckpt)
        say(rank, "saved dcp checkpoint")
        sd = {"head.w": torch.empty(6 if hit else 4), "step": torch.tensor(0)}  # this rank rebuilt a wider head
        dcp.load(sd, checkpoint_id=ckpt)
        say(rank, "resumed from dcp checkpoint")

def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    setup_logging(rank)
    init = None
    if a.fault == "file_init":  # shared-filesystem rendezvous; this rank's job config names another file
        tag = "b" if rank == a.rank else "a"
        init = f"file://{tempfile.gettempdir()}/fault10_init_{os.environ.get('MASTER_PORT')}_{tag}"
    dist.init_process_group("gloo", init_method=init, timeout=TIMEOUT, rank=rank, world_size=world)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, a.steps + 1):
        if step == 3:
            fault_at_step3(rank, world)
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    entry = record(main) if a.fault == "record_exc" else main
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29900 + os.getpid() % 90)
        mp.spawn(entry, args=(a.spawn,), nprocs=a.spawn)
    else:
        entry()
