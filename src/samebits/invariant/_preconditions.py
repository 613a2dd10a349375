"""The preconditions of data-parallel-size invariance, checked and refused with a clear error.

The reduction makes the sum of M micro-batch gradients independent of how the micro-batches
were spread over ranks; it cannot make the gradients themselves independent of the rank.
That takes, for every step:

* a fixed micro-batch size (every micro-batch the same number of samples);
* a canonical list of M micro-batches, M divisible by the data-parallel size (rank r takes
  micro-batches [r * M / W, (r + 1) * M / W), in order);
* per-micro-batch computation that does not depend on the rank: RNG keyed by (step,
  micro-batch), never by rank; the loss normalised by a global count (tokens, samples) from
  an exact integer all-reduce, never by a local mean that the reduction then averages.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

from samebits.errors import ConfigError

RNG_KEYS = ("step_micro_batch",)  # the only invariant keying
REFUSED_RNG_KEYS = {
    "rank": "a generator seeded by the rank draws different dropout/jitter for the same micro-batch "
            "at another data-parallel size",
    "dp_rank": "a generator seeded by the data-parallel rank draws different numbers for the same "
               "micro-batch at another data-parallel size",
    "step": "a generator keyed by the step alone (and advanced through the step's micro-batches) "
            "gives micro-batch m the numbers of its position on its rank, which depends on the DP size",
}
LOSS_NORMALIZATIONS = ("global_tokens", "global_samples", "sum")
REFUSED_LOSS_NORMALIZATIONS = {
    "local_mean": "a mean over this rank's tokens weights each rank by its own count and is then "
                  "averaged over ranks: the weights change with the data-parallel size",
    "mean": "a per-micro-batch mean divided by the world size is a different loss at each DP size "
            "unless every micro-batch holds the same token count; normalise by the global count",
}
_SEED_RULE = "samebits-invariant-seed/1"


@dataclass(frozen=True, kw_only=True)
class Preconditions:
    """What a training loop declares about itself; `check` refuses what breaks invariance.

    ``rng_key``: how per-micro-batch randomness (dropout, router jitter) is seeded;
    ``loss_normalization``: what each micro-batch's loss is divided by.
    """

    num_micro_batches: int
    world_size: int
    micro_batch_size: int | None = None
    rng_key: str = "step_micro_batch"
    loss_normalization: str = "global_tokens"

    def check(self) -> None:
        """Raise `ConfigError` naming the first setting that breaks invariance (all of them)."""
        problems = []
        for name in ("num_micro_batches", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r}: must be a positive int")
        if not problems and self.num_micro_batches % self.world_size:
            problems.append(
                f"num_micro_batches={self.num_micro_batches} is not divisible by the data-parallel size "
                f"{self.world_size}: every rank must take the same number of whole micro-batches. Choose "
                f"num_micro_batches as a multiple of every DP size you compare (e.g. "
                f"{_lcm_hint(self.num_micro_batches, self.world_size)}).")
        if self.micro_batch_size is not None and (isinstance(self.micro_batch_size, bool)
                                                  or not isinstance(self.micro_batch_size, int)
                                                  or self.micro_batch_size < 1):
            problems.append(f"micro_batch_size={self.micro_batch_size!r}: invariance needs one fixed "
                            "positive micro-batch size")
        if self.rng_key in REFUSED_RNG_KEYS:
            problems.append(f"rng_key={self.rng_key!r}: {REFUSED_RNG_KEYS[self.rng_key]}. Seed each "
                            "micro-batch from (step, micro-batch) with `micro_batch_seed` / "
                            "`GradientAccumulator.micro_batch`.")
        elif self.rng_key not in RNG_KEYS:
            problems.append(f"rng_key={self.rng_key!r} is not one of {', '.join(RNG_KEYS)}")
        if self.loss_normalization in REFUSED_LOSS_NORMALIZATIONS:
            problems.append(f"loss_normalization={self.loss_normalization!r}: "
                            f"{REFUSED_LOSS_NORMALIZATIONS[self.loss_normalization]}. Divide each "
                            "micro-batch's summed loss by `global_count(...)` instead.")
        elif self.loss_normalization not in LOSS_NORMALIZATIONS:
            problems.append(f"loss_normalization={self.loss_normalization!r} is not one of "
                            f"{', '.join(LOSS_NORMALIZATIONS)}")
        if problems:
            raise ConfigError("the training loop cannot be invariant to the data-parallel size:\n"
                              + "\n".join(f"  - {p}" for p in problems))


def check_micro_batch_size(step: int, index: int, size: int, expected: int) -> None:
    """Refuse a micro-batch whose size is not the fixed one (a ragged last batch, a sampler
    that splits a global batch by rank count)."""
    if size != expected:
        raise ConfigError(f"step {step}, micro-batch {index}: {size} samples, but the fixed micro-batch "
                          f"size is {expected}. Invariance needs equal micro-batches: drop or pad the "
                          "ragged batch, and cut the global batch into micro-batches before assigning ranks.")


def micro_batch_seed(seed: int, step: int, micro_batch: int) -> int:
    """A 63-bit seed that depends on (seed, step, micro-batch) only, never on the rank."""
    for name, value in (("seed", seed), ("step", step), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
    digest = hashlib.sha256(f"{_SEED_RULE}|{seed}|{step}|{micro_batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def manual_seed(seed: int) -> None:
    """`torch.manual_seed(seed)`'s effect, at a hundredth of its cost on a host with no
    accelerator: there it seeds the CPU generator alone (torch's lazy seeds of absent devices
    never take effect, but each records a stack); with any accelerator it is `torch.manual_seed`."""
    if _accelerator_present():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))


@functools.lru_cache(maxsize=1)
def _accelerator_present() -> bool:
    return bool(torch.cuda.is_available() or torch.backends.mps.is_available() or torch.xpu.is_available() or
                torch.mtia.is_available() or torch._C._get_privateuse1_backend_name() != "privateuseone")


def _lcm_hint(m: int, w: int) -> int:
    return m * w // math.gcd(m, w)


__all__ = ["Preconditions", "check_micro_batch_size", "micro_batch_seed", "RNG_KEYS", "LOSS_NORMALIZATIONS"]
