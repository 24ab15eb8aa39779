"""A ninety-eighth hand-run batch: VARIABLE-SIZE INPUTS AND PADDING ACROSS RANKS, on gloo. A tiny token tagger under
DDP (Embedding(64,16, padding_idx 0) + positional Embedding(MAX_POS=32,16) -> ReLU -> Linear(16,4); the tag of a token
is its id mod 4), SGD, 8 variable-length sequences per rank and step drawn from length buckets (bucket k holds lengths
4k..4k+3, sorted within the bucket), padded with pad_sequence(batch_first=True) to the rank's local maximum for the
forward; loss = masked cross-entropy summed over the real tokens / their count. After each step the token predictions
are gathered: all_reduce(MAX) of the batch size and padded length, F.pad to those global maxima (rows of length 0),
all_gather of the lengths (int64), of the padded predictions and of the padded tags; the logging rank (0 unless said) unpads and prints the global token
accuracy. Every 3rd step a detection-style eval: 3 images a rank, each with 1-5 boxes, scores 0.2-1.0, boxes under
score 0.3 dropped, images with none left out, torch.cat of the rest -> [K,4]; all_reduce(MAX) of K, pad to [Kmax,4],
all_gather of the padded boxes and the counts, all_gather_object of the per-image box counts. 6 steps, PG timeout
--pg-timeout (12 s). --ddp 0 (for the TORCH_DISTRIBUTED_DEBUG=DETAIL runs: DDP's construction segfaults under DETAIL
on this build) replaces DDP by one all_reduce of the flattened gradients after backward. It prints `rank R world W fault F`, `rank R step S batch B len a-b loss L ntok T`,
`step S gathered T tokens acc A`, `eval step S boxes per rank [...] per image [...]` and `rank R done`. No @record.

Faults (--rank N is the rank whose data or code is odd; the failing step is --at, 3, unless said):
  none        control (exit 0)
  emptyok     the tail bucket (world-1 sequences of length 25-28, dealt round-robin from an offset that turns with the
              step: one each) leaves rank N with nothing at one step; the guard gives it 8 padding rows of length 0
              (exit 0)
  emptybatch  the same without the guard: the collate's fast-path test `lens[0] == lens[-1]` on no lengths: IndexError
  localmax    rank N pads its predictions and tags to its local maximum, not the all_reduced global one, before the
              all_gather (at the first step where its maximum is below the global one): a size mismatch in gloo
  lendtype    rank N builds its lengths tensor as int32 (the others int64) for the lengths all_gather
  wronglens   the logging rank is N; it unpads every rank's gathered tags with its own lengths (the predictions with
              each rank's): the flattened predictions and tags differ in size, RuntimeError in the comparison
  maxpos      rank N's shard skipped the length filter: at step --at one of its documents has 40 tokens, more than
              MAX_POS: IndexError in the positional embedding
  stack       rank N's bucket sampler shuffles within the bucket (the others sort); the collate takes the
              `lens[0] == lens[-1]` fast path (torch.stack) and at step --at its first and last lengths agree while the
              middle ones differ: RuntimeError: stack expects each tensor to be equal size
  batchfirst  rank N's collate calls pad_sequence without batch_first=True: inputs [L,B]; the length mask [B,L] does
              not index the logits [L,B,C]: IndexError
  nodecfg     static padding for the gather from a per-node config ({workdir}/nodecfg/node{GROUP_RANK}.json,
              `gather_pad`): node 1's file says 48, node 0's 32: the all_gather sizes differ by node
  straggler   rank N re-tokenizes an oversized document at step --at, blocking pg_timeout + 6 s before its batch:
              the others time out in DDP's all-reduce
  bucketwait  at step --at the global length schedule picks the long class (24-27); the streaming bucketer polls the
              rank's stream until 8 such sequences arrived; rank N's stream has none (--rank -1: no rank's stream
              has any): it waits forever (the others time out in DDP's all-reduce; with -1 everyone waits)
  boxcols     rank N's eval keeps the score column: its boxes are [K,5], the others' [K,4], in the boxes all_gather
  noboxes     at the step-3 eval every box of rank N's images is under the score threshold: torch.cat of an empty
              list, ValueError
"""
import argparse, datetime, json, os, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault98_work")
p.add_argument("--ddp", type=int, default=1)
a = p.parse_args()
B, V, C, MAX_POS, PAD = 8, 64, 4, 32, 0


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16, padding_idx=PAD)
        self.pos = nn.Embedding(MAX_POS, 16)
        self.fc = nn.Linear(16, C)

    def forward(self, x):
        pos = torch.arange(x.size(1))
        return self.fc(torch.relu(self.emb(x) + self.pos(pos)[None]))


