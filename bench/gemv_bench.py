"""The decode's projections at batch 1 and 16 (a verify step), cuBLAS against a Triton GEMV of our
own, at the 8B shape (issue 31 item 3: the small GEMMs run at ~3.2 TB/s in a decode step).

    python3 bench/gemv_bench.py --out $OUT            # one GPU, ~3 minutes
    python3 bench/gemv_bench.py --dry-run --out /tmp/gemv   # CPU, Triton's interpreter: checks the kernels

For each projection (q/k/v, o, gate/up, down, the LM head) and M tokens (1, 16; 64, a regen batch's
step, cuBLAS only): y[M, N] = x[M, K] @ W[N, K]^T
in bf16 with fp32 accumulation, timed as a decode step runs it: back to back in one CUDA graph over
enough copies of W that they do not fit in the L2 cache (W is read from HBM every time, as in a
step that reads 16 GB). Rows: `F.linear` (cuBLAS, what the decode runs now) and the best of a sweep
of the GEMV's tile sizes, warps and stages; TB/s counts W's bytes. Each GEMV result is checked
against `F.linear` (max abs difference in units of bf16 rounding). Prints a table; gemv_bench.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # before triton is imported: its interpreter runs kernels on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

# (name, N, K) at Qwen3-8B: hidden 4096, 32 query and 8 key-value heads of 128, MLP 12288, vocab 151936.
SHAPES_8B = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 24576, 4096),
    ("down", 4096, 12288),
    ("lm_head", 151936, 4096),
]
SHAPES_DRY = [("small", 96, 64), ("odd", 40, 80)]
L2_BYTES = 256 << 20  # copies of W add up to at least this (the H200's L2 is 60 MB)


@triton.jit
def gemv_rows(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """M = 1: y[N] = W[N, K] @ x[K]; one program per BLOCK_N rows of W, the whole K."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def gemv_dot(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """M <= BLOCK_M (16): y[M, N] = x[M, K] @ W[N, K]^T on the tensor cores, x padded to BLOCK_M rows."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int, warps: int, stages: int):
    """y = x @ w.T with one of the two kernels (x [M, K], w [N, K], y [M, N], all contiguous)."""
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(n, block_n),)
    if m == 1:
        gemv_rows[grid](x, w, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    else:
        gemv_dot[grid](
            x, w, y, m, n, k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages
        )


def timed_ms(run, copies: int, device: torch.device, repeat: int) -> float:
    """ms per call of run(i) for i over the copies, replayed back to back from one CUDA graph."""
    for i in range(copies):  # compile and warm up outside the capture
        run(i)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            run(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / repeat / copies


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of bf16's rounding at the reference's magnitude."""
    scale = want.float().abs().clamp_min(1e-3) * 2**-8
    return float(((got.float() - want.float()).abs() / scale).max())


def main(argv: list[str] | None = None) -> int:
    """Sweep the GEMV against cuBLAS for each shape and M; print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/gemv-bench"))
    ap.add_argument("--dry-run", action="store_true", help="CPU: Triton's interpreter, small shapes, correctness only")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    # The interpreter's tl.dot gives garbage in bf16 (numpy has no bf16): the dry run checks in fp16.
    dtype = torch.float16 if dry else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    sweep = (
        [(8, 32, 4, 2), (16, 32, 4, 2)]
        if dry
        else list(itertools.product((8, 16, 32, 64), (256, 512), (4, 8), (3, 4)))  # block_n, block_k, warps, stages
    )
    rows = []
    for (name, n, k), m in itertools.product(SHAPES_DRY if dry else SHAPES_8B, (1, 16, 64)):
        wbytes = n * k * 2
        copies = 1 if dry else max(2, -(-L2_BYTES // wbytes))
        ws = [(torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device) for _ in range(copies)]
        x = torch.randn(m, k, generator=g).to(dtype).to(device)
        y = torch.empty(m, n, dtype=dtype, device=device)
        want = F.linear(x, ws[0])
        row = {"shape": name, "M": m, "N": n, "K": k}
        if not dry:
            ms = timed_ms(lambda i: torch.mm(x, ws[i].t(), out=y), copies, device, args.repeat)
            row["cublas_ms"], row["cublas_tb_s"] = round(ms, 4), round(wbytes / ms / 1e9, 2)
        best = None
        for cfg in sweep if m <= 16 else ():  # M = 64 (a regen batch): cuBLAS only, for the record
            if m > 1 and cfg[0] < 16:  # tl.dot's tiles are at least 16 wide
                continue
            try:
                gemv(x, ws[0], y, *cfg)
            except OutOfResources as exc:  # tiles x stages over the shared memory
                row.setdefault("skipped", []).append([*cfg, type(exc).__name__])
                continue
            err = ulps(y, want)
            if err > 4:  # a wrong kernel is not a fast one
                row.setdefault("wrong", []).append([*cfg, round(err, 1)])
                continue
            ms = 0.0 if dry else timed_ms(lambda i, cfg=cfg: gemv(x, ws[i], y, *cfg), copies, device, args.repeat)
            if best is None or ms < best[0]:
                best = (ms, cfg, err)
        if best is not None:
            ms, cfg, err = best
            row |= {"gemv_config": list(cfg), "gemv_ulps": round(err, 2)}
            if not dry:
                row |= {"gemv_ms": round(ms, 4), "gemv_tb_s": round(wbytes / ms / 1e9, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_bench.json").write_text(
        json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows})
    )
    print("| shape | M | N x K | cuBLAS ms (TB/s) | GEMV ms (TB/s) | its block_n, block_k, warps, stages |")
    print("| --- | ---: | --- | ---: | ---: | --- |")
    for r in rows:
        cub = f"{r['cublas_ms']} ({r['cublas_tb_s']})" if "cublas_ms" in r else "-"
        gem = f"{r['gemv_ms']} ({r['gemv_tb_s']})" if "gemv_ms" in r else "-"
        cfg = r.get("gemv_config", "none correct" if r["M"] <= 16 else "-")
        print(f"| {r['shape']} | {r['M']} | {r['N']} x {r['K']} | {cub} | {gem} | {cfg} |")
    return 0 if all("gemv_config" in r for r in rows if r["M"] <= 16) else 1


if __name__ == "__main__":
    sys.exit(main())
