"""A thirty-seventh hand-run batch: RANK-0 I/O and the barriers around it. A small DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, 6 steps, PG timeout 15 s unless --pg-timeout) whose I/O around rank 0 has
ONE fault selected by --fault. --rank N: the reader that gets there first (the others read 5 s later, after
rank 0 is done), or the writer at fault. --fmt picks the progress-line format.

Faults:
  nobarrier_json   rank 0 tokenises for 3 s, then writes cache.json; nobody waits; rank N reads it at once:
                   FileNotFoundError
  nobarrier_pt     same with a torch.save'd tensor dict read by torch.load: FileNotFoundError from torch.load
  trunc_pt         rank 0 writes the torch.save'd cache in two halves 3 s apart; rank N torch.loads after 1 s:
                   PytorchStreamReader failed finding central directory
  trunc_json       same with JSON: json.decoder.JSONDecodeError
  resume_nobarrier at step 3 rank 0 saves ckpt.pt (slowly, 3 s) with no barrier; the others torch.load it at once
                   (rank N first): FileNotFoundError from torch.load
  slowsave         at step 3 rank 0 saves (sleep 25 s inside the save) while the others wait in dist.barrier():
                   their gloo timeouts (--quiet: rank 0 prints no 'saving' line)
  samepath         every rank saves model.state_dict() to the same ckpt.pt unguarded (written in two halves 3 s
                   apart); rank N writes at once and loads it back while the others rewrite it: corrupt read
  makedirs         rank 0 creates the run dir; rank N (the eval-writer) calls os.makedirs on it too without
                   exist_ok: FileExistsError
  notdir           rank 0 writes metrics to out/metrics.json where out is a file: NotADirectoryError; the others
                   wait in the barrier after it
  rank0barrier     the barrier is inside 'if rank == 0:', so the others run ahead and read the cache before it is
                   written (rank N first): FileNotFoundError
  nodelocal        cache path is node-local (/tmp/fault37/node{GROUP_RANK}); global rank 0 writes, barrier, then
                   everyone reads its node's copy: node 1's ranks find nothing (rank N first)
  ok_barrier       control: rank 0 writes, barrier, everyone reads
  ok_slow          control: rank 0's write takes 8 s, PG timeout 30 s
  ok_retry         control: no barrier but readers retry with 'waiting for cache ...' until the file is complete
"""
import argparse, datetime, io, json, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--fmt", default="a")
p.add_argument("--quiet", action="store_true")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--dir", default="/tmp/fault37/work")
a = p.parse_args()
F_ = a.fault


def say(rank, msg):
    if a.fmt == "a":
        print(f"[rank {rank}] {msg}", flush=True)
    elif a.fmt == "b":
        print(f"{time.strftime('%H:%M:%S')} | r{rank} | {msg}", flush=True)
    elif a.fmt == "c":
        print(f"rank={rank} :: {msg}", flush=True)
    else:
        print(f"(worker {rank}) {msg}", flush=True)


def step_line(rank, s, loss):
    if a.fmt == "a":
        say(rank, f"step {s} loss {loss:.4f}")
    elif a.fmt == "b":
        say(rank, f"step {s}/{a.steps} loss={loss:.4f}")
    elif a.fmt == "c":
        say(rank, f"it {s} | loss {loss:.4f}")
    else:
        say(rank, f"epoch 0 batch {s} loss {loss:.4f}")


