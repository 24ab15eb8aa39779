"""Batch 646 fault job: tamandua ant raids (gloo, CPU only).

Each rank trains a tiny linear "ants eaten" model on its own synthetic shard of
termite/ant mounds; mound kinds go through a JSON lookup table (kind -> ant density).
6 steps; at step 3 the ranks run a "raid exchange" of collectives beyond all_reduce
(all_gather, broadcast, all_to_all_single, scatter, gather, reduce, a subgroup
all_reduce, an isend/irecv ring). Rank 0 saves an export at the end.

  python fault646.py --prepare                  # writes /tmp/fault646_work
  python fault646.py --fault NAME --rank N      # plain torchrun (env:// vars)
  python fault646.py --acc ...                  # accelerate: Accelerator(cpu=True), gloo
  python fault646.py --hf ...                   # transformers.Trainer (1-layer tiny Bert)

Faults (--fault):
  none             control run
  gather_size      rank N passes a 5-element tensor to all_gather (others 4)
  gather_size_all  every rank passes a wrong-size output to all_gather_into_tensor
  reduce_scatter   every rank calls reduce_scatter_tensor with an input of world+1 elements
  bcast_src        rank N broadcasts from src=world-1 while the others use src 0
  a2a_splits       rank N gives all_to_all_single split sizes that do not add up
  reduce_dst       rank N calls reduce with dst=world (out of range)
  scatter_list     rank N (not src) passes a scatter_list to scatter
  gather_dst       rank N calls gather with dst=world-1 while the others use dst 0
  isend_missing    rank N never posts its isend in the ring; its neighbour waits
  batch_p2p        rank N's batch_isend_irecv sends to the wrong peer
  bad_dtype        rank N all_reduces a uint16 tensor
  skip_one         rank N skips the all_gather of the raid exchange
  subgroup_stall   rank N sleeps past the timeout inside the subgroup all_reduce
  keyerror         rank N looks up a mound kind not in the JSON table
  missing_shard    rank N's shard file is missing
  sigkill          rank N SIGKILLs itself at step 4
  nan_loss         rank N's loss becomes NaN, its check raises FloatingPointError

Runs (one line per log):
  tamandua_none_np5_rnone_acc: control, all 5 ranks finish 6 steps, export saved, exit 0
  tamandua_gather_size_np6_r5_torchrun: rank 5 'ProcessGroupGloo::allgather: invalid tensor size', others Connection closed, exit 1
  tamandua_a2a_splits_np5_r2_tee: rank 2 'Split sizes doesn't match total dim 0 size', others Connection closed, exit 1
  tamandua_bcast_src_np4_r3_accdebug: all 4 ranks gloo 'Timed out waiting 12000ms' (broadcast / all_to_all_single), exit 1
  tamandua_reduce_dst_np5_r0_accconfig: rank 0 'ProcessGroupGloo::reduce: invalid root rank: 5', others Connection closed, exit 1
  tamandua_scatter_list_np8_r3_torchrun: rank 3 ValueError scatter_list on non-source rank, rank 0 Connection closed, exit 1
  tamandua_isend_missing_np5_r4_tee: rank 0 recv timeout in work.wait(), ranks 1-4 timeout in step-4 all_reduce, exit 1
  tamandua_keyerror_np3_r2_hf: Trainer, rank 2 KeyError 'bullet_ant_tree' in the dataset, others Connection closed, exit 1
  tamandua_batch_p2p_np4_r1_acc2nodes: ranks 1-2 timeout in p2p wait, 0 and 3 in backward all_reduce, exit 0 (bare wait)
  tamandua_bad_dtype_np3_r1_torchrun: rank 1 gloo 'Invalid scalar type' (uint16 all_reduce), others Connection closed, exit 1
  tamandua_gather_size_all_np5_rall_acc: all 5 ranks 'allgather: invalid tensor size' alike, exit 1
  tamandua_subgroup_stall_np5_r2_torchrun: rank 4 (outside subgroup) timed out first on its ring irecv, exit 1
  tamandua_gather_size_np4_r3_hf: Trainer, rank 3 'allgather: invalid tensor size' in callback, others Connection closed, exit 1
  tamandua_skip_one_np6_r0_accconfig: rank 0 in broadcast, ranks 1-5 in all_gather, timeouts, exit 1
  tamandua_reduce_scatter_np4_rall_tee: DROPPED, reduce_scatter_tensor of the right size worked on gloo, exit 0
  tamandua_reduce_scatter_np5_rall_torchrun: all 5 ranks 'Check failed: outputShape[0] * worldSize == inputShape[0]', exit 1
  tamandua_gather_dst_np6_r2_acc: all 6 ranks timed out in gather / reduce / all_reduce, exit 1
  tamandua_sigkill_np6_r4_acc2nodes: rank 4 exitcode -9 (SIGKILL), others Connection closed, exit 1
  tamandua_scatter_list_np3_r2_hf: Trainer, rank 2 ValueError scatter_list on non-source rank, others Connection closed, exit 1
  tamandua_nan_loss_np3_r1_accdebug: rank 1 FloatingPointError 'raid loss is nan' at step 5, others Connection closed, exit 1
  tamandua_missing_shard_np7_r6_torchrun: rank 6 FileNotFoundError shard_6_raid.pt, others SIGTERM, exit 1
  tamandua_a2a_splits_np8_r7_acc: rank 7 'Split sizes doesn't match total dim 0 size', others Connection closed, exit 1
  (reserved 23)
  (reserved 24)
"""
import argparse
import datetime
import json
import math
import os
import signal
import time

