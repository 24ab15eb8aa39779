"""A fifth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault4.py)."""
import argparse, ctypes, datetime, os, resource, signal, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
a = p.parse_args()

CKPT_DIR = "/tmp/fault5_ckpt"


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    ws = world + 1 if (a.fault == "wrong_world" and rank == a.rank) else world
    if a.fault == "wrong_port" and rank == a.rank:
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)  # a stale config value
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15), rank=rank, world_size=ws)
    net = nn.Linear(8, 4)
    if a.fault in ("truncated_load", "missing_key"):
        path = os.path.join(CKPT_DIR, f"rank{rank}.pt")
        if rank == 0:
            os.makedirs(CKPT_DIR, exist_ok=True)
        dist.barrier()
        sd = net.state_dict()
        if a.fault == "missing_key" and rank == a.rank:
            sd = {k: v for k, v in sd.items() if k != "bias"}  # an older export without the bias
        torch.save(sd, path)
        if a.fault == "truncated_load" and rank == a.rank:
            data = open(path, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])  # a copy cut short
        net.load_state_dict(torch.load(path))
    if a.fault == "weights_only" and rank == a.rank:
        import argparse as _ap
        path = f"/tmp/fault5_ckpt_wo_rank{rank}.pt"
        torch.save({"model": net.state_dict(), "args": _ap.Namespace(lr=0.1)}, path)
        net.load_state_dict(torch.load(path)["model"])  # weights_only=True by default
    if a.fault == "init_twice" and rank == a.rank:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))  # a second setup helper
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, a.steps + 1):
        hit = rank == a.rank and step == 3
        if step == 3 and a.fault in ("dtype_mismatch", "size_mismatch"):
            t = torch.ones(1024)
            if rank == a.rank:
                t = torch.ones(1024, dtype=torch.float64) if a.fault == "dtype_mismatch" else torch.ones(1000)
            dist.all_reduce(t)
        if hit and a.fault == "send_outside":
            dist.send(torch.ones(4), dst=dist.get_world_size())
        if hit and a.fault == "early_return":
            print(f"rank {rank}: early stopping, patience exhausted", flush=True)
            return
        if hit and a.fault == "thread_exception":
            box = []
            def prefetch():
                shard = {"tokens": [1, 2, 3]}
                box.append(shard["input_ids"])
            th = threading.Thread(target=prefetch, name="prefetch", daemon=True)
            th.start(); th.join()
            while not box:  # waits for a batch the dead thread never delivers
                time.sleep(0.5)
        if hit and a.fault == "anomaly":
            with torch.autograd.detect_anomaly():
                x = torch.randn(16, 8)
                y = model(x)
                loss = (y.pow(2).mean() * 0.0).sqrt() * torch.tensor(-1.0).sqrt()
                opt.zero_grad(); loss.backward()
        if hit and a.fault == "sigint_self":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        if hit and a.fault == "segv":
            ctypes.string_at(0)
        if hit and a.fault == "rlimit_as":
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (4 << 30, hard))
            buf = bytearray(8 << 30)
        if hit and a.fault == "destroy_early":
            dist.destroy_process_group()  # an evaluation helper tears the group down
        if hit and a.fault == "sigalrm":
            signal.alarm(1)  # a watchdog left armed; SIGALRM's default action ends the process
            time.sleep(5)
        x = torch.randn(16, 8)
        if hit and a.fault == "inplace_grad":
            h = model(x).sigmoid()
            h.mul_(2)  # sigmoid's backward needs its output
            loss = h.sum()
        else:
            loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29800 + os.getpid() % 150)
        mp.spawn(main, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()
