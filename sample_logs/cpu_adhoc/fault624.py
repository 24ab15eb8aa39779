"""Batch 624 fault job: lapwing nest scrapes.

A tiny regressor predicts the depth (mm) of a lapwing's nest scrape from synthetic features
(ground wetness, sward height, distance to the nearest scrape, a substrate code looked up through
a JSON table). `--prepare` writes per-rank shards, the substrate lookup table and a start
checkpoint into /tmp/fault624_work. Training: gloo on CPU, 6 steps, hand-written gradient
all_reduce (DDP only where a fault needs it, FSDP for fsdp_shape), every rank prints
`rank R step S loss L scrape_mm M`; rank 0 saves an export at the end. main() carries the
@record decorator of torch.distributed.elastic.multiprocessing.errors. Process-group timeout 12 s
(`--pg-timeout`).

Faults (`--fault NAME --rank N`):
  none            control run
  dcp_key         start state goes through torch.distributed.checkpoint save+load; rank N's load state dict
                  has an extra key 'scrape_head.bias_extra' that the checkpoint lacks
  dcp_shape       as dcp_key, but rank N's model is built with a wider hidden layer (shape differs at load)
  fsdp_shape      FSDP2 fully_shard over the model on CPU/gloo; rank N builds it with a wider hidden layer
  compile_full    rank N runs its loss through torch.compile(fullgraph=True, backend='eager') over code
                  with a graph break at step 3
  static_graph    DDP static_graph=True; at step 3 rank N skips the auxiliary head (the graph changes)
  nosync          DDP with 2 micro-steps per step under no_sync(); rank N never enters no_sync()
  autocast_mix    rank N computes a calibration matmul of a bf16 tensor and a float tensor outside autocast
  mesh_shape      init_device_mesh("cpu", ...) where rank N asks for a (2, W//2+1) mesh
  gather_size     all_gather_into_tensor of the step's metric; rank N's input holds one element too many
  p2p_norecv      at step 3 rank N posts irecv from its right neighbour, which never sends
  empty_shard     rank N's shard holds no rows; the loader's wet-ground mean divides by zero rows
  double_init     rank N calls init_process_group a second time
  after_destroy   rank N destroys the process group after step 2 and then calls all_reduce
  keyerror        rank N's shard names a substrate missing from the lookup table
  nan             rank N's loss becomes NaN at step 3; the script's check raises FloatingPointError
  sigsegv         rank N reads address 0 at step 3
  sigkill         rank N SIGKILLs itself at step 3

Runs (one line per log):
  lapwing_compile_full_np8_r0_redirects: rank 0's torch.compile(fullgraph=True) hits a graph break at step 3 (torch._dynamo.exc.Unsupported); ranks 1 and 7 fail with gloo 'Connection closed by peer', the rest SIGTERMed.
  lapwing_nan_np8_r4_prefix: rank 4's loss is NaN at step 3, FloatingPointError; ranks 3 and 5 fail in all_reduce with 'Connection closed by peer'.
  lapwing_keyerror_np7_r6_plain: rank 6's shard names 'shingle_bank', missing from the table: KeyError in load_shard before step 0; ranks 0-5 SIGTERMed.
  lapwing_dcp_key_np6_r5_plain: every rank raises CheckpointException ranks:dict_keys([5]) with rank 5's 'Missing key in checkpoint state_dict: model.scrape_head.bias_extra'.
  lapwing_mesh_shape_np6_r3_prefix: rank 3's init_device_mesh('cpu', (2, 4)): 'Mesh should not be bigger than default world size 6, but found 8 ranks!'.
  lapwing_none_np6_rnone_plain: control run; 6 ranks print 6 steps, rank 0 saves the export, exit 0.
  lapwing_gather_size_np6_r5_pdsh2: rank 5's all_gather_into_tensor: 'ProcessGroupGloo::allgather: invalid tensor size'; others 'Connection closed by peer'; agent 2 loses the store.
  lapwing_autocast_mix_np5_r4_detail: rank 4's float @ bf16 matmul outside autocast: 'expected m1 and m2 to have the same dtype'; DETAIL: rank 0 reports rank 4 missed the monitoredBarrier.
  lapwing_gather_size_np5_r0_filter: rank 0's all_gather_into_tensor input too long: 'invalid tensor size at index 0'; rank 1 'Connection closed by peer' (only ranks 0,1 shown).
  lapwing_after_destroy_np5_r4_tee_trainer: rank 4 destroys its group then calls all_reduce: ValueError 'Default process group has not been initialized'.
  lapwing_sigkill_np5_r1_loglevel: rank 1 SIGKILLs itself at step 3 (exitcode -9); ranks 0 and 2 fail with gloo connection closed/reset.
  lapwing_static_graph_np4_r3_pymodule: rank 3 skips the aux head at step 3 under static_graph; 'Expected to have finished reduction in the prior iteration' (params 4 5).
  lapwing_nosync_np4_r1_loglevel: rank 1 never enters no_sync(); after step 4 it waits in backward's all_reduce, the others in the barrier; 12 s gloo recv timeouts.
  lapwing_empty_shard_np4_r3_pdsh2: rank 3's empty shard: ZeroDivisionError in load_shard; ranks 0 and 1 'Connection closed by peer'.
  lapwing_sigsegv_np4_r2_redirects: rank 2 reads address 0 at step 3, SIGSEGV (exitcode -11); ranks 1 and 3 'Connection reset by peer'.
  lapwing_p2p_norecv_np3_r2_wrapper: rank 2's irecv from rank 0 is never matched; ranks 2 and 1 time out after 12000 ms, rank 0 'Connection closed by peer'.
  lapwing_double_init_np3_r1_restart: rank 1's second init_process_group: ValueError 'twice!'; the restarted attempt fails in Gloo connectFullMesh (connection refused).
  lapwing_dcp_shape_np3_r0_tee: every rank raises CheckpointException ranks:dict_keys([0]) with rank 0's 'Size mismatch between saved torch.Size([16, 4]) and current [24, 4]'.
  lapwing_fsdp_shape_np4_r0_wrapper: rank 0's wider fully_shard model; rank 1 aborts on gloo 'Received data size doesn't match expected size' (exitcode -6).
  (dropped) lapwing_fsdp_shape_np5_r2_tee: FSDP1 sync_module_states=True on CPU: every rank 'FSDP needs a non-CPU accelerator device'.
  lapwing_compile_full_np5_r4_tee: rank 4's fullgraph compile hits the graph break at step 3 (Unsupported); ranks 0 and 3 'Connection closed by peer'.
  (unused)
  (unused)
  (unused)
"""
import argparse, ctypes, json, os, shutil, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