import torch
import torch.distributed as dist

WORK = "/tmp/fault646_work"
KINDS = ["termite_mound", "leafcutter_nest", "army_bivouac", "fire_ant_hill", "carpenter_log"]


def prepare(world_max=8):
    os.makedirs(os.path.join(WORK, "exports"), exist_ok=True)
    table = {k: 0.4 + 0.3 * i for i, k in enumerate(KINDS)}
    with open(os.path.join(WORK, "mound_lookup.json"), "w") as f:
        json.dump(table, f)
    g = torch.Generator().manual_seed(646)
    for r in range(world_max):
        x = torch.randn(36, 5, generator=g)
        kind = [KINDS[(r + i) % len(KINDS)] for i in range(36)]
        y = x.sum(1, keepdim=True) * 0.2 + 0.5
        torch.save({"x": x, "kind": kind, "y": y}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.save(torch.nn.Linear(6, 1).state_dict(), os.path.join(WORK, "start.pt"))
    print("prepared", WORK, flush=True)


def features(x, kind, table):
    dens = torch.tensor([[table[k]] for k in kind]).reshape(-1, 1)
    return torch.cat([x, dens], 1)


def raid_exchange(rank, world, args, sub):
    f, me = args.fault, (rank == args.rank)
    t = torch.full((4,), float(rank))
    if not (f == "skip_one" and me):
        out = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(out, torch.zeros(5) if (f == "gather_size" and me) else t)
    if f == "gather_size_all":
        dist.all_gather_into_tensor(torch.zeros(4 * world + 1), t)
    if f == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(world + 1))
    b = torch.tensor([7.0 + rank])
    dist.broadcast(b, src=(world - 1) if (f == "bcast_src" and me) else 0)
    inp = torch.arange(world, dtype=torch.float32) + rank
    outp = torch.zeros(world)
    if f == "a2a_splits" and me:
        dist.all_to_all_single(outp, inp, output_split_sizes=[1] * world,
                               input_split_sizes=[2] + [1] * (world - 1))
    else:
        dist.all_to_all_single(outp, inp)
    s = torch.zeros(2)
    sl = [torch.full((2,), float(i)) for i in range(world)]
    dist.scatter(s, sl if (rank == 0 or (f == "scatter_list" and me)) else None, src=0)
    gdst = (world - 1) if (f == "gather_dst" and me) else 0
    dist.gather(s, [torch.zeros(2) for _ in range(world)] if rank == gdst else None, dst=gdst)
    r = torch.tensor([1.0])
    dist.reduce(r, dst=world if (f == "reduce_dst" and me) else 0)
    if f == "bad_dtype" and me:
        dist.all_reduce(torch.ones(3, dtype=torch.uint16))
    else:
        dist.all_reduce(torch.ones(3))
    if rank in range(world - 1):
        if f == "subgroup_stall" and me:
            time.sleep(args.pg_timeout + 8)
        dist.all_reduce(torch.ones(2), group=sub)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    rb = torch.zeros(3)
    if f == "batch_p2p":
        dst = (rank + 2) % world if me else nxt
        ops = [dist.P2POp(dist.isend, torch.ones(3) * rank, dst), dist.P2POp(dist.irecv, rb, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    else:
        works = [dist.irecv(rb, prv)]
        if not (f == "isend_missing" and me):
            works.append(dist.isend(torch.ones(3) * rank, nxt))
        for w in works:
            w.wait()
    return float(b.item())


def run_plain(args):
    acc = None
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    if args.acc:
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs
        acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timeout)])
        rank, world = acc.process_index, acc.num_processes
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    sub = dist.new_group(list(range(world - 1)))
    with open(os.path.join(WORK, "mound_lookup.json")) as f:
        table = json.load(f)
    shard_path = os.path.join(WORK, f"shard_{rank}.pt")
    if args.fault == "missing_shard" and rank == args.rank:
        shard_path = os.path.join(WORK, f"shard_{rank}_raid.pt")
    shard = torch.load(shard_path)
    model = torch.nn.Linear(6, 1)
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if acc is not None:
        model, opt = acc.prepare(model, opt)
    x, kind, y = shard["x"], shard["kind"], shard["y"]
    for step in range(1, args.steps + 1):
        lo = (step - 1) * 6
        ks = list(kind[lo:lo + 6])
        if args.fault == "keyerror" and rank == args.rank and step == 2:
            ks[4] = "bullet_ant_tree"
        pred = model(features(x[lo:lo + 6], ks, table))
        loss = ((pred - y[lo:lo + 6]) ** 2).mean()
        if args.fault == "nan_loss" and rank == args.rank and step == 5:
            loss = loss * float("nan")
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank} step {step}: raid loss is {loss.item()} (non-finite)")
        opt.zero_grad()
        if acc is not None:
            acc.backward(loss)
        else:
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        ants = int((pred.detach() > 0.5).sum()) * 1000 + step
        print(f"rank {rank} step {step} loss {loss.item():.4f} ants_eaten {ants}", flush=True)
        if step == 3:
            raid_exchange(rank, world, args, sub)
        if args.fault == "sigkill" and rank == args.rank and step == 4:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    if rank == 0:
        sd = (acc.unwrap_model(model) if acc is not None else model).state_dict()
        torch.save(sd, os.path.join(WORK, "exports", "tamandua_raid.pt"))
        print("rank 0 export saved", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


def run_hf(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer,
                              TrainerCallback, TrainingArguments)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(WORK, "mound_lookup.json")) as f:
        table = json.load(f)
    kinds = list(KINDS)
    if args.fault == "keyerror" and rank == args.rank:
        kinds[2] = "bullet_ant_tree"

    class Mounds(torch.utils.data.Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            k = kinds[i % len(kinds)]
            d = table[k]
            ids = torch.tensor([1 + (i + j) % 30 for j in range(8)])
            return {"input_ids": ids, "labels": torch.tensor(int(d > 1.0))}

    class RaidTrainer(Trainer):
        last = float("nan")

        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = super().compute_loss(model, inputs, return_outputs, **kw)
            RaidTrainer.last = float((out[0] if return_outputs else out).detach())
            return out

    class RaidCallback(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            s = state.global_step
            print(f"rank {rank} step {s} loss {RaidTrainer.last:.4f} ants_eaten {1000 * s + rank}", flush=True)
            if s == 3:
                w = dist.get_world_size()
                raid_exchange(rank, w, args, hf_sub[0])

    hf_sub = [None]
    cfg = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=os.path.join(WORK, f"hf_out_{args.fault}"), use_cpu=True,
                              ddp_backend="gloo", ddp_timeout=int(args.pg_timeout), max_steps=args.steps,
                              per_device_train_batch_size=2, logging_steps=100, save_strategy="no",
                              report_to=[], dataloader_num_workers=0, disable_tqdm=True)
    tr = RaidTrainer(model=model, args=targs, train_dataset=Mounds(), callbacks=[RaidCallback()])
    hf_sub[0] = dist.new_group(list(range(dist.get_world_size() - 1)))
    tr.train()
    if rank == 0:
        tr.save_model(os.path.join(WORK, "exports", "tamandua_hf"))
        print("rank 0 export saved", flush=True)
    print(f"rank {rank} done", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--acc", action="store_true")
    ap.add_argument("--hf", action="store_true")
    args = ap.parse_args()
    if args.prepare:
        prepare()
    elif args.hf:
        run_hf(args)
    else:
        run_plain(args)


if __name__ == "__main__":
    main()
