"""The digest's version and dtype codes: plain data, no torch, so that reading a stream
(`samebits show`, `samebits dump`) needs no torch (docs/digest.md is the spec)."""

# The version of the digest's definition.  Every persisted digest (stream headers, golden
# files) carries it; digests of different versions are never compared.  1: the body term was
# fmix64(w_j + (j+1)*G).  2: it is mix2(w_j + (j+1)*G), which vectorizes with 32x32->64
# multiplies only (docs/digest.md, "Why this construction").
DIGEST_VERSION = 2

# Codes are part of every published digest: never change or reuse one, only append.
# Names are resolved with getattr so that an older torch simply lacks the newer dtypes.
DTYPE_CODE_BY_NAME = {
    "bool": 1,
    "uint8": 2,
    "int8": 3,
    "int16": 4,
    "int32": 5,
    "int64": 6,
    "float16": 7,
    "bfloat16": 8,
    "float32": 9,
    "float64": 10,
    "complex64": 11,
    "complex128": 12,
    "float8_e4m3fn": 13,
    "float8_e5m2": 14,
    "float8_e4m3fnuz": 15,
    "float8_e5m2fnuz": 16,
    "uint16": 17,
    "uint32": 18,
    "uint64": 19,
    "complex32": 20,
    "float8_e8m0fnu": 21,
    "float4_e2m1fn_x2": 22,
    "bits8": 23,
    "bits16": 24,
    "bits1x8": 25,
    "bits2x4": 26,
    "bits4x2": 27,
    # Sub-byte "shell" dtypes: one element per byte in memory, so their bytes are well defined.
    "uint1": 28,
    "uint2": 29,
    "uint3": 30,
    "uint4": 31,
    "uint5": 32,
    "uint6": 33,
    "uint7": 34,
    "int1": 35,
    "int2": 36,
    "int3": 37,
    "int4": 38,
    "int5": 39,
    "int6": 40,
    "int7": 41,
}

# Bytes per element of each dtype above, as torch's ``dtype.itemsize`` says (a metric's value
# holds one element; tests/test_digest.py checks this table against torch).
ITEMSIZE_BY_NAME = {
    **dict.fromkeys(("bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                     "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits1x8", "bits2x4", "bits4x2"), 1),
    **{f"{kind}{bits}": 1 for kind in ("uint", "int") for bits in range(1, 8)},
    **dict.fromkeys(("int16", "float16", "bfloat16", "uint16", "bits16"), 2),
    **dict.fromkeys(("int32", "float32", "uint32", "complex32"), 4),
    **dict.fromkeys(("int64", "float64", "uint64", "complex64"), 8),
    "complex128": 16,
}
