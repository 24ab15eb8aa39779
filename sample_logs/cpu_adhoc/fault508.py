"""Krill swarm biomass from echosounder pings: a small distributed training job (gloo, CPU).

Each rank reads its shard of synthetic multi-frequency echosounder pings (38/120/200 kHz,
64 range bins), maps each swarm's species code to a target-strength factor through a lookup
table, and regresses swarm biomass (g/m^2) with a small MLP wrapped in DDP (or with gradients
all_reduced by hand, --manual-allreduce). It starts from a checkpoint, runs 6 steps, prints
`rank R step S loss L biomass_mae M` on every rank each step, and rank 0 saves an export.

  python fault508.py --prepare            # writes shards, lookup table, checkpoints to /tmp/fault508_work

Faults (--fault NAME --rank N plants one):
  none            control, nothing planted
  keyerror        rank N meets a species code missing from the target-strength table at step 2 (KeyError)
  missing_shard   rank N opens a resampled shard file that does not exist (FileNotFoundError)
  ckpt_size       rank N starts from a checkpoint whose hidden layer is wider (load_state_dict size mismatch)
  weights_only    rank N torch.load()s the checkpoint that pickles a calibration object (weights_only refusal)
  gather_size     rank N all_gathers a 5-element swarm-stats tensor where peers use 4, at step 3
  slow            rank N does pure-Python echo integration for 40 s at step 2 (peers time out after --pg-timeout)
  nan             rank N gets a NaN ping volume at step 3; the script's own finiteness check raises
  sigsegv         rank N sends itself SIGSEGV at step 2
  logexit         rank N prints its own ERROR line (transducer calibration drift) and sys.exit(4) at step 1
  shape_all       every rank drops the 200 kHz channel before the 3-frequency input layer (matmul shape error)
  worker_crash    rank N's DataLoader worker is SIGKILLed while reading ping batch 2

What happened (runs of 2026-12-06, torch 2.13.0+cpu, gloo):
  none            both controls finished 6 steps and saved the export (pdsh2: rendezvous-shutdown warnings, exit 0).
  keyerror        KeyError: 'E.superba_larval' on the planted rank; peers "Connection closed by peer"; summary names it.
  missing_shard   FileNotFoundError in torch.load before step 0; with --local-ranks-filter only exit code 1 shows.
  ckpt_size       load_state_dict RuntimeError: size mismatch for 1.weight/1.bias/3.weight (48 vs 32).
  weights_only    _pickle.UnpicklingError "Weights only load failed" (TransducerCalib object in the checkpoint).
  gather_size     DETAIL: "Detected mismatch between collectives" (TensorShape [5] vs [4]) on every rank;
                  plain: "ProcessGroupGloo::allgather: invalid tensor size" on the planted rank.
  slow            peers raise gloo "Timed out waiting 12000ms"; with --pg-timeout 300 output stops until timeout's SIGTERM.
  nan             FloatingPointError from the script's own check at step 3; under --max-restarts 1 the restart
                  died at gloo connectFullMesh ("Connection refused") and the final summary blamed another rank.
  sigsegv         exitcode -11 (SIGSEGV) with no traceback; peers "Connection reset/closed by peer".
  logexit         the rank's own ERROR line then exit code 4 (line hidden under --local-ranks-filter, in stdout.log under --redirects).
  shape_all       "mat1 and mat2 shapes cannot be multiplied (16x128 and 192x32)" on every rank at step 0.
  worker_crash    default sharing: ConnectionResetError inside DataLoader/resource_sharer; file_system sharing:
                  "DataLoader worker (pid N) is killed by signal: Killed." / "exited unexpectedly".
"""
import argparse, json, os, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault508_work"
FREQS, BINS, HIDDEN, NSAMP, BATCH = 3, 64, 32, 96, 16
SPECIES = ["E.superba", "E.crystallorophias", "T.macrura"]


class TransducerCalib:
    def __init__(self, gains):
        self.gains = gains