WORK = "/tmp/fault624_work"
SUBSTRATES = ["bare_mud", "short_sward", "gravel", "dung_patch", "tilled_soil"]


class ScrapeNet(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.Tanh())
        self.scrape_head = nn.Linear(hidden, 1)
        self.aux_head = nn.Linear(hidden, 1)

    def forward(self, x, use_aux=True):
        h = self.body(x)
        out = self.scrape_head(h).squeeze(-1)
        if use_aux:
            out = out + 0.1 * self.aux_head(h).squeeze(-1)
        return out


def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    table = {name: 0.2 * i + 0.1 for i, name in enumerate(SUBSTRATES)}
    with open(os.path.join(WORK, "substrate_table.json"), "w") as f:
        json.dump(table, f)
    g = torch.Generator().manual_seed(624)
    for r in range(world):
        n = 24
        rows = []
        for i in range(n):
            feats = torch.rand(3, generator=g).tolist()
            rows.append({"wet": feats[0], "sward": feats[1], "dist": feats[2],
                         "substrate": SUBSTRATES[(i + r) % len(SUBSTRATES)]})
        with open(os.path.join(WORK, f"shard_{r}.json"), "w") as f:
            json.dump(rows, f)
        bad = list(rows)
        bad[5] = dict(bad[5], substrate="shingle_bank")
        with open(os.path.join(WORK, f"shard_{r}_badsub.json"), "w") as f:
            json.dump(bad, f)
    with open(os.path.join(WORK, "shard_empty.json"), "w") as f:
        json.dump([], f)
    torch.manual_seed(0)
    torch.save(ScrapeNet().state_dict(), os.path.join(WORK, "start.pt"))
    print("prepared", WORK, flush=True)


def load_shard(path):
    with open(os.path.join(WORK, "substrate_table.json")) as f:
        table = json.load(f)
    with open(path) as f:
        rows = json.load(f)
    wet_mean = sum(r["wet"] for r in rows) / len(rows)
    xs, ys = [], []
    for row in rows:
        hard = table[row["substrate"]]
        x = [row["wet"] - wet_mean, row["sward"], row["dist"], hard]
        xs.append(x)
        ys.append(20.0 + 15.0 * row["wet"] - 8.0 * row["sward"] - 10.0 * hard)
    return torch.tensor(xs), torch.tensor(ys)


def graph_break_loss(pred, y):
    loss = ((pred - y) ** 2).mean()
    torch._dynamo.graph_break()
    return loss / 100.0