class Stream:
    """A rank's streaming shard: poll() returns the sequences of one length class that arrived since the last poll."""

    def __init__(self, rank, has_long):
        self.rank, self.has_long, self.n = rank, has_long, 0

    def poll(self, lo, hi):
        self.n += 1
        if lo >= 24 and not self.has_long:
            return []
        g = torch.Generator().manual_seed(555 * self.rank + self.n)
        return [torch.randint(1, V, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
                for _ in range(3)]


def make_batch(rank, world, step, stream):
    g = torch.Generator().manual_seed(7919 * rank + 131 * step + 17)
    if a.fault == "bucketwait" and step == a.at:
        seqs = []
        while len(seqs) < B:  # wait for a full bucket of the long class
            seqs += stream.poll(24, 27)
            if len(seqs) < B:
                time.sleep(0.2)
        return seqs[:B]
    k = int(torch.randint(1, 6, (1,), generator=g))
    lens = sorted(int(v) for v in torch.randint(4 * k, 4 * k + 4, (B,), generator=g))
    if a.fault == "stack" and rank == a.rank:
        lens = [lens[i] for i in torch.randperm(B, generator=g).tolist()]  # shuffle=True in its sampler
        if step == a.at:
            lens[-1] = lens[0] = 4 * k + 1
            lens[3] = 4 * k + 2
    if a.fault == "maxpos" and rank == a.rank and step == a.at:
        lens[-1] = 40
    if a.fault in ("emptybatch", "emptyok"):
        # the tail bucket: world-1 long sequences, dealt round-robin from an offset turning with the step
        s_tail = (a.rank - world + 1) % world
        s_tail += world if s_tail < 2 else 0
        if step == s_tail:
            tail = [25 + (i % 4) for i in range(world - 1)]
            lens = [l for i, l in enumerate(tail) if (i + step) % world == rank]
    return [torch.randint(1, V, (l,), generator=g) for l in lens]


def collate(seqs, rank):
    lens = [len(s) for s in seqs]
    if not seqs and a.fault == "emptyok":
        return torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, 1, dtype=torch.long), [0] * B
    tags = [s % C for s in seqs]
    if lens[0] == lens[-1]:  # all one length (buckets are sorted): no padding needed
        return torch.stack(seqs), torch.stack(tags), lens
    batch_first = not (a.fault == "batchfirst" and rank == a.rank)
    return (pad_sequence(seqs, batch_first=batch_first, padding_value=PAD),
            pad_sequence(tags, batch_first=True, padding_value=-100), lens)


def node_cfg():
    path = f"{a.workdir}/nodecfg/node{os.environ.get('GROUP_RANK', '0')}.json"
    if a.fault == "nodecfg" and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    return {}


