"""A thirty-first hand-run batch: the CONSOLE STYLES of real training codebases. A small DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), 8 steps, batch 16 per rank, process-group timeout 15 s) whose output imitates one
codebase's console per run (--style), start-up chatter, progress lines and error reporting included:
  nanogpt   rank-0-only prints: config override dump, `number of parameters: 0.00M`, `step N: train loss ..., val
            loss ...` and `iter N: loss L, time Tms, mfu M%`; exceptions propagate
  megatron  print_rank_0 set-up (arguments table, `> initializing torch distributed ...`, `> building ...`,
            `[after ...] datetime:` markers), the iteration line from the LAST rank only; exceptions propagate
  titan     `[titan] <asctime> - root - INFO - ...` logging on every rank, `step:  N  loss: ...`; exceptions
            propagate
  deepspeed `[<asctime>] [INFO] [file.py:N:func] [Rank 0] ...` log_dist lines (rank 0 only), the engine's config
            dump; exceptions propagate
  mmengine  `MM/DD HH:MM:SS - mmengine - INFO - ...` on rank 0 (other ranks' MMLogger prints ERROR only, as
            mmengine sets it), environment table, `Epoch(train) [1][ N/8] ...`; an ERROR record is logged on the
            failing rank before the exception is re-raised
  fairseq   `<date> | INFO | name | ...` on rank 0 (others WARNING and up), config dict, `train_inner | epoch 001:`
            lines; an ERROR record on the failing rank before the re-raise
  hf        Trainer-like: every rank's `Process rank: R, device: cpu ...` WARNING, rank 0's `***** Running training
            *****` block, a tqdm bar and `{'loss': ...}` dicts; exceptions propagate
  timm      `Training in distributed mode ...` on every rank, rank 0's model/data config and `Train: 0 [ N/8 ...]`
            lines; exceptions propagate
  plain     `[rank{rank}] it {i}/{n} loss={loss:.4f}` on every rank; exceptions propagate

Faults (--rank R at step --step S, default 4; one rank only unless said):
  key       the batch dict lacks 'labels' (KeyError: 'labels')
  value     a CSV field 'n/a' in a sample (ValueError: could not convert string to float: 'n/a')
  shape     a batch with 7 features (RuntimeError: mat1 and mat2 shapes cannot be multiplied)
  assert    a batch-size check fails (AssertionError with a message)
  datafile  the next data shard is missing (FileNotFoundError)
  ckpt      before training, rank R's resume checkpoint is missing (torch.load FileNotFoundError)
  segv      os.kill(getpid(), SIGSEGV)
  sigkill   os.kill(getpid(), SIGKILL)
  exit      os._exit(1), no message
  nan       the loss turns NaN; the script raises FloatingPointError (--nancheck raise) or asserts
            torch.isfinite(loss) (--nancheck assert)
  stall     rank R sleeps 60 s (a stuck read); the others time out in DDP's all-reduce
  deadlock  rank R calls dist.barrier() while the other ranks wait in dist.broadcast(src=R): every rank stalls
            until the gloo timeout
  memory    rank R allocates a 1 PiB bytearray for a prefetch buffer (MemoryError)
  mismatch  rank R all_reduces a metrics tensor of --mismatch-n elements (default 3) where the others use 2
  none      no fault
"""
import argparse, datetime, logging, math, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--style", required=True,
               choices=["nanogpt", "megatron", "titan", "deepspeed", "mmengine", "fairseq", "hf", "timm", "plain"])
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--step", type=int, default=4)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--nancheck", choices=["raise", "assert"], default="raise")
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--mismatch-n", type=int, default=3)
a = p.parse_args()
BATCH, LR = 16, 1e-4
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
STYLE = a.style


def now(fmt):
    return datetime.datetime.now().strftime(fmt)


def out(msg):
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------------- loggers
class MsFormatter(logging.Formatter):
    def formatTime(self, record, datefmt=None):
        t = datetime.datetime.fromtimestamp(record.created)
        return t.strftime("%Y-%m-%d %H:%M:%S") + f",{int(record.msecs):03d}"


