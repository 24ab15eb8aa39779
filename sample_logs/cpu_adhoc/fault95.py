"""A ninety-fifth hand-run batch: MIXTURE OF EXPERTS AND ALL-TO-ALL ROUTING on gloo. A tiny model
fc1 Linear(8,16, no bias) -> MoE(16) -> ReLU -> fc2 Linear(16,4), trained --steps (6) steps with SGD on --tokens (32)
synthetic tokens per rank. The MoE layer has --experts experts (default: one per rank; --experts 2W gives two per rank), each
an MLP Linear(16,32)-ReLU-Linear(32,16) held by rank e // (E/W). A gate Linear(16,E, no bias) plus a router-bias buffer
(aux-free balancing, zero at start) picks the top-k (--topk 1) experts per token; the tokens are sorted by destination rank, the ranks exchange their per-rank split counts with
`dist.all_to_all_single(recv_counts, send_counts)`, then the local expert ids (`all_to_all_single` with split sizes)
and the tokens themselves through an autograd Function whose backward is the reverse `all_to_all_single`; the expert
outputs go back the same way and are combined with the gate weights (residual). A Switch-style load-balancing loss
(aux = E * sum_e f_e * P_e, weight 0.01) is added; a finite check on the step's losses; the dense parameters' gradients
are averaged with one `all_reduce` of their flattened concatenation (the experts are not replicated); the step logs
the global gradient norm over all parameters. Expert capacity = ceil(capacity_factor * T * k / E) (--capacity-factor
2.5; 0 means dropless); `--overflow assert` (default) asserts that no expert gets more, `--overflow drop` drops the
excess tokens. Prints `rank R world W experts E/R fault F`, `rank R step S loss L aux A load [..] gnorm G` and
`rank R done`. PG timeout --pg-timeout (12 s). No @record.

Faults (rank N = --rank; badsplit, reroute, collapse, gatetemp and emptyok set the overflow/capacity/guard config they
come with, as their launch scripts would):
  none        control (exit 0)
  collapse    every rank's router bias was loaded with expert 0 favoured by +8: every token goes to expert 0 (rank 0
              does all the expert work); with --capacity-factor 0 (dropless) it works, only unbalanced (aux ~E)
  collapsecap the same with the default capacity: every rank's capacity assert fires (AssertionError, every rank)
  capacity    rank N's shard was not standardised (raw values, offset +30): its tokens all pick one expert and its
              capacity assert fires: AssertionError on rank N
  badsplit    --overflow drop on every rank; the split sizes are computed from the counts before the drop; rank N's
              raw shard (as capacity) overflows, so its input split sizes no longer sum to its send buffer's length:
              the all_to_all_single of the expert ids raises on rank N
  skipcount   rank N caches its receive counts from step 1 ("routing is static after warm-up") and skips the count
              exchange from step 2: its next all_to_all does not line up with the peers' count exchange
  cntdtype    rank N builds its count tensor as int32 (the peers int64): the count exchange's sizes differ
  ndivide     --experts is not a multiple of the world size: the config check raises ValueError on every rank
  cfgone      rank N's node-local config override sets num_experts = E + 2: its check raises ValueError on rank N
  nograd      rank N's MOE_FAST_A2A=1 path exchanges tokens with plain dist.all_to_all_single (no autograd
              Function): no gradient reaches its experts and its backward skips the reverse exchange; the
              grad-norm log over all parameters meets p.grad None: AttributeError on rank N
  gatetemp    (dropless config) rank N's gate temperature schedule (per-rank jitter) reaches 0 at step 3: logits/0,
              NaN probabilities, NaN aux loss: the finite check raises FloatingPointError on rank N
  empty       rank N's shard is exhausted at step 3: zero tokens; the aux loss's mean over no tokens is NaN: the
              finite check raises FloatingPointError on rank N
  emptyok     the same empty batch with the guard (--guard-empty): aux 0, CE summed over max(T,1); the zero-size
              exchanges work; exit 0
  straggler   rank N writes its expert-load dump synchronously at step 3 and blocks for pg_timeout + 6 s: the
              peers' count exchange times out
  reroute     --overflow reroute (dropless rerouting to the next expert until none is over capacity) with a
              capacity factor < 1 on every rank: total capacity < tokens and the loop never ends on any rank (hang)
"""
import argparse, datetime, json, math, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--tokens", type=int, default=32)
p.add_argument("--experts", type=int, default=0)
p.add_argument("--topk", type=int, default=1)
p.add_argument("--capacity-factor", type=float, default=2.5)
p.add_argument("--overflow", default="assert", choices=["assert", "drop", "reroute"])
p.add_argument("--guard-empty", action="store_true")
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault95_work")
a = p.parse_args()
D = 16
# the configs these faults come with (as their launch scripts set them)
if a.fault == "badsplit":
    a.overflow = "drop"
