"""Tests of samebits.kernels: Triton kernels under the CPU interpreter, torch fallbacks, gpu_check.

The Triton tests run the real kernels with TRITON_INTERPRET=1 on CPU (tiny shapes: the
interpreter runs each program in Python).  The interpreter runs programs one after another,
so atomics land in program order: it cannot show that the atomic variants vary on a GPU,
only that both variants compute the right thing and that the deterministic ones are
repeatable and, where the algorithm promises it, independent of the tile size.
`benchmarks/gpu_check.py` measures the run-to-run behaviour on a GPU.

Byte comparisons go through samebits.testing (`@pytest.mark.bitwise`, `assert_same_bits`):
dtype, shape and every bit, with the differing elements named on failure.  Each kernel's
byte test is registered in src/samebits/kernels/kernel-coverage.toml (`samebits coverage`).

The interpreter is switched on by a module fixture (not at import) so that other test
modules in the same session keep the plain CPU fallback.  `@triton.jit` reads the variable
when a kernel module is first imported, which happens inside these tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import samebits.kernels as kernels
from samebits.fingerprint._reference import body_sum
from samebits.testing import assert_same_bits

REPO = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="Triton is not installed: samebits.kernels uses its torch references"
)

# max |kernel - float64 reference| / max |reference|.  Inputs are exact in both; the error
# comes from rounding the output to the dtype (the interpreter truncates fp32 -> bf16, up to
# one unit, where a GPU rounds to nearest), rounding prob * dY to the dtype in the backward,
# and fp32 accumulation.  4 units of the dtype's epsilon bound all three with margin.
TOLERANCE = {torch.float32: 4 * 2.0**-23, torch.bfloat16: 4 * 2.0**-7}
DTYPES = list(TOLERANCE)
VARIANTS = ["deterministic", "atomic"]


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """TRITON_INTERPRET=1 for this module only; skip if the kernels were already compiled
    for a GPU in this process (they cannot take CPU tensors then)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        if HAS_TRITON:
            from triton.runtime.interpreter import InterpretedFunction

            for name, kernel in (("_triton_gemm", "_grouped_gemm_kernel"),
                                 ("_triton_combine", "_combine_gather_kernel"),
                                 ("_triton_digest", "_digest_body_kernel")):
                module = sys.modules.get(f"samebits.kernels.{name}")
                if module and not isinstance(getattr(module, kernel), InterpretedFunction):
                    pytest.skip("samebits.kernels was compiled for a GPU earlier in this process")
        yield


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    return (actual.double() - expected).abs().max().item() / scale


# --- grouped GEMM with the dprob epilogue ---------------------------------------------------

COUNTS = [5, 0, 19]  # an empty expert, and experts that are not a multiple of block_m
SMALL_TILES = {"block_m": 16, "block_n": 32, "block_k": 16}  # K=40, N=48: partial tiles


