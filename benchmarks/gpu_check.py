"""GPU check of samebits.kernels: correctness, repeatability and the determinism tax.

For each kernel (grouped GEMM dprob epilogue, MoE combine) and each variant (atomic,
deterministic), on realistic MoE shapes (32k tokens, top-8 of 64 experts, hidden 4096; the
grouped GEMM is the second expert GEMM, K = expert FFN size 2048 -> N = hidden 4096, the one
whose output the router probability scales):

1. correctness against the float64 torch reference (on a prefix of the rows, to bound memory);
2. repeatability: each variant runs 100 times on the same inputs; distinct results are
   counted by digest (atomic: several expected; deterministic: exactly one);
3. speed: median time over many runs after warm-up, with CUDA events; the ratio
   deterministic / atomic is the per-kernel determinism tax (target <= 1.05).

And the digest kernel: equal to the reference body on 1 GiB, odd sizes and unaligned
starts; throughput against a device-to-device copy and `torch.hash_tensor` (targets: digest
reads >= 80% of the copy's bandwidth, read + write counted, and beats hash_tensor).

Run on one GPU (about 2 minutes on an H200, under 5 including Triton compiles):

    python benchmarks/gpu_check.py --out gpu_check.json

Smoke test on CPU (tiny shapes, Triton interpreter; timings meaningless):

    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --small --out /tmp/gpu_check.json

Exit status: 0 all correctness and repeatability checks pass, 1 one failed, 2 no CUDA device
(without --small).  Speed targets are reported, not enforced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import samebits  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
    num_tokens: int
    """Tokens in the batch (before top-k routing)."""
    top_k: int
    """Experts per token; rows = num_tokens * top_k."""
    num_experts: int
    hidden: int
    """Model width: N of the grouped GEMM, H of the combine."""
    ffn_hidden: int
    """Expert FFN width: K of the grouped GEMM."""
    num_repeats: int
    """Runs per variant for the repeatability count."""
    num_timed: int
    """Timed runs per measurement (median reported)."""
    num_warmup: int
    check_rows: int
    """At most this many expert-sorted rows (whole experts) are checked against float64."""
    check_tokens: int
    """Tokens checked against float64 in the combine."""
    digest_bytes: int
    block_h_choices: tuple[int, ...]
    """Combine H-blocks whose deterministic results must be bitwise equal."""


FULL = Shapes(num_tokens=32768, top_k=8, num_experts=64, hidden=4096, ffn_hidden=2048,
              num_repeats=100, num_timed=30, num_warmup=5, check_rows=16384,
              check_tokens=2048, digest_bytes=1 << 30, block_h_choices=(512, 1024, 2048))
SMALL = Shapes(num_tokens=12, top_k=2, num_experts=3, hidden=48, ffn_hidden=32,
               num_repeats=3, num_timed=2, num_warmup=1, check_rows=24, check_tokens=12,
               digest_bytes=(1 << 16) + 13, block_h_choices=(16, 32, 64))

# Relative error bound (max |err| / max |ref|) against float64: 4 units of the input dtype's
# epsilon (output rounding, rounding of prob * dY, fp32 accumulation).  See docs/kernels.md.
TOLERANCE = {torch.bfloat16: 4 * 2.0**-7, torch.float16: 4 * 2.0**-10, torch.float32: 4 * 2.0**-23}
TAX_TARGET = 1.05
DIGEST_COPY_TARGET = 0.80


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json",
                        help="JSON file for the full results (default: gpu_check.json)")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes; runs on CPU with TRITON_INTERPRET=1 (smoke test)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="activation and weight dtype (default: bfloat16)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def pick_device(small: bool) -> torch.device | None:
    """CUDA if present; CPU (Triton interpreter) only for --small; else None."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported
        return torch.device("cpu")
    return None


