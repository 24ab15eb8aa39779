"""fault622.py: dikdik territory marking, a small gloo/CPU training job with planted faults (batch 622).

Each rank reads its own shard of synthetic dikdik scent-mark samples (/tmp/fault622_work/shard_R.pt), maps each
sample's territory through a JSON lookup table (territories.json) to a scent strength, starts from a checkpoint
(start.ckpt) that rank 0 loads and broadcasts, and fits a small MLP for 6 steps, printing
`rank R step S loss L scent_marks M` every step. Rank 0 saves an export at the end. Default mode: plain accelerate
(Accelerator(cpu=True), gloo, InitProcessGroupKwargs timeout); `--hf`: a transformers.Trainer job (1-layer tiny
GPT-2 from a config, use_cpu, ddp_backend gloo). Run `--prepare` first.

Faults (`--fault NAME --rank N`):
  none        control run
  uneven      rank N's shard has 4 batches, not 6: it leaves the loop early and goes on to the final barrier
  slowexport  rank 0 alone runs a slow "evaluation" (sleeps 30 s) before the final barrier
  ckptload    rank 0 loads a start checkpoint that does not exist, before it broadcasts the weights
  pickle      rank N passes a lambda to all_gather_object at step 2
  p2p         at step 3 ranks pass marks round a ring with send/recv; rank N sends with the wrong tag
  monitored   rank N sleeps 40 s at step 3 before dist.monitored_barrier(timeout=6 s)
  thread      rank N's background scent-reader thread raises; its main loop waits for the thread's result
  watchdog    rank N's heartbeat thread kills its own process (os._exit(3)) after 4 s with no step progress
  savefull    rank N saves its end-of-training state to /dev/full
  subproc     rank N runs `ls` on a missing territory-map folder with check=True after the last step
  newgroup    rank N calls dist.new_group with a different rank list at step 2
  envmissing  rank N lacks the job variable DIKDIK_SEASON (os.environ[...] -> KeyError)
  keyerror    rank N's shard names a territory missing from the lookup table
  sigkill     rank N sends itself SIGKILL at step 2
  (external stop: --step-sleep S slows each step; the launcher is sent SIGTERM/SIGINT from outside)

Runs (one line per log):
  dikdik_none_np3_rnone_torchrun: control, all ranks finish 6 steps, rank 0 saves the export; exit 0
  dikdik_uneven_np6_r5_acc: rank 5 (4 batches) times out in the end barrier, ranks 1-4 in backward, rank 0 conn closed; exit 1
  dikdik_slowexport_np5_r0_accdebug: rank 0 'evaluating', ranks 1-4 gloo timeout in end barrier, rank 0 SIGTERMed; exit 1
  dikdik_ckptload_np4_r0_torchrun: rank 0 FileNotFoundError start_missing.ckpt, ranks 1-2 conn closed in broadcast; exit 1
  dikdik_pickle_np8_r3_tee: rank 3 AttributeError Can't pickle local object (lambda) in all_gather_object; exit 1
  dikdik_p2p_np5_r2_acc: rank 2's send (tag 7) and rank 3's recv time out, ranks 0/1/4 time out in backward; exit 1
  dikdik_monitored_np6_r4_accconfig: rank 0 'Rank 4 failed to pass monitoredBarrier in 6000 ms'; exit 1
  dikdik_thread_np5_r1_torchrun: 'Exception in thread scent-reader-1' ValueError, ranks 0,2-4 gloo timeout; exit 1
  dikdik_savefull_np5_r4_hf: Trainer done, rank 4 torch.save /dev/full 'unexpected pos 64 vs 0'; exit 1
  dikdik_subproc_np4_r2_acc2nodes: rank 2 CalledProcessError (ls exit 2); wrapper lost machine 1 status; exit 127
  dikdik_newgroup_np4_r1_tee: rank 1's different new_group rank list had no visible effect, run ok; exit 0
  dikdik_envmissing_np5_r2_accdebug: rank 2 KeyError 'DIKDIK_SEASON', rank 0 conn closed; exit 1
  dikdik_extstop_np5_rall_torchrun: launcher sent SIGTERM after step 3, SignalException signal 15; exit 1
  dikdik_sigkill_np6_r0_acc: rank 0 SIGKILL at step 2, exitcode -9, ranks 1 and 5 conn reset; exit 1
  dikdik_watchdog_np3_r1_torchrun: rank 1 '[watchdog] ... os._exit(3)', torchrun exitcode 3; exit 1
  dikdik_sigkill_np5_r2_hf: Trainer rank 2 SIGKILL at step 2, exitcode -9; exit 1
  dikdik_uneven_np3_r0_tee: rank 0 (4 batches) times out in end barrier, rank 2 in backward; exit 1
  dikdik_subproc_np6_r5_hf: Trainer done, rank 5 CalledProcessError (ls exit 2) at train end; exit 1
  DROPPED dikdik_watchdog_np4_r3_hf: hf mode starts no watchdog and ddp_timeout did not apply; ran ok; exit 0
  DROPPED dikdik_extstop_np4_rall_torchrun: my queue script's kill line had a syntax error, no signal sent; exit 0
  DROPPED dikdik_keyerror_np7_r6_hf: Trainer's sampler never gave rank 6 the bad sample; ran ok; exit 0
  -
  -
  -
"""
import argparse, json, os, queue, signal, subprocess, sys, threading, time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault622_work"
TERR = ["acacia_ridge", "termite_mound", "dry_wash", "thornbush_east", "kopje_north", "salt_lick"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    return p.parse_args()


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(622)
    for r in range(8):
        x = torch.randn(48, 8, generator=g)
        y = x[:, :2].sum(1, keepdim=True) * 0.5
        terr = [TERR[(r + i) % len(TERR)] for i in range(48)]
        torch.save({"x": x, "y": y, "terr": terr}, f"{WORK}/shard_{r}.pt")
        torch.save({"x": x[:32], "y": y[:32], "terr": terr[:32]}, f"{WORK}/shard_{r}_short.pt")
    table = {t: {"scent": 1.0 + 0.5 * i, "dung_piles": 3 + i} for i, t in enumerate(TERR)}
    with open(f"{WORK}/territories.json", "w") as f:
        json.dump(table, f, indent=1)
    torch.manual_seed(622)
    torch.save(make_net().state_dict(), f"{WORK}/start.ckpt")
    print(f"prepared {WORK}: 8 shards (+short), territories.json, start.ckpt")


def make_net():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def me(rank, a, name):
    return a.fault == name and (rank == a.rank or a.rank == -1)


class MarkData(torch.utils.data.Dataset):
    def __init__(self, rank, a):
        short = "_short" if me(rank, a, "uneven") else ""
        sh = torch.load(f"{WORK}/shard_{rank}{short}.pt", weights_only=True)
        self.x, self.y, self.terr = sh["x"], sh["y"], list(sh["terr"])
        with open(f"{WORK}/territories.json") as f:
            self.table = json.load(f)
        if me(rank, a, "keyerror"):
            self.terr[9] = "hyena_den"

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        scent = torch.tensor(float(self.table[self.terr[i]]["scent"]))
        return self.x[i], self.y[i], scent


def check_env(rank, a):
    if me(rank, a, "envmissing"):
        os.environ.pop("DIKDIK_SEASON", None)
    season = os.environ["DIKDIK_SEASON"]
    return season


class Watchdog(threading.Thread):
    def __init__(self, rank, limit=4.0):
        super().__init__(daemon=True)
        self.rank, self.limit, self.last = rank, limit, time.time()

    def beat(self):
        self.last = time.time()

    def run(self):
        while True:
            time.sleep(0.5)
            idle = time.time() - self.last
            if idle > self.limit:
                print(f"[watchdog] rank {self.rank}: no step progress for {idle:.1f} s (limit {self.limit} s), "
                      f"killing this process with os._exit(3)", flush=True)
                os._exit(3)


def scent_reader(rank, q):
    raw = {"acacia_ridge": "1.0", "dry_wash": "n/a"}
    vals = {k: float(v) for k, v in raw.items()}
    q.put(vals)


def plant_step(rank, step, a, wd=None):
    if me(rank, a, "sigkill") and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if me(rank, a, "watchdog") and step == 3:
        time.sleep(30)
    if me(rank, a, "thread") and step == 2:
        q = queue.Queue()
        threading.Thread(target=scent_reader, args=(rank, q), name=f"scent-reader-{rank}").start()
        q.get()
    if a.fault == "pickle" and step == 2:
        obj = {"rank": rank, "marks": step * 3}
        if me(rank, a, "pickle"):
            obj["scorer"] = lambda m: m * 2
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
    if a.fault == "newgroup" and step == 2:
        w = dist.get_world_size()
        ranks = list(range(w - 1)) if me(rank, a, "newgroup") else list(range(w))
        grp = dist.new_group(ranks=ranks)
        t = torch.ones(1)
        dist.all_reduce(t, group=grp)
    if a.fault == "p2p" and step == 3:
        w = dist.get_world_size()
        t = torch.full((4,), float(rank))
        buf = torch.zeros(4)
        tag = 7 if me(rank, a, "p2p") else 3
        req = dist.isend(t, (rank + 1) % w, tag=tag)
        dist.recv(buf, (rank - 1) % w, tag=3)
        req.wait()
    if a.fault == "monitored" and step == 3:
        if me(rank, a, "monitored"):
            time.sleep(40)
        dist.monitored_barrier(timeout=timedelta(seconds=6))
    if a.step_sleep:
        time.sleep(a.step_sleep)


def load_start(rank, a, net):
    if rank == 0:
        ck = f"{WORK}/start_missing.ckpt" if a.fault == "ckptload" else f"{WORK}/start.ckpt"
        net.load_state_dict(torch.load(ck, weights_only=True))
    for p in net.parameters():
        dist.broadcast(p.data, src=0)


def end_of_run(rank, a, state):
    if me(rank, a, "subproc"):
        subprocess.run(["ls", f"{WORK}/territory_maps"], check=True)
    if me(rank, a, "savefull"):
        torch.save(state, "/dev/full")
        print(f"rank {rank} saved state", flush=True)
    if rank == 0 and a.fault == "slowexport":
        print("rank 0 evaluating territory overlap before export", flush=True)
        time.sleep(30)
    dist.barrier()
    if rank == 0:
        torch.save(state, f"{WORK}/dikdik_export.pt")
        print(f"rank 0 saved export {WORK}/dikdik_export.pt", flush=True)


def run_accel(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo",
                                                                        timeout=timedelta(seconds=a.pg_timeout))])
    rank = acc.process_index
    check_env(rank, a)
    net = make_net()
    load_start(rank, a, net)
    wd = None
    if me(rank, a, "watchdog"):
        wd = Watchdog(rank)
        wd.start()
    ds = MarkData(rank, a)
    dl = torch.utils.data.DataLoader(ds, batch_size=8)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = acc.prepare(net, opt)
    for step, (x, y, scent) in enumerate(dl):
        if step >= 6:
            break
        plant_step(rank, step, a, wd)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        m = scent.mean().detach().clone()
        dist.all_reduce(m)
        print(f"rank {rank} step {step} loss {loss.item():.4f} scent_marks {m.item() / dist.get_world_size():.3f}",
              flush=True)
        if wd:
            wd.beat()
    end_of_run(rank, a, acc.unwrap_model(model).state_dict())
    dist.destroy_process_group()


