"""digest / digest_many / body_sums: turn tensors into bytes and route them to a body-sum
backend: the compiled library on CPU, a registered device backend (CUDA with Triton), else the
torch reference.  All compute the same bits.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from samebits._torchutil import int_view
from samebits.errors import ConfigError
from samebits.fingerprint import _native, _reference
from samebits.fingerprint._spec import finalize, header


def _check(t: object) -> None:
    """Check that `t` is a tensor whose bytes we can digest (TypeError / ConfigError)."""
    plain = type(t) is torch.Tensor  # the usual case: no subclass checks to run
    if not plain and not isinstance(t, torch.Tensor):
        raise TypeError(f"samebits can only digest torch.Tensor objects, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise ConfigError(
            f"samebits digests dense tensors; this one has layout {t.layout}: digest "
            "t.to_dense() (or its indices and values separately)"
        )
    if t.is_meta:
        raise ConfigError("samebits cannot digest a tensor on the meta device: it has no data")
    if not plain and is_traceable_wrapper_subclass(t):
        raise ConfigError(
            f"samebits cannot digest a {type(t).__name__} directly: it is a wrapper without its "
            "own data; digest the tensors inside it (e.g. DTensor.to_local())"
        )


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """`t`'s logical contents as row-major memory (possibly with another dtype of equal size)."""
    if t.is_conj():  # lazy conjugate: memory still holds the unconjugated values
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_contiguous():
        return t
    # detach: copying for autograd would only cost time; the integer view makes the copy a plain
    # bit copy, also for dtypes without a copy kernel (torch.uint4 and other shell dtypes)
    return int_view(t.detach()).contiguous()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes B of the spec as a 1-D uint8 tensor on `t`'s device."""
    t = _row_major(t).detach()
    # Not reshape(-1): a contiguous tensor may have odd strides on size-1 dims, and so may
    # its reshape; view(uint8) needs stride 1.
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


_cuda_body_sum: Callable[[torch.Tensor], torch.Tensor] | None = None  # chosen on first use
_device_backends: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


def register_body_sum_backend(device_type: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Offer ``fn`` (1-D uint8 bytes -> int64 body sum, same bits as `_reference.body_sum`) for
    tensors on ``device_type``: `samebits.kernels` registers its kernel, never imported from here."""
    global _cuda_body_sum
    _device_backends[device_type] = fn
    _cuda_body_sum = None  # choose again on next use


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _body_sum_fn(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Body-sum function for 1-D uint8 tensors on `device` (not CPU)."""
    global _cuda_body_sum
    if device.type != "cuda":
        return _reference.body_sum
    if _cuda_body_sum is None:
        backend = _device_backends.get("cuda")
        usable = backend is not None and _triton_installed() and torch.cuda.is_available()
        _cuda_body_sum = backend if usable else _reference.body_sum
    return _cuda_body_sum


def body_sums_of_checked(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`body_sums` of tensors known to pass its checks, all on ``device`` (the Recorder's call plans)."""
    if device.type == "cpu" and _native.available():
        return _native.body_sums([_row_major(t) for t in tensors])  # one native call for all
    if device.type == "cpu":
        _native.warn_missing()
        body_sum = _reference.body_sum
    else:
        body_sum = _body_sum_fn(device)
    # S of no words is 0: the empty case spares the kernels
    sums = [body_sum(data) if data.numel() else torch.zeros((), dtype=torch.int64, device=device)
            for data in map(_as_bytes, tensors)]
    return torch.stack(sums) if sums else torch.empty(0, dtype=torch.int64, device=device)


def body_sums(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Body sums S (spec step 3) of tensors on one device, as int64 [n] there, with no host
    synchronisation (docs/digest.md, "API").  Checks every tensor before computing anything."""
    tensors = list(tensors)
    for t in tensors:
        _check(t)  # only the check: the header is the caller's, from metadata it has cached
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ConfigError(
            f"body_sums takes tensors on one device, got {', '.join(sorted(map(str, devices)))}; "
            "call it once per device (digest_many does this for you)"
        )
    return body_sums_of_checked(tensors, devices.pop() if devices else torch.device("cpu"))


def digest_many(tensors: Iterable[torch.Tensor]) -> list[int]:
    """64-bit digests of `tensors`, in order: one host synchronisation per device, not per tensor."""
    tensors = list(tensors)
    for t in tensors:
        _check(t)
    headers = [header(t.dtype, t.shape) for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    if len(by_device) <= 1:  # the usual case: nothing to scatter
        device = next(iter(by_device), torch.device("cpu"))
        return finalize(body_sums_of_checked(tensors, device), headers)
    sums = [0] * len(tensors)
    for device, indices in by_device.items():
        device_sums = body_sums_of_checked([tensors[i] for i in indices], device)
        for i, s in zip(indices, device_sums.tolist()):  # this device's one synchronisation
            sums[i] = s
    return finalize(sums, headers)


def digest(tensor: torch.Tensor) -> int:
    """The 64-bit digest of one tensor's dtype, shape and bytes, as an unsigned int (equal
    digests: bitwise-equal tensors; docs/digest.md).  For many tensors use `digest_many`."""
    return digest_many([tensor])[0]
