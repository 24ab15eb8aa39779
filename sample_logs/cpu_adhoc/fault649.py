"""fault649.py - kinkajou nectar routes: a tiny gloo/CPU training job with planted faults.

Each rank reads its shard of synthetic "nectar route" visits (route ids) from /tmp/fault649_work,
maps every route id through a JSON lookup table (route -> flower features, nectar yield), trains a
small linear model with hand-written all_reduce of gradients, logs every step through `logging`
(with timestamps), prints a progress line, a stats table every 5 steps, and rank 0 exports at the end.

--prepare writes the shards, the lookup table and the start checkpoint.
--fault NAME --rank N plants one fault on rank N:
  none           control run
  fh_stall       faulthandler.dump_traceback_later armed on every rank; rank N sleeps at step 20
  segv           faulthandler.enable() on every rank; rank N reads address 0 at step 30 (SIGSEGV)
  abort          faulthandler.enable() on every rank; rank N calls os.abort() at step 28
  noisy_exc      rank 0 logs a handled exception (logger.exception) every 3 steps; rank N raises RuntimeError at step 34
  keyerror       rank N meets a route id missing from the lookup table at step 40 (KeyError)
  stats_value    stats table has eval_error / failed_batches columns; rank N raises ValueError at step 32
  memgrow        rank N keeps every batch in a list under an RLIMIT_AS cap -> MemoryError
  nan            rank N's loss goes NaN at step 33; the script's finiteness check raises FloatingPointError
  loader_worker  rank N's DataLoader worker warns every step and is SIGKILLed at step ~25
  export_fail    all ranks train; rank 0's export after a long "saving" phase goes to /dev/full
  sigkill        rank N SIGKILLs itself at step 31 (like the OOM killer)
  allrank_bug    every rank hits the same IndexError at step 30
  restart_bug    under torchrun --max-restarts 1: attempt 0 fails late on rank N (step 30), attempt 1 fails early (step 2)
  missing_shard  rank N's shard file is missing (FileNotFoundError at start)
--warn-every-step adds a Python warning every step on every rank.

Runs of batch 649 (one line per log; filled after the runs):
  - kinkajou_fh_stall_np6_r3_bashloop: 6 faulthandler stack dumps, 5 gloo 12 s timeouts, rank 3 Connection closed; exit 1
  - kinkajou_segv_np5_r4_ranklabel: rank 4 'Fatal Python error: Segmentation fault' at step 30, gloo cascade; exit 0 (sed pipe)
  - kinkajou_loader_worker_np4_r1_legacy: rank 1 'DataLoader worker ... killed by signal: Killed.' after step 23; exit 1
  - kinkajou_noisy_exc_np6_r5_srunlabel: 11 handled ERROR tracebacks on rank 0, rank 5 RuntimeError at step 34; exit 124 (outer timeout)
  - kinkajou_keyerror_np5_r2_mpitag: rank 2 KeyError 'route69' at step 41 of 50, gloo cascade; exit 0 (sed pipe)
  - kinkajou_sigkill_np6_r2_pdsh2: rank 2 exitcode -9 (SIGKILL) after step 30, two agents' ChildFailedError; exit 0 (sed pipe)
  - kinkajou_nan_np5_r4_logfmt: rank 4 FloatingPointError loss is nan at step 33; exit 1
  - kinkajou_memgrow_np3_r1_spawn: rank 1 MemoryError at step 12 under RLIMIT_AS, ProcessRaisedException; exit 1
  - kinkajou_export_fail_np3_r0_tee: all ranks finish, rank 0 export to /dev/full RuntimeError iostream error; exit 1
  - kinkajou_stats_value_np4_r0_files: rank 0 ValueError at step 32 under eval_error/failed_batches tables; exit 1
  - kinkajou_allrank_bug_np8_rall_bashloop: dropped, 8 ranks never got past start-up in 100 s under load (exit 124)
  - kinkajou_none_np5_rnone_ranklabel: control, 40 steps on 5 ranks, export written; exit 0
  - kinkajou_restart_bug_np4_r3_tee: attempt 0 rank 3 RuntimeError at step 30, attempt 1 gloo connectFullMesh refused; exit 1
  -
  -
  -
  -
  -
  -
  -
  -
  -
"""
import argparse, ctypes, datetime, faulthandler, json, logging, os, resource, signal, sys, time, warnings

WORK = "/tmp/fault649_work"
ROUTES = 64


