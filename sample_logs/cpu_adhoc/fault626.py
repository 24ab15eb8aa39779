"""fault626.py - epiphyte moisture capture: a tiny multi-rank CPU/gloo training job with planted faults.

Each rank reads its shard of synthetic leaf/air readings (humidity, leaf area, trichome density ...), maps the
species id through a JSON lookup table of capture coefficients, and fits a linear model of captured moisture.
`--prepare` writes /tmp/fault626_work (per-rank shards, species_table.json, start.pt, a DCP checkpoint dcp_start/).
Modes: plain (torchrun env), --acc (accelerate Accelerator(cpu=True)), --hf (transformers.Trainer, use_cpu).
Faults (--fault NAME --rank N, at step 2 unless said):
  none            control run
  keyerror        rank N looks up a species id missing from the JSON table (KeyError)
  nan             rank N's loss becomes NaN; its own check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV
  sigkill         rank N sends itself SIGKILL
  autocast_mix    rank N multiplies a bf16 tensor from autocast("cpu") by a float32 weight outside autocast
  compile_fullgraph rank N runs torch.compile(fullgraph=True) over a function with a graph break
  double_init     rank N calls init_process_group a second time
  after_destroy   rank N destroys the process group, then calls all_reduce
  mesh_shape      every rank builds init_device_mesh("cpu", (W,)); rank N asks for (W+1,)
  gather_size     all_gather_into_tensor with an output one row too long on rank N
  a2a_size        all_to_all_single with an input of W+1 rows on rank N
  recv_nosend     rank N posts dist.recv from its neighbour, which never sends (timeout)
  dcp_key         at start every rank loads dcp_start/ with DCP; rank N's state dict has a key the checkpoint lacks
  dcp_shape       at start every rank loads dcp_start/ with DCP; rank N's model has another shape
  fsdp_shape      FSDP(device_id=None) over a model whose shape differs on rank N
  static_graph    DDP(static_graph=True); from step 3 rank N skips the spare head (graph changes)
  nosync_extra    gradient accumulation with no_sync(); rank N runs one more micro-step
Runs (one line per log):
  epiphyte_gather_size_np6_r5_torchrun: rank 5 RuntimeError ProcessGroupGloo::allgather invalid output tensor list; exit 1
  epiphyte_a2a_size_np5_r0_tee: rank 0 gloo alltoall enforce in->size % context->size == 0; exit 1
  epiphyte_dcp_key_np5_r2_torchrun: all ranks CheckpointException ranks [2], Missing key model.mist_gate; exit 1
  epiphyte_mesh_shape_np5_r4_acc: rank 4 'Mesh should not be bigger than default world size 5'; exit 1
  epiphyte_compile_fullgraph_np3_r1_accdebug: rank 1 torch._dynamo.exc.Unsupported (graph_break); exit 1
  epiphyte_none_np4_rnone_accconfig: control, 6 steps, export saved; exit 0
  epiphyte_double_init_np6_r3_torchrun: rank 3 ValueError process group initialized twice; exit 1
  epiphyte_after_destroy_np5_r0_tee: rank 0 ValueError default process group has not been initialized; exit 1
  epiphyte_autocast_mix_np6_r2_acc2nodes: rank 2 RuntimeError m1/m2 dtype BFloat16 != float; exit 1
  epiphyte_keyerror_np3_r2_hf: rank 2 KeyError 'species_tillandsia_97' in a Trainer callback; exit 1
  epiphyte_recv_nosend_np5_r3_torchrun: every rank gloo 'Timed out waiting 12000ms' (rank 3 in recv); exit 1
  epiphyte_fsdp_shape_np4_r3_torchrun: DROPPED, every rank 'FSDP needs a non-CPU accelerator device'; exit 1
  epiphyte_dcp_shape_np3_r0_accconfig: all ranks CheckpointException ranks [0], Size mismatch model.weight; exit 1
  epiphyte_sigsegv_np8_r7_tee: rank 7 exitcode -11 (SIGSEGV), others connection reset/closed; exit 1
  epiphyte_nan_np3_r1_hf: rank 1 FloatingPointError from a Trainer callback; exit 1
  epiphyte_sigkill_np4_r0_hf: rank 0 exitcode -9 (SIGKILL) in a Trainer run; exit 1
  epiphyte_nan_np7_r6_torchrun: rank 6 FloatingPointError loss is nan; exit 1
  epiphyte_dcp_key_np4_r3_acc: all ranks CheckpointException ranks [3], Missing key model.mist_gate; exit 1
  static_graph, nosync_extra: written but not run (no time in the 20-minute batch)
  -
  -
  -
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

WORK = "/tmp/fault626_work"
FEAT = 8


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(626)
    table = {f"species_{i}": round(0.2 + 0.1 * i, 3) for i in range(6)}
    json.dump(table, open(f"{WORK}/species_table.json", "w"))
    for r in range(world):
        x = torch.rand(24, FEAT, generator=g)
        sp = torch.randint(0, 6, (24,), generator=g)
        y = x.sum(1, keepdim=True) * 0.1
        torch.save({"x": x, "species": sp, "y": y}, f"{WORK}/shard_{r}.pt")
    m = nn.Linear(FEAT, 1)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": m.state_dict()}, checkpoint_id=f"{WORK}/dcp_start", no_dist=True)
    print(f"prepared {world} shards in {WORK}")


def build_model(fault, rank, frank, world):
    out = 2 if (fault in ("dcp_shape", "fsdp_shape") and rank == frank) else 1
    m = nn.Linear(FEAT, out)
    if out == 1:
        m.load_state_dict(torch.load(f"{WORK}/start.pt"))
    return m


def batch(shard, table, step, rank, fault, frank):
    i = (step * 4) % 24
    x, sp, y = shard["x"][i:i + 4], shard["species"][i:i + 4], shard["y"][i:i + 4]
    keys = [f"species_{int(s)}" for s in sp]
    if fault == "keyerror" and rank == frank and step == 2:
        keys[1] = "species_tillandsia_97"
    coef = torch.tensor([table[k] for k in keys]).unsqueeze(1)
    return x, y * coef * 10, coef


def step_fault(fault, rank, frank, world, step, x, model):
    if rank != frank or step != 2:
        if fault in ("mesh_shape", "gather_size", "a2a_size") and step == 2:
            pass
        else:
            return
    if fault == "sigsegv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "autocast_mix":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.mm(x, torch.ones(FEAT, FEAT))
        w = torch.ones(FEAT, 1)
        torch.mm(h, w)
    if fault == "compile_fullgraph":
        def capture(t):
            t = t * 2
            torch._dynamo.graph_break()
            return t.sum()
        torch.compile(capture, fullgraph=True)(x)
    if fault == "double_init":
        dist.init_process_group("gloo", timeout=timedelta(seconds=12))
    if fault == "after_destroy":
        dist.destroy_process_group()
        dist.all_reduce(torch.ones(1))
    if fault == "mesh_shape":
        from torch.distributed.device_mesh import init_device_mesh
        shape = (world + 1,) if rank == frank else (world,)
        init_device_mesh("cpu", shape)
    if fault == "gather_size":
        out = torch.zeros(world + (1 if rank == frank else 0), 2)
        dist.all_gather_into_tensor(out, torch.full((1, 2), float(rank)))
    if fault == "a2a_size":
        inp = torch.ones(world + (1 if rank == frank else 0), 2)
        dist.all_to_all_single(torch.zeros(world, 2), inp)
    if fault == "recv_nosend":
        dist.recv(torch.zeros(2), src=(rank + 1) % world)


def dcp_start(model, fault, rank, frank):
    import torch.distributed.checkpoint as dcp
    sd = {"model": model.state_dict()}
    if fault == "dcp_key" and rank == frank:
        sd["model"]["mist_gate"] = torch.zeros(3)
    dcp.load(sd, checkpoint_id=f"{WORK}/dcp_start")
    model.load_state_dict(sd["model"])


def train_plain(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    table = json.load(open(f"{WORK}/species_table.json"))
    shard = torch.load(f"{WORK}/shard_{rank}.pt")
    model = build_model(a.fault, rank, a.rank, world)
    if a.fault in ("dcp_key", "dcp_shape"):
        dcp_start(model, a.fault, rank, a.rank)
    if a.fault == "fsdp_shape":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, device_id=None)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        if a.fault == "static_graph":
            model = nn.ModuleDict({"body": model, "spare": nn.Linear(1, 1)})
        model = DDP(model, static_graph=(a.fault == "static_graph"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        x, y, coef = batch(shard, table, step, rank, a.fault, a.rank)
        step_fault(a.fault, rank, a.rank, world, step, x, model)
        micro = 2 + (1 if a.fault == "nosync_extra" and rank == a.rank and step == 2 else 0)
        if a.fault == "nosync_extra":
            for m in range(micro - 1):
                with model.no_sync():
                    ((model(x) - y) ** 2).mean().backward()
        if a.fault == "static_graph":
            h = model.module["body"](x) if False else None
            out = model(x) if False else None
        if a.fault == "static_graph":
            pred = model.module["body"](x)
            loss = ((pred - y) ** 2).mean()
        else:
            pred = model(x)
            loss = ((pred - y) ** 2).mean()
        if a.fault == "nan" and rank == a.rank and step == 2:
            loss = loss * float("nan")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()}")
        opt.zero_grad() if a.fault != "nosync_extra" else None
        loss.backward()
        opt.step()
        opt.zero_grad()
        m = float(pred.mean() * coef.mean())
        print(f"rank {rank} step {step} loss {loss.item():.5f} moisture_capture {m:.4f}", flush=True)
    if rank == 0:
        sd = model.state_dict()
        torch.save(sd, f"{WORK}/export_{a.fault}.pt")
        print(f"rank 0 saved export {WORK}/export_{a.fault}.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def train_acc(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    table = json.load(open(f"{WORK}/species_table.json"))
    shard = torch.load(f"{WORK}/shard_{rank}.pt")
    model = build_model(a.fault, rank, a.rank, world)
    if a.fault in ("dcp_key", "dcp_shape"):
        dcp_start(model, a.fault, rank, a.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    for step in range(6):
        x, y, coef = batch(shard, table, step, rank, a.fault, a.rank)
        step_fault(a.fault, rank, a.rank, world, step, x, model)
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        if a.fault == "nan" and rank == a.rank and step == 2:
            loss = loss * float("nan")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()}")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        m = float(pred.mean() * coef.mean())
        print(f"rank {rank} step {step} loss {loss.item():.5f} moisture_capture {m:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export_acc_{a.fault}.pt")
        print(f"rank 0 saved export {WORK}/export_acc_{a.fault}.pt", flush=True)


def train_hf(a):
    from transformers import Trainer, TrainingArguments, TrainerCallback, BertConfig, BertForSequenceClassification
    rank = int(os.environ.get("RANK", 0))
    table = json.load(open(f"{WORK}/species_table.json"))
    cfg = BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=1)
    model = BertForSequenceClassification(cfg)

    class Leaves(torch.utils.data.Dataset):
        def __len__(self):
            return 96
        def __getitem__(self, i):
            sp = i % 6
            return {"input_ids": torch.tensor([sp, (i * 7) % 16, (i * 3) % 16, 1]),
                    "labels": torch.tensor([table[f"species_{sp}"]])}

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            s = state.global_step
            if a.fault == "keyerror" and rank == a.rank and s == 2:
                table["species_tillandsia_97"]
            if a.fault == "sigkill" and rank == a.rank and s == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if a.fault == "nan" and rank == a.rank and s == 2:
                raise FloatingPointError(f"rank {rank} step {s}: moisture loss is nan")
            print(f"rank {rank} step {s} loss {state.log_history[-1]['loss'] if state.log_history else float('nan')} moisture_capture {0.1 * s:.4f}", flush=True)

    args = TrainingArguments(output_dir=f"{WORK}/hf_{a.fault}", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             per_device_train_batch_size=4, max_steps=6, logging_steps=1, save_strategy="no",
                             report_to=[], disable_tqdm=True)
    tr = Trainer(model=model, args=args, train_dataset=Leaves(), callbacks=[Probe()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/hf_{a.fault}/export")
        print(f"rank 0 saved export {WORK}/hf_{a.fault}/export", flush=True)


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--acc", action="store_true")
    p.add_argument("--hf", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare(a.world)
    if a.hf:
        return train_hf(a)
    if a.acc:
        return train_acc(a)
    train_plain(a, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()