def machine_info(device: torch.device) -> dict:
    """What decides the numbers: device, versions, commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "python": platform.python_version(),
        "host": platform.node(),
        "commit": commit,
    }


def make_routing(shapes: Shapes, device: torch.device, gen: torch.Generator) -> dict:
    """Top-k routing of random tokens with a skewed router (uneven expert loads)."""
    logits = torch.randn(shapes.num_tokens, shapes.num_experts, generator=gen)
    logits += 0.5 * torch.randn(shapes.num_experts, generator=gen)  # popular experts
    top_logit, top_expert = logits.topk(shapes.top_k, dim=-1)  # (T, K)
    top_prob = top_logit.softmax(dim=-1)  # (T, K)
    order = torch.argsort(top_expert.reshape(-1), stable=True)  # (R,) sorted row -> (t, k)
    return {
        "tokens_per_expert": torch.bincount(top_expert.reshape(-1),
                                            minlength=shapes.num_experts).to(device),  # (E,)
        "row_prob": top_prob.reshape(-1)[order].to(device),  # (R,)
        "top_prob": top_prob.to(device),  # (T, K)
        "slot_index": torch.argsort(order).view(shapes.num_tokens, shapes.top_k).to(device),
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int,
            runs: int) -> list[float]:
    """Per-run times in ms: CUDA events on a GPU (no host sync inside the timed region),
    perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def digest_of(tensor: torch.Tensor) -> int:
    """Digest body of a tensor's bytes, as a Python int (one host sync)."""
    from samebits.kernels import digest_body

    return int(digest_body(tensor.detach().contiguous().reshape(-1).view(torch.uint8)).item())


