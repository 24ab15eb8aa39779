"""A two-hundred-and-seventy-ninth hand-run batch: FEW-SHOT CLASSIFICATION WITH PROTOTYPICAL NETWORKS.

Synthetic class-conditional 12x12 images (one mean pattern per class and domain, plus noise), episodes of
N-way K-shot support and query sets drawn from the classes of a split file (/tmp/job_work/splits/<domain>.txt),
a three-block conv embedding (conv 3x3, ReLU, max-pool; warm-started from ckpt/embed_3blocks.pt), a linear
distance head, class prototypes as the means of the support embeddings, a softmax over negative squared
distances, DDP (gloo) over embedding and head (or --ddp 0: gradients all_reduced by hand), the episode accuracy
all_reduced every step and the per-rank episode accuracies all_gathered at step 3, destroy_process_group.
--prep 1 writes the split files and the checkpoints into the work dir.

Faults:
- clsidx: from step 2 rank N numbers its query labels 1..way instead of 0..way-1 (IndexError in the loss).
- emptyproto: rank N reads a shot of 0 for the last class at step 1; its prototype is nan and the check raises.
- accgather: rank N all_gathers its accuracies including the warm-up episode (another length) at step 3.
- nosplit: rank N looks for its class split in splits_v2/, which does not exist (FileNotFoundError at startup).
- baddomain: rank N's config names the domain "quickdraw", not in the domain table (KeyError at startup).
- embwidth: every rank builds the distance head 32 wide for the 16-wide embedding (shape error).
- embckpt: rank N loads ckpt/embed_4blocks.pt into the three-block embedding (unexpected keys).
- slowepisode: rank N samples step 2's episode by rejection in Python for --stall seconds (others wait).
- waitseed: rank N waits at step 1 for an episode seed from rank 0 that rank 0 never sends.
- sigterm: rank N sends itself SIGTERM after step 3's optimizer step.
- none: control.

What happened (filled in after the runs):
- clsidx: IndexError: index 5 is out of bounds for dimension 1 with size 5 on rank N at step 2; peers Connection closed (fewc_clsidx_np4_r1_plain, _np3_r2_tee).
- emptyproto: FloatingPointError 'non-finite prototype distances at step 1 (support counts per class [3, 3, 3, 3, 0])' on rank N (fewc_emptyproto_np3_r1_detail, _np4_r3_loglevel).
- accgather: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank N at step 3 (fewc_accgather_np4_r2_prefix, _np3_r0_pymodule).
- nosplit: FileNotFoundError for /tmp/job_work/splits_v2/omniglot.txt on rank 1 at startup, in its stderr.log (fewc_nosplit_np3_r1_redirects).
- baddomain: KeyError: 'quickdraw' on rank N at startup (fewc_baddomain_np4_r3_tee_trainer, _np3_r1_filter).
- embwidth: every rank: 'mat1 and mat2 shapes cannot be multiplied (35x16 and 32x8)' in step 0's forward (fewc_embwidth_np3_rall_wrapper).
- embckpt: Unexpected key(s) "blocks.3.0.weight", "blocks.3.0.bias" on rank N (fewc_embckpt_np4_r2_pdsh2, _np3_r1_restart: attempt 1 died in connectFullMesh).
- slowepisode: PG 12 s: peers 'Timed out waiting 12000ms' (fewc_slowepisode_np3_r2_tee); PG 300 s: killed at 60 s, exit 124 (_np3_r1_plain).
- waitseed: rank 1 in recv and the others in the DDP forward: 'Timed out waiting 12000ms' (fewc_waitseed_np4_r1_loglevel).
- sigterm: rank N exitcode -15, no traceback; peers Connection reset/closed; Root Cause rank N (fewc_sigterm_np3_r2_plain, _np4_r0_pymodule).
- none: exit 0, 'rank 0 done: 6 episodes, last loss 1.6087' (fewc_none_np3_rnone_tee).
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

DOMAINS = {"omniglot": 11, "glyphs": 23, "textures": 37}
HID = 16


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--way", type=int, default=5)
    p.add_argument("--shot", type=int, default=3)
    p.add_argument("--query", type=int, default=4)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--work", default="/tmp/fault279_work")
    p.add_argument("--domain", default="omniglot")
    p.add_argument("--prep", type=int, default=0)
    return p.parse_args()


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))


class Embed(nn.Module):
    def __init__(self, width=HID, nblocks=3):
        super().__init__()
        chans = [1] + [width] * nblocks
        self.blocks = nn.Sequential(*[block(chans[i], chans[i + 1]) for i in range(nblocks)])

    def forward(self, x):
        return self.blocks(x).flatten(1)


class ProtoNet(nn.Module):
    def __init__(self, width=HID):
        super().__init__()
        self.embed = Embed(HID)
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        return self.head(self.embed(x))


def prep(work):
    os.makedirs(os.path.join(work, "splits"), exist_ok=True)
    os.makedirs(os.path.join(work, "ckpt"), exist_ok=True)
    for name, seed in DOMAINS.items():
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(40, generator=g)[:24].tolist()
        with open(os.path.join(work, "splits", name + ".txt"), "w") as f:
            f.write("\n".join(str(i) for i in ids) + "\n")
    torch.manual_seed(0)
    torch.save(Embed(HID, 3).state_dict(), os.path.join(work, "ckpt", "embed_3blocks.pt"))
    torch.save(Embed(HID, 4).state_dict(), os.path.join(work, "ckpt", "embed_4blocks.pt"))
    print(f"prepared splits and checkpoints in {work}")


def class_images(cls, dseed, n, gen):
    pg = torch.Generator().manual_seed(dseed * 1000 + cls)
    mean = torch.rand(1, 12, 12, generator=pg)
    return mean.unsqueeze(0) + 0.3 * torch.randn(n, 1, 12, 12, generator=gen)


def episode(classes, dseed, way, shot, query, gen, shots=None):
    pick = torch.randperm(len(classes), generator=gen)[:way].tolist()
    sx, sy, qx, qy = [], [], [], []
    for j, ci in enumerate(pick):
        k = shot if shots is None else shots[j]
        imgs = class_images(classes[ci], dseed, k + query, gen)
        sx.append(imgs[:k]); sy += [j] * k
        qx.append(imgs[k:]); qy += [j] * query
    return torch.cat(sx), torch.tensor(sy), torch.cat(qx), torch.tensor(qy)


def main():
    a = parse()
    if a.prep:
        prep(a.work)
        return
    rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
    bad = a.rank == -1 or a.rank == rank
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(1234)

    domain = "quickdraw" if (a.fault == "baddomain" and bad) else a.domain
    dseed = DOMAINS[domain]
    split_dir = "splits_v2" if (a.fault == "nosplit" and bad) else "splits"
    with open(os.path.join(a.work, split_dir, a.domain + ".txt")) as f:
        classes = [int(line) for line in f if line.strip()]
    print(f"rank {rank}/{world}: domain {domain}, {len(classes)} training classes, {a.way}-way {a.shot}-shot")

    width = HID * 2 if a.fault == "embwidth" else HID
    model = ProtoNet(width)
    ck = "embed_4blocks.pt" if (a.fault == "embckpt" and bad) else "embed_3blocks.pt"
    model.embed.load_state_dict(torch.load(os.path.join(a.work, "ckpt", ck)))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    accs = [0.2]  # warm-up episode (chance level)

    for s in range(a.steps):
        shots = None
        if a.fault == "emptyproto" and bad and s == 1:
            shots = [a.shot] * (a.way - 1) + [0]
        if a.fault == "slowepisode" and bad and s == 2:
            print(f"rank {rank} step {s}: resampling episode classes by rejection (distinct superclasses)", flush=True)
            t0 = time.time(); tries = 0
            while time.time() - t0 < a.stall:
                tries += 1
                _ = sorted(torch.randperm(len(classes), generator=gen)[:a.way].tolist())
                time.sleep(0.02)
        if a.fault == "waitseed" and bad and s == 1:
            seed = torch.zeros(1, dtype=torch.long)
            dist.recv(seed, src=0 if rank != 0 else 1)
            gen.manual_seed(int(seed.item()))
        sx, sy, qx, qy = episode(classes, dseed, a.way, a.shot, a.query, gen, shots)
        if a.fault == "clsidx" and bad and s >= 2:
            qy = qy + 1
        z = net(torch.cat([sx, qx]))
        zs, zq = z[: len(sx)], z[len(sx):]
        protos = torch.stack([zs[sy == c].mean(0) for c in range(a.way)])
        dists = ((zq.unsqueeze(1) - protos.unsqueeze(0)) ** 2).sum(-1)
        if not torch.isfinite(dists).all():
            counts = [int((sy == c).sum()) for c in range(a.way)]
            raise FloatingPointError(f"non-finite prototype distances at step {s} (support counts per class {counts})")
        log_p = torch.log_softmax(-dists, dim=1)
        loss = -log_p[torch.arange(len(qy)), qy].mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad); p.grad /= world
        opt.step()
        acc = (log_p.argmax(1) == qy).float().mean()
        accs.append(float(acc))
        t = acc.clone(); dist.all_reduce(t); t /= world
        print(f"rank {rank} step {s} loss {loss.item():.4f} episode acc {t.item():.3f}", flush=True)
        if s == 3:
            mine = torch.tensor(accs if (a.fault == "accgather" and bad) else accs[1:])
            out = [torch.zeros(4) for _ in range(world)]
            dist.all_gather(out, mine)
            if rank == 0:
                print(f"rank 0: per-rank mean episode acc {[round(float(o.mean()), 3) for o in out]}", flush=True)
        if a.fault == "sigterm" and bad and s == 3:
            os.kill(os.getpid(), signal.SIGTERM)
    if rank == 0:
        print(f"rank 0 done: {a.steps} episodes, last loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
