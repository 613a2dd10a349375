"""For which block shapes do the platform fp32 GEMM's bits depend only on the block?

    python benchmarks/gemm_block_bits.py [--kb 32 256 1024] [--threads 1 2 4] [--ops ...] [--grids]

The question behind TP-invariant GEMMs built from platform GEMM leaves (issue 37): a leaf
C = A[:, kblock] @ B[kblock, :] of a fixed K-block size kb is computed at another M (tokens,
or a rank's share of a weight's rows) and another N (a rank's share of the output columns)
at each tensor-parallel degree, from other row and column offsets, contiguous or strided.
For each kb, op (torch.matmul, F.linear with an (N, kb) weight, torch.mm, torch.addmm with a
zero bias, torch.bmm with the block among 3 others, and samebits' `gemm_matmul`) and thread
count, every (M, N) embedding in four layouts (contiguous; other row and column offsets; a
K-slice of wider rows with a transposed weight view; a transposed view of ``a``) is compared
element by element with the reference: torch.matmul at M = N = 1024, offset 0, contiguous, 1
thread.  A line per (kb, op, threads): how many (M, N) agree in every layout, from which M
and N on all agree, and the pairs with M >= 4 and N >= 12 that do not; --grids adds the
M x N grid ('.' all agree, else the initials of the layouts that differ).  Threads above the
core count still make MKL cut M and N into that many tiles.  Prints the CPU and BLAS first:
the finding is this platform's, not a law.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.nn.functional as F

from samebits.invariant import gemm_matmul

SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 16, 24, 64, 512, 1024)
BIG = 1024
LAYOUTS = ("contig", "offset", "strided", "transposed")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _product(op: str, a: torch.Tensor, b: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """a (M, kb) @ b (kb, N) by ``op``."""
    if op == "matmul":
        return torch.matmul(a, b)
    if op == "linear":
        return F.linear(a, b.t())  # weight (N, kb): b.t(), as a weight shard's
    if op == "mm":
        return torch.mm(a, b)
    if op == "addmm":
        return torch.addmm(torch.zeros(a.shape[0], b.shape[1]), a, b)
    if op == "bmm4":  # the block first among 3 others of its shape (leaves of one rank)
        others_a = torch.randn(3, *a.shape, generator=gen)
        others_b = torch.randn(3, *b.shape, generator=gen)
        return torch.bmm(torch.cat([a[None], others_a]), torch.cat([b[None], others_b]))[0]
    if op == "gemm_matmul":  # samebits' leaf: one thread, M and N padded (issue 37)
        return gemm_matmul(a, b)
    raise ValueError(op)


def _operands(layout: str, m: int, n: int, a_big, b_big, wide_a, wide_b):
    """(row offset, column offset, a, b) of the (m, n) embedding of the block in ``layout``."""
    kb = a_big.shape[1]
    if layout == "contig":
        return 0, 0, a_big[:m].contiguous(), b_big[:, :n].contiguous()
    if layout == "offset":  # other rows and columns of the same data
        r0, c0 = min(5, BIG - m), min(3, BIG - n)
        return r0, c0, a_big[r0:r0 + m].contiguous(), b_big[:, c0:c0 + n].contiguous()
    if layout == "strided":  # a K-slice of a wider row (a rank's share of K), b a weight's .t()
        return 0, 0, wide_a[:m, kb:2 * kb], wide_b[:n, kb:2 * kb].t()
    # transposed: a a view of a (kb, M) tensor (grad.t() of a weight gradient), b contiguous
    return 0, 0, a_big[:m].t().contiguous().t(), b_big[:, :n].contiguous()


def survey(kb: int, op: str, threads: int) -> dict[tuple[int, int], list[str]]:
    """{(M, N): the layouts whose bits differ from the reference} for one kb, op and thread count."""
    gen = torch.Generator().manual_seed(kb)
    a_big = torch.randn(BIG, kb, generator=gen)
    b_big = torch.randn(kb, BIG, generator=gen)
    wide_a = torch.cat([torch.randn(BIG, kb, generator=gen), a_big, torch.randn(BIG, kb, generator=gen)], dim=1)
    wide_b = torch.cat([torch.randn(BIG, kb, generator=gen), b_big.t(), torch.randn(BIG, kb, generator=gen)], dim=1)
    torch.set_num_threads(1)
    reference = torch.matmul(a_big, b_big)
    torch.set_num_threads(threads)
    differ: dict[tuple[int, int], list[str]] = {}
    try:
        for m in SIZES:
            for n in SIZES:
                for layout in LAYOUTS:
                    r0, c0, a, b = _operands(layout, m, n, a_big, b_big, wide_a, wide_b)
                    out = _product(op, a, b, gen)
                    expect = reference[r0:r0 + m, c0:c0 + n]
                    if not torch.equal(out.view(torch.int32), expect.view(torch.int32)):
                        differ.setdefault((m, n), []).append(layout[0])
    finally:
        torch.set_num_threads(1)
    return differ


def _grid(differ: dict[tuple[int, int], list[str]]) -> list[str]:
    """Rows M, columns N: '.' every layout agrees, else the initials of those that differ."""
    lines = ["  M\\N " + "".join(f"{n:>5}" for n in SIZES)]
    for m in SIZES:
        lines.append(f"{m:>6} " + "".join(f"{''.join(differ.get((m, n), [])) or '.':>5}" for n in SIZES))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kb", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ops", nargs="+", default=["matmul", "linear", "mm", "addmm", "bmm4", "gemm_matmul"])
    parser.add_argument("--grids", action="store_true", help="print the M x N grid of every line")
    args = parser.parse_args()
    blas = "MKL" if torch.backends.mkl.is_available() else "another BLAS"
    print(f"# {_cpu_name()} ({os.cpu_count()} CPUs), torch {torch.__version__}, {blas}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"# reference: torch.matmul at M=N={BIG}, offset 0, contiguous, 1 thread; M, N over {SIZES}; "
          f"layouts {', '.join(LAYOUTS)}")
    print("| kb | op | threads | (M, N) pairs agreeing in every layout | the smallest M, N from which all agree | differ |")
    print("|---|---|---|---|---|---|")
    for kb in args.kb:
        for op in args.ops:
            for threads in args.threads:
                differ = survey(kb, op, threads)
                total = len(SIZES) ** 2
                bad = sorted(differ)
                lo_m = min((m for m in SIZES if all((mm, n) not in differ for mm in SIZES if mm >= m
                                                    for n in SIZES if n >= 12)), default=None)
                lo_n = min((n for n in SIZES if all((m, nn) not in differ for nn in SIZES if nn >= n
                                                    for m in SIZES if m >= 4)), default=None)
                shown = ", ".join(f"{m}x{n}" for m, n in bad if m >= 4 and n >= 12) or "none with M>=4, N>=12"
                print(f"| {kb} | {op} | {threads} | {total - len(bad)}/{total} | M>={lo_m} (at N>=12), "
                      f"N>={lo_n} (at M>=4) | {shown} |", flush=True)
                if args.grids:
                    print("\n".join(_grid(differ)))


if __name__ == "__main__":
    main()