def count_distinct(fn: Callable[[], torch.Tensor], repeats: int) -> int:
    """Run fn `repeats` times; count distinct results by digest (memory stays flat)."""
    return len({digest_of(fn()) for _ in range(repeats)})


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal fp32 on the generator's device."""
    return torch.randn(*shape, generator=gen, device=gen.device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    expected = expected.double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (actual.double() - expected).abs().max().item() if expected.numel() else 0.0
    return err / scale if scale > 0 else err


def speed_summary(times_ms: dict[str, list[float]]) -> dict:
    median = {name: statistics.median(t) for name, t in times_ms.items()}
    return {"median_ms": median, "all_ms": times_ms,
            "tax": median["deterministic"] / median["atomic"] if median["atomic"] else None}


def check_grouped_gemm(shapes: Shapes, device: torch.device, dtype: torch.dtype,
                       routing: dict, gen: torch.Generator) -> dict:
    from samebits.kernels import grouped_gemm_dprob, reference_grouped_gemm_dprob
    from samebits.kernels import _triton_gemm  # the dprob kernel alone, for timing

    num_rows = shapes.num_tokens * shapes.top_k
    counts, prob = routing["tokens_per_expert"], routing["row_prob"]
    x = randn(gen, num_rows, shapes.ffn_hidden).to(dtype)  # (R, K)
    w = (randn(gen, shapes.num_experts, shapes.ffn_hidden, shapes.hidden)
         / shapes.ffn_hidden**0.5).to(dtype)  # (E, K, N)
    dy = randn(gen, num_rows, shapes.hidden).to(dtype)  # (R, N)
    tiles = _triton_gemm.Tiles()
    schedule = _triton_gemm.make_schedule(counts, num_rows, tiles.block_m)
    result: dict = {"shape": {"rows": num_rows, "K": shapes.ffn_hidden, "N": shapes.hidden,
                              "experts": shapes.num_experts,
                              "tiles": dataclasses.asdict(tiles)}}

    # 1. Correctness on whole experts covering at most check_rows rows (at least one expert).
    per_expert = counts.tolist()
    num_checked_experts, num_checked_rows = 1, per_expert[0]
    while (num_checked_experts < len(per_expert)
           and num_checked_rows + per_expert[num_checked_experts] <= shapes.check_rows):
        num_checked_rows += per_expert[num_checked_experts]
        num_checked_experts += 1
    rows = slice(0, num_checked_rows)
    x64 = x[rows].double().requires_grad_()
    w64 = w[:num_checked_experts].double().requires_grad_()
    p64 = prob[rows].double().requires_grad_()
    y64 = reference_grouped_gemm_dprob(x64, w64, counts[:num_checked_experts], p64)
    y64.backward(dy[rows].double())
    correctness = {"rows_checked": num_checked_rows, "experts_checked": num_checked_experts}
    outputs = {}
    for variant in ("atomic", "deterministic"):
        xv, wv, pv = (t.detach().clone().requires_grad_() for t in (x, w, prob))
        y = grouped_gemm_dprob(xv, wv, counts, pv, variant=variant)
        y.backward(dy)
        outputs[variant] = y.detach()
        correctness[variant] = {
            "y": relative_error(y[rows], y64),
            "dx": relative_error(xv.grad[rows], x64.grad),
            "dw": relative_error(wv.grad[:num_checked_experts], w64.grad),
            "dprob": relative_error(pv.grad[rows], p64.grad),
        }
    tolerance = TOLERANCE[dtype]
    correctness["tolerance"] = tolerance
    correctness["ok"] = all(err <= tolerance for variant in ("atomic", "deterministic")
                            for err in correctness[variant].values())
    correctness["forward_equal_across_variants"] = torch.equal(
        outputs["atomic"].view(torch.uint8), outputs["deterministic"].view(torch.uint8))
    result["correctness"] = correctness
    del x64, w64, p64, y64, outputs

    # 2. Repeatability of the dprob epilogue kernel (the forward is one kernel for both).
    def dprob(variant: str) -> Callable[[], torch.Tensor]:
        return lambda: _triton_gemm.grouped_dprob(x, w, schedule, dy, variant, tiles, prob.dtype)

    result["distinct_results"] = {
        variant: count_distinct(dprob(variant), shapes.num_repeats)
        for variant in ("atomic", "deterministic")
    }
    result["distinct_results"]["forward"] = count_distinct(
        lambda: _triton_gemm.grouped_gemm(x, w, schedule, prob, tiles), shapes.num_repeats)

    # 3. Speed: the dprob kernel alone, and the whole backward through autograd.
    result["speed_dprob_kernel"] = speed_summary({
        variant: time_ms(dprob(variant), device, warmup=shapes.num_warmup, runs=shapes.num_timed)
        for variant in ("atomic", "deterministic")
    })
    backward_times = {}
    for variant in ("atomic", "deterministic"):
        xv, wv, pv = (t.detach().clone().requires_grad_() for t in (x, w, prob))
        y = grouped_gemm_dprob(xv, wv, counts, pv, variant=variant)
        backward_times[variant] = time_ms(
            lambda: torch.autograd.grad(y, (xv, wv, pv), dy, retain_graph=True), device,
            warmup=shapes.num_warmup, runs=shapes.num_timed)
        del y
    result["speed_backward"] = speed_summary(backward_times)
    forward_ms = time_ms(lambda: _triton_gemm.grouped_gemm(x, w, schedule, prob, tiles), device,
                         warmup=shapes.num_warmup, runs=shapes.num_timed)
    flops = 2 * num_rows * shapes.ffn_hidden * shapes.hidden
    result["speed_forward"] = {"median_ms": statistics.median(forward_ms),
                               "tflops": flops / statistics.median(forward_ms) / 1e9}
    result["ok"] = correctness["ok"] and result["distinct_results"]["deterministic"] == 1 \
        and result["distinct_results"]["forward"] == 1
    return result


def check_combine(shapes: Shapes, device: torch.device, dtype: torch.dtype, routing: dict,
                  gen: torch.Generator) -> dict:
    from samebits.kernels import moe_combine, reference_moe_combine

    num_rows = shapes.num_tokens * shapes.top_k
    prob, slot_index = routing["top_prob"], routing["slot_index"]
    expert_out = randn(gen, num_rows, shapes.hidden).to(dtype)  # (R, H)
    dout = randn(gen, shapes.num_tokens, shapes.hidden).to(dtype)  # (T, H)
    result: dict = {"shape": {"tokens": shapes.num_tokens, "top_k": shapes.top_k,
                              "H": shapes.hidden}}

    # 1. Correctness on the first check_tokens tokens: their rows, compacted.
    tokens = slice(0, min(shapes.check_tokens, shapes.num_tokens))
    slots = slot_index[tokens]  # (n, K)
    eo64 = expert_out.index_select(0, slots.reshape(-1)).double().requires_grad_()  # (n*K, H)
    p64 = prob[tokens].double().requires_grad_()
    compact = torch.arange(slots.numel(), device=device).view(slots.shape)
    out64 = reference_moe_combine(eo64, p64, compact)
    out64.backward(dout[tokens].double())
    correctness: dict = {"tokens_checked": slots.shape[0]}
    for variant in ("atomic", "deterministic"):
        eo, pv = (t.detach().clone().requires_grad_() for t in (expert_out, prob))
        out = moe_combine(eo, pv, slot_index, variant=variant)
        out.backward(dout)
        correctness[variant] = {
            "out": relative_error(out[tokens], out64),
            "d_expert_out": relative_error(eo.grad.index_select(0, slots.reshape(-1)), eo64.grad),
            "d_prob": relative_error(pv.grad[tokens], p64.grad),
        }
    tolerance = TOLERANCE[dtype]
    correctness["tolerance"] = tolerance
    correctness["ok"] = all(err <= tolerance for variant in ("atomic", "deterministic")
                            for err in correctness[variant].values())
    result["correctness"] = correctness
    del eo64, p64, out64

    # 2. Repeatability, and block-size independence of the deterministic variant.
    def combine(variant: str, block_h: int = 1024) -> Callable[[], torch.Tensor]:
        return lambda: moe_combine(expert_out, prob, slot_index, variant=variant, block_h=block_h)

    result["distinct_results"] = {
        variant: count_distinct(combine(variant), shapes.num_repeats)
        for variant in ("atomic", "deterministic")
    }
    block_choices = list(shapes.block_h_choices)
    result["deterministic_block_h"] = {
        "block_h": block_choices,
        "distinct_results": len({digest_of(combine("deterministic", b)()) for b in block_choices}),
    }

    # 3. Speed of the forward (the backward is one kernel shared by both variants).
    result["speed"] = speed_summary({
        variant: time_ms(combine(variant), device, warmup=shapes.num_warmup,
                         runs=shapes.num_timed)
        for variant in ("atomic", "deterministic")
    })
    result["ok"] = correctness["ok"] and result["distinct_results"]["deterministic"] == 1 \
        and result["deterministic_block_h"]["distinct_results"] == 1
    return result


def check_digest(shapes: Shapes, device: torch.device, gen: torch.Generator) -> dict:
    from samebits.fingerprint._reference import body_sum
    from samebits.kernels import digest_body

    data = torch.randint(0, 256, (shapes.digest_bytes,), dtype=torch.uint8, generator=gen,
                         device=device)  # (L,)
    cases = {"full": data}
    for size in (0, 1, 7, 8, 9, 4095, (1 << 16) + 3):
        cases[f"size_{size}"] = data[:size]
    for offset in range(1, 8):  # unaligned starts take the byte-load path
        cases[f"offset_{offset}"] = data[offset:offset + 100_003]
    mismatches = [name for name, bytes_ in cases.items()
                  if digest_body(bytes_).item() != body_sum(bytes_).item()]
    result: dict = {"bytes": shapes.digest_bytes, "cases": len(cases), "mismatches": mismatches}

    timed = {"digest_body": lambda: digest_body(data)}
    copy_target = torch.empty_like(data)
    timed["copy"] = lambda: copy_target.copy_(data)
    if hasattr(torch, "hash_tensor"):
        # 64-bit words: hash_tensor's own upcast-and-XOR path at its best.
        words = data[: data.numel() // 8 * 8].view(torch.int64)
        timed["hash_tensor"] = lambda: torch.hash_tensor(words)
    median = {}
    for name, fn in timed.items():
        try:
            median[name] = statistics.median(
                time_ms(fn, device, warmup=shapes.num_warmup, runs=shapes.num_timed))
        except RuntimeError as err:  # e.g. hash_tensor without this dtype on this device
            result[f"{name}_error"] = str(err)
    gbps = {name: shapes.digest_bytes / ms / 1e6 for name, ms in median.items()}  # GB/s read
    if "copy" in gbps:
        gbps["copy_read_plus_write"] = 2 * gbps["copy"]
    result["median_ms"], result["gb_per_s"] = median, gbps
    if "copy" in gbps and "digest_body" in gbps:
        result["digest_vs_copy_bandwidth"] = gbps["digest_body"] / gbps["copy_read_plus_write"]
    if "hash_tensor" in median and "digest_body" in median:
        result["speedup_vs_hash_tensor"] = median["hash_tensor"] / median["digest_body"]
    result["ok"] = not mismatches
    return result


def targets(results: dict) -> dict:
    gemm, combine, digest = results["grouped_gemm"], results["combine"], results["digest"]
    return {
        "grouped_gemm_dprob_tax<=1.05": (gemm["speed_dprob_kernel"]["tax"] or 0) <= TAX_TARGET,
        "moe_combine_tax<=1.05": (combine["speed"]["tax"] or 0) <= TAX_TARGET,
        "digest>=0.8*copy_bandwidth":
            digest.get("digest_vs_copy_bandwidth", 0) >= DIGEST_COPY_TARGET,
        "digest_faster_than_hash_tensor": digest.get("speedup_vs_hash_tensor", 0) > 1,
    }


def format_table(results: dict) -> str:
    """The human summary: one line per kernel, then the targets."""
    gemm, combine, digest = results["grouped_gemm"], results["combine"], results["digest"]
    lines = [f"{'kernel':<22}{'variant':<15}{'max rel err':>12}{'distinct/N':>12}"
             f"{'median ms':>11}"]
    repeats = results["shapes"]["num_repeats"]
    for name, entry, speed in (("grouped_gemm dprob", gemm, gemm["speed_dprob_kernel"]),
                               ("moe_combine", combine, combine["speed"])):
        for variant in ("atomic", "deterministic"):
            err = max(entry["correctness"][variant].values())
            lines.append(f"{name:<22}{variant:<15}{err:>12.2e}"
                         f"{entry['distinct_results'][variant]:>8}/{repeats:<3}"
                         f"{speed['median_ms'][variant]:>11.3f}")
        lines.append(f"{'':<22}{'tax det/atomic':<15}{'':>24}{speed['tax']:>11.3f}")
    lines.append(f"grouped_gemm backward (autograd) tax: {gemm['speed_backward']['tax']:.3f}; "
                 f"forward {gemm['speed_forward']['tflops']:.0f} TFLOP/s")
    block_h = combine["deterministic_block_h"]
    lines.append(f"combine deterministic over block_h {block_h['block_h']}: "
                 f"{block_h['distinct_results']} distinct")
    gbps = digest["gb_per_s"]
    lines.append("digest: " + ", ".join(f"{k} {v:.3g} GB/s" for k, v in gbps.items())
                 + f"; mismatches {len(digest['mismatches'])}/{digest['cases']}")
    for name, met in results["targets"].items():
        lines.append(f"target {name:<34} {'met' if met else 'NOT met'}")
    lines.append(f"correctness and repeatability: {'PASS' if results['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.small)
    if device is None:
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); run it "
              "on a GPU machine, or pass --small for a CPU smoke test with TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    import samebits.kernels as kernels

    if not kernels.available():
        print("gpu_check: Triton kernels cannot run here (is triton installed?); "
              "pip install triton", file=sys.stderr)
        return 2
    shapes = SMALL if args.small else FULL
    dtype = getattr(torch, args.dtype)
    routing = make_routing(shapes, device, torch.Generator().manual_seed(args.seed))
    # Inputs are drawn on the device: gigabytes of CPU randn would take longer than the checks.
    gen = torch.Generator(device=device).manual_seed(args.seed)
    results: dict = {"machine": machine_info(device), "shapes": dataclasses.asdict(shapes),
                     "dtype": args.dtype, "seed": args.seed}
    begin = time.perf_counter()
    results["grouped_gemm"] = check_grouped_gemm(shapes, device, dtype, routing, gen)
    results["combine"] = check_combine(shapes, device, dtype, routing, gen)
    results["digest"] = check_digest(shapes, device, gen)
    results["targets"] = targets(results)
    results["ok"] = all(results[k]["ok"] for k in ("grouped_gemm", "combine", "digest"))
    results["wall_s"] = time.perf_counter() - begin
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(format_table(results))
    print(f"full results: {args.out} ({results['wall_s']:.0f} s)")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
