"""Tests of the tensor digest (samebits.fingerprint) against its spec, docs/digest.md.

Three implementations are held to the same bits: the compiled CPU library, the torch
reference (`_reference.body_sum`) and `spec_digest` below, a plain-Python transcription of
the spec that shares no code with the package.  The whole file runs in well under a minute.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from samebits import fingerprint
from samebits.fingerprint import _digest, _native, _reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "digest.md"
MASK64 = (1 << 64) - 1
ALL_DTYPES = list(fingerprint.DTYPE_CODES)
# Dtypes whose random bit patterns are all valid values (bool must be 0 or 1).
ANY_BITS_DTYPES = [d for d in ALL_DTYPES if d is not torch.bool]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

fast = settings(max_examples=25, deadline=None)


# --- the spec, transcribed with Python ints -----------------------------------------------


def spec_fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    return x ^ (x >> 33)


def spec_mix2(x: int) -> int:
    """Digest version 2's word mixer, on the two 32-bit halves (high, low) of x."""
    high, low = x >> 32, x & 0xFFFFFFFF
    for key in (0x9E3779B8, 0x85EBCA6A, 0xC2B2AE34, 0x27D4EB2E, 0x165667B0):
        product = low * key  # < 2**64
        high, low = low ^ (product & 0xFFFFFFFF), high ^ (product >> 32)  # xor, then swap
    return (high << 32) | low


def spec_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg()
    return bytes(bit_copy(t).reshape(-1).view(torch.uint8).tolist())


def spec_body_sum(data: bytes, first_word: int = 0) -> int:
    data = data + bytes(-len(data) % 8)
    total = 0
    for j in range(len(data) // 8):
        w = int.from_bytes(data[8 * j : 8 * j + 8], "little")
        total += spec_mix2((w + (first_word + j + 1) * 0x9E3779B97F4A7C15) & MASK64)
    return total & MASK64


def spec_digest(t: torch.Tensor) -> int:
    data = spec_bytes(t)
    h = 0x243F6A8885A308D3
    for x in [fingerprint.DTYPE_CODES[t.dtype], t.dim(), *t.shape, len(data)]:
        h = spec_fmix64(h ^ x)
    return spec_fmix64(h ^ spec_body_sum(data))


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bits of `dtype` (valid 0/1 for bool)."""
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    if dtype is torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=generator).bool()
    data = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return data.view(dtype).reshape(shape)


def bit_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`'s bits with standard strides (also for dtypes without a copy kernel, like
    uint4): copying through an integer view of the same size cannot alter any bits."""
    same_size_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype.itemsize not in same_size_int:
        return t.clone(memory_format=torch.contiguous_format)
    bits = t.view(same_size_int[t.dtype.itemsize])
    return bits.clone(memory_format=torch.contiguous_format).view(t.dtype)


def u64(x: int) -> int:
    return x & MASK64


def reference_sum(t: torch.Tensor) -> int:
    return u64(_reference.body_sum(_digest._as_bytes(t)).item())


def native_sum(t: torch.Tensor) -> int:
    return u64(_native.body_sums([_digest._row_major(t)]).item())


# --- the document and the code agree --------------------------------------------------------


def doc_block(name: str) -> str:
    text = DOC.read_text()
    match = re.search(rf"<!-- samebits:{name}[^>]*-->(.*?)<!-- /samebits:{name} -->", text, re.S)
    assert match, f"docs/digest.md lost its {name} block"
    return match.group(1)


def table_rows(block: str) -> list[list[str]]:
    rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for line in block.strip().splitlines()
    ]
    return rows[2:]  # skip the heading and the |---| line


def test_dtype_code_table_matches_doc():
    documented = {row[1]: int(row[0]) for row in table_rows(doc_block("dtype-codes"))}
    assert len(set(documented.values())) == len(documented), "dtype codes must be unique"
    in_code = {str(d).removeprefix("torch."): c for d, c in fingerprint.DTYPE_CODES.items()}
    # An older torch lacks some dtypes; every dtype this torch has must carry its code.
    assert in_code == {name: code for name, code in documented.items() if hasattr(torch, name)}


