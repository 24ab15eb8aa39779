"""CKP301 near miss: a conversion tool that imports torch.distributed but never runs as ranks."""
import argparse

import torch
import torch.distributed.checkpoint as dcp


def convert(src, dst):
    state = {}
    dcp.load(state, checkpoint_id=src)
    # ok: CKP301
    torch.save(state, dst)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args()
    convert(args.src, args.dst)
