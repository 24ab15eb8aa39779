"""A forty-ninth hand-run batch: NON-ENGLISH CODEBASES. A small DDP loop on gloo (2-8 ranks, Linear(8,16)-ReLU-
Linear(16,4), SGD, batch 16, 5 steps) whose own output is in Chinese, as the training code of many Chinese teams is:
progress lines `[rank 3] 第 5 步 损失 1.2345 学习率 0.1`, `训练开始`, `加载检查点 /tmp/job/检查点/模型.pt`, `评估完成`,
logging records `2026-12-03 05:00:00,123 - 训练器 - ERROR - 第 3 步失败：...`, Chinese paths and file names, full-width
punctuation and exceptions raised with Chinese messages.

Setup (the script makes it on first use under --workdir, default /tmp/job): 数据/分片-000R.pt (a dict
{"特征": x, "标签": y} per rank), 检查点/模型.pt (a warm-start state_dict), 检查点/损坏.pt (garbage bytes).

Faults (--rank N: the rank at fault; at step 3 unless said otherwise):
  exc      ValueError("标签越界: 7 不在 [0, 4) 内") from the label check
  key      rank N's step-3 batch dict has "标注" instead of "标签" (KeyError: '标签')
  nockpt   after init_process_group rank N loads 检查点/模型_第N卡.pt, which does not exist (FileNotFoundError)
  nodata   after init_process_group rank N loads its shard from 数据/训练集/分片-000N.pt, which does not exist
  ckptbad  rank N loads 检查点/损坏.pt (garbage); the script raises RuntimeError("检查点加载失败：...") from the
           torch.load error
  nan      a NaN feature; the script logs an ERROR record and raises FloatingPointError("损失为 NaN，停止训练")
  shape    a 9-feature batch; the script logs an ERROR record and re-raises the mat1/mat2 RuntimeError
  osexit   an ERROR record "第 3 步失败：梯度同步异常，进程退出" then os._exit(3)
  segv     ctypes.string_at(0) (SIGSEGV)
  hang     "[rank N] 等待数据加载……" then a 60 s sleep before the step-3 forward (the others time out, --pg-timeout)
  mismatch no DDP (gradients averaged by hand, as TORCH_DISTRIBUTED_DEBUG=DETAIL + DDP segfaults on this torch);
           at step 3 rank N all-reduces a 5-element metric tensor where the others reduce 4 elements
  none     no fault (control); with --warn: a Chinese UserWarning and a WARNING record
Options: --gbk (sys.stdout.reconfigure(encoding="gbk"): progress lines in GBK bytes), --tqdm (a tqdm bar per rank,
desc "第R卡 训练中", on stderr), --no-ddp (gradients by hand; implied by mismatch).
"""
import argparse, ctypes, datetime, logging, math, os, sys, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True, choices=["exc", "key", "nockpt", "nodata", "ckptbad", "nan", "shape",
                                                  "osexit", "segv", "hang", "mismatch", "none"])
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--workdir", default="/tmp/job")
p.add_argument("--gbk", action="store_true")
p.add_argument("--tqdm", action="store_true")
p.add_argument("--warn", action="store_true")
p.add_argument("--no-ddp", action="store_true")
a = p.parse_args()
BATCH = 16
LR = 0.1
if a.gbk:
    sys.stdout.reconfigure(encoding="gbk")
logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
log = logging.getLogger("训练器")
DATA = os.path.join(a.workdir, "数据")
CKPT = os.path.join(a.workdir, "检查点")


