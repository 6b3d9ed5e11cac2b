"""Sleep mode at Flash's sizes on the GPU: give back and take again the weights of N MoE layers'
routed experts (256 experts x w1 / w3 / w2 MXFP4 codes and e8m0 scales, as Flash stores them:
1,536 tensors a layer), level 1 (host copy) and level 2 (dropped), and time each way
(`dsv4.sleep.Released`). Prints seconds and GB/s; the whole model is ~43x a layer."""

from __future__ import annotations

import argparse
import time

import torch

from dsv4.sleep import Released, storages


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    ns = p.parse_args()
    D, inter, E = 4096, 2048, 256
    ts = []
    for _ in range(ns.layers):
        for _ in range(E):
            for rows, cols in ((inter, D), (inter, D), (D, inter)):
                ts.append(
                    torch.randint(-128, 127, (rows, cols // 2), dtype=torch.int8, device="cuda")
                )
                ts.append(torch.ones(rows, cols // 32, device="cuda").to(torch.float8_e8m0fnu))
    ref = [t.clone() for t in ts[:12]]
    nbytes = sum(t.nbytes for t in ts)
    host = None
    for level, pin, again in (
        (1, True, False),
        (1, True, True),
        (1, False, False),
        (2, None, False),
    ):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        if level == 1:
            r = Released(storages(ts), [], pin, host=host if again else None)
        else:
            r = Released([], storages(ts))
        torch.cuda.empty_cache()
        t1 = time.perf_counter()
        freed = torch.cuda.mem_get_info()[0] - free0
        r.restore()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host = r.host if pin else host
        same = all(torch.equal(a, b) for a, b in zip(ts[:12], ref)) if level == 1 else None
        how = f"level {level}{' pinned' if pin else ''}{' (host buffer reused)' if again else ''}"
        print(
            f"{how}: {len(ts)} tensors, {nbytes / 1e9:.2f} GB; release {t1 - t0:.3f} s "
            f"({nbytes / (t1 - t0) / 1e9:.1f} GB/s), {freed / 1e9:.2f} GB back to the driver; "
            f"restore {t2 - t1:.3f} s ({nbytes / (t2 - t1) / 1e9:.1f} GB/s); bytes back {same}"
        )


if __name__ == "__main__":
    main()
