#!/bin/bash
# LNC401 near miss: the environment comes from a sourced file this lint cannot see.
source ./cluster_env.sh
# ok: LNC401
# ok: LNC402
torchrun --nproc-per-node 8 train.py
