"""A twenty-first hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault20_*.py),
made with PyTorch's newer distributed APIs on CPU/gloo: DeviceMesh (2-D, with sub-groups), DTensor, FSDP2
`fully_shard`, tensor parallel `parallelize_module`, `torch.distributed.pipelining` and DCP
(`dcp.save`/`dcp.load`/`async_save` with the `state_dict` helpers). `main` is wrapped in torchelastic's `@record`,
so a failing rank writes an error file that torchrun's summary shows.

Run under torchrun: --fault NAME --rank N (the faulty rank)."""
import argparse, datetime, os, signal, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16
CKPT = "/tmp/fault21_ckpt"


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class MLP(nn.Module):
    def __init__(self, extra: bool = False, width: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 8)
        self.head = nn.Linear(8, 4)
        if extra:  # an auxiliary head added to this rank's copy of the model code
            self.aux = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


# ---------------------------------------------------------------- DeviceMesh / DTensor
def run_mesh(rank: int, world: int, hit: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    shape = (2, world // 2)
    if a.fault == "mesh_shape" and hit:  # this rank's launch config was written for two more ranks
        shape = (2, world // 2 + 1)
    if a.fault == "redistribute_one":  # 1-D mesh over the world (its group keeps the 15 s timeout)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        tp, dpg = mesh, None
    else:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        tp, dpg = mesh["tp"], mesh["dp"].get_group()
    say(rank, f"mesh {tuple(mesh.shape)} tp={tp.get_local_rank()}")
    torch.manual_seed(0)
    w = torch.randn(16, 12)
    for step in range(1, a.steps + 1):
        place = [Shard(0)]
        if a.fault == "placement" and hit and step == 3:  # this rank's sharding plan says Shard(1) for the weight
            place = [Shard(1)]
        dw = distribute_tensor(w, tp, place)
        x = torch.randn(BATCH, 12, generator=torch.Generator().manual_seed(step))
        full = dw.full_tensor()
        loss = (x @ full.t()).pow(2).mean()
        stats = torch.tensor([loss.item()])
        dist.all_reduce(stats, group=dpg)
        say(rank, f"step {step} loss {stats.item() / 2:.4f}")
    if a.fault == "redistribute_one" and hit:  # a debug-only gather of the final weight left behind a rank check
        say(rank, "gathering final weight for inspection")
        insp = dw.redistribute(tp, [Replicate()]).to_local()
        say(rank, f"weight norm {insp.norm().item():.4f}")


# ---------------------------------------------------------------- FSDP2
def run_fsdp(rank: int, world: int, hit: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = MLP()
    early = a.fault == "fsdp_opt_early" and hit
    if early:  # this rank's code builds the optimizer before sharding (it holds the unsharded parameters)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if a.fault == "fsdp_other" and hit:  # this rank's wrap policy shards only the root
        fully_shard(model)
    else:
        for m in (model.fc1, model.fc2):
            fully_shard(m)
        fully_shard(model)
    say(rank, "model sharded with fully_shard")
    if not early:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01) if a.fault == "fsdp_opt_early" else torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        if a.fault == "fsdp_inplace" and hit and step == 3:  # weight clipping done on the parameter, outside unshard
            with torch.no_grad():
                model.fc1.weight.data = model.fc1.weight.full_tensor().clamp(-0.1, 0.1)
            say(rank, "clamped fc1.weight")
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        stats = torch.tensor([loss.item()])
        dist.all_reduce(stats)
        say(rank, f"step {step} loss {stats.item() / world:.4f}")
        if a.fault == "fsdp_opt_early" and step == 2:  # a sharded checkpoint of model and optimizer
            from torch.distributed.checkpoint.state_dict import get_state_dict
            import torch.distributed.checkpoint as dcp
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{CKPT}_{a.fault}")
            say(rank, "saved sharded checkpoint")


# ---------------------------------------------------------------- tensor parallel
def run_tp(rank: int, world: int, hit: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = MLP()
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if a.fault == "tp_plan" and hit:  # this rank's plan came from the model's old layer names
        plan = {"fc1": ColwiseParallel(), "proj": RowwiseParallel()}
    model = parallelize_module(model, mesh, plan)
    say(rank, "model parallelized")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(1, a.steps + 1):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- pipelining
class Block(nn.Module):
    def __init__(self, i: int, last: bool):
        super().__init__()
        self.i = i
        self.lin = nn.Linear(8, 4 if last else 8)

    def forward(self, x):
        if a.fault == "pp_raise" and self.i == a.rank and self.step == 3:
            raise RuntimeError(f"stage {self.i}: activation checkpoint buffer not registered for microbatch")
        if a.fault == "pp_sigkill" and self.i == a.rank and self.step == 3:
            print(f"stage {self.i} forward step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.lin(x) if self.lin.out_features == 4 else F.relu(self.lin(x))


def run_pp(rank: int, world: int, hit: bool) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, Schedule1F1B
    num_stages = world
    if a.fault == "pp_stages" and hit:  # this rank's config was written for one stage fewer
        num_stages = world - 1
    torch.manual_seed(rank)
    block = Block(rank, last=rank == world - 1)
    stage = PipelineStage(block, rank, num_stages, torch.device("cpu"))
    n_micro = 4
    if a.fault == "pp_nmicro" and hit:  # this rank's config kept the old n_microbatches
        n_micro = 2
    batch = BATCH
    if a.fault == "pp_microbatch":  # the batch size was changed to 18 without changing n_microbatches
        batch = 18
    sched_cls = Schedule1F1B if a.fault in ("pp_sigkill", "pp_stages") else ScheduleGPipe
    sched = sched_cls(stage, n_microbatches=n_micro, loss_fn=lambda out, y: F.cross_entropy(out, y))
    say(rank, f"stage {rank}/{num_stages} {sched_cls.__name__} microbatches {n_micro}")
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(1, a.steps + 1):
        block.step = step
        x, y = torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            losses = []
            sched.step(target=y, losses=losses)
            say(rank, f"step {step} loss {torch.stack(losses).mean().item():.4f}")
        else:
            sched.step()
        opt.step()
        say(rank, f"step {step} done")


# ---------------------------------------------------------------- DCP
def run_dcp(rank: int, world: int, hit: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    path = f"{CKPT}_{a.fault}"
    for step in range(1, a.steps + 1):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")
        if step == 2:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            ckpt_id = path
            if a.fault == "dcp_unwritable" and hit:  # this node's checkpoint mount is read-only
                ckpt_id = "/sys/fault21_ckpt"
            if a.fault == "async_nowait":
                fut = dcp.async_save(sd, checkpoint_id=ckpt_id)
                say(rank, "async checkpoint started")
                if hit:  # this rank leaves right after starting the save (its last shard), never waiting on it
                    say(rank, "leaving after async save")
                    return
                fut.result()
            else:
                dcp.save(sd, checkpoint_id=ckpt_id)
            say(rank, f"saved {ckpt_id}")
        if step == 3 and a.fault in ("dcp_extra_key", "dcp_missing_key"):
            # resume into a model whose definition changed on this rank's copy of the code
            m2 = MLP(extra=(a.fault == "dcp_extra_key" and hit))
            if a.fault == "dcp_missing_key" and hit:
                del m2.head  # the head was renamed/moved in this rank's code
                m2.head = nn.Identity()
            # (an eval copy, not wrapped in DDP)
            o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
            msd, osd = get_state_dict(m2, o2)
            sd = {"model": msd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=osd)
            say(rank, "resumed from checkpoint")


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    dist.init_process_group("gloo", timeout=TIMEOUT)
    f = a.fault
    if f in ("mesh_shape", "placement", "redistribute_one"):
        run_mesh(rank, world, hit)
    elif f.startswith("fsdp_"):
        run_fsdp(rank, world, hit)
    elif f.startswith("tp_"):
        run_tp(rank, world, hit)
    elif f.startswith("pp_"):
        run_pp(rank, world, hit)
    elif f.startswith("dcp_") or f == "async_nowait":
        run_dcp(rank, world, hit)
    else:
        raise SystemExit(f"unknown fault {f}")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    main()