def test_published_dtype_codes_never_change():
    published = [
        "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
        "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "uint16", "uint32", "uint64", "complex32", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    ]  # fmt: skip
    for code, name in enumerate(published, start=1):
        if hasattr(torch, name):
            assert fingerprint.DTYPE_CODES[getattr(torch, name)] == code, name


def test_test_vectors_from_doc():
    rows = table_rows(doc_block("test-vectors"))
    assert len(rows) >= 15
    tensors = [eval(expression, {"torch": torch}) for expression, *_ in rows]
    digests = fingerprint.digest_many(tensors)
    for (expression, length, body, expected), t, got in zip(rows, tensors, digests):
        assert t.nbytes == int(length), expression
        assert u64(fingerprint.body_sums([t]).item()) == int(body, 16), expression
        assert reference_sum(t) == int(body, 16), expression
        assert got == fingerprint.digest(t) == spec_digest(t) == int(expected, 16), expression


def test_worked_example_from_doc():
    block = doc_block("worked-example")
    expression = re.search(r"<!-- samebits:worked-example (.*?) -->", DOC.read_text()).group(1)
    t = eval(expression, {"torch": torch})
    values = dict(re.findall(r"^(\w+)\s*=\s*(.+)$", block, re.M))
    data = spec_bytes(t)
    assert values.pop("B").split() == [f"{b:02x}" for b in data]
    padded = data + bytes(-len(data) % 8)
    expected = {}
    for j in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * j : 8 * j + 8], "little")
        a = (w + (j + 1) * 0x9E3779B97F4A7C15) & MASK64
        expected |= {f"w_{j}": w, f"a_{j}": a, f"m_{j}": spec_mix2(a)}
    expected["S"] = spec_body_sum(data)
    h = 0x243F6A8885A308D3
    for k, x in enumerate([fingerprint.DTYPE_CODES[t.dtype], t.dim(), *t.shape, len(data)], 1):
        h = expected[f"H_{k}"] = spec_fmix64(h ^ x)
    expected["D"] = fingerprint.digest(t)
    assert {name: int(value, 16) for name, value in values.items()} == expected
    assert spec_fmix64(h ^ expected["S"]) == expected["D"]


# --- the word mixer: a bijection with full avalanche ------------------------------------------

MIX_KEYS = (0x9E3779B8, 0x85EBCA6A, 0xC2B2AE34, 0x27D4EB2E, 0x165667B0)


def low_half_map_is_bijective(key: int, bits: int = 16) -> bool:
    """Whether lo -> lo ^ (lo * key) is a bijection on `bits`-bit numbers.  Bit i of lo * key
    depends on bits <= i of lo, and only on bits < i when the key is even, so the map is
    triangular and its restriction to the low `bits` bits decides it for 32 bits too."""
    import numpy as np

    lo = np.arange(1 << bits, dtype=np.uint64)
    image = (lo ^ (lo * np.uint64(key))) & np.uint64((1 << bits) - 1)
    return len(np.unique(image)) == 1 << bits


def spec_unmix2(x: int, keys=MIX_KEYS) -> int:
    """The inverse of spec_mix2: undo each round (swap back, recover low bit by bit, then high)."""
    high, low = x >> 32, x & 0xFFFFFFFF
    for key in reversed(keys):
        mixed_low, high = high, low  # before the swap: (high ^ p_hi, low ^ p_lo) = (low, high)
        low = 0
        for bit in range(32):  # bit i of mixed_low = bit i of low ^ bit i of (low * key)
            guess = low | (((mixed_low ^ (low * key)) >> bit) & 1) << bit
            low = guess
        high ^= (low * key) >> 32
    return (high << 32) | low