def make_logger():
    lg = logging.getLogger(STYLE)
    lg.propagate = False
    h = logging.StreamHandler(sys.stdout if STYLE in ("titan", "timm") else sys.stderr)
    if STYLE == "titan":
        h.setFormatter(MsFormatter("[titan] %(asctime)s - root - %(levelname)s - %(message)s"))
        lg.setLevel(logging.INFO)
    elif STYLE == "mmengine":
        h.setFormatter(logging.Formatter("%(asctime)s - mmengine - %(levelname)s - %(message)s", "%m/%d %H:%M:%S"))
        lg.setLevel(logging.INFO if RANK == 0 else logging.ERROR)
        h.stream = sys.stdout
    elif STYLE == "fairseq":
        h.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s", "%Y-%m-%d %H:%M:%S"))
        lg.setLevel(logging.INFO if RANK == 0 else logging.WARNING)
    elif STYLE == "timm":
        class NoInfo(logging.Formatter):
            def format(self, r):
                return r.getMessage() if r.levelno == logging.INFO else f"{r.levelname}: {r.getMessage()}"
        h.setFormatter(NoInfo())
        lg.setLevel(logging.INFO)
    else:
        h.setFormatter(logging.Formatter("%(message)s"))
        lg.setLevel(logging.INFO)
    lg.addHandler(h)
    return lg


LOG = make_logger()


def fslog(name, level, msg):
    """fairseq: a record under a module name (fairseq_cli.train, fairseq.trainer, train_inner ...)"""
    lg = LOG.getChild(name) if False else logging.getLogger("fs." + name)
    if not lg.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"%(asctime)s | %(levelname)s | {name} | %(message)s", "%Y-%m-%d %H:%M:%S"))
        lg.addHandler(h)
        lg.propagate = False
        lg.setLevel(logging.INFO if RANK == 0 else logging.WARNING)
    lg.log(level, msg)


def ds(file_line_func, msg, rank0_only=True, level="INFO"):
    if rank0_only and RANK != 0:
        return
    ts = datetime.datetime.now()
    sys.stdout.write(f"[{ts.strftime('%Y-%m-%d %H:%M:%S')},{ts.microsecond // 1000:03d}] [{level}] [{file_line_func}] {msg}\n")
    sys.stdout.flush()


