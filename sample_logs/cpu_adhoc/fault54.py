"""A fifty-fourth hand-run batch: TORCH.COMPILE in distributed training. A tiny DDP loop on gloo whose model
(Linear(8,16)-ReLU-Linear(16,4)) is torch.compile'd (inductor on CPU unless --backend says otherwise) and then wrapped
in DDP; SGD, batch 16, --steps steps (default 5), 0.1 s per step, PG timeout --pg-timeout (default 15 s). Every rank
prints `[rank R] world W, torch V, compile backend B, fullgraph F`, `[rank R] step S/N loss L` and rank 0 prints
`[rank 0] first step (compile) took T s`; `[rank R] training finished` at the end.

ONE fault per run on rank --rank (faults at step --at, default 3, unless said):
  unsupported   rank N's model carries a range check (`if h.abs().max() > 100: h = h.clamp(...)`), a data-dependent
                branch that dynamo cannot trace with fullgraph=True (raised at the first forward)
  backend       every rank compiles through a custom backend `fuse_tiny` (inductor's compile_fx underneath); on rank N
                it raises RuntimeError (wrapped by dynamo as BackendCompilerFailed) at the first compile
  inductor      rank N's inductor is pointed at a C++ compiler that does not exist (cpp.cxx), its FX graph cache off:
                the first compile fails on that rank
  slowcompile   custom backend `fuse_tiny` on every rank; on rank N it sleeps --sleep s (default 30) before compiling,
                so the other ranks time out in DDP's first gradient all-reduce
  recompile     rank N's batch shrinks by one row every step with automatic dynamic shapes off; with
                --error-on-recompile dynamo raises at the first recompile; with --fail-on-limit the recompile limit
                (--limit, default 2) raises when hit; otherwise it is only warned about (falls back to eager)
  shape         rank N's step-N batch has 9 features (a shape mismatch inside the compiled forward)
  nan           rank N's step-N batch holds a NaN feature; the script's finite-loss check raises FloatingPointError
  exc           rank N's step-N sample has label 'n/a' (ValueError from the script's data code, outside compile)
  osexit        rank N calls os._exit(3) at step N
  segv          rank N dereferences NULL (ctypes.string_at(0)) at step N
  ok            no fault
Herrings: --item makes every rank's forward call `.item()` for a debug statistic (a graph break with a dynamo
UserWarning; not allowed with fullgraph), --vary makes rank --rank's batch size vary so that it recompiles (warned
about once the limit is hit), TORCH_LOGS=recompiles,graph_breaks / inductor in the environment.
"""
import argparse, ctypes, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="ok")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--at", type=int, default=3)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--backend", default="inductor")
p.add_argument("--fullgraph", action="store_true")
p.add_argument("--sleep", type=float, default=30.0)
p.add_argument("--limit", type=int, default=2)
p.add_argument("--error-on-recompile", action="store_true")
p.add_argument("--fail-on-limit", action="store_true")
p.add_argument("--item", action="store_true")
p.add_argument("--vary", action="store_true")
a = p.parse_args()

import torch._dynamo
import torch._inductor.config as inductor_config


class TinyNet(nn.Module):
    def __init__(self, range_check: bool, item_stat: bool):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.range_check = range_check
        self.item_stat = item_stat
        self.last_max = 0.0

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.range_check:
            if h.abs().max() > 100:  # data-dependent branch
                h = h.clamp(-100, 100)
        if self.item_stat:
            self.last_max = h.abs().max().item()  # debug statistic: a graph break
        return self.fc2(h)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank == a.rank
    f = a.fault if me else "ok"

    if a.fault == "recompile" or a.vary:
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = a.limit
        if me and a.error_on_recompile:
            torch._dynamo.config.error_on_recompile = True
        if me and a.fail_on_limit:
            torch._dynamo.config.fail_on_recompile_limit_hit = True
    if f == "inductor":
        inductor_config.fx_graph_cache = False
        inductor_config.cpp.cxx = (None, "/opt/toolchain/gcc-12/bin/g++")

    backend = a.backend
    if a.fault in ("backend", "slowcompile"):
        from torch._inductor.compile_fx import compile_fx

        def fuse_tiny(gm, example_inputs):
            if f == "backend":
                raise RuntimeError(
                    f"fuse_tiny: no fused kernel for pattern addmm+relu+addmm with {len(example_inputs)} inputs "
                    "(kernel registry has 0 entries for this CPU)")
            if f == "slowcompile":
                time.sleep(a.sleep)
            return compile_fx(gm, example_inputs)

        backend = fuse_tiny
    bname = backend if isinstance(backend, str) else backend.__name__
    print(f"[rank {rank}] world {world}, torch {torch.__version__}, compile backend {bname}, "
          f"fullgraph {a.fullgraph}", flush=True)

    torch.manual_seed(0)
    net = TinyNet(range_check=(f == "unsupported"), item_stat=a.item)
    cnet = torch.compile(net, backend=backend, fullgraph=a.fullgraph)
    model = DDP(cnet)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    w_true = torch.randn(8, 4, generator=g)

    for step in range(1, a.steps + 1):
        t0 = time.time()
        bs = 16
        if me and (a.fault == "recompile" or a.vary):
            bs = 16 - step + 1
        x = torch.randn(bs, 8, generator=g)
        y = x @ w_true
        if step == a.at:
            if f == "shape":
                x = torch.randn(bs, 9, generator=g)
            elif f == "nan":
                x[0, 3] = float("nan")
            elif f == "exc":
                raw = ["0.5", "n/a", "1.0"]
                y = y + torch.tensor([float(v) for v in raw]).mean()
            elif f == "osexit":
                os._exit(3)
            elif f == "segv":
                ctypes.string_at(0)
        out = model(x)
        loss = F.mse_loss(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 and rank == 0:
            print(f"[rank 0] first step (compile) took {time.time() - t0:.1f} s", flush=True)
        print(f"[rank {rank}] step {step}/{a.steps} loss {loss.item():.4f}", flush=True)
        time.sleep(0.1)
    dist.barrier()
    print(f"[rank {rank}] training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