def make_model(freqs=FREQS, hidden=HIDDEN):
    return nn.Sequential(nn.Flatten(), nn.Linear(freqs * BINS, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare(world_max=8):
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(508)
    for r in range(world_max):
        sv = torch.randn(NSAMP, FREQS, BINS, generator=g) * 0.5 - 70.0  # Sv in dB
        codes = [SPECIES[i % 3] for i in range(NSAMP)]
        biomass = (sv.mean(dim=(1, 2)) + 75.0).clamp(min=0.1) * 3.0
        torch.save({"sv": sv, "codes": codes, "biomass": biomass}, f"{WORK}/shards/shard_{r}.pt")
    with open(f"{WORK}/ts_table.json", "w") as f:
        json.dump({"E.superba": -0.082, "E.crystallorophias": -0.091, "T.macrura": -0.077}, f)
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), f"{WORK}/start.pt")
    torch.save(make_model(hidden=48).state_dict(), f"{WORK}/start_wide.pt")
    torch.save({"model": make_model().state_dict(), "calib": TransducerCalib([1.0, 0.98, 1.03])},
               f"{WORK}/start_with_calib.pt")
    print("prepared", WORK)


class PingSet(torch.utils.data.Dataset):
    def __init__(self, shard, crash_at=None):
        self.sv, self.codes, self.biomass, self.crash_at = shard["sv"], shard["codes"], shard["biomass"], crash_at

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.sv[i], self.codes[i], self.biomass[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--manual-allreduce", action="store_true")
    ap.add_argument("--sharing-strategy", default="")
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank == a.rank)
    torch.manual_seed(rank)

    shard_path = f"{WORK}/shards/shard_{rank}.pt"
    if a.fault == "missing_shard" and me:
        shard_path = f"{WORK}/shards/shard_{rank}_resampled_120kHz.pt"
    shard = torch.load(shard_path)
    with open(f"{WORK}/ts_table.json") as f:
        ts_table = json.load(f)

    model = make_model()
    ckpt = f"{WORK}/start.pt"
    if a.fault == "ckpt_size" and me:
        ckpt = f"{WORK}/start_wide.pt"
    if a.fault == "weights_only" and me:
        state = torch.load(f"{WORK}/start_with_calib.pt")["model"]
    else:
        state = torch.load(ckpt)
    model.load_state_dict(state)
    if a.manual_allreduce:
        net = model
    else:
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    crash_at = BATCH * 2 if (a.fault == "worker_crash" and me) else None
    if a.sharing_strategy:
        torch.multiprocessing.set_sharing_strategy(a.sharing_strategy)
    loader = torch.utils.data.DataLoader(PingSet(shard, crash_at), batch_size=BATCH, shuffle=False,
                                         num_workers=1 if crash_at is not None else 0)
    it = iter(loader)
    for step in range(6):
        sv, codes, biomass = next(it)
        if a.fault == "keyerror" and me and step == 2:
            codes = list(codes)
            codes[5] = "E.superba_larval"
        if a.fault == "logexit" and me and step == 1:
            print(f"[rank{rank}] ERROR transducer 120kHz calibration drift 2.7 dB exceeds 1.0 dB limit; "
                  f"refusing to integrate echoes", flush=True)
            sys.exit(4)
        if a.fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "slow" and me and step == 2:
            t0, acc = time.time(), 0.0
            while time.time() - t0 < (400 if a.pg_timeout > 100 else 40):
                for v in range(20000):  # pure-Python echo integration, ping by ping
                    acc += (v % 64) * 1e-6
        ts = torch.tensor([ts_table[c] for c in codes])
        x = (sv + 70.0) * (1.0 + ts.view(-1, 1, 1))
        if a.fault == "nan" and me and step == 3:
            x[3, 1, 10] = float("nan")
        if not torch.isfinite(x).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite volume backscatter in ping batch "
                                     f"({int((~torch.isfinite(x)).sum())} values)")
        if a.fault == "shape_all":
            x = x[:, :2]  # bug on every rank: drops the 200 kHz channel before the input layer
        pred = net(x).squeeze(1)
        loss = nn.functional.mse_loss(pred, biomass)
        opt.zero_grad()
        loss.backward()
        if a.manual_allreduce:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if step == 3:
            stats = torch.tensor([float(pred.detach().mean()), float(pred.detach().std()), float(biomass.mean()), float(len(codes))])
            if a.fault == "gather_size" and me:
                stats = torch.cat([stats, torch.tensor([float(step)])])
            out = [torch.zeros(4) for _ in range(world)]
            dist.all_gather(out, stats)
        mae = float((pred.detach() - biomass).abs().mean())
        print(f"rank {rank} step {step} loss {loss.item():.4f} biomass_mae {mae:.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_krill_biomass_{os.getpid()}.pt")
        print("rank 0 saved export", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