def setup(world):
    os.makedirs(DATA, exist_ok=True)
    os.makedirs(CKPT, exist_ok=True)
    for r in range(world):
        f = os.path.join(DATA, f"分片-{r:04d}.pt")
        if not os.path.exists(f):
            g = torch.Generator().manual_seed(r)
            torch.save({"特征": torch.randn(BATCH * a.steps, 8, generator=g),
                        "标签": torch.randint(0, 4, (BATCH * a.steps,), generator=g)}, f)
    torch.manual_seed(0)
    torch.save(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).state_dict(), os.path.join(CKPT, "模型.pt"))
    with open(os.path.join(CKPT, "损坏.pt"), "wb") as fh:
        fh.write(b"\x00\x01 not a checkpoint \xff" * 8)


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and rank == 0:
        setup(world)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    dist.barrier()
    bad = rank == a.rank and a.fault != "none"
    if rank == 0:
        print(f"训练开始：世界大小 {world}，后端 gloo，共 {a.steps} 步", flush=True)
    if a.warn:
        warnings.warn(f"学习率 {LR} 过大，可能导致训练不稳定")
        log.warning(f"[rank {rank}] 未找到验证集目录 {os.path.join(a.workdir, '数据', '验证集')}，跳过评估前的预热")
    shard = os.path.join(DATA, f"分片-{rank:04d}.pt")
    if bad and a.fault == "nodata":
        shard = os.path.join(DATA, "训练集", f"分片-{rank:04d}.pt")
    print(f"[rank {rank}] 加载数据分片 {shard}", flush=True)
    data = torch.load(shard)
    ckpt = os.path.join(CKPT, "模型.pt")
    if bad and a.fault == "nockpt":
        ckpt = os.path.join(CKPT, f"模型_第{rank}卡.pt")
    if bad and a.fault == "ckptbad":
        ckpt = os.path.join(CKPT, "损坏.pt")
    print(f"[rank {rank}] 加载检查点 {ckpt}", flush=True)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    try:
        state = torch.load(ckpt)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise RuntimeError(f"检查点加载失败：{ckpt}") from e
    net.load_state_dict(state)
    no_ddp = a.no_ddp or a.fault == "mismatch"
    model = net if no_ddp else nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = range(1, a.steps + 1)
    if a.tqdm:
        from tqdm import tqdm
        steps = tqdm(steps, desc=f"第{rank}卡 训练中", ncols=80)
    for step in steps:
        lo = (step - 1) * BATCH
        batch = {"特征": data["特征"][lo:lo + BATCH].clone(), "标签": data["标签"][lo:lo + BATCH].clone()}
        if bad and step == 3:
            if a.fault == "exc":
                batch["标签"][7] = 7
            elif a.fault == "key":
                batch = {"特征": batch["特征"], "标注": batch["标签"]}
            elif a.fault == "nan":
                batch["特征"][3, 5] = float("nan")
            elif a.fault == "shape":
                batch["特征"] = torch.randn(BATCH, 9)
            elif a.fault == "osexit":
                log.error(f"第 {step} 步失败：梯度同步异常，进程退出")
                os._exit(3)
            elif a.fault == "segv":
                ctypes.string_at(0)
            elif a.fault == "hang":
                print(f"[rank {rank}] 等待数据加载……", flush=True)
                time.sleep(60)
        x, y = batch["特征"], batch["标签"]
        if int(y.max()) >= 4:
            raise ValueError(f"标签越界: {int(y.max())} 不在 [0, 4) 内")
        opt.zero_grad()
        try:
            loss = F.cross_entropy(model(x), y)
        except RuntimeError as e:
            log.error(f"第 {step} 步失败：{e}")
            raise
        if not math.isfinite(loss.item()):
            log.error(f"第 {step} 步失败：损失为 {loss.item()}（第 {rank} 卡）")
            raise FloatingPointError("损失为 NaN，停止训练")
        loss.backward()
        if no_ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
            metric = torch.tensor([loss.item(), 0.0, 0.0, float(step)])
            if bad and step == 3 and a.fault == "mismatch":
                metric = torch.cat([metric, torch.tensor([1.0])])
            dist.all_reduce(metric)
        opt.step()
        msg = f"[rank {rank}] 第 {step} 步 损失 {loss.item():.4f} 学习率 {LR}"
        if a.tqdm:
            steps.set_postfix_str(f"损失={loss.item():.4f}")
        else:
            print(msg, flush=True)
        time.sleep(0.05)
    dist.barrier()
    if rank == 0:
        print("评估完成，准确率 0.2500", flush=True)
        log.info(f"保存检查点 {os.path.join(CKPT, '模型_最终.pt')}")
    dist.destroy_process_group()
    print(f"[rank {rank}] 训练结束", flush=True)


if __name__ == "__main__":
    main()