if a.fault == "reroute":
    a.overflow, a.capacity_factor = "reroute", 0.75
if a.fault in ("collapse", "gatetemp"):
    a.capacity_factor = 0.0  # dropless
if a.fault == "emptyok":
    a.guard_empty = True


class AllToAll(torch.autograd.Function):
    """Token exchange whose backward sends the gradients back the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gi = g.new_empty((sum(in_splits), g.shape[1]))
        dist.all_to_all_single(gi, g.contiguous(), in_splits, out_splits)
        return gi, None, None


def plain_a2a(x, out_splits, in_splits):
    out = x.new_empty((sum(out_splits), x.shape[1]))
    dist.all_to_all_single(out, x.detach().contiguous(), out_splits, in_splits)
    return out


class MoE(nn.Module):
    def __init__(self, num_experts, rank, world, fast_a2a=False):
        super().__init__()
        self.E, self.rank, self.world = num_experts, rank, world
        self.epr = num_experts // world
        self.gate = nn.Linear(D, num_experts, bias=False)
        self.register_buffer("router_bias", torch.zeros(num_experts))
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))
                                     for _ in range(self.epr))
        self.exchange = plain_a2a if fast_a2a else AllToAll.apply
        self.temp = 1.0
        self.cached_recv = None
        self.count_dtype = torch.int64
        self.step = 0

    def route(self, probs):
        T = probs.shape[0]
        topv, topi = probs.topk(a.topk, dim=-1)
        flat_e, flat_w = topi.reshape(-1), topv.reshape(-1)
        flat_tok = torch.arange(T).repeat_interleave(a.topk)
        cnt = torch.bincount(flat_e, minlength=self.E)
        keep = torch.ones_like(flat_e, dtype=torch.bool)
        if a.capacity_factor > 0:
            cap = math.ceil(a.capacity_factor * T * a.topk / self.E)
            if a.overflow == "assert":
                e = int(cnt.argmax())
                assert int(cnt[e]) <= cap, (f"expert capacity overflow on rank {self.rank}: expert {e} got "
                                            f"{int(cnt[e])} tokens, capacity {cap}")
            elif a.overflow == "drop":
                seen = torch.zeros(self.E, dtype=torch.long)
                for i, e in enumerate(flat_e.tolist()):
                    seen[e] += 1
                    keep[i] = bool(seen[e] <= cap)
            else:  # reroute: move the excess to the next expert until every expert fits
                flat_e = flat_e.clone()
                while True:
                    load = torch.bincount(flat_e, minlength=self.E)
                    over = (load > cap).nonzero().flatten().tolist()
                    if not over:
                        break
                    for e in over:
                        idx = (flat_e == e).nonzero().flatten()[cap:]
                        flat_e[idx] = (e + 1) % self.E
                cnt = torch.bincount(flat_e, minlength=self.E)
        return flat_e, flat_w, flat_tok, cnt, keep

    def forward(self, x):
        self.step += 1
        T = x.shape[0]
        probs = ((self.gate(x) + self.router_bias) / self.temp).softmax(-1)
        flat_e, flat_w, flat_tok, cnt, keep = self.route(probs)
        # split counts per destination rank (computed from the routing counts)
        send_counts = cnt.view(self.world, self.epr).sum(1).to(self.count_dtype)
        flat_e, flat_w, flat_tok = flat_e[keep], flat_w[keep], flat_tok[keep]
        order = flat_e.argsort(stable=True)
        e_sorted, tok_sorted = flat_e[order], flat_tok[order]
        send = x[tok_sorted]
        if self.cached_recv is not None:
            recv_counts = self.cached_recv
        else:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            if a.fault == "skipcount" and self.rank == a.rank:
                self.cached_recv = recv_counts  # "routing is static after warm-up"
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
        recv_ids = torch.empty(sum(out_splits), dtype=torch.int64)
        dist.all_to_all_single(recv_ids, (e_sorted % self.epr).contiguous(), out_splits, in_splits)
        recv = self.exchange(send, out_splits, in_splits)
        y = recv.new_zeros(recv.shape)
        for j, expert in enumerate(self.experts):
            m = recv_ids == j
            if bool(m.any()):
                y[m] = expert(recv[m])
        back = self.exchange(y, in_splits, out_splits)
        out = x.new_zeros(x.shape).index_add(0, tok_sorted, back * flat_w[order, None])
        if a.guard_empty and T == 0:
            aux = probs.sum() * 0.0
        else:
            f = cnt.float() / max(1, int(cnt.sum()))
            aux = self.E * (f * probs.mean(0)).sum()
        return x + out, aux, cnt


def batch(rank, step, world):
    g = torch.Generator().manual_seed(1000 * rank + step)
    T = a.tokens
    if a.fault in ("empty", "emptyok") and rank == a.rank and step >= 3:
        T = 0  # this rank's shard is exhausted
    x = torch.randn(T, 8, generator=g)
    teacher = torch.Generator().manual_seed(7)
    y = (x @ torch.randn(8, 4, generator=teacher)).argmax(-1)
    if a.fault in ("capacity", "badsplit") and rank == a.rank:
        x = x + 30.0  # raw sensor values: this shard was not standardised
    return x, y


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    E = a.experts or world
    if a.fault == "cfgone" and me:
        E = E + 2  # node-local override of moe.num_experts
    if E % world != 0:
        raise ValueError(f"moe.num_experts={E} must be a multiple of the world size {world} (expert parallelism "
                         f"places num_experts/world_size experts on every rank)")
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, D, bias=False), nn.Linear(D, 4)
    torch.manual_seed(100 + rank)  # experts differ per rank
    fast = a.fault == "nograd" and me
    if fast:
        os.environ["MOE_FAST_A2A"] = "1"
    moe = MoE(E, rank, world, fast_a2a=os.environ.get("MOE_FAST_A2A") == "1")
    torch.manual_seed(1)
    moe.gate.reset_parameters()  # the gate is replicated
    if a.fault in ("collapse", "collapsecap"):
        with torch.no_grad():
            moe.router_bias[0] += 8.0
    if a.fault == "cntdtype" and me:
        moe.count_dtype = torch.int32
    dense = list(fc1.parameters()) + list(moe.gate.parameters()) + list(fc2.parameters())
    params = dense + list(moe.experts.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    print(f"rank {rank} world {world} experts {E}/{moe.epr} topk {a.topk} fault {a.fault}", flush=True)
    os.makedirs(a.workdir, exist_ok=True)
    for step in range(1, a.steps + 1):
        if a.fault == "gatetemp" and me:
            moe.temp = max(0.0, 1.0 - 0.5 * (step - 1))  # per-rank jitter made its schedule decay too fast
        if a.fault == "straggler" and me and step == 3:
            with open(f"{a.workdir}/load_rank{rank}.json", "w") as fh:
                json.dump({"step": step, "note": "expert load dump"}, fh)
                time.sleep(a.pg_timeout + 6)  # the synchronous dump blocks on the slow file system
        x, y = batch(rank, step, world)
        opt.zero_grad()
        h, aux, cnt = moe(fc1(x))
        logits = fc2(F.relu(h))
        if a.guard_empty:
            ce = F.cross_entropy(logits, y, reduction="sum") / max(1, x.shape[0])
        else:
            ce = F.cross_entropy(logits, y)
        for name, v in (("aux", aux), ("loss", ce)):
            if not math.isfinite(v.item()):
                raise FloatingPointError(f"rank {rank}: {name} is {v.item()} at step {step}, stopping")
        (ce + 0.01 * aux).backward()
        gnorm = torch.norm(torch.stack([q.grad.norm() for q in params]))
        flat = torch.cat([q.grad.reshape(-1) for q in dense])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for q in dense:
            q.grad.copy_(flat[off:off + q.numel()].view_as(q))
            off += q.numel()
        opt.step()
        print(f"rank {rank} step {step} loss {ce.item():.4f} aux {aux.item():.3f} load {cnt.tolist()} "
              f"gnorm {gnorm.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