def test_mix2_is_a_bijection():
    """Every change inside one word changes its term (docs/digest.md, "Why this construction")
    because each round is invertible; an odd key would break that (the faulty variant)."""
    for key in MIX_KEYS:
        assert key % 2 == 0 and low_half_map_is_bijective(key)
    assert not low_half_map_is_bijective(MIX_KEYS[0] | 1)  # odd: bit 0 always cancels
    generator = torch.Generator().manual_seed(0)
    for x in torch.randint(-(2**63), 2**63 - 1, (200,), generator=generator).tolist():
        x &= MASK64
        assert spec_unmix2(spec_mix2(x)) == x
    assert spec_mix2(0) == 0  # a fixed point; the position offset (j+1)*G keeps zeros apart


def avalanche(mix, num_inputs: int = 10_000) -> torch.Tensor:
    """[64, 64] frequencies: how often output bit o flips when input bit i is flipped, over
    random inputs (int64 bits)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(-(2**63), 2**63 - 1, (num_inputs,), dtype=torch.int64, generator=generator)
    flips = torch.ones(64, dtype=torch.int64) << torch.arange(64)  # bit 63: -2**63
    y = mix(x)
    flipped = mix((x[None, :] ^ flips[:, None]).reshape(-1)).reshape(64, num_inputs)
    changed = flipped ^ y[None, :]  # [input bit, input]
    return torch.stack([((row[:, None] >> torch.arange(64)) & 1).double().mean(dim=0) for row in changed])


def mix_rounds(num_rounds: int):
    def mix(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        for key in MIX_KEYS[:num_rounds]:
            x ^= (x & 0xFFFFFFFF) * key
            x = ((x >> 32) & 0xFFFFFFFF) | (x << 32)
        return x

    return mix


def test_mix2_avalanche():
    """Flipping any one input bit flips every output bit with probability ~1/2 (10^4 random
    inputs, all 64 x 64 pairs within [0.45, 0.55]): a change confined to one half randomises
    both halves.  The package's mixer is the one measured; three rounds (the faulty variant)
    fail."""
    frequencies = avalanche(_reference.mix2)
    assert 0.45 <= frequencies.min() and frequencies.max() <= 0.55, (frequencies.min(), frequencies.max())
    assert torch.equal(_reference.mix2(torch.arange(-50, 50)), mix_rounds(5)(torch.arange(-50, 50)))
    weak = avalanche(mix_rounds(3), num_inputs=2000)
    assert weak.min() < 0.45 or weak.max() > 0.55


def test_mix2_matches_its_spec_transcription():
    from samebits.fingerprint import _spec

    generator = torch.Generator().manual_seed(2)
    values = torch.randint(-(2**63), 2**63 - 1, (500,), generator=generator)
    mixed = _reference.mix2(values).tolist()
    for x, m in zip(values.tolist(), mixed):
        assert u64(m) == spec_mix2(x & MASK64) == _spec.mix2(x)


# --- what the digest detects (hypothesis, bounded) ------------------------------------------


@fast
@given(st.sampled_from(ANY_BITS_DTYPES), st.integers(1, 5), st.integers(0, 2**32))
def test_every_single_bit_flip_is_detected(dtype, numel, seed):
    t = random_tensor(dtype, (numel,), seed)
    flipped = []
    for byte in range(t.nbytes):
        for bit in range(8):
            f = bit_copy(t)
            f.view(torch.uint8)[byte] ^= 1 << bit
            flipped.append(f)
    digests = fingerprint.digest_many([t, *flipped])
    assert len(set(digests)) == len(digests)  # each flip differs from t and from each other


@fast
@given(st.sampled_from(FLOAT_DTYPES + [torch.int32, torch.uint8]), st.integers(0, 2**32))
def test_pairs_of_equal_bit_flips_are_detected(dtype, seed):
    t = random_tensor(dtype, (6,), seed)
    bits = 8 * dtype.itemsize
    variants = []
    for i in range(6):
        for k in range(i + 1, 6):
            for bit in range(bits):
                f = t.clone()
                raw = f.view(torch.uint8).view(6, dtype.itemsize)
                raw[i, bit // 8] ^= 1 << (bit % 8)
                raw[k, bit // 8] ^= 1 << (bit % 8)
                variants.append(f)
    digests = fingerprint.digest_many([t, *variants])
    assert len(set(digests)) == len(digests)


@fast
@given(st.integers(2, 64), st.integers(0, 2**32))
def test_permutations_are_detected(numel, seed):
    t = torch.arange(numel, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(numel, generator=generator)
    if torch.equal(order, torch.arange(numel)):
        order = order.roll(1)
    assert fingerprint.digest(t[order]) != fingerprint.digest(t)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # torch.cat, complex32
@fast
@given(st.sampled_from(ANY_BITS_DTYPES), st.integers(0, 2**32), st.integers(0, 2**32))
def test_pairs_of_equal_values_do_not_cancel(dtype, seed_a, seed_b):
    a = random_tensor(dtype, (1,), seed_a)
    b = random_tensor(dtype, (1,), seed_b)
    if torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        return
    # XOR hashes give [a, a] == [b, b] == [0, 0]; the digest must not.
    assert fingerprint.digest(torch.cat([a, a])) != fingerprint.digest(torch.cat([b, b]))


def test_zeros_of_different_sizes_and_dtypes_differ():
    tensors = [
        torch.zeros(n * d.itemsize, dtype=torch.uint8).view(d)  # torch.zeros lacks some dtypes
        for d in ALL_DTYPES
        for n in range(0, 40)
    ]
    tensors += [torch.zeros(shape) for shape in [(), (1, 0), (0, 1), (1, 1), (2, 1), (1, 2)]]
    digests = fingerprint.digest_many(tensors)
    assert len(set(digests)) == len(digests)


@fast
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32))
def test_same_bytes_other_shape_differ(rows, cols, seed):
    t = random_tensor(torch.float32, (rows, cols), seed)
    others = [t.reshape(cols, rows), t.reshape(-1), t.reshape(1, rows, cols)]
    digests = fingerprint.digest_many([t, *others])
    assert len(set(digests)) == (4 if rows != cols else 3)


def test_same_bits_other_dtype_differ():
    bits = random_tensor(torch.int16, (7,), 0)
    same_bits = [bits.view(d) for d in ALL_DTYPES if d.itemsize == 2]
    digests = fingerprint.digest_many(same_bits)
    assert len(set(digests)) == len(digests)
    bf16, fp16 = bits.view(torch.bfloat16), bits.view(torch.float16)
    assert fingerprint.digest(bf16) != fingerprint.digest(fp16)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_signed_zeros_and_nan_payloads_differ(dtype):
    nans = torch.full((3,), float("nan"), dtype=dtype)
    other_nan = nans.clone()
    other_nan.view(torch.uint8)[0] ^= 1  # lowest mantissa bit: still a NaN, another payload
    assert other_nan.isnan().all()
    values = [torch.zeros(3, dtype=dtype), -torch.zeros(3, dtype=dtype), nans, other_nan]
    digests = fingerprint.digest_many(values)
    assert len(set(digests)) == len(digests)


def test_torch_hash_tensor_misses_what_the_digest_catches():
    """The motivation: torch.hash_tensor (an XOR of elements) misses both of these."""
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    pair_flip = t.clone()
    pair_flip.view(torch.int32)[:2] ^= 1  # the same low bit in two elements
    permuted = t.flip(0)
    for changed in (pair_flip, permuted):
        assert torch.hash_tensor(changed) == torch.hash_tensor(t)
        assert fingerprint.digest(changed) != fingerprint.digest(t)


# --- views, layouts and odd inputs -----------------------------------------------------------


@fast
@given(
    st.sampled_from(ALL_DTYPES),
    st.lists(st.integers(1, 5), min_size=2, max_size=4),
    st.integers(0, 2**32),
    st.integers(2, 3),
)
def test_non_contiguous_view_equals_contiguous_copy(dtype, shape, seed, step):
    t = random_tensor(dtype, shape, seed)
    views = [t.transpose(0, -1), t[..., ::step], t[1:, 1:], t.expand(2, *shape)]
    for view in views:
        copy = bit_copy(view)
        assert copy.is_contiguous()
        assert fingerprint.digest(view) == fingerprint.digest(copy) == spec_digest(view)


def test_conjugate_and_negative_views_hash_their_values():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert fingerprint.digest(z.conj()) == fingerprint.digest(z.conj().resolve_conj())
    assert fingerprint.digest(z.conj()) != fingerprint.digest(z)
    neg = torch._neg_view(z)
    assert fingerprint.digest(neg) == fingerprint.digest(neg.resolve_neg())
    assert fingerprint.digest(z.conj().imag) == fingerprint.digest(-z.imag)


def test_zero_dim_empty_and_channels_last():
    assert fingerprint.digest(torch.tensor(2.5)) == spec_digest(torch.tensor(2.5))
    assert fingerprint.digest(torch.tensor(2.5)) != fingerprint.digest(torch.tensor([2.5]))
    for empty in (torch.empty(0), torch.empty(3, 0, 2), torch.empty(0, dtype=torch.uint4)):
        assert fingerprint.digest(empty) == spec_digest(empty)
    x = random_tensor(torch.float32, (2, 3, 4, 5), 1)
    channels_last = x.to(memory_format=torch.channels_last)
    assert fingerprint.digest(channels_last) == fingerprint.digest(x)


def test_requires_grad_is_read_without_autograd():
    leaf = torch.randn(4, 5, requires_grad=True)
    nonleaf = (leaf * 2).t()  # non-contiguous and part of a graph
    assert fingerprint.digest(leaf) == fingerprint.digest(leaf.detach())
    assert fingerprint.digest(nonleaf) == fingerprint.digest(nonleaf.detach().contiguous())
    assert leaf.grad is None


# --- every backend gives the same bits -------------------------------------------------------


def test_native_library_is_built():
    assert _native.available(), (
        "the compiled digest library is missing: run `pip install -e .` in the repository"
    )


needs_native = pytest.mark.skipif(not _native.available(), reason="compiled library not built")


@needs_native
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_native_equals_reference_on_every_dtype(dtype):
    tensors = [random_tensor(dtype, (n,), seed=n) for n in (0, 1, 3, 7, 8, 9, 17, 1001)]
    tensors += [random_tensor(dtype, (5, 7), 3).t(), random_tensor(dtype, (4, 6), 4)[:, 1::2]]
    for t in tensors:
        assert native_sum(t) == reference_sum(t) == spec_body_sum(spec_bytes(t))
        assert fingerprint.digest(t) == spec_digest(t)


@needs_native
@pytest.mark.parametrize("offset", range(8))
def test_native_equals_reference_on_unaligned_odd_lengths(offset):
    base = random_tensor(torch.uint8, (4099,), offset)
    for length in (0, 1, 5, 8, 13, 64, 4090):
        data = base[offset : offset + length]  # start address not 8-byte aligned
        assert native_sum(data) == reference_sum(data) == spec_body_sum(spec_bytes(data))


@needs_native
def test_native_parallel_chunks_equal_reference():
    """Inputs big enough for the threaded path, with chunks that end inside tensors."""
    sizes = [3 << 20, 1, 0, (1 << 19) + 3, 5 << 19, 7]  # 6.5 MiB in all: over the threshold
    tensors = [random_tensor(torch.uint8, (n,), n) for n in sizes]
    expected = [reference_sum(t) for t in tensors]
    old_threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            got = [u64(s) for s in fingerprint.body_sums(tensors).tolist()]
            assert got == expected, f"{num_threads} threads"
    finally:
        torch.set_num_threads(old_threads)


@needs_native
@pytest.mark.parametrize("isa", ["portable", "sse2", "avx2", "avx512f"])
def test_every_vector_loop_equals_the_spec(isa):
    """Each compiled loop, not only the one picked for this CPU (the others are otherwise never
    run here): lengths around the vector steps, unaligned starts, positions beyond 32 bits."""
    if _native.body_sum_with(isa, torch.zeros(8, dtype=torch.uint8)) is None:
        pytest.skip(f"this build or CPU has no {isa} loop")
    base = random_tensor(torch.uint8, (8 * 300 + 16,), 11)
    for offset in (0, 3):
        # 8 * 32 and up: the AVX2/AVX-512 loops' four streams (a 64-byte line of each at a time),
        # with and without a tail of whole lines and of words
        for length in (0, 5, 8, 31, 32, 63, 64, 65, 8 * 17 + 3, 8 * 32, 8 * 40, 8 * 64 + 8 * 7 + 3, 8 * 300):
            data = base[offset : offset + length]
            for first_word in (0, 2**32 + 5):
                expected = spec_body_sum(spec_bytes(data), first_word)
                assert _native.body_sum_with(isa, data, first_word) == expected, (offset, length, first_word)
    assert _native.body_sum_with("no-such-loop", base) is None


@needs_native
@pytest.mark.parametrize("first_word", [0, 1, 2**32 - 1, 2**32 + 5, 2**40 + 3, 2**61])
def test_positions_beyond_32_bits(first_word):
    """Word indices of tensors too big to allocate (> 4 G words) wrap the same way everywhere."""
    data = random_tensor(torch.uint8, (61,), 7)
    expected = spec_body_sum(spec_bytes(data), first_word)
    assert _native.body_sum_at(data, first_word) == expected
    assert u64(_reference.body_sum_at(data, first_word).item()) == expected


def test_reference_fallback_warns_once_and_agrees(monkeypatch):
    tensors = [random_tensor(d, (11,), 5) for d in (torch.float32, torch.bfloat16, torch.bool)]
    expected = [spec_digest(t) for t in tensors]
    monkeypatch.setattr(_native, "LIB", None)
    monkeypatch.setattr(_native, "_warned_missing", False)
    with pytest.warns(UserWarning, match=r"pip install -e \.") as caught:
        assert fingerprint.digest_many(tensors) == expected
        assert fingerprint.digest(tensors[0]) == expected[0]
    assert len([w for w in caught if "compiled digest library" in str(w.message)]) == 1


# --- API ---------------------------------------------------------------------------------------


def test_digest_many_equals_digest_loop():
    tensors = [random_tensor(d, (3, n), n) for n, d in enumerate(ALL_DTYPES)]
    tensors += [torch.tensor(1.0), torch.empty(0), torch.randn(300, 700).t()]
    assert fingerprint.digest_many(tensors) == [fingerprint.digest(t) for t in tensors]
    assert fingerprint.digest_many(iter(tensors)) == fingerprint.digest_many(tensors)
    assert fingerprint.digest_many([]) == []


def test_body_sums_then_finalize_is_digest_many():
    tensors = [torch.randn(5, 3), torch.arange(7, dtype=torch.int16), torch.tensor(True)]
    sums = fingerprint.body_sums(tensors)
    assert sums.dtype == torch.int64 and sums.shape == (3,)
    headers = [fingerprint.header(t.dtype, t.shape) for t in tensors]
    expected = fingerprint.digest_many(tensors)
    assert fingerprint.finalize(sums, headers) == expected
    assert fingerprint.finalize([u64(s) for s in sums.tolist()], headers) == expected
    assert fingerprint.body_sums([]).shape == (0,)
    with pytest.raises(ValueError, match="2 body sums but 3 headers"):
        fingerprint.finalize(sums[:2], headers)


def test_finalize_packed_is_finalize():
    """The Recorder's vectorised finalize: the same digests as the Python loop, packed little
    endian, for sums and headers across the whole 64-bit range (numpy's uint64 wraps)."""
    import numpy as np

    rng = np.random.default_rng(0)
    sums = rng.integers(0, 2**64, size=200, dtype=np.uint64, endpoint=False)
    sums[:3] = [0, 2**64 - 1, 2**63]
    headers = [int(h) for h in rng.integers(0, 2**64, size=200, dtype=np.uint64)]
    headers[:3] = [2**64 - 1, 0, 1]
    packed = fingerprint.finalize_packed(sums, headers)
    expected = fingerprint.finalize([int(s) for s in sums], headers)
    assert [int.from_bytes(packed[i : i + 8], "little") for i in range(0, len(packed), 8)] == expected
    assert fingerprint.finalize_packed(np.zeros(0, dtype=np.uint64), []) == b""
    with pytest.raises(ValueError, match="2 body sums but 3 headers"):
        fingerprint.finalize_packed(sums[:2], headers[:3])


def test_bad_inputs_have_clear_errors():
    with pytest.raises(TypeError, match="got list"):
        fingerprint.digest([1.0, 2.0])
    with pytest.raises(TypeError, match="got ndarray"):
        fingerprint.digest_many([torch.zeros(1), torch.zeros(1).numpy()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized creation is deprecated
        quantized = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
    with pytest.raises(ValueError, match=r"dtype torch\.qint8 .*int_repr.*supported dtypes: bool"):
        fingerprint.digest(quantized)
    with pytest.raises(ValueError, match="layout torch.sparse_coo.*to_dense"):
        fingerprint.digest(torch.randn(3).to_sparse())
    with pytest.raises(ValueError, match="meta device"):
        fingerprint.digest(torch.empty(3, device="meta"))
    from torch.testing._internal.two_tensor import TwoTensor

    with pytest.raises(ValueError, match="TwoTensor .*wrapper"):
        fingerprint.digest(TwoTensor(torch.randn(3), torch.randn(3)))
    with pytest.raises(ValueError, match="1-D uint8"):
        _reference.body_sum(torch.zeros(8))


def test_cuda_backend_choice(monkeypatch):
    """CUDA body sums use the registered kernel (samebits.kernels.digest_body) when Triton is
    usable, else the reference."""
    from samebits import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_digest, "_triton_installed", lambda: True)
    monkeypatch.setattr(_digest, "_cuda_body_sum", None)
    assert _digest._body_sum_fn(torch.device("cuda", 0)) is kernels.digest_body
    monkeypatch.setattr(_digest, "_device_backends", {})  # no kernel registered
    monkeypatch.setattr(_digest, "_cuda_body_sum", None)
    assert _digest._body_sum_fn(torch.device("cuda", 0)) is _reference.body_sum
    assert _digest._body_sum_fn(torch.device("mps")) is _reference.body_sum
    monkeypatch.setattr(_digest, "_device_backends", {"cuda": kernels.digest_body})
    monkeypatch.setattr(_digest, "_triton_installed", lambda: False)  # Triton missing
    monkeypatch.setattr(_digest, "_cuda_body_sum", None)
    assert _digest._body_sum_fn(torch.device("cuda", 0)) is _reference.body_sum


def test_cuda_backend_is_optional():
    """Importing samebits (which registers samebits.kernels' CUDA digest with fingerprint, the
    layer below it) must not import Triton: it is optional and loaded on a kernel's first use."""
    code = "import sys, samebits.fingerprint; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- living next to torch's OpenMP -----------------------------------------------------------


@needs_native
def test_one_openmp_runtime_no_extra_threads_and_fork_safe():
    code = textwrap.dedent(
        """
        import os, torch
        torch.set_num_threads(2)
        x = torch.randn(1 << 21)
        (x @ x, x.sum(), torch.randn(256, 256) @ torch.randn(256, 256))  # start torch's pool
        threads_before = len(os.listdir("/proc/self/task"))
        from samebits import fingerprint
        for _ in range(5):
            digests = fingerprint.digest_many([x, torch.randn(3 << 20), torch.randn(5)])
            x.sum()
        threads_after = len(os.listdir("/proc/self/task"))
        gomp = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
        # After a parallel region, OpenMP in a forked child hangs (torch's too): we must not.
        pid = os.fork()
        if pid == 0:
            os._exit(0 if fingerprint.digest(x) == digests[0] else 1)
        _, status = os.waitpid(pid, 0)
        print(len(gomp), threads_before, threads_after, torch.get_num_threads(), status)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=30
    )
    num_runtimes, threads_before, threads_after, torch_threads, child_status = map(
        int, out.stdout.split()
    )
    assert torch_threads == 2
    assert threads_after == threads_before, "the digest started a second thread pool"
    assert child_status == 0, "digest in a forked child failed"
    torch_lib = Path(torch.__file__).parent / "lib"
    if (torch_lib / "libgomp.so.1").exists():  # same soname as ours: must be shared
        assert num_runtimes == 1
