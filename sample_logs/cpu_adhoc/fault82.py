"""An eighty-second hand-run batch: NATIVE EXTENSIONS AND CUSTOM OPS. A tiny DDP loop on gloo whose hot path is a
C++ extension JIT-built with torch.utils.cpp_extension.load_inline (`fused82`: gather_rows, a feature-store lookup
with no upper bounds check; prefetch_check, a worker thread that rejects negative row ids; scaled_act, a leaky
activation; row_stats, per-group row norms for the log line). The extension cache is --ext-dir (shared, prebuilt);
the ranks of --rank (a comma list, -1 = all, none) stand for nodes whose own local cache is --node-cache where the
fault needs one. Model: feature table 1024x8 (fixed seed) -> gather_rows -> Linear(8,16) -> BiasAct (an
autograd.Function: bias + scaled_act, backward in Python) -> Linear(16,4), cross entropy, SGD, batch 16, --steps
steps (6), the bad batch at step --at (3). Prints `rank R world W fault F ext DIR`, `rank R step S loss L rms X`,
`rank R done`. PG timeout --pg-timeout (12 s). No @record.

Faults:
  none      control (exit 0)
  prebuild  no training: build the extension into --ext-dir and exit (used to fill caches, and killed mid-build
            to leave a stale `lock` behind)
  cerr      rank N's node has a half-edited copy of the C++ source (an undeclared `neg_slope`): g++ fails,
            RuntimeError: Error building extension 'fused82'
  coldcache rank N's node cache is empty, so it builds; whether that works depends on the node's toolchain
            (run with CXX naming a compiler the node lacks, or a PATH without ninja)
  stale     rank N's node cache holds fused82.so built by an older, pre-cxx11-ABI torch (same source, so ninja
            sees it up to date): ImportError: undefined symbol
  lock      rank N's node cache (or, with --rank -1, the shared cache) holds the `lock` of a build that was
            killed: FileBaton waits forever, silently
  dtype     rank N's feature table was saved as float64: TORCH_CHECK in gather_rows
  fortran   rank N's feature table comes from a Fortran-ordered array: TORCH_CHECK(is_contiguous) in gather_rows
  segv      rank N's index file has a corrupt row id (2**40) at step --at: gather_rows reads far outside the
            table: SIGSEGV
  negid     rank N's index at step --at holds -1 (padding): prefetch_check throws inside its std::thread:
            terminate called ..., SIGABRT
  groups    rank N's config asks row_stats for 3 groups of 16 features: assert() in the C++: SIGABRT
  ctypes    rank N's loader stages its batch in a libc.malloc buffer via ctypes without setting restype (the
            pointer is truncated to a C int): memmove segfaults
  ngrads    rank N's batch at step --at carries a padding mask, BiasAct.forward gets 3 inputs, its backward
            returns 2 gradients: RuntimeError ... incorrect number of gradients
  gshape    BiasAct.backward sums the bias gradient over dim 1 (only right when batch == 16 == hidden); rank N's
            last shard batch at step --at has 12 rows: RuntimeError ... invalid gradient at index 1
  schema    a torch.library custom op f82::clip_rows declared "(Tensor x, int max_norm) -> Tensor" while the
            config's max_norm is 2.5 (every rank): RuntimeError from the schema check
  cudaonly  f82::clip_rows implemented for the CUDA dispatch key only (copied from the GPU code path), called on
            CPU tensors (every rank): NotImplementedError
"""
import argparse, ctypes, datetime, os, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", default="1")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ext-dir", default="/tmp/fault82_work/ext_shared")
p.add_argument("--node-cache", default="")
a = p.parse_args()
BATCH, SCALE = 16, 1.0

SRC = r"""
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

static inline float leaky(float v, float s) { return v > 0 ? v * s : 0.01f * v * s; }

#include <torch/extension.h>

torch::Tensor gather_rows(torch::Tensor table, torch::Tensor idx) {
  TORCH_CHECK(table.scalar_type() == at::kFloat, "gather_rows: feature table must be float32, got ", table.scalar_type());
  TORCH_CHECK(table.is_contiguous(), "gather_rows: feature table must be contiguous, got strides ", table.strides());
  const int64_t n = idx.size(0), d = table.size(1);
  auto out = torch::empty({n, d}, table.options());
  const float* t = table.data_ptr<float>();
  const int64_t* ix = idx.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) std::memcpy(o + i * d, t + ix[i] * d, d * sizeof(float));  // ids trusted
  return out;
}

void prefetch_check(torch::Tensor idx) {
  const int64_t* ix = idx.data_ptr<int64_t>();
  const int64_t n = idx.size(0);
  std::thread worker([ix, n]() {
    for (int64_t i = 0; i < n; ++i)
      if (ix[i] < 0) throw std::invalid_argument("prefetch: negative row id " + std::to_string(ix[i]) + " at " + std::to_string(i));
  });
  worker.join();
}

torch::Tensor scaled_act(torch::Tensor x, double scale) {
  TORCH_CHECK(x.is_contiguous(), "scaled_act: input must be contiguous");
  auto out = torch::empty_like(x);
  const float* p = x.data_ptr<float>();
  float* q = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  for (int64_t i = 0; i < x.numel(); ++i) q[i] = leaky(p[i], s);
  return out;
}

torch::Tensor row_stats(torch::Tensor x, int64_t groups) {
  const int64_t n = x.size(0), d = x.size(1);
  assert(groups > 0 && d % groups == 0);
  const int64_t g = d / groups;
  auto out = torch::zeros({n, groups}, x.options());
  auto xc = x.contiguous();
  const float* p = xc.data_ptr<float>();
  float* q = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < groups; ++k) {
      float acc = 0.f;
      for (int64_t j = 0; j < g; ++j) acc += p[i * d + k * g + j] * p[i * d + k * g + j];
      q[i * groups + k] = std::sqrt(acc / g);
    }
  return out;
}
"""
FUNCS = ["gather_rows", "prefetch_check", "scaled_act", "row_stats"]


