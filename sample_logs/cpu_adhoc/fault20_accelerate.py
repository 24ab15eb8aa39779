"""A twentieth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault19.py), run
under Hugging Face Accelerate (`accelerate launch --multi_gpu --num_processes N`, gloo, with
`Accelerator(cpu=True)` in the script: accelerate 1.15 refuses `--cpu` with `--multi_gpu`), the training
framework on top of torch.distributed: a plain loop with `Accelerator()` (faults `stall`, `gather_shape`,
`save_missing_dir`, `sigsegv`, `rlimit_as`, `early_return`,
`load_corrupt`, `main_only_barrier`) and `transformers.Trainer` on a tiny BERT built
from a config, no downloads (`trainer_loss_shape`, `trainer_stall`). The 15 s process-group timeout goes
through the framework's own option: `InitProcessGroupKwargs(timeout=...)`, `TrainingArguments(ddp_timeout=15)`."""
import argparse, datetime, os, resource, signal, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--use-cpu", type=int, default=1, help="TrainingArguments(use_cpu=...); with 1, transformers 5.24 does not pass ddp_timeout on")
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
OUT = "/tmp/job/out"


def say(rank, msg):
    print(f"rank {rank} {msg}", flush=True)


def loop():
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from torch.utils.data import DataLoader, TensorDataset

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=TIMEOUT)])
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 16 * world * (a.steps + 1)
    ds = TensorDataset(torch.randn(n, 8), torch.randint(0, 4, (n,)))
    dl = DataLoader(ds, batch_size=16, shuffle=False)
    model, opt, dl = acc.prepare(model, opt, dl)
    say(rank, f"of {world} ready ({acc.distributed_type})")
    for step, (x, y) in enumerate(dl):
        if step >= a.steps:
            break
        faulty = rank == a.rank and step == 3
        if a.fault == "load_corrupt" and step == 2:
            acc.save_state(f"{OUT}/state")
            acc.wait_for_everyone()
            if acc.is_main_process:  # a copy job that was cut short: half of the weights file
                f = f"{OUT}/state/model.safetensors"
                os.truncate(f, os.path.getsize(f) // 2)
            acc.wait_for_everyone()
            acc.load_state(f"{OUT}/state")  # e.g. a resume after preemption
        if faulty and a.fault == "stall":
            say(rank, "step 3: waiting for the shared data cache to fill")
            time.sleep(60)  # a stand-in for a blocking read; the others wait in the all-reduce
        if faulty and a.fault == "sigsegv":
            say(rank, "step 3: calling the custom kernel")
            os.kill(os.getpid(), signal.SIGSEGV)
        if faulty and a.fault == "early_return":
            say(rank, "step 3: my shard looks exhausted, stopping")
            return  # skips the rest of the loop, wait_for_everyone and end_training
        out = model(x)
        loss = F.cross_entropy(out, y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        preds = out.argmax(-1)
        if faulty and a.fault == "gather_shape":
            preds = out.argmax(-1, keepdim=True)  # [16, 1] on this rank, [16] on the others
        if faulty and a.fault == "rlimit_as":
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (2 * 1024 ** 3, hard))  # a 2 GiB cap, as a container limit
            say(rank, "step 3: building the confusion-matrix buffer")
            buf = torch.empty(1024 ** 3, dtype=torch.float32)  # 4 GiB
        allp = acc.gather_for_metrics(preds)
        ally = acc.gather_for_metrics(y)
        accu = (allp == ally).float().mean().item()
        acc.print(f"step {step} loss {loss.item():.4f} acc {accu:.3f}")
        if a.fault == "main_only_barrier" and step == 3 and acc.is_main_process:
            acc.print("step 3: writing an eval summary")
            acc.wait_for_everyone()  # a barrier inside `if is_main_process`: only rank 0 enters it
        say(rank, f"step {step} done")
    acc.wait_for_everyone()
    if a.fault == "save_missing_dir":
        # accelerator.save writes on the main process only; torch.save does not create the folder
        acc.save(acc.unwrap_model(model).state_dict(), f"{OUT}/run1/model.pt")
        say(rank, "saved")
    acc.wait_for_everyone()
    acc.end_training()
    say(rank, "finished")


def trainer():
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, TrainerCallback

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randint(1, 64, (n, 12), generator=g)
            self.y = torch.randint(0, 2, (n,), generator=g)

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.y[i]}

    class LossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            per_example = F.cross_entropy(outputs.logits, labels, reduction="none")
            loss = per_example.mean()
            if a.fault == "trainer_loss_shape" and self.args.process_index == a.rank and self.state.global_step == 3:
                loss = per_example  # the per-example losses kept for a weighting experiment, never reduced
            return (loss, outputs) if return_outputs else loss

    class StallCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if a.fault == "trainer_stall" and args.process_index == a.rank and state.global_step == 3:
                say(args.process_index, "step 3: syncing the run folder to remote storage")
                time.sleep(60)

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    args = TrainingArguments(output_dir=f"{OUT}/trainer", use_cpu=bool(a.use_cpu), ddp_backend="gloo",
                             ddp_timeout=a.pg_timeout, max_steps=a.steps, per_device_train_batch_size=4,
                             logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                             dataloader_num_workers=0)
    tr = LossTrainer(model=model, args=args, train_dataset=Rows(64), callbacks=[StallCallback()])
    tr.train()
    say(args.process_index, "finished")


if a.fault.startswith("trainer_"):
    trainer()
else:
    loop()
