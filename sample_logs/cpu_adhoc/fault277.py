"""A two-hundred-and-seventy-seventh hand-run batch: TEXT-TO-SQL WITH A SMALL SEQ2SEQ.

Each rank generates synthetic questions over a toy schema (three tables of four columns, written by rank 0 to
/tmp/job_work/data/schema.json and read back by every rank) and their SQL token sequences
(SELECT col FROM table WHERE col = VAL EOS). A GRU encoder reads the question; a GRU-cell decoder attends over
the table's schema columns and mixes a generation distribution (keywords, tables) with a copy distribution over
the columns (copy gate). Cross-entropy on the mixed probabilities, DDP (or, with --ddp 0, gradients
all_reduced by hand); rank 0 saves the initial weights that every rank reloads; after training the per-table
exact-match counts are all_gathered and the exact-match accuracy is all_reduced; rank 0 saves the parser.

Faults:
  colidx    rank N's WHERE-column sampler draws an index one past the table's columns (IndexError)
  copynan   rank N's copy prior is -200: the copy gate underflows to 0, log(0) = -inf, the program's check
  emlen     rank N all_gathers per-table exact-match counts with an extra "unknown table" slot (size mismatch)
  schema    rank N reads data/schema_prod.json, which is not there (FileNotFoundError)
  table     rank N's question templates name table "orders_2024", missing from the schema map (KeyError)
  hidden    every rank builds the decoder with hidden 48 for a 32-wide encoder (RuntimeError in GRUCell)
  pickle    rank N warm-starts from the whole pickled module file, loaded with weights_only=True
  execsql   rank N executes every predicted SQL against a Python toy database before the all_reduce
  sigabrt   rank N sends itself SIGABRT after step 2
  skipcopy  rank N's forward skips the copy head on odd steps, DDP find_unused_parameters off
  none      no fault

What happened (filled in after the runs):
  colidx    IndexError: list index out of range on rank N in make_data; peers Connection closed by peer (np4 r2 tee, np3 r1 pymodule)
  copynan   FloatingPointError: rank N: loss is inf at step 0 (min target prob 0) (np3 r1 loglevel, np4 r3 prefix)
  emlen     rank N: ProcessGroupGloo::allgather: invalid tensor size (expected (4), got (3)) (np3 r2 plain, np4 r1 filter)
  schema    FileNotFoundError schema_prod.json on rank N (np4 r3 redirects: only in the rank files; np3 r0 wrapper)
  table     KeyError: 'orders_2024' on rank N; rank 0 monitoredBarrier under DETAIL (np3 r1 detail, np5 r4 tee_trainer)
  hidden    RuntimeError: hidden0 has inconsistent hidden_size: got 32, expected 48 on every rank (np4 rall pdsh2)
  pickle    UnpicklingError Weights only load failed on rank N (np3 r2 tee; np4 r1 restart: attempt 1 connectFullMesh)
  execsql   12 s: peers Timed out waiting 12000ms (np3 r1 tee); 300 s: killed by timeout 60 (np4 r2 plain)
  sigabrt   rank N killed by SIGABRT after step 2, Root Cause exitcode -6 (np4 r2 pymodule, np3 r0 tee_trainer)
  skipcopy  rank N: Expected to have finished reduction in the prior iteration at step 2 (np3 r1 plain, np4 r3 tee)
  none      exit 0, rank 0 saved the parser (np3 plain)
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault277_work"
KEYWORDS = ["<bos>", "<eos>", "SELECT", "FROM", "WHERE", "=", "<val>"]
SCHEMA = {"users": ["id", "name", "age", "city"], "orders": ["id", "user_id", "amount", "placed"],
          "items": ["id", "order_id", "sku", "price"]}


class Text2SQL(nn.Module):
    def __init__(self, q_vocab, n_tables, n_cols, enc_hidden, dec_hidden):
        super().__init__()
        self.n_gen = len(KEYWORDS) + n_tables
        self.q_emb = nn.Embedding(q_vocab, 16)
        self.enc = nn.GRU(16, enc_hidden, batch_first=True)
        self.col_emb = nn.Embedding(n_tables * n_cols, dec_hidden)
        self.y_emb = nn.Embedding(self.n_gen + n_cols, 16)
        self.cell = nn.GRUCell(16, dec_hidden)
        self.gen = nn.Linear(dec_hidden, self.n_gen)
        self.copy_q = nn.Linear(dec_hidden, dec_hidden)
        self.copy_gate = nn.Linear(dec_hidden, 1)

    def forward(self, q, col_ids, y_in, copy_prior=0.0, use_copy=True):
        _, h = self.enc(self.q_emb(q))
        h = h.squeeze(0)
        keys = self.col_emb(col_ids)
        out = []
        for t in range(y_in.shape[1]):
            h = self.cell(self.y_emb(y_in[:, t]), h)
            gen = torch.softmax(self.gen(h), -1)
            if use_copy:
                att = torch.softmax(torch.bmm(keys, self.copy_q(h).unsqueeze(2)).squeeze(2), -1)
                p = torch.sigmoid(self.copy_gate(h) + copy_prior)
            else:
                att = gen.new_full((h.shape[0], keys.shape[1]), 1.0 / keys.shape[1])
                p = gen.new_full((h.shape[0], 1), 0.5)
            out.append(torch.cat([(1 - p) * gen, p * att], -1))
        return torch.stack(out, 1)


def make_data(schema, r, n, bad, fault, gen):
    tables = list(schema)
    templates = list(tables)
    if bad and fault == "table":
        templates.append("orders_2024")
    qs, ys, cols, tids = [], [], [], []
    for i in range(n):
        tname = templates[i % len(templates)]
        tcols = schema[tname]
        t = tables.index(tname)
        a = int(torch.randint(0, len(tcols), (1,), generator=gen))
        hi = len(tcols) + 1 if bad and fault == "colidx" else len(tcols)
        b = int(torch.randint(0, hi, (1,), generator=gen))
        _ = tcols[b]  # the WHERE column's name, for the question text
        qs.append([3 + t, 10 + 4 * t + a, 30, 10 + 4 * t + b, 31, 32 + i % 8])
        ng = len(KEYWORDS) + len(tables)
        ys.append([2, ng + a, 3, len(KEYWORDS) + t, 4, ng + b, 5, 6, 1])
        cols.append([4 * t + c for c in range(len(tcols))])
        tids.append(t)
    return torch.tensor(qs), torch.tensor(ys), torch.tensor(cols), torch.tensor(tids)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    a = p.parse_args()
    r = int(os.environ["RANK"])
    bad = a.fault != "none" and (a.rank == -1 or a.rank == r)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    ws = dist.get_world_size()
    cfg = {"enc_hidden": 32, "dec_hidden": 32, "copy_prior": 0.0, "lr": 0.1, "schema": "data/schema.json",
           "warm_start": "ckpt/sqlg_init.pt"}
    if bad and a.fault == "hidden":
        cfg["dec_hidden"] = 48
    if bad and a.fault == "copynan":
        cfg["copy_prior"] = -200.0
    if bad and a.fault == "schema":
        cfg["schema"] = "data/schema_prod.json"
    if bad and a.fault == "pickle":
        cfg["warm_start"] = "ckpt/sqlg_init_module.pt"
    if r == 0:
        os.makedirs(os.path.join(WORK, "data"), exist_ok=True)
        with open(os.path.join(WORK, "data", "schema.json"), "w") as f:
            json.dump(SCHEMA, f)
    dist.barrier()
    with open(os.path.join(WORK, cfg["schema"])) as f:
        schema = json.load(f)
    gen = torch.Generator().manual_seed(277 + r)
    q, y, col_ids, tids = make_data(schema, r, 48, bad, a.fault, gen)
    print(f"rank {r}/{ws}: {len(schema)} tables, {len(q)} questions, enc {cfg['enc_hidden']} dec {cfg['dec_hidden']}",
          flush=True)
    torch.manual_seed(0)
    model = Text2SQL(40, len(schema), 4, cfg["enc_hidden"], cfg["dec_hidden"])
    if r == 0:
        os.makedirs(os.path.join(WORK, "ckpt"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(WORK, "ckpt", "sqlg_init.pt"))
        torch.save(model, os.path.join(WORK, "ckpt", "sqlg_init_module.pt"))
    dist.barrier()
    model.load_state_dict(torch.load(os.path.join(WORK, cfg["warm_start"]), weights_only=True))
    if a.ddp:
        net = DDP(model, find_unused_parameters=False)
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"], momentum=0.9)
    for step in range(a.steps):
        idx = torch.arange(step * 12, step * 12 + 12) % len(q)
        y_in = torch.cat([torch.zeros(12, 1, dtype=torch.long), y[idx, :-1]], 1)
        use_copy = not (bad and a.fault == "skipcopy" and step % 2 == 1)
        probs = net(q[idx], col_ids[idx], y_in, cfg["copy_prior"], use_copy)
        loss = -torch.log(probs.gather(2, y[idx].unsqueeze(2))).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {r}: loss is {loss.item()} at step {step} "
                                     f"(min target prob {probs.gather(2, y[idx].unsqueeze(2)).min().item():.3g})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= ws
        opt.step()
        print(f"rank {r} step {step} loss {loss.item():.4f}", flush=True)
        if bad and a.fault == "sigabrt" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
    with torch.no_grad():
        y_in = torch.cat([torch.zeros(len(q), 1, dtype=torch.long), y[:, :-1]], 1)
        pred = model(q, col_ids, y_in).argmax(-1)
    exact = (pred == y).all(1)
    per_table = torch.zeros(len(schema) + (1 if bad and a.fault == "emlen" else 0))
    per_table.index_add_(0, tids, exact.float())
    gathered = [torch.zeros(len(schema)) for _ in range(ws)]
    dist.all_gather(gathered, per_table)
    if bad and a.fault == "execsql":
        print(f"rank {r}: executing {len(q)} predicted queries against the toy database for execution accuracy",
              flush=True)
        t0 = time.time()
        while time.time() - t0 < a.stall:
            sum(i * i for i in range(20000))
            time.sleep(0.05)
    em = torch.tensor([exact.float().mean().item()])
    dist.all_reduce(em)
    em /= ws
    print(f"rank {r} exact-match {em.item():.3f} per-table {gathered[r].tolist()}", flush=True)
    dist.barrier()
    if r == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(WORK, "out", "sqlg_parser.pt"))
        print(f"rank 0: saved parser to {WORK}/out/sqlg_parser.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