def allreduce_grads(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


@record
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    fault, frank = args.fault, args.rank
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = fault != "none" and (frank == rank or frank == -1)
    if mine and fault == "double_init":
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))

    shard = os.path.join(WORK, f"shard_{rank}.json")
    if mine and fault == "keyerror":
        shard = os.path.join(WORK, f"shard_{rank}_badsub.json")
    if mine and fault == "empty_shard":
        shard = os.path.join(WORK, "shard_empty.json")
    xs, ys = load_shard(shard)

    hidden = 24 if mine and fault in ("dcp_shape", "fsdp_shape") else 16
    torch.manual_seed(0)
    model = ScrapeNet(hidden)
    if hidden == 16:
        model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))

    if fault in ("dcp_key", "dcp_shape"):
        import torch.distributed.checkpoint as dcp
        ckdir = os.path.join(WORK, f"dcp_{fault}_w{world}")
        if rank == 0:
            shutil.rmtree(ckdir, ignore_errors=True)
        dist.barrier()
        ref = ScrapeNet(16)
        ref.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
        dcp.save({"model": ref.state_dict()}, checkpoint_id=ckdir)
        print(f"rank {rank} saved start state to {ckdir}", flush=True)
        sd = {"model": model.state_dict()}
        if mine and fault == "dcp_key":
            sd["model"]["scrape_head.bias_extra"] = torch.zeros(1)
        dcp.load(sd, checkpoint_id=ckdir)
        print(f"rank {rank} loaded start state through DCP", flush=True)

    if fault == "mesh_shape":
        from torch.distributed.device_mesh import init_device_mesh
        shape = (2, world // 2 + 1) if mine else (world,)
        mesh = init_device_mesh("cpu", shape)
        print(f"rank {rank} device mesh {mesh}", flush=True)

    ddp = None
    if fault == "fsdp_shape":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model.body); fully_shard(model)
    elif fault in ("static_graph", "nosync"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = ddp = DDP(model, static_graph=(fault == "static_graph"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    bs = 4
    total, nb = 0.0, 0
    for step in range(args.steps):
        i0 = (step * bs) % max(len(xs), 1)
        x, y = xs[i0:i0 + bs], ys[i0:i0 + bs]
        if mine and fault == "sigsegv" and step == 3:
            ctypes.string_at(0)
        if mine and fault == "sigkill" and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if mine and fault == "p2p_norecv" and step == 3:
            buf = torch.zeros(4)
            print(f"rank {rank} waiting for a scrape token from rank {(rank + 1) % world}", flush=True)
            dist.irecv(buf, src=(rank + 1) % world).wait()
        if mine and fault == "after_destroy" and step == 2:
            dist.destroy_process_group()
            print(f"rank {rank} destroyed its process group", flush=True)
            dist.all_reduce(torch.ones(1))
        if mine and fault == "autocast_mix" and step == 3:
            calib = torch.rand(4, 4).to(torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _ = model(x)
            x = x @ calib  # outside autocast: bf16 with float
        opt.zero_grad()
        if fault == "nosync":
            micro = [(x[:2], y[:2]), (x[2:], y[2:])]
            for k, (mx, my) in enumerate(micro):
                if k < len(micro) - 1 and not mine:
                    with ddp.no_sync():
                        l = ((model(mx) - my) ** 2).mean() / 100.0
                        l.backward()
                else:
                    l = ((model(mx) - my) ** 2).mean() / 100.0
                    l.backward()
            loss = l.detach()
            pred = model(x).detach()
        else:
            use_aux = not (mine and fault == "static_graph" and step == 3)
            pred = model(x, use_aux) if fault != "fsdp_shape" else model(x)
            if mine and fault == "compile_full" and step == 3:
                loss = torch.compile(graph_break_loss, fullgraph=True, backend="eager")(pred, y)
            else:
                loss = ((pred - y) ** 2).mean() / 100.0
            if mine and fault == "nan" and step == 3:
                loss = loss * float("nan")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step}")
            loss.backward()
            if ddp is None and fault != "fsdp_shape":
                allreduce_grads(model, world)
        opt.step()
        metric = pred.mean() if len(pred) else torch.tensor(0.0)
        if fault == "gather_size":
            inp = torch.full((2 if mine else 1,), metric.item())
            out = torch.zeros(world)
            dist.all_gather_into_tensor(out, inp)
            metric = out.mean()
        total += loss.item() if len(x) else 0.0
        nb += 1 if len(x) else 0
        print(f"rank {rank} step {step} loss {loss.item():.4f} scrape_mm {metric.item():.3f}", flush=True)
    mean_loss = total / nb
    dist.barrier()
    if rank == 0:
        sd = model.state_dict()
        torch.save(sd, os.path.join(WORK, "scrape_export.pt"))
        print(f"rank 0 saved export {WORK}/scrape_export.pt mean loss {mean_loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