def gemm_inputs(dtype, counts=COUNTS, k=40, n=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(counts)
    x = torch.randn(num_rows, k, generator=gen).to(dtype)  # (T, K)
    w = (torch.randn(len(counts), k, n, generator=gen) / k**0.5).to(dtype)  # (E, K, N)
    prob = torch.rand(num_rows, generator=gen)  # (T,)
    dy = torch.randn(num_rows, n, generator=gen).to(dtype)  # (T, N)
    return x, w, torch.tensor(counts), prob, dy


def run_gemm(x, w, counts, prob, dy, **options):
    """Forward and backward; returns y, dx, dw, dprob."""
    x, w, prob = (t.detach().clone().requires_grad_() for t in (x, w, prob))
    y = kernels.grouped_gemm_dprob(x, w, counts, prob, **options)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, prob.grad


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_grouped_gemm_matches_float64_reference(dtype, variant):
    x, w, counts, prob, dy = gemm_inputs(dtype)
    got = run_gemm(x, w, counts, prob, dy, variant=variant, **SMALL_TILES)
    expected = run_gemm(x.double(), w.double(), counts, prob.double(), dy.double(),
                        variant="torch")
    for name, actual, ref in zip(("y", "dx", "dw", "dprob"), got, expected):
        assert actual.dtype == (prob.dtype if name == "dprob" else dtype), name
        assert relative_error(actual, ref) <= TOLERANCE[dtype], name


@needs_triton
def test_grouped_gemm_default_tiles_and_fp32_prob_grad_dtype():
    x, w, counts, prob, dy = gemm_inputs(torch.float32, counts=[3, 9], k=24, n=20)
    got = run_gemm(x, w, counts, prob.double(), dy)  # default tiles, float64 prob
    expected = run_gemm(x.double(), w.double(), counts, prob.double(), dy.double(),
                        variant="torch")
    assert got[3].dtype == torch.float64
    for actual, ref in zip(got, expected):
        assert relative_error(actual, ref) <= TOLERANCE[torch.float32]


@needs_triton
def test_grouped_gemm_variants_differ_only_in_dprob_reduction():
    inputs = gemm_inputs(torch.float32)
    deterministic = run_gemm(*inputs, variant="deterministic", **SMALL_TILES)
    atomic = run_gemm(*inputs, variant="atomic", **SMALL_TILES)
    # the same kernels, the same tiles: y, dx and dw bit for bit
    assert_same_bits(deterministic[:3], atomic[:3], names=("deterministic", "atomic"))
    assert torch.allclose(deterministic[3], atomic[3], rtol=1e-6, atol=0)


@needs_triton
@pytest.mark.bitwise(runs=2)
def test_grouped_gemm_deterministic_is_repeatable_for_fixed_tiles():
    # Only for fixed tiles: another block_n changes the slots, another block_k the K order.
    # The plugin runs this twice and compares y, dx, dw and dprob bit for bit.
    return run_gemm(*gemm_inputs(torch.bfloat16), variant="deterministic", **SMALL_TILES)


@needs_triton
def test_grouped_gemm_all_experts_empty():
    x, w, counts, prob, dy = gemm_inputs(torch.float32, counts=[0, 0])
    y, dx, dw, dprob = run_gemm(x, w, counts, prob, dy, **SMALL_TILES)
    assert y.shape == (0, 48) and dx.shape == (0, 40) and dprob.shape == (0,)
    assert torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("options, message", [
    ({"variant": "fast"}, "variant='fast'"),
    ({"block_n": 48}, "block_n=48"),
    ({"block_k": 8}, "block_k=8"),
])
def test_grouped_gemm_rejects_bad_options(options, message):
    x, w, counts, prob, _ = gemm_inputs(torch.float32)
    with pytest.raises(ValueError, match=message):
        kernels.grouped_gemm_dprob(x, w, counts, prob, **options)


def test_grouped_gemm_rejects_bad_shapes():
    x, w, counts, prob, _ = gemm_inputs(torch.float32)
    with pytest.raises(ValueError, match="weight"):
        kernels.grouped_gemm_dprob(x, w[:, :-1], counts, prob)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        kernels.grouped_gemm_dprob(x, w, counts[:-1], prob)
    with pytest.raises(ValueError, match="prob"):
        kernels.grouped_gemm_dprob(x, w, counts, prob[:-1])
    with pytest.raises(ValueError, match="sums to"):
        kernels.reference_grouped_gemm_dprob(x, w, counts + 1, prob)


@needs_triton
def test_grouped_gemm_rejects_dtype_the_kernels_lack():
    x, w, counts, prob, _ = gemm_inputs(torch.float64)
    with pytest.raises(ValueError, match="variant='torch'"):
        kernels.grouped_gemm_dprob(x, w, counts, prob)


# --- MoE combine --------------------------------------------------------------------------

def combine_inputs(dtype, num_tokens=7, top_k=3, hidden=40, num_padding_rows=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    num_rows = num_tokens * top_k + num_padding_rows
    expert_out = torch.randn(num_rows, hidden, generator=gen).to(dtype)  # (R, H)
    prob = torch.rand(num_tokens, top_k, generator=gen)  # (T, K)
    slot_index = torch.randperm(num_rows, generator=gen)[: num_tokens * top_k]
    dout = torch.randn(num_tokens, hidden, generator=gen).to(dtype)  # (T, H)
    return expert_out, prob, slot_index.view(num_tokens, top_k), dout


def run_combine(expert_out, prob, slot_index, dout, **options):
    expert_out, prob = (t.detach().clone().requires_grad_() for t in (expert_out, prob))
    out = kernels.moe_combine(expert_out, prob, slot_index, **options)
    out.backward(dout)
    return out.detach(), expert_out.grad, prob.grad


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_combine_matches_float64_reference(dtype, variant):
    expert_out, prob, slot_index, dout = combine_inputs(dtype)
    got = run_combine(expert_out, prob, slot_index, dout, variant=variant, block_h=16)
    expected = run_combine(expert_out.double(), prob.double(), slot_index, dout.double(),
                           variant="torch")
    for name, actual, ref in zip(("out", "d_expert_out", "d_prob"), got, expected):
        assert relative_error(actual, ref) <= TOLERANCE[dtype], name
    unused = torch.ones(len(expert_out), dtype=torch.bool)
    unused[slot_index.reshape(-1)] = False
    assert torch.equal(got[1][unused], torch.zeros_like(got[1][unused]))  # padding rows


@needs_triton
def test_combine_deterministic_is_independent_of_block_h_and_repeatable():
    expert_out, prob, slot_index, _ = combine_inputs(torch.bfloat16, hidden=72)
    first = kernels.moe_combine(expert_out, prob, slot_index, block_h=16)
    for block_h in (32, 64, 128, 16):
        assert_same_bits(first, kernels.moe_combine(expert_out, prob, slot_index, block_h=block_h),
                         names=("block_h=16", f"block_h={block_h}"))


@needs_triton
@pytest.mark.bitwise(runs=2)
@pytest.mark.parametrize("variant", VARIANTS)
def test_combine_forward_and_backward_are_repeatable(variant):
    # Under the interpreter atomics land in program order, so the atomic variant repeats too
    # (only a GPU can show it vary: benchmarks/gpu_check.py); this checks every kernel's bytes.
    expert_out, prob, slot_index, dout = combine_inputs(torch.float32)
    return run_combine(expert_out, prob, slot_index, dout, variant=variant, block_h=16)


@needs_triton
def test_combine_deterministic_adds_in_k_order():
    # Each output element is ((p0 x0 + p1 x1) + p2 x2) in fp32: exactly the reference's order.
    expert_out, prob, slot_index, _ = combine_inputs(torch.float32)
    out = kernels.moe_combine(expert_out, prob, slot_index, block_h=32)
    assert_same_bits(out, kernels.reference_moe_combine(expert_out, prob, slot_index),
                     names=("kernel", "reference"))


def test_combine_rejects_bad_arguments():
    expert_out, prob, slot_index, _ = combine_inputs(torch.float32)
    with pytest.raises(ValueError, match="variant"):
        kernels.moe_combine(expert_out, prob, slot_index, variant="scatter")
    with pytest.raises(ValueError, match="block_h"):
        kernels.moe_combine(expert_out, prob, slot_index, block_h=100)
    with pytest.raises(ValueError, match="slot_index"):
        kernels.moe_combine(expert_out, prob, slot_index[:, :2])
    with pytest.raises(ValueError, match="integer"):
        kernels.moe_combine(expert_out, prob, slot_index.float())


# --- digest body ----------------------------------------------------------------------------

MASK64 = (1 << 64) - 1


def python_body_sum(data: bytes) -> int:
    """The spec (digest version 2) in plain Python integers: independent of torch and Triton."""
    def mix2(x):
        high, low = x >> 32, x & 0xFFFFFFFF
        for key in (0x9E3779B8, 0x85EBCA6A, 0xC2B2AE34, 0x27D4EB2E, 0x165667B0):
            product = low * key
            high, low = low ^ (product & 0xFFFFFFFF), high ^ (product >> 32)
        return (high << 32) | low

    data = data + bytes(-len(data) % 8)
    total = 0
    for j in range(len(data) // 8):
        word = int.from_bytes(data[8 * j: 8 * j + 8], "little")
        total += mix2((word + (j + 1) * 0x9E3779B97F4A7C15) & MASK64)
    return total & MASK64


def as_uint64(value: torch.Tensor) -> int:
    assert value.dtype == torch.int64 and value.dim() == 0
    return value.item() & MASK64


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """What the fingerprint package hands over: logical bytes, contiguous, (L,) uint8."""
    return t.contiguous().reshape(-1).view(torch.uint8)


ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.complex64, torch.complex128, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
]


@needs_triton
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_digest_equals_reference_on_every_dtype(dtype):
    gen = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 256, (13 * 7 * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    t = raw.view(dtype).view(13, 7)  # arbitrary bit patterns: NaNs, subnormals, -0
    data = tensor_bytes(t)
    got = kernels.digest_body(data)
    assert got.dtype == torch.int64 and got.shape == () and got.device == data.device
    assert as_uint64(got) == python_body_sum(data.numpy().tobytes()) == as_uint64(body_sum(data))


# 65536 bytes is one program (1024 words x 8 steps): sizes around and past it.
@needs_triton
@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 65535, 65536, 65537,
                                  2 * 65536 + 13])
def test_digest_equals_reference_on_odd_sizes(size):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(size))
    assert as_uint64(kernels.digest_body(data)) == python_body_sum(data.numpy().tobytes())
    # All-ones bytes: mix2's products (x & 0xFFFFFFFF) * K come near 2**64 and every half swap
    # moves set bits, so uint64 overflow or a wrong shift in the kernel shows here.
    ones = torch.full((size,), 0xFF, dtype=torch.uint8)
    assert as_uint64(kernels.digest_body(ones)) == python_body_sum(ones.numpy().tobytes())