def gather_tokens(preds, tags, lens, rank, world, step, cfg):
    Bl, L = preds.shape
    if cfg.get("gather_pad"):
        Bg, Lg = Bl, int(cfg["gather_pad"])
    else:
        t = torch.tensor([Bl, L], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        Bg, Lg = t.tolist()
        if a.fault == "localmax" and rank == a.rank:
            Lg = L  # pads to its own maximum
    pp = F.pad(preds, (0, Lg - L, 0, Bg - Bl), value=-1)
    tt = F.pad(tags, (0, Lg - L, 0, Bg - Bl), value=-100)
    dtype = torch.int32 if (a.fault == "lendtype" and rank == a.rank) else torch.int64
    lens_t = torch.tensor(lens + [0] * (Bg - Bl), dtype=dtype)
    lens_all = [torch.empty_like(lens_t) for _ in range(world)]
    dist.all_gather(lens_all, lens_t)
    pp_all = [torch.empty_like(pp) for _ in range(world)]
    dist.all_gather(pp_all, pp)
    tt_all = [torch.empty_like(tt) for _ in range(world)]
    dist.all_gather(tt_all, tt)
    log_rank = a.rank if a.fault == "wronglens" else 0
    if rank == log_rank:
        flat_p = torch.cat([pp_all[r][i, :int(n)] for r in range(world) for i, n in enumerate(lens_all[r])])
        if a.fault == "wronglens":
            flat_t = torch.cat([tt_all[r][i, :n] for r in range(world) for i, n in enumerate(lens)])
        else:
            flat_t = torch.cat([tt_all[r][i, :int(n)] for r in range(world) for i, n in enumerate(lens_all[r])])
        acc = (flat_p == flat_t).float().mean().item()
        print(f"step {step} gathered {flat_p.numel()} tokens acc {acc:.3f}", flush=True)


def detection_eval(rank, world, step):
    g = torch.Generator().manual_seed(31 * rank + step)
    kept, per_image = [], []
    for img in range(3):
        k = int(torch.randint(1, 6, (1,), generator=g))
        boxes, scores = torch.rand(k, 4, generator=g) * 100, 0.2 + 0.8 * torch.rand(k, generator=g)
        if a.fault == "noboxes" and rank == a.rank and step == a.at:
            scores = scores * 0.1  # blank frames: nothing over the threshold
        keep = scores > 0.3
        per_image.append(int(keep.sum()))
        if keep.any():
            det = boxes[keep]
            if a.fault == "boxcols" and rank == a.rank:
                det = torch.cat([det, scores[keep][:, None]], 1)  # keeps the score column
            kept.append(det)
    dets = torch.cat(kept)
    k = torch.tensor([dets.size(0)], dtype=torch.int64)
    dist.all_reduce(k, op=dist.ReduceOp.MAX)
    padded = F.pad(dets, (0, 0, 0, int(k) - dets.size(0)))
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    cnt = torch.tensor([dets.size(0)], dtype=torch.int64)
    cnts = [torch.empty_like(cnt) for _ in range(world)]
    dist.all_gather(cnts, cnt)
    lists = [None] * world
    dist.all_gather_object(lists, per_image)
    if rank == 0:
        print(f"eval step {step} boxes per rank {[int(c) for c in cnts]} per image {lists}", flush=True)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Tagger()) if a.ddp else Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = node_cfg()
    stream = Stream(rank, has_long=not (a.fault == "bucketwait" and a.rank in (rank, -1)))
    print(f"rank {rank} world {world} fault {a.fault}", flush=True)
    for step in range(1, a.steps + 1):
        if a.fault == "straggler" and rank == a.rank and step == a.at:
            time.sleep(a.pg_timeout + 6)  # re-tokenizing an oversized document (a stand-in)
        seqs = make_batch(rank, world, step, stream)
        x, tags, lens = collate(seqs, rank)
        lo, hi = (min(lens, default=0), max(lens, default=0)) if a.fault == "emptyok" else (min(lens), max(lens))
        logits = model(x)
        mask = torch.arange(tags.size(1))[None, :] < torch.tensor(lens)[:, None]
        ntok = int(mask.sum())
        loss = F.cross_entropy(logits[mask], tags[mask], reduction="sum") / max(ntok, 1)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            params = list(model.parameters())
            flat = torch.cat([q.grad.flatten() for q in params])
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat / world, [q.grad for q in params])
        opt.step()
        print(f"rank {rank} step {step} batch {len(seqs)} len {lo}-{hi} loss {loss.item():.4f} ntok {ntok}",
              flush=True)
        with torch.no_grad():
            gather_tokens(logits.argmax(-1), tags, lens, rank, world, step, cfg)
        if step % 3 == 0:
            detection_eval(rank, world, step)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