def prepare(world):
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(649)
    table = {f"route{i}": {"feat": [float(x) for x in torch.rand(4, generator=g)], "nectar": float(i % 7) / 7}
             for i in range(ROUTES)}
    with open(os.path.join(WORK, "lookup.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        ids = torch.randint(0, ROUTES, (400,), generator=g)
        torch.save({"routes": ids}, os.path.join(WORK, f"shard_{r}.pt"))
    model = torch.nn.Linear(4, 1)
    torch.save(model.state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {world} shards, lookup table and start checkpoint in {WORK}")


class RouteDS:
    def __init__(self, ids, table, fault, planted):
        self.ids, self.table, self.fault, self.planted = ids, table, fault, planted

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        import torch
        if self.fault == "loader_worker" and self.planted:
            warnings.warn(f"nectar route cache miss for sample {i}: re-reading lookup table", RuntimeWarning)
            if i >= 25 * 8:
                os.kill(os.getpid(), signal.SIGKILL)
        e = self.table[f"route{int(self.ids[i])}"]
        return torch.tensor(e["feat"]), torch.tensor([e["nectar"]])


def collate(batch):
    import torch
    return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])


def main(local=None, spawn_world=None, args=None):
    import torch
    import torch.distributed as dist
    if local is not None:
        os.environ.update(RANK=str(local), LOCAL_RANK=str(local), WORLD_SIZE=str(spawn_world))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fault = args.fault
    planted = (rank == args.rank) or fault == "allrank_bug"
    fmt = ("%(asctime)s [rank %(rank)s] %(levelname)s %(message)s" if args.logfmt_rank
           else "%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout)
    old = logging.getLogRecordFactory()

    def factory(*a, **k):
        rec = old(*a, **k)
        rec.rank = rank
        return rec
    logging.setLogRecordFactory(factory)
    log = logging.getLogger("kinkajou")
    warnings.simplefilter("always")
    if fault in ("segv", "abort"):
        faulthandler.enable()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    log.info("process group up: rank %d of %d, pg timeout %ss", rank, world, args.pg_timeout)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    table = json.load(open(os.path.join(WORK, "lookup.json")))
    shard = os.path.join(WORK, f"shard_{rank}.pt")
    if fault == "missing_shard" and planted:
        shard = os.path.join(WORK, f"shard_{rank}_routes.pt")
    ids = torch.load(shard)["routes"]
    if fault == "keyerror" and planted:
        ids[40 * 8 + 3] = ROUTES + 5
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = RouteDS(ids, table, fault, planted)
    nw = 1 if (fault == "loader_worker" and planted) else 0
    loader = iter(torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate, num_workers=nw))
    keep = []
    if fault == "memgrow" and planted:
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 400 * 2**20, resource.RLIM_INFINITY))
        log.info("memory cap set: %d MiB address space", (vm + 400 * 2**20) // 2**20)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        if fault == "fh_stall":
            faulthandler.dump_traceback_later(5, exit=False)
        x, y = next(loader)
        if fault == "keyerror" and False:
            pass
        if fault == "memgrow" and planted:
            keep.append(bytearray(24 * 2**20))
            keep.append(x.clone())
        if fault == "fh_stall" and planted and step == 20:
            log.info("waiting for nectar route refresh")
            time.sleep(40)
        if fault == "segv" and planted and step == 30:
            ctypes.string_at(0)
        if fault == "abort" and planted and step == 28:
            os.abort()
        if fault == "sigkill" and planted and step == 31:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "noisy_exc" and rank == 0 and step % 3 == 0:
            try:
                table[f"route_alias{step}"]["nectar"]
            except KeyError:
                log.exception("ERROR: alias lookup failed for step %d, using default nectar", step)
        if fault == "noisy_exc" and planted and step == 34:
            raise RuntimeError(f"route planner lost its flower graph at step {step}")
        if fault == "stats_value" and planted and step == 32:
            raise ValueError(f"nectar yield out of range on route batch {step}: -3.5")
        if fault == "allrank_bug" and step == 30:
            order = list(range(8))
            x = x[[order[i + 1] for i in range(8)]]
        if fault == "restart_bug" and planted and step == (30 if attempt == 0 else 2):
            raise RuntimeError(f"flower index out of sync (attempt {attempt}, step {step})")
        if args.warn_every_step:
            warnings.warn(f"kinkajou route sampler: nectar map older than {step} steps", UserWarning)
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        if fault == "nan" and planted and step == 33:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        nectar = float(out.mean())
        log.info("rank %d step %d loss %.4f nectar_ml %.4f", rank, step, loss.item(), nectar)
        print(f"rank {rank} step {step} loss {loss.item():.4f} nectar_ml {nectar:.4f}", flush=True)
        print(f"[progress] rank {rank} {step}/{args.steps} {'#' * (20 * step // args.steps):<20} "
              f"{time.time() - t0:.1f}s", flush=True)
        if step % 5 == 0:
            if fault == "stats_value":
                print(f"| rank | step | routes_seen | eval_error | failed_batches | nectar_ml |\n"
                      f"| {rank} | {step} | {step * 8} | {0.01 * step:.3f} | 0 | {nectar:.4f} |", flush=True)
            else:
                print(f"| rank | step | routes_seen | mean_loss | nectar_ml |\n"
                      f"| {rank} | {step} | {step * 8} | {loss.item():.4f} | {nectar:.4f} |", flush=True)
        if fault == "fh_stall":
            faulthandler.cancel_dump_traceback_later()
        time.sleep(0.05)
    dist.barrier()
    if rank == 0:
        dest = os.path.join(WORK, "export.pt")
        if fault == "export_fail":
            for i in range(1, 9):
                log.info("saving: packing route table part %d/8", i)
                time.sleep(0.3)
            dest = "/dev/full"
        torch.save({"model": model.state_dict(), "table": table}, dest)
        log.info("export written to %s", dest)
    dist.destroy_process_group()
    log.info("rank %d done", rank)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--logfmt-rank", action="store_true")
    p.add_argument("--warn-every-step", action="store_true")
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare(a.prepare)
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(main, args=(a.spawn, a), nprocs=a.spawn)
    else:
        main(args=a)
