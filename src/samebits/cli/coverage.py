"""`samebits coverage [PACKAGE...]`: does every kernel and custom op have a recorded byte test?"""

from __future__ import annotations

from samebits.cli._format import print_result
from samebits.testing import add_to_argparse
from samebits.testing.coverage import check_coverage, render_coverage


EXAMPLES = """\
samebits coverage                              # samebits' own kernels
samebits coverage mypackage.kernels --manifest kernel-coverage.toml
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "coverage",
        help="check that every kernel, custom op and autograd Function of a package has a byte test",
        description="List the Triton kernels, torch.library custom ops and autograd Functions a package "
                    "defines (parsed, not imported) and judge them against the package's kernel-coverage.toml: "
                    "exit 1 when one has no test, its test is missing, or its source changed since the "
                    "recorded hash without its test changing; 2 when nothing could be checked.",
    )
    parser.add_argument("packages", nargs="*", metavar="PACKAGE", default=["samebits.kernels"],
                        help="importable packages to check (default: samebits.kernels, our own kernels)")
    add_to_argparse(parser, "manifest", "update")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    result = check_coverage(args.packages, manifest=args.samebits_manifest, update=args.samebits_update)
    return print_result(result, args.json, render_coverage)
