"""One Gluon sparse-attention launch to profile (Nsight Compute), after a warm-up compile:

  ncu -k regex:_decode_kernel -c 1 --launch-skip 1 python3 bench/ncu_attn.py --T 64

The inputs are the probe's decode tokens (`dsv4.bench.probe_inputs.AttnDecode`, 128 window + 512
selected keys, one kv source)."""

from __future__ import annotations

import argparse

import torch

from dsv4.bench.probe_inputs import AttnDecode
from dsv4.ops import sparse_attn_sm90 as sm90


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-buf", type=int, default=2)
    p.add_argument("--splits", type=int, default=None)
    ns = p.parse_args()
    q, kv, sink, idx = AttnDecode(torch.Generator(device="cuda").manual_seed(0)).tokens(ns.T)
    one = (torch.cat(kv),)
    kw = dict(block_n=ns.block_n, num_buf=ns.num_buf, num_splits=ns.splits)
    for _ in range(2):  # the compile, then the profiled launch
        sm90.sparse_attn_sm90(q, one, sink, idx, 0.04, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
