"""fault636.py - batch 636, theme "gerenuk upright browsing".

A tiny CPU-only gloo training job: a gerenuk browses leaves while standing upright; a two-layer
MLP predicts how much foliage each browse bout takes from 8 posture features.  `--prepare` writes
per-rank shards (/tmp/fault636_work/shard_R.pt), a JSON lookup table (browse id -> reach height,
every batch goes through it) and a start checkpoint.  Each of 6 steps prints
`rank R step S loss L browse_reach M`; gradients are averaged with hand-written all_reduce (the
`nosync` fault uses DDP with no_sync()); rank 0 saves an export at the end.

Faults (--fault NAME --rank N; planted at step 2 unless said otherwise):
  none          control run
  inplace       rank N: in-place add_ on the tanh output autograd saved
  backward2     rank N: loss.backward() called twice on the same graph
  nograd        rank N: loss.detach() left in before backward
  dtype64       rank N: float64 input to the first Linear (matmul dtype mismatch)
  longtarget    rank N: Long targets to mse_loss (fails in backward)
  shape         rank N: target one element longer than the prediction (warning, then error)
  paramgroup    rank N: optimizer.add_param_group with a layer already in the optimizer
  gradscaler    rank N: bf16 autocast + GradScaler, loss turned inf; skipped steps; own check raises
  anomaly       rank N: set_detect_anomaly(True) on all ranks; sqrt of a negative on rank N
  clip          rank N: inf loss, clip_grad_norm_(error_if_nonfinite=True) raises
  compile       all ranks torch.compile the forward; rank N feeds it 7 features instead of 8
  nosync        DDP + no_sync() accumulation; rank N runs one extra synced micro-batch at step 2
  wrongview     every rank: x.view(-1, 5) on a batch of 64 values
  sigkill       rank N: SIGKILL to itself mid-step
  segv          rank N: ctypes.string_at(0)
  keyerror      rank N: browse id missing from the JSON lookup table
  noshard       rank N: opens a shard file that does not exist (start-up)

Runs (one line per log, filled in after the runs):
  - gerenuk_none_np8_rnone_plain: 6 steps on all ranks, export saved, exit 0
  - gerenuk_keyerror_np8_r7_loglevel: rank 7 KeyError 'b_upright_999'; others Connection closed by peer
  - gerenuk_clip_np6_r5_prefix: rank 5 clip_grad_norm_ non-finite RuntimeError; others Connection closed
  - gerenuk_nograd_np6_r0_tee_trainer: rank 0 'element 0 of tensors does not require grad'
  - gerenuk_inplace_np5_r2_plain: rank 2 'modified by an inplace operation' (output 0 of Tanh)
  - gerenuk_shape_np5_r4_pymodule: rank 4 target-size warning, then size 8 vs 9 RuntimeError
  - gerenuk_anomaly_np5_r2_detail: rank 2 MseLossBackward0 returned nan; rank 0 monitoredBarrier
  - gerenuk_nosync_np5_r3_wrapper: rank 2 aborts, gloo received data size mismatch (68 vs 4)
  - gerenuk_wrongview_np4_rall_pdsh2: all 4 ranks "shape '[-1, 5]' is invalid"
  - gerenuk_backward2_np4_r3_tee: rank 3 'backward through the graph a second time'
  - gerenuk_dtype64_np3_r1_redirects: rank 1 Double vs Float (only in its stderr.log)
  - gerenuk_paramgroup_np4_r0_loglevel: rank 0 ValueError parameters in more than one group
  - gerenuk_gradscaler_np4_r1_filter: rank 1 FloatingPointError, scaler skipped 2 steps
  - gerenuk_sigkill_np3_r2_restart: rank 2 exitcode -9; restart fails in connectFullMesh
  - gerenuk_compile_np5_r1_tee: rank 1 torch._dynamo TorchRuntimeError (linear, 7 vs 8)
  - gerenuk_segv_np6_r3_plain: rank 3 exitcode -11 SIGSEGV; others Connection reset
  - gerenuk_longtarget_np3_r0_detail: DROPPED, Long targets did not fail, exit 0
  - gerenuk_noshard_np3_r0_prefix: rank 0 FileNotFoundError shard_0_upright.pt at start
  - gerenuk_inplace_np7_r6_tee: rank 6 'modified by an inplace operation'
  - gerenuk_clip_np3_r1_pymodule: rank 1 clip_grad_norm_ non-finite RuntimeError
  - gerenuk_dtype64_np4_r3_detail: rank 3 Double vs Float; rank 0 monitoredBarrier
  - gerenuk_backward2_np8_r4_plain: rank 4 'backward through the graph a second time'
  (spare line)
  (spare line)
"""
import argparse, ctypes, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

