"""A two-hundredth hand-run batch: HUMAN POSE ESTIMATION WITH HEATMAPS.

Each rank draws synthetic 32x32 images of stick figures (8 joints, limbs drawn along the skeleton read from
/tmp/job_work/data/person_keypoints_train.json), builds Gaussian heatmap targets at 16x16, and trains a tiny
hourglass-like CNN (down, bottleneck, up, skip) to predict the heatmaps, with flip augmentation whose keypoint
flip map comes from /tmp/job_work/data/flip_map.json, a hand-written soft-argmax for a coordinate loss, and
DDP. Rank 0 saves the initial weights and every rank reloads them. After training each rank computes per-joint
PCK counts and OKS by hand; the counts are all_gathered and the OKS all_reduced; rank 0 saves the pose model.
Launch under torchrun, torch.distributed.launch, a bash loop (env://) or --spawn N.

Faults:
  flipidx   rank N reads flip_map_coco17.json, whose flip pairs go up to keypoint 16 for 8 joints (IndexError)
  hmres     every rank's head upsamples to 32x32 heatmaps against 16x16 targets (RuntimeError in the loss)
  annot     rank N opens person_keypoints_train_v2.json, which is not there (FileNotFoundError)
  softnan   rank N's soft-argmax beta is inf after warm-up -> NaN coordinates, the program's check
  sigma0    rank N's Gaussian target sigma is 0.0 (ZeroDivisionError)
  jointskey every rank's config uses the old key "n_joints" instead of "num_joints" (KeyError)
  pcklen    rank N all_gathers its PCK counts with an extra total entry (gloo size mismatch)
  ckptjoint rank N builds its heatmap head with 9 joints and loads the init checkpoint (size mismatch)
  slowtgt   rank N regenerates its targets at 4x resolution before the OKS all_reduce (peers time out)
  segv      rank N sends itself SIGSEGV after step 3
  exit3     rank N prints an error line after validation and exits with code 3
  none      no fault

What happened (filled in after the runs):
  flipidx   IndexError list assignment index out of range on rank N in flip_perm (np4 r2 ranklabel, np3 r1 legacy)
  hmres     RuntimeError size of tensor a (32) must match b (16) in the loss on every rank (np3 rall srunlabel)
  annot     FileNotFoundError person_keypoints_train_v2.json on rank N (np4 r3 mpitag, np3 r1 files)
  softnan   FloatingPointError soft-argmax coordinates not finite at step 2 on rank N (np3 r1 spawn, np4 r2 logfmt)
  sigma0    ZeroDivisionError float division by zero in gaussian_targets on rank N (np3 r2 tee, np4 r1 bashloop)
  jointskey KeyError: 'num_joints' on every rank right after init (np4 rall pdsh2)
  pcklen    rank 1: ProcessGroupGloo::allgather: invalid tensor size (expected (9), got (8)) (np3 r1 ranklabel)
  ckptjoint size mismatch for head.weight/head.bias loading the init checkpoint on rank 2 (np4 r2 logfmt)
  slowtgt   12 s: peers Timed out waiting 12000ms in all_reduce (np3 r2 bashloop); 300 s: timeout 60 (np4 r1 srunlabel)
  segv      rank N killed by SIGSEGV after step 3 (np4 r3 legacy, Root Cause -11; np3 r1 spawn, ProcessExitedException)
  exit3     rank N ERROR line after validation and exit 3 (np4 r1 files, np4 r3 pdsh2)
  none      exit 0, rank 0 saved the pose model (np3 bashloop)
"""
import argparse, json, logging, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault200_work"


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def draw_figure(joints, skeleton, size, gen):
    img = torch.rand(1, size, size, generator=gen) * 0.2
    pts = joints * (size / 16.0)
    for a, b in skeleton:
        for t in torch.linspace(0, 1, 12):
            x, y = (pts[a] * (1 - t) + pts[b] * t).long().clamp(0, size - 1).tolist()
            img[0, y, x] = 1.0
    return img


def gaussian_targets(joints, res, sigma):
    norm = 1.0 / (2.0 * sigma * sigma)
    ys, xs = torch.meshgrid(torch.arange(res, dtype=torch.float32), torch.arange(res, dtype=torch.float32),
                            indexing="ij")
    d2 = (xs[None] - joints[:, 0, None, None]) ** 2 + (ys[None] - joints[:, 1, None, None]) ** 2
    return torch.exp(-d2 * norm)


def soft_argmax(hm, beta):
    n, j, h, w = hm.shape
    p = torch.softmax(hm.reshape(n, j, -1) * beta, dim=2).reshape(n, j, h, w)
    xs = torch.arange(w, dtype=hm.dtype)
    ys = torch.arange(h, dtype=hm.dtype)
    return torch.stack([(p.sum(2) * xs).sum(2), (p.sum(3) * ys).sum(2)], dim=2)


class Hourglass(nn.Module):
    def __init__(self, joints, out_res, c=16):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, stride=2, padding=1)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(c, c, 3, padding=1)
        self.skip = nn.Conv2d(c, c, 1)
        self.head = nn.Conv2d(c, joints, 1)
        self.out_res = out_res

    def forward(self, x):
        s = F.relu(self.stem(x))
        d = F.relu(self.mid(F.relu(self.down(s))))
        u = F.interpolate(d, size=s.shape[-2:], mode="nearest") + self.skip(s)
        return F.interpolate(self.head(u), size=(self.out_res, self.out_res), mode="bilinear", align_corners=False)