def hf_log(level, file_line, msg, rank0=True):
    if rank0 and RANK != 0:
        return
    ts = datetime.datetime.now()
    sys.stderr.write(f"[{level}|{file_line}] {ts.strftime('%Y-%m-%d %H:%M:%S')},{ts.microsecond // 1000:03d} >> {msg}\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------------------------------- start-up
def startup_before_init():
    if STYLE == "nanogpt" and RANK == 0:
        out("Overriding config with config/train_shakespeare_char.py:")
        for line in ["# train a miniature character-level shakespeare model", "# good for debugging and playing on macbooks and such", "",
                     "out_dir = 'out-shakespeare-char'", "eval_interval = 2", "eval_iters = 2", "log_interval = 1", "",
                     "always_save_checkpoint = False", "", "wandb_log = False # override via command line if you like",
                     "wandb_project = 'shakespeare-char'", "wandb_run_name = 'mini-gpt'", "", "dataset = 'shakespeare_char'",
                     "gradient_accumulation_steps = 1", "batch_size = 16", "block_size = 8 # context of up to 8 previous characters", "",
                     "n_layer = 1", "n_head = 1", "n_embd = 16", "dropout = 0.0", "", "learning_rate = 1e-4",
                     f"max_iters = {a.steps}", "lr_decay_iters = 8", "min_lr = 1e-5", "beta2 = 0.99", "",
                     "warmup_iters = 0", "device = 'cpu'", "compile = False"]:
            out(line)
        out("Overriding: device = cpu")
        out("Overriding: compile = False")
    if STYLE == "megatron" and RANK == 0:
        out(f"using world size: {WORLD}, data-parallel size: {WORLD}, context-parallel size: 1, hierarchical context-parallel sizes: None tensor-model-parallel size: 1, encoder-tensor-model-parallel size: 0, pipeline-model-parallel size: 1, encoder-pipeline-model-parallel size: 0")
        out("using torch.float32 for parameters ...")
        out("------------------------ arguments ------------------------")
        args = {"accumulate_allreduce_grads_in_fp32": False, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-08,
                "bf16": False, "clip_grad": 1.0, "data_parallel_size": WORLD, "data_path": "['/tmp/job/data/my-gpt2_text_document']",
                "distributed_backend": "gloo", "distributed_timeout_minutes": 0.25, "eval_interval": 1000, "eval_iters": 10,
                "fp16": False, "global_batch_size": BATCH * WORLD, "hidden_size": 16, "load": "None", "log_interval": 1,
                "lr": LR, "micro_batch_size": BATCH, "num_attention_heads": 1, "num_layers": 1, "rank": 0,
                "seed": 1234, "seq_length": 8, "tensor_model_parallel_size": 1, "tokenizer_type": "GPT2BPETokenizer",
                "train_iters": a.steps, "world_size": WORLD}
        for k, v in args.items():
            out(f"  {k} {'.' * (48 - len(k))} {v}")
        out("-------------------- end of arguments ---------------------")
        out("setting number of micro-batches to constant 1")
        out("> building GPT2BPETokenizer tokenizer ...")
        out(" > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)")
        out("> initializing torch distributed ...")
    if STYLE == "deepspeed":
        ds("real_accelerator.py:219:get_accelerator", "Setting ds_accelerator to cpu (auto detect)", rank0_only=False)
    if STYLE == "hf":
        ts = now("%m/%d/%Y %H:%M:%S")
        sys.stderr.write(f"{ts} - WARNING - __main__ - Process rank: {RANK}, device: cpu, n_gpu: 0, distributed training: True, 16-bits training: False\n")
        sys.stderr.flush()
    if STYLE == "fairseq":
        fslog("fairseq.distributed.utils", logging.INFO, f"distributed init (rank {RANK}): env://")


def startup_after_init(nparams):
    if STYLE == "nanogpt" and RANK == 0:
        out(f"tokens per iteration will be: {BATCH * 8 * WORLD:,}")
        out("found vocab_size = 65 (inside data/shakespeare_char/meta.pkl)")
        out("Initializing a new model from scratch")
        out(f"number of parameters: {nparams / 1e6:.2f}M")
        out(f"num decayed parameter tensors: 2, with {16 * 8 + 4 * 16:,} parameters")
        out(f"num non-decayed parameter tensors: 2, with {16 + 4:,} parameters")
        out("using fused AdamW: False")
    elif STYLE == "megatron" and RANK == 0:
        out("> initialized tensor model parallel with size 1")
        out("> initialized pipeline model parallel with size 1")
        out("> setting random seeds to 1234 ...")
        out("> compiling dataset index builder ...")
        out(">>> done with dataset index builder. Compilation time: 0.052 seconds")
        out("time to initialize megatron (seconds): 2.873")
        out(f"[after megatron is initialized] datetime: {now('%Y-%m-%d %H:%M:%S')} ")
        out("building GPT model ...")
        out(f" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): {nparams}")
        out(f"[after model, optimizer, and learning rate scheduler are built] datetime: {now('%Y-%m-%d %H:%M:%S')} ")
        out("> building train, validation, and test datasets ...")
        out(f" > datasets target sizes (minimum size):")
        out(f"    train:      {BATCH * WORLD * a.steps}")
        out(f"    validation: 0")
        out(f"    test:       0")
        out("> building train, validation, and test datasets for GPT ...")
        out("> finished creating GPT datasets ...")
        out(f"[after dataloaders are built] datetime: {now('%Y-%m-%d %H:%M:%S')} ")
        out("done with setup ...")
        out("(min, max) time across ranks (ms):")
        out("    model-and-optimizer-setup ......................: (12.31, 14.02)")
        out("    train/valid/test-data-iterators-setup ..........: (3.70, 4.11)")
        out("training ...")
        out(f"[before the start of training step] datetime: {now('%Y-%m-%d %H:%M:%S')} ")
    elif STYLE == "titan":
        LOG.info("Starting job: Llama 3 debug training")
        LOG.info(f"Building 1-D device mesh with ['dp_shard'], [{WORLD}]")
        LOG.info("[GC] Initial GC collection. 0.00 seconds.")
        LOG.info("Building tokenizer...")
        LOG.info("Preparing c4_test dataset from tests/assets/c4_test")
        LOG.info("Building llama3 debugmodel with TransformerModelArgs(_enforced='This field is used to enforce all fields have defaults.', dim=16, n_layers=1, n_heads=1, n_kv_heads=None, vocab_size=2000, multiple_of=256, ffn_dim_multiplier=None, norm_eps=1e-05, rope_theta=500000, max_seq_len=8, depth_init=True, use_flex_attn=False, attn_mask_type='causal', eos_id=0)")
        LOG.info(f"Model llama3 debugmodel size: {nparams:,} total parameters")
        LOG.info("Applied DDP to the model")
        LOG.info("CPU is used for training")
        LOG.info("Checkpointing is disabled. Skipping checkpoint loading.")
        LOG.info(f"Trainer is initialized with local batch size {BATCH}, global batch size {BATCH * WORLD}, gradient accumulation steps 1, sequence length 8, total steps {a.steps} (warmup 2).")
        LOG.info("Training starts at step 1.")
    elif STYLE == "deepspeed":
        ds("comm.py:652:init_distributed", "cdb=None", rank0_only=False)
        ds("comm.py:683:init_distributed", "Initializing TorchBackend in DeepSpeed with backend gloo", rank0_only=False)
        ds("logging.py:96:log_dist", "[Rank 0] DeepSpeed info: version=0.14.4, git-hash=unknown, git-branch=unknown")
        ds("logging.py:96:log_dist", "[Rank 0] DeepSpeed Flops Profiler Enabled: False")
        ds("logging.py:96:log_dist", "[Rank 0] Using client Optimizer as basic optimizer")
        ds("logging.py:96:log_dist", "[Rank 0] Removing param_group that has no 'params' in the basic Optimizer")
        ds("logging.py:96:log_dist", "[Rank 0] DeepSpeed Basic Optimizer = AdamW")
        ds("logging.py:96:log_dist", "[Rank 0] DeepSpeed Final Optimizer = AdamW")
        ds("logging.py:96:log_dist", "[Rank 0] DeepSpeed using configured LR scheduler = None")
        ds("logging.py:96:log_dist", f"[Rank 0] step=0, skipped=0, lr=[{LR}], mom=[(0.9, 0.999)]")
        ds("config.py:997:print", "DeepSpeedEngine configuration:")
        for k, v in {"activation_checkpointing_config": '{\n    "partition_activations": false, \n    "contiguous_memory_optimization": false\n}',
                     "amp_enabled": False, "communication_data_type": None, "dump_state": False, "fp16_enabled": False,
                     "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 1,
                     "train_batch_size": BATCH * WORLD, "train_micro_batch_size_per_gpu": BATCH, "wall_clock_breakdown": False,
                     "world_size": WORLD, "zero_enabled": False, "zero_optimization_stage": 0}.items():
            ds("config.py:1001:print", f"  {k} {'.' * (30 - len(k)) if len(k) < 30 else ''} {v}")
        ds("config.py:987:print_user_config", '  json = {\n    "train_batch_size": %d, \n    "train_micro_batch_size_per_gpu": %d, \n    "steps_per_print": 1, \n    "gradient_clipping": 1.0\n}' % (BATCH * WORLD, BATCH))
    elif STYLE == "mmengine":
        LOG.info("\n------------------------------------------------------------\nSystem environment:\n"
                 f"    sys.platform: linux\n    Python: {sys.version.split()[0]} (main, Dec  1 2026, 10:11:12) [GCC 11.4.0]\n"
                 "    CUDA available: False\n    MUSA available: False\n    numpy_random_seed: 1234\n    GCC: gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0\n"
                 f"    PyTorch: {torch.__version__}\n    PyTorch compiling details: PyTorch built with:\n  - GCC 11.2\n  - C++ Version: 201703\n"
                 "\n    OpenCV: 4.10.0\n    MMEngine: 0.10.5\n\nRuntime environment:\n    cudnn_benchmark: False\n"
                 "    mp_cfg: {'mp_start_method': 'fork', 'opencv_num_threads': 0}\n    dist_cfg: {'backend': 'gloo'}\n"
                 f"    seed: 1234\n    Distributed launcher: pytorch\n    Distributed training: True\n    GPU number: {WORLD}\n"
                 "------------------------------------------------------------\n")
        LOG.info("Config:\nmodel = dict(type='TinyClassifier', in_channels=8, hidden=16, num_classes=4)\n"
                 f"train_dataloader = dict(batch_size={BATCH}, num_workers=0, dataset=dict(type='ShardDataset', data_root='data/shards'))\n"
                 f"train_cfg = dict(type='IterBasedTrainLoop', max_iters={a.steps}, val_interval=1000)\n"
                 f"optim_wrapper = dict(type='OptimWrapper', optimizer=dict(type='SGD', lr={LR}, momentum=0.9))\n"
                 "default_hooks = dict(logger=dict(type='LoggerHook', interval=1))\nlauncher = 'pytorch'\nwork_dir = './work_dirs/tiny'\n")
        LOG.info("Distributed training is enabled.")
        LOG.info("Hooks will be executed in the following order:\nbefore_run:\n(VERY_HIGH   ) RuntimeInfoHook\n(BELOW_NORMAL) LoggerHook\n -------------------- ")
        LOG.warning("The prefix is not set in metric class DumpResults.") if RANK == 0 else None
        LOG.info("Checkpoints will be saved to /tmp/job/work_dirs/tiny.")
    elif STYLE == "fairseq":
        fslog("fairseq_cli.train", logging.INFO, "{'_name': None, 'common': {'_name': None, 'no_progress_bar': False, 'log_interval': 1, 'log_format': 'simple', 'seed': 1, 'cpu': True, 'fp16': False}, 'distributed_training': {'_name': None, 'distributed_world_size': %d, 'distributed_backend': 'gloo', 'ddp_backend': 'pytorch_ddp'}, 'optimization': {'_name': None, 'max_update': %d, 'lr': [%s], 'clip_norm': 0.0}, 'task': {'_name': 'language_modeling', 'data': 'data-bin/wikitext-103', 'tokens_per_sample': 8}}" % (WORLD, a.steps, LR))
        fslog("fairseq.tasks.language_modeling", logging.INFO, "dictionary: 267744 types")
        fslog("fairseq_cli.train", logging.INFO, "TransformerLanguageModel(\n  (decoder): TransformerDecoder(\n    (fc1): Linear(in_features=8, out_features=16, bias=True)\n    (fc2): Linear(in_features=16, out_features=4, bias=True)\n  )\n)")
        fslog("fairseq_cli.train", logging.INFO, "task: LanguageModelingTask")
        fslog("fairseq_cli.train", logging.INFO, "model: TransformerLanguageModel")
        fslog("fairseq_cli.train", logging.INFO, "criterion: CrossEntropyCriterion")
        fslog("fairseq_cli.train", logging.INFO, f"num. shared model params: {nparams:,} (num. trained: {nparams:,})")
        fslog("fairseq.trainer", logging.INFO, f"detected shared parameter: none")
        fslog("fairseq.utils", logging.INFO, "***********************CUDA enviroments for all %d workers***********************" % WORLD)
        fslog("fairseq_cli.train", logging.INFO, f"training on {WORLD} devices (GPUs/TPUs)")
        fslog("fairseq_cli.train", logging.INFO, f"max tokens per device = None and max sentences per device = {BATCH}")
        fslog("fairseq.trainer", logging.INFO, "No existing checkpoint found checkpoints/checkpoint_last.pt")
        fslog("fairseq.trainer", logging.INFO, "loading train data for epoch 1")
        fslog("fairseq.data.data_utils", logging.INFO, "loaded 1,801,350 examples from: data-bin/wikitext-103/train")
        fslog("fairseq.trainer", logging.INFO, "begin training epoch 1")
        fslog("fairseq_cli.train", logging.INFO, "Start iterating over samples")
    elif STYLE == "hf" and RANK == 0:
        hf_log("INFO", "trainer.py:2369", "***** Running training *****")
        hf_log("INFO", "trainer.py:2370", f"  Num examples = {BATCH * WORLD * a.steps:,}")
        hf_log("INFO", "trainer.py:2371", "  Num Epochs = 1")
        hf_log("INFO", "trainer.py:2372", f"  Instantaneous batch size per device = {BATCH}")
        hf_log("INFO", "trainer.py:2375", f"  Total train batch size (w. parallel, distributed & accumulation) = {BATCH * WORLD}")
        hf_log("INFO", "trainer.py:2376", "  Gradient Accumulation steps = 1")
        hf_log("INFO", "trainer.py:2377", f"  Total optimization steps = {a.steps}")
        hf_log("INFO", "trainer.py:2378", f"  Number of trainable parameters = {nparams:,}")
    elif STYLE == "timm":
        LOG.info(f"Training in distributed mode with multiple processes, 1 device per process.Process {RANK}, total {WORLD}, device cpu.")
        if RANK == 0:
            LOG.info(f"Model tinymlp created, param count:{nparams}")
            LOG.info("Data processing configuration for current model + dataset:")
            for k, v in [("input_size", "(8,)"), ("interpolation", "bicubic"), ("mean", "(0.485, 0.456, 0.406)"),
                         ("std", "(0.229, 0.224, 0.225)"), ("crop_pct", "0.875"), ("crop_mode", "center")]:
                LOG.info(f"\t{k}: {v}")
            LOG.info("Using native Torch DistributedDataParallel.")
            LOG.info("Scheduled epochs: 1. LR stepped per epoch.")
    elif STYLE == "plain":
        out(f"[rank{RANK}] world {WORLD}, model ready ({nparams} params)")


# ----------------------------------------------------------------------------------------------------- progress
class Progress:
    def __init__(self):
        self.t0 = time.time()
        self.losses = []
        self.bar = None
        if STYLE == "hf" and RANK == 0:
            import tqdm
            self.bar = tqdm.tqdm(total=a.steps)

    def step(self, i, loss, dt, gnorm):
        self.losses.append(loss)
        n = a.steps
        avg = sum(self.losses) / len(self.losses)
        if STYLE == "nanogpt" and RANK == 0:
            if i % 2 == 0:
                out(f"step {i}: train loss {loss:.4f}, val loss {loss * 1.03:.4f}")
            out(f"iter {i}: loss {loss:.4f}, time {dt * 1000:.2f}ms, mfu {0.01 * i:.2f}%")
        elif STYLE == "megatron" and RANK == WORLD - 1:
            out(f" [{now('%Y-%m-%d %H:%M:%S')}] iteration {i:8d}/{n:8d} | consumed samples: {i * BATCH * WORLD:12d} | "
                f"elapsed time per iteration (ms): {dt * 1000:.1f} | learning rate: {LR:.6E} | global batch size: {BATCH * WORLD:5d} | "
                f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {gnorm:.3f} | number of skipped iterations: {0:3d} | "
                f"number of nan iterations: {0:3d} |")
            if i == 1:
                out("[Rank %d] (after 1 iterations) memory (MB) | allocated: 0.0 | max allocated: 0.0 | reserved: 0.0 | max reserved: 0.0" % RANK)
        elif STYLE == "titan":
            tps = int(BATCH * 8 / max(dt, 1e-6))
            LOG.info(f"step: {i:2d}  loss: {loss:7.4f}  memory:  0.00GiB(0.00%)  tps: {tps:,}  tflops: 0.00  mfu: 0.00%")
        elif STYLE == "deepspeed" and RANK == 0:
            ds("logging.py:96:log_dist", f"[Rank 0] step={i}, skipped=0, lr=[{LR}], mom=[(0.9, 0.999)]")
            ds("timer.py:259:stop", f"epoch=0/micro_step={i}/global_step={i}, RunningAvgSamplesPerSec={BATCH * WORLD / max(dt, 1e-6):.2f}, CurrSamplesPerSec={BATCH * WORLD / max(dt, 1e-6):.2f}, MemAllocated=0.0GB, MaxMemAllocated=0.0GB")
            out(f"epoch 0 step {i} loss {loss:.4f}")
        elif STYLE == "mmengine":
            eta = datetime.timedelta(seconds=int(dt * (n - i)))
            LOG.info(f"Epoch(train) [1][{i:>{len(str(n)) + 1}}/{n}]  lr: {LR:.4e}  eta: {eta}  time: {dt:.4f}  data_time: 0.0012  memory: 0  loss: {loss:.4f}")
        elif STYLE == "fairseq":
            fslog("train_inner", logging.INFO, f"epoch 001:{i:7d} / {n} loss={loss:.3f}, ppl={2 ** loss:.2f}, wps={BATCH * 8 / max(dt, 1e-6):.1f}, "
                  f"ups={1 / max(dt, 1e-6):.2f}, wpb={BATCH * 8}, bsz={BATCH}, num_updates={i}, lr={LR}, gnorm={gnorm:.3f}, train_wall=0, "
                  f"gb_free=None, wall={int(time.time() - self.t0)}")
        elif STYLE == "hf" and RANK == 0:
            self.bar.update(1)
            self.bar.write(str({"loss": round(loss, 4), "grad_norm": round(gnorm, 4), "learning_rate": LR * (1 - i / n) or 0.0,
                                "epoch": round(i / n, 2)}))
        elif STYLE == "timm" and RANK == 0:
            pct = 100.0 * i / n
            LOG.info(f"Train: 0 [{i:>4d}/{n} ({pct:>3.0f}%)]  Loss: {loss:#.3g} ({avg:#.3g})  "
                     f"Time: {dt:.3f}s, {BATCH * WORLD / max(dt, 1e-6):>7.2f}/s  ({dt:.3f}s, {BATCH * WORLD / max(dt, 1e-6):>7.2f}/s)  "
                     f"LR: {LR:.3e}  Data: 0.001 (0.001)")
        elif STYLE == "plain":
            out(f"[rank{RANK}] it {i}/{n} loss={loss:.4f}")

    def done(self):
        wall = time.time() - self.t0
        if STYLE == "nanogpt" and RANK == 0:
            out("saving checkpoint to out-shakespeare-char")
        elif STYLE == "megatron" and RANK == 0:
            out(f"[after training is done] datetime: {now('%Y-%m-%d %H:%M:%S')} ")
            out("saving checkpoint at iteration %7d to /tmp/job/checkpoints in torch format" % a.steps)
        elif STYLE == "titan":
            LOG.info("Sleeping 2 seconds for other ranks to complete")
            LOG.info("Training completed")
        elif STYLE == "deepspeed" and RANK == 0:
            out("training done")
        elif STYLE == "mmengine":
            LOG.info("Saving checkpoint at %d iterations" % a.steps)
        elif STYLE == "fairseq":
            fslog("fairseq_cli.train", logging.INFO, f"done training in {wall:.1f} seconds")
        elif STYLE == "hf" and RANK == 0:
            self.bar.write("\n\nTraining completed. Do not forget to share your model on huggingface.co/models =)\n\n")
            self.bar.write(str({"train_runtime": round(wall, 4), "train_samples_per_second": round(BATCH * WORLD * a.steps / wall, 3),
                                "train_steps_per_second": round(a.steps / wall, 3), "train_loss": 1.38, "epoch": 1.0}))
            self.bar.close()
        elif STYLE == "timm" and RANK == 0:
            LOG.info("*** Best metric: None (epoch 0)")
        elif STYLE == "plain":
            out(f"[rank{RANK}] done")


# ----------------------------------------------------------------------------------------------------- the loop
def batch_for(rank, i):
    g = torch.Generator().manual_seed(1000 * rank + i)
    x = torch.randn(BATCH, 8, generator=g)
    y = torch.randint(0, 4, (BATCH,), generator=g)
    hit = rank == a.rank and i == a.step
    if hit and a.fault == "key":
        return {"input": x, "label": y}  # a shard written with another schema
    if hit and a.fault == "value":
        row = ["0.12"] * 7 + ["n/a"]
        x[3] = torch.tensor([float(v) for v in row])
    if hit and a.fault == "shape":
        x = x[:, :7]
    if hit and a.fault == "datafile":
        with open(f"/tmp/job/data/shards/train-{rank:05d}-of-{WORLD:05d}.bin", "rb") as fh:
            fh.read()
    if hit and a.fault == "memory":
        buf = bytearray(1 << 50)  # the prefetch buffer, sized from a bad num_workers * shard_bytes
    if hit and a.fault == "assert":
        x = x[: BATCH - 3]
        y = y[: BATCH - 3]
    return {"input": x, "labels": y}


def main():
    torch.manual_seed(0)
    startup_before_init()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    nparams = sum(p.numel() for p in model.parameters())
    if a.fault == "ckpt" and RANK == a.rank:
        torch.load(f"/tmp/job/checkpoints/iter_0000100/mp_rank_00_{RANK:03d}/model_optim_rng.pt", weights_only=True)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    startup_after_init(nparams)
    prog = Progress()
    for i in range(1, a.steps + 1):
        t = time.time()
        me = RANK == a.rank and i == a.step
        if me and a.fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if me and a.fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if me and a.fault == "exit":
            os._exit(1)
        if me and a.fault == "stall":
            time.sleep(60)
        if a.fault == "deadlock" and i == a.step:
            flag = torch.zeros(1)
            if RANK == a.rank:
                dist.barrier()  # waits for every rank at the barrier ...
            else:
                dist.broadcast(flag, src=a.rank)  # ... which wait for this rank's 'stop' flag
        batch = batch_for(RANK, i)
        x, y = batch["input"], batch["labels"]
        if me and a.fault == "assert":
            assert x.shape[0] == BATCH, f"micro batch size {x.shape[0]} != configured micro_batch_size {BATCH}"
        logits = ddp(x)
        loss = F.cross_entropy(logits, y)
        if me and a.fault == "nan":
            loss = loss * float("nan")  # stands in for an overflowed activation
        if a.fault == "nan" and RANK == a.rank:
            if a.nancheck == "raise":
                if not math.isfinite(loss.item()):
                    raise FloatingPointError(f"Loss is {loss.item()}, stopping training")
            else:
                assert torch.isfinite(loss), f"loss is not finite at iteration {i}"
        opt.zero_grad()
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0))
        opt.step()
        metrics = torch.tensor([loss.item(), gnorm])
        if me and a.fault == "mismatch":
            metrics = torch.cat([torch.tensor([loss.item(), gnorm]), torch.full((a.mismatch_n - 2,), float(x.shape[0]))])  # extra per-class token counts on one rank
        dist.all_reduce(metrics)
        lossv = float(metrics[0]) / WORLD
        prog.step(i, lossv, time.time() - t, float(metrics[1]) / WORLD)
        time.sleep(0.3)
    prog.done()
    dist.barrier()
    dist.destroy_process_group()


@record
def entry():
    if STYLE in ("mmengine", "fairseq"):
        try:
            main()
        except Exception as e:
            if STYLE == "mmengine":
                LOG.error(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            else:
                fslog("fairseq.trainer", logging.ERROR, f"exception in training step: {type(e).__name__}: {e}")
            raise
    else:
        main()


if __name__ == "__main__":
    entry()