def slow_write(path, data: bytes, pause: float):
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        time.sleep(pause)
        f.write(data[len(data) // 2:])


def cache_bytes(kind):
    g = torch.Generator().manual_seed(0)
    d = {"x": torch.randn(64, 8, generator=g), "y": torch.randn(64, 4, generator=g)}
    if kind == "json":
        return json.dumps({k: v.tolist() for k, v in d.items()}).encode()
    b = io.BytesIO()
    torch.save(d, b)
    return b.getvalue()


def read_cache(path, kind):
    if kind == "json":
        with open(path) as f:
            d = json.load(f)
        return {k: torch.tensor(v) for k, v in d.items()}
    return torch.load(path)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(a.dir, exist_ok=True)
    kind = "json" if F_ in ("nobarrier_json", "trunc_json", "ok_retry") else "pt"
    cache = os.path.join(a.dir, "cache." + ("json" if kind == "json" else "pt"))
    if F_ == "nodelocal":
        node = os.environ.get("GROUP_RANK", "0")
        cache = os.path.join(a.dir, f"node{node}", "cache.pt")
    dist.barrier()  # everyone is up; stale files from earlier runs are gone (launcher script clears them)
    say(rank, f"world {world}, preparing data cache {cache}")
    data = cache_bytes(kind)

    # ---- the data-cache stage ----
    if F_ in ("nobarrier_json", "nobarrier_pt", "trunc_pt", "trunc_json", "rank0barrier", "ok_barrier", "ok_slow",
              "ok_retry", "nodelocal", "resume_nobarrier", "slowsave", "samepath", "makedirs", "notdir"):
        if rank == 0:
            if F_ in ("nobarrier_json", "nobarrier_pt", "rank0barrier"):
                say(rank, "tokenising dataset ...")
                time.sleep(3)
                with open(cache, "wb") as f:
                    f.write(data)
            elif F_ in ("trunc_pt", "trunc_json"):
                say(rank, "writing cache ...")
                slow_write(cache, data, 3)
            elif F_ == "ok_slow":
                say(rank, "writing cache (slow shared storage) ...")
                time.sleep(8)
                with open(cache, "wb") as f:
                    f.write(data)
            elif F_ == "ok_retry":
                say(rank, "tokenising dataset ...")
                time.sleep(2.5)
                with open(cache + ".tmp", "wb") as f:
                    f.write(data)
                os.replace(cache + ".tmp", cache)
            else:
                if F_ == "nodelocal":
                    os.makedirs(os.path.dirname(cache), exist_ok=True)
                with open(cache, "wb") as f:
                    f.write(data)
            say(rank, f"cache written ({len(data)} bytes)")
            if F_ == "rank0barrier":
                dist.barrier()
        if F_ in ("ok_barrier", "ok_slow", "nodelocal", "resume_nobarrier", "slowsave", "samepath", "makedirs",
                  "notdir"):
            dist.barrier()
        if rank != 0:
            if F_ in ("nobarrier_json", "nobarrier_pt", "rank0barrier", "trunc_pt", "trunc_json", "nodelocal"):
                if rank != a.rank:
                    time.sleep(5)
                elif F_.startswith("trunc"):
                    time.sleep(1)
            if F_ == "ok_retry":
                tries = 0
                while not os.path.exists(cache):
                    tries += 1
                    say(rank, f"waiting for cache {cache} ({tries}) ...")
                    time.sleep(1)
        ds = read_cache(cache, kind)
        say(rank, f"cache loaded: {ds['x'].shape[0]} samples")

    if F_ == "makedirs":
        run_dir = os.path.join(a.dir, "run1")
        if rank == 0:
            os.makedirs(run_dir)
            say(rank, f"created {run_dir}")
        dist.barrier()
        if rank == a.rank:
            say(rank, f"eval writer: creating {run_dir}")
            os.makedirs(run_dir)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ckpt = os.path.join(a.dir, "ckpt.pt")
    for s in range(1, a.steps + 1):
        i = ((s * world + rank) * 8) % 64
        x, y = ds["x"][i:i + 8], ds["y"][i:i + 8]
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_line(rank, s, loss.item())
        time.sleep(0.05)
        if s == 3 and F_ == "resume_nobarrier":
            if rank == 0:
                say(rank, f"saving checkpoint {ckpt}")
                b = io.BytesIO()
                torch.save(model.state_dict(), b)
                time.sleep(3)
                with open(ckpt, "wb") as f:
                    f.write(b.getvalue())
            else:
                if rank != a.rank:
                    time.sleep(5)
                say(rank, f"resuming EMA copy from {ckpt}")
                sd = torch.load(ckpt)
                model.load_state_dict(sd)
        if s == 3 and F_ == "slowsave":
            if rank == 0:
                if not a.quiet:
                    say(rank, f"saving checkpoint {ckpt} ...")
                torch.save(model.state_dict(), ckpt)
                time.sleep(25)  # stands in for a slow shared-storage write
            dist.barrier()
            say(rank, "checkpoint barrier passed")
        if s == 3 and F_ == "samepath":
            b = io.BytesIO()
            torch.save(model.state_dict(), b)
            if rank == a.rank:
                with open(ckpt, "wb") as f:
                    f.write(b.getvalue())
                say(rank, f"saved {ckpt}; reloading to verify")
                time.sleep(1)
                model.load_state_dict(torch.load(ckpt))
            else:
                time.sleep(0.5)
                say(rank, f"saving {ckpt}")
                slow_write(ckpt, b.getvalue(), 3)
        if s == 4 and F_ == "notdir":
            if rank == 0:
                say(rank, "writing metrics")
                with open(os.path.join(a.dir, "out", "metrics.json"), "w") as f:
                    json.dump({"step": s, "loss": loss.item()}, f)
            dist.barrier()
    say(rank, "training finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