def flip_perm(path, nj):
    with open(path) as f:
        pairs = json.load(f)["flip_pairs"]
    perm = list(range(nj))
    for a, b in pairs:
        perm[a], perm[b] = b, a
    return perm


def worker(rank, a, world):
    if a.spawn:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    r = int(os.environ["RANK"])
    bad = a.fault != "none" and (a.rank == -1 or a.rank == r)
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        h.addFilter(RankFilter(r))
        logging.basicConfig(level=logging.INFO, handlers=[h])
        say, err = logging.getLogger("pose").info, logging.getLogger("pose").error
    else:
        say = err = lambda m: print(m, flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    ws = dist.get_world_size()
    cfg = {"num_joints": 8, "img_size": 32, "hm_res": 16, "out_res": 16, "sigma": 1.5, "beta": 8.0, "lr": 0.05}
    if bad and a.fault == "jointskey":
        cfg["n_joints"] = cfg.pop("num_joints")
    if bad and a.fault == "hmres":
        cfg["out_res"] = 32
    if bad and a.fault == "sigma0":
        cfg["sigma"] = 0.0
    if bad and a.fault == "softnan":
        cfg["beta"] = float("inf")
    nj = cfg["num_joints"]
    ann = "person_keypoints_train_v2.json" if bad and a.fault == "annot" else "person_keypoints_train.json"
    with open(os.path.join(WORK, "data", ann)) as f:
        skeleton = json.load(f)["skeleton"]
    fm = "flip_map_coco17.json" if bad and a.fault == "flipidx" else "flip_map.json"
    perm = flip_perm(os.path.join(WORK, "data", fm), nj)
    say(f"rank {r}/{ws}: {nj} joints, {len(skeleton)} limbs, heatmaps {cfg['hm_res']}x{cfg['hm_res']}, "
        f"sigma {cfg['sigma']}")
    gen = torch.Generator().manual_seed(200 + r)
    base = torch.tensor([[8, 2], [8, 5], [5, 6], [11, 6], [3, 10], [13, 10], [6, 14], [10, 14]], dtype=torch.float32)
    joints = (base[None] + torch.randn(48, 8, 2, generator=gen) * 0.8).clamp(0.5, 15.0)[:, :nj]
    imgs = torch.stack([draw_figure(j, skeleton, cfg["img_size"], gen) for j in joints])
    targets = torch.stack([gaussian_targets(j, cfg["hm_res"], cfg["sigma"]) for j in joints])
    torch.manual_seed(0)
    model = Hourglass(nj + (1 if bad and a.fault == "ckptjoint" else 0), cfg["out_res"])
    ck = os.path.join(WORK, "ckpt", "pose_init.pt")
    if r == 0:
        os.makedirs(os.path.dirname(ck), exist_ok=True)
        torch.save(model.state_dict(), ck)
    dist.barrier()
    model.load_state_dict(torch.load(ck))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=0.9)
    for step in range(a.steps):
        idx = torch.arange(step * 8, step * 8 + 8) % len(imgs)
        x, y, kp = imgs[idx], targets[idx], joints[idx]
        if step % 2 == 1:
            x, y = x.flip(-1), y.flip(-1)[:, perm]
            kp = kp[:, perm].clone()
            kp[..., 0] = cfg["hm_res"] - 1 - kp[..., 0]
        hm = ddp(x)
        beta = cfg["beta"] if step >= 2 else 1.0
        coords = soft_argmax(hm, beta)
        if not torch.isfinite(coords).all():
            raise FloatingPointError(f"rank {r}: soft-argmax coordinates are not finite at step {step} "
                                     f"(beta {beta}, {int((~torch.isfinite(coords)).sum())} bad values)")
        loss = F.mse_loss(hm, y) * 100 + 0.01 * (coords - kp).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"rank {r} step {step} loss {loss.item():.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        pred = soft_argmax(ddp.module(imgs), cfg["beta"])
    dist_err = (pred - joints).norm(dim=2)
    pck = (dist_err < 0.1 * cfg["hm_res"] * 2).sum(0).float()
    if bad and a.fault == "pcklen":
        pck = torch.cat([pck, pck.sum().view(1)])
    gathered = [torch.zeros(nj) for _ in range(ws)]
    dist.all_gather(gathered, pck)
    if bad and a.fault == "slowtgt":
        say(f"rank {r}: regenerating heatmap targets at {4 * cfg['hm_res']}x{4 * cfg['hm_res']} for OKS scoring")
        time.sleep(a.stall)
    oks = torch.exp(-dist_err ** 2 / (2 * (0.5 * cfg["sigma"]) ** 2)).mean().view(1)
    dist.all_reduce(oks)
    oks /= ws
    pck_all = torch.stack(gathered).sum(0) / (len(imgs) * ws)
    say(f"rank {r} val OKS {oks.item():.3f} PCK@0.2 {[round(v, 2) for v in pck_all.tolist()]}")
    if bad and a.fault == "exit3":
        err(f"ERROR rank {r}: PCK@0.2 is {pck_all.mean().item():.3f} but {int((pred < 0).sum())} predicted "
            "keypoints fall outside the heatmap on this shard; refusing to save pose model")
        sys.exit(3)
    dist.barrier()
    if r == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save({"model": model.state_dict(), "flip_perm": perm}, os.path.join(WORK, "out", "pose_final.pt"))
        say(f"rank 0: saved pose model to {WORK}/out/pose_final.pt")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        worker(None, a, None)


if __name__ == "__main__":
    main()
