"""The reference recipe's determinism rules, registered through the public rule API when
`samebits.recipes` is imported.  Each option's choices come from its `Literal` type in
`RecipeConfig`: a value neither known deterministic nor known nondeterministic fails closed.
"""

from __future__ import annotations

from typing import Iterator

from samebits.determinism import CheckContext, Rule, RuleFinding, register_rule, rules

RECIPE_CHOICES: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    # key: (deterministic values, known nondeterministic values, why)
    "moe_combine": (
        ("index_add", "triton_deterministic"), ("index_put_accumulate", "triton_atomic"),
        "index_put_(accumulate=True) races between CPU threads and uses atomicAdd on CUDA "
        "(measured: differs on every call with 2 threads); the atomic Triton combine adds "
        "in arrival order.  index_add_ (Megatron's unpermute) and the sorted Triton kernel "
        "sum each row in a fixed order."),
    "moe_grouped_gemm": (
        ("torch", "triton_deterministic"), ("triton_atomic",),
        "the atomic Triton grouped GEMM accumulates split-K partial sums with atomic adds, "
        "in arrival order."),
    "embedding_backward": (
        ("dense",), ("index_put_accumulate",),
        "an index_put_(accumulate=True) gradient races between CPU threads and uses "
        "atomicAdd on CUDA; the dense embedding backward is deterministic (measured)."),
}


def _choice_rule(key: str) -> Rule:
    good, bad, why = RECIPE_CHOICES[key]

    def check_choice(ctx: CheckContext) -> Iterator[RuleFinding]:
        for path, value in ctx.config.find(key):
            if value in good:
                continue
            known = "" if value in bad else "unknown value; "
            yield RuleFinding(path, value, f"{known}set {path} to one of {', '.join(map(repr, good))}")

    return Rule(id=f"recipe-{key.replace('_', '-')}", category="config", setting=key,
                checks=f"{key} is one of {', '.join(good)}", why=why,
                fix=f"set {key} to one of {', '.join(good)}", func=check_choice, keys=(key,))


def register_recipe_rules() -> None:
    """Register (or re-register, idempotently) the recipe's rules; importing the package
    calls this.  After the built-ins (listing them loads them), as before the move."""
    rules()
    for key in RECIPE_CHOICES:
        register_rule(_choice_rule(key), replace=True)


register_recipe_rules()