@needs_triton
@pytest.mark.parametrize("offset", range(1, 9))
def test_digest_unaligned_start_takes_the_byte_path(offset):
    base = torch.randint(0, 256, (70_000,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))
    data = base[offset:offset + 65_541]  # a view whose start is not 8-byte aligned
    assert as_uint64(kernels.digest_body(data)) == python_body_sum(data.numpy().tobytes())


@needs_triton
def test_digest_of_non_contiguous_tensor_bytes():
    t = torch.randn(33, 17, dtype=torch.float64).t()[::2]  # transposed and strided
    assert not t.is_contiguous()
    data = tensor_bytes(t)
    assert as_uint64(kernels.digest_body(data)) == python_body_sum(data.numpy().tobytes())


@needs_triton
def test_digest_body_many_matches_single_calls():
    datas = [tensor_bytes(torch.randn(n)) for n in (0, 3, 1000)]
    many = kernels.digest_body_many(datas)
    assert many.dtype == torch.int64 and many.shape == (3,)
    assert many.tolist() == [kernels.digest_body(d).item() for d in datas]
    assert kernels.digest_body_many([]).shape == (0,)


def test_digest_rejects_what_is_not_contiguous_bytes():
    with pytest.raises(ValueError, match="uint8"):
        kernels.digest_body(torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.digest_body(torch.zeros(8, dtype=torch.uint8)[::2])


# --- fallbacks without the interpreter or without Triton --------------------------------

def test_fallback_without_interpreter_runs_references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.available() == (HAS_TRITON and torch.cuda.is_available())
    x, w, counts, prob, dy = gemm_inputs(torch.float32)
    with pytest.warns(UserWarning, match="torch reference ran instead"):
        got = run_gemm(x, w, counts, prob, dy, variant="atomic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # variant="torch" is a choice: no warning
        expected = run_gemm(x, w, counts, prob, dy, variant="torch")
    assert_same_bits(got, expected, names=("atomic fallback", "torch"))
    expert_out, prob, slot_index, _ = combine_inputs(torch.float32)
    with pytest.warns(UserWarning, match="moe_combine"):
        out = kernels.moe_combine(expert_out, prob, slot_index)
    assert_same_bits(out, kernels.reference_moe_combine(expert_out, prob, slot_index))
    data = tensor_bytes(torch.randn(11))
    assert as_uint64(kernels.digest_body(data)) == python_body_sum(data.numpy().tobytes())


def test_import_and_fallback_without_triton_installed():
    code = (
        "import sys, warnings; sys.modules['triton'] = None\n"
        "import torch, samebits.kernels as k\n"
        "assert not k.available()\n"
        "warnings.simplefilter('ignore')\n"
        "out = k.moe_combine(torch.ones(4, 8), torch.ones(2, 2), torch.arange(4).view(2, 2))\n"
        "assert torch.equal(out, torch.full((2, 8), 2.0))\n"
        "print(k.digest_body(torch.zeros(3, dtype=torch.uint8)).item())\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # ignored: there is no Triton
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) & MASK64 == python_body_sum(bytes(3))


# --- benchmarks/gpu_check.py ---------------------------------------------------------------

GPU_CHECK = REPO / "benchmarks" / "gpu_check.py"


@needs_triton
def test_gpu_check_small_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--small", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "correctness and repeatability: PASS" in done.stdout
    results = json.loads(out.read_text())
    assert results["ok"] and set(results["targets"]) == {
        "grouped_gemm_dprob_tax<=1.05", "moe_combine_tax<=1.05",
        "digest>=0.8*copy_bandwidth", "digest_faster_than_hash_tensor"}
    for kernel in ("grouped_gemm", "combine"):
        assert results[kernel]["distinct_results"]["deterministic"] == 1
        assert set(results[kernel]["correctness"]) >= {"atomic", "deterministic", "tolerance"}
    assert results["digest"]["mismatches"] == []
    assert results["machine"]["torch"] == torch.__version__


def test_gpu_check_without_cuda_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "--small" in done.stderr
    assert not (tmp_path / "x.json").exists()