def load_ext(ext_dir: str, src: str = SRC):
    os.makedirs(ext_dir, exist_ok=True)
    os.environ["TORCH_EXTENSIONS_DIR"] = ext_dir
    return load_inline(name="fused82", cpp_sources=SRC if src is None else src, functions=FUNCS,
                       extra_cflags=["-O2", "-Wfatal-errors"], verbose=False,
                       no_implicit_headers=True)


def main() -> None:
    if a.fault == "prebuild":
        t0 = time.time()
        load_ext(a.ext_dir)
        print(f"built fused82 into {a.ext_dir} in {time.time() - t0:.1f} s", flush=True)
        return
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    ranks = set(range(world)) if a.rank == "-1" else {int(r) for r in a.rank.split(",") if r != "none"}
    me = rank in ranks
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    ext_dir = a.ext_dir
    if me and a.fault in ("cerr", "coldcache", "stale", "lock") and a.node_cache:
        ext_dir = a.node_cache  # this rank's node has its own local extension cache
    print(f"rank {rank} world {world} fault {a.fault} ext {ext_dir}", flush=True)
    src = SRC
    if me and a.fault == "cerr":  # this node's checkout has a half-finished edit of the kernel
        src = SRC.replace("v * s : 0.01f * v * s", "v * s : neg_slope * v * s")
    ext = load_ext(ext_dir, src)

    class BiasAct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, bias, mask=None):
            z = h + bias
            if mask is not None:
                z = z * mask
            ctx.save_for_backward(z)
            return ext.scaled_act(z.contiguous(), SCALE)

        @staticmethod
        def backward(ctx, g):
            (z,) = ctx.saved_tensors
            gz = g * torch.where(z > 0, SCALE, 0.01 * SCALE)
            if a.fault == "ngrads":
                return gz, gz.sum(0)  # written before the mask argument was added
            return gz, gz.sum(1 if a.fault == "gshape" else 0), None

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)
            self.b = nn.Parameter(torch.zeros(16))

        def forward(self, x, mask=None):
            return self.l2(BiasAct.apply(self.l1(x), self.b, mask) if mask is not None
                           else BiasAct.apply(self.l1(x), self.b))

    clip = None
    if a.fault in ("schema", "cudaonly"):
        lib = torch.library.Library("f82", "DEF")
        lib.define("clip_rows(Tensor x, int max_norm) -> Tensor" if a.fault == "schema"
                   else "clip_rows(Tensor x, float max_norm) -> Tensor")

        def clip_rows_impl(x, max_norm):
            n = x.norm(dim=1, keepdim=True).clamp_min(1e-6)
            return x * (max_norm / n).clamp(max=1.0)

        lib.impl("clip_rows", clip_rows_impl, "CUDA" if a.fault == "cudaonly" else "CompositeExplicitAutograd")
        clip = torch.ops.f82.clip_rows
    max_norm = 2.5

    rng = np.random.default_rng(0)
    arr = rng.standard_normal((1024, 8))
    if me and a.fault == "fortran":
        table = torch.from_numpy(np.asfortranarray(arr.astype(np.float32)))
    elif me and a.fault == "dtype":
        table = torch.from_numpy(arr)  # this rank's features.npy was written as float64
    else:
        table = torch.from_numpy(arr.astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 4, 1024))
    groups = 3 if (me and a.fault == "groups") else 4
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    libc = ctypes.CDLL("libc.so.6")
    for step in range(1, a.steps + 1):
        g = torch.Generator().manual_seed(1000 * rank + step)
        n = 12 if (me and a.fault == "gshape" and step == a.at) else BATCH  # last batch of this rank's shard
        idx = torch.randint(0, 1024, (n,), generator=g)
        if me and step == a.at and a.fault == "segv":
            idx[5] = 1 << 40  # a corrupt entry of the index file
        if me and step == a.at and a.fault == "negid":
            idx[-4:] = -1  # the index file pads short shards with -1
        ext.prefetch_check(idx)
        x = ext.gather_rows(table, idx)
        if me and a.fault == "ctypes" and step >= a.at:
            nbytes = x.numel() * x.element_size()
            buf = libc.malloc(nbytes)  # restype defaults to c_int: the pointer is cut to 32 bits
            ctypes.memmove(buf, x.data_ptr(), nbytes)
            x = torch.frombuffer((ctypes.c_char * nbytes).from_address(buf), dtype=torch.float32).view(n, 8)
        if clip is not None:
            x = clip(x, max_norm)
        y = labels[idx]
        mask = None
        if me and a.fault == "ngrads" and step == a.at:
            mask = (torch.arange(16) < 14).float()  # the padded batch carries a feature mask
        opt.zero_grad()
        loss = F.cross_entropy(model(x, mask), y)
        loss.backward()
        opt.step()
        rms = ext.row_stats(x.detach().repeat(1, 2), groups).mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} rms {rms:.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