WORK = "/tmp/fault636_work"
FAULT_STEP = 2


class BrowseNet(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.l1 = nn.Linear(8, hidden)
        self.l2 = nn.Linear(hidden, 1)

    def forward(self, x, inplace=False):
        h = torch.tanh(self.l1(x))
        if inplace:
            h.add_(0.1)  # planted: modifies the tanh output autograd saved
        return self.l2(h).squeeze(-1)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(636)
    table = {f"b{i}": round(1.2 + 0.01 * i, 3) for i in range(64)}
    with open(os.path.join(WORK, "reach_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = torch.randn(48, 8, generator=g)
        ids = torch.randint(0, 64, (48,), generator=g)
        y = x[:, :3].sum(1) * 0.5 + 0.1 * torch.randn(48, generator=g)
        torch.save({"x": x, "ids": ids, "y": y}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.save(BrowseNet().state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {world} shards in {WORK}")


def sync_grads(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare(a.world)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault == "wrongview" or rank == a.rank
    torch.manual_seed(rank)

    shard = os.path.join(WORK, f"shard_{rank}.pt")
    if a.fault == "noshard" and me:
        shard = os.path.join(WORK, f"shard_{rank}_upright.pt")
    data = torch.load(shard)
    with open(os.path.join(WORK, "reach_table.json")) as f:
        table = json.load(f)

    model = BrowseNet()
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    ddp = None
    if a.fault == "nosync":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) if a.fault == "gradscaler" else None
    skipped = 0
    if a.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    fwd = model
    if a.fault == "compile":
        fwd = torch.compile(model, backend="eager")

    for step in range(a.steps):
        sl = slice((step * 8) % 48, (step * 8) % 48 + 8)
        x, y, ids = data["x"][sl], data["y"][sl], data["ids"][sl]
        fault_now = me and step == FAULT_STEP
        keys = [f"b{int(i)}" for i in ids]
        if a.fault == "keyerror" and fault_now:
            keys[3] = "b_upright_999"
        reach = torch.tensor([table[k] for k in keys])
        x = x * reach[:, None] / 1.5
        opt.zero_grad()

        if a.fault == "nosync":
            micro = 3 if fault_now else 2
            for m in range(micro):
                xm, ym = x[m * 4 % 8:m * 4 % 8 + 4], y[m * 4 % 8:m * 4 % 8 + 4]
                if m < 1:
                    with ddp.no_sync():
                        loss = F.mse_loss(ddp(xm), ym)
                        loss.backward()
                else:
                    loss = F.mse_loss(ddp(xm), ym)  # planted: rank N syncs one extra micro-batch
                    loss.backward()
            opt.step()
        elif a.fault == "gradscaler":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = model(x)
                loss = F.mse_loss(pred.float(), y)
                if me and step >= FAULT_STEP:
                    loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            local_inf = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
            old = scaler.get_scale()
            sync_grads(model, world)
            scaler.step(opt)
            scaler.update()
            skipped = skipped + 1 if local_inf else 0
            if skipped >= 2:
                raise FloatingPointError(f"rank {rank}: GradScaler skipped {skipped} steps in a row, loss scale {old} -> {scaler.get_scale()}")
        else:
            if a.fault == "dtype64" and fault_now:
                x = x.double()
            if a.fault == "compile" and fault_now:
                x = x[:, :7]
            if a.fault == "wrongview" and step == FAULT_STEP:
                x = x.view(-1, 5)
            pred = fwd(x, inplace=(a.fault == "inplace" and fault_now)) if a.fault != "compile" else fwd(x)
            if a.fault == "anomaly" and fault_now:
                pred = torch.sqrt(pred - 10.0)
            tgt = y
            if a.fault == "longtarget" and fault_now:
                tgt = (y * 4).long()
            if a.fault == "shape" and fault_now:
                tgt = torch.cat([y, y[:1]])
            loss = F.mse_loss(pred, tgt)
            if a.fault == "clip" and fault_now:
                loss = loss * float("inf")
            if a.fault == "nograd" and fault_now:
                loss = loss.detach()
            if a.fault == "sigkill" and fault_now:
                os.kill(os.getpid(), signal.SIGKILL)
            if a.fault == "segv" and fault_now:
                ctypes.string_at(0)
            loss.backward()
            if a.fault == "backward2" and fault_now:
                loss.backward()
            if a.fault == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            sync_grads(model, world)
            if a.fault == "paramgroup" and fault_now:
                opt.add_param_group({"params": model.l2.parameters(), "lr": 0.01})
            opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} browse_reach {reach.mean().item():.3f}", flush=True)

    summary = torch.tensor([loss.item()])
    dist.all_reduce(summary)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export_gerenuk.pt"))
        print(f"rank 0 saved export, mean final loss {summary.item() / world:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