def run_hf(a):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, TrainerCallback
    rank = int(os.environ.get("RANK", "0"))
    check_env(rank, a)

    class MarkTokens(torch.utils.data.Dataset):
        def __init__(self):
            self.inner = MarkData(rank, a)

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            x, y, scent = self.inner[i]
            ids = ((x.abs() * 10).long() % 64)
            return {"input_ids": ids, "labels": ids, "scent": scent}

    class MarkTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            scent = inputs.pop("scent")
            out = model(**inputs)
            m = scent.float().mean().detach().clone()
            dist.all_reduce(m)
            print(f"rank {rank} step {self.state.global_step} loss {out.loss.item():.4f} "
                  f"scent_marks {m.item() / dist.get_world_size():.3f}", flush=True)
            return (out.loss, out) if return_outputs else out.loss

    class Plant(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            plant_step(rank, state.global_step, a)

        def on_train_end(self, args, state, control, model=None, **kw):
            end_of_run(rank, a, {k: v for k, v in model.state_dict().items() if "wte" not in k})

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(622)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=int(a.pg_timeout),
                             per_device_train_batch_size=8, max_steps=6, report_to=[], save_strategy="no",
                             logging_strategy="no", remove_unused_columns=False, dataloader_num_workers=0,
                             disable_tqdm=True)
    MarkTrainer(model=model, args=args, train_dataset=MarkTokens(), callbacks=[Plant()]).train()


def main():
    a = parse()
    if a.prepare:
        prepare()
        return
    if a.hf:
        run_hf(a)
    else:
        run_accel(a)


if __name__ == "__main__":
    main()
