"""`samebits diff RUN_A RUN_B`: are two runs bitwise identical?  If not, where first?"""

from __future__ import annotations

import collections

from samebits.cli._format import echo, escape, print_json, table
from samebits.cli._lazy import lazy
from samebits.cli._options import check_input_directory
from samebits.errors import ConfigError, IncomparableRunsError
from samebits.verdicts import EXIT_CANNOT_RUN, Verdict

process_rank = lazy("samebits._torchutil", "process_rank")
DiffResult, GlobalDiffResult, diff = lazy("samebits.compare", "DiffResult", "GlobalDiffResult", "diff")
differing_records = lazy("samebits.runners.report", "differing_records")
compared_counts, diff_conclusion = lazy("samebits.runners.conclusion", "compared_counts", "diff_conclusion")


EXAMPLES = """\
samebits diff runs/a runs/b
samebits diff runs/a runs/c                    # c resumed at step K: compared from step K
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "diff",
        help="compare two recorded runs bit for bit",
        description="Compare two run directories bit for bit. Every frame's checksum is checked and every "
                    "step root recomputed. Exit 0 identical, 1 diverged, 2 could not compare (a stream "
                    "damaged, missing or cut short, or a window holding no step).",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="run directory A (its rank-NNNNN.sbs streams)")
    parser.add_argument("run_b", metavar="RUN_B", help="run directory B; a run resumed at step K (its first "
                        "recorded step) is compared from step K")
    parser.add_argument("--from-step", type=int, default=None, help="compare steps >= this (e.g. a resume step)")
    parser.add_argument("--to-step", type=int, default=None, help="compare steps < this")
    parser.add_argument("--allow-config-diff", action="store_true",
                        help="compare even if configs or recorded names differ (intended changes)")
    parser.add_argument("--verify", action="store_true",
                        help="decode and compare every step's records, not only steps whose recomputed roots differ")
    parser.add_argument("--by", choices=("local", "global"), default="local",
                        help="local: rank by rank (runs of one layout, the default); global: full tensors by "
                             "name, for runs of different layouts or world sizes (needs records of "
                             "Recorder.global_tensors)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="compare ranks in N processes (default: one per core for large runs; 1 is serial)")
    parser.add_argument("--distributed", action="store_true",
                        help="under torchrun: each process compares a slice of the ranks, process 0 prints "
                             "(torchrun --nproc-per-node N -m samebits diff --distributed A B)")
    parser.add_argument("--all", dest="all_records", action="store_true",
                        help="list every record that differs at the first divergent step, not only the first")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.all_records and args.by == "global":
        raise ConfigError("--all lists the records of one rank (--by local); --by global already lists every "
                          "global tensor.")
    check_input_directory(args.run_a)
    check_input_directory(args.run_b)
    try:
        result = diff(args.run_a, args.run_b, start_step=args.from_step, stop_step=args.to_step, by=args.by,
                      allow_config_diff=args.allow_config_diff, verify=args.verify, jobs=args.jobs,
                      distributed=args.distributed)
    except IncomparableRunsError as err:
        if args.json:
            print_json({"verdict": "incomparable", "error": str(err), "differences": err.differences})
            return EXIT_CANNOT_RUN
        raise
    if args.distributed and process_rank() not in (None, 0):
        return result.verdict.exit_code  # every process holds the result; process 0 prints it
    records = None
    if args.all_records and isinstance(result, DiffResult) and result.first_divergence is not None:
        d = result.first_divergence
        records = differing_records(args.run_a, args.run_b, rank=d.rank, step=d.step)
    if args.json:
        print_json(result.to_dict() if records is None else {**result.to_dict(), "differing_records": records})
    else:
        echo(render_global(result) if isinstance(result, GlobalDiffResult) else render(result))
        if records is not None:
            echo(render_records(records, result.first_divergence))
    return result.verdict.exit_code


def render_records(records: list[dict], d) -> str:
    """``--all``: every record that differs at the first divergent step of the first rank."""
    rows = [[r["phase"], r["name"] + (f" #{r['occurrence']}" if r["occurrence"] else ""), r["kind"],
             "(missing)" if r["a"] is None else _side(r["a"], d), "(missing)" if r["b"] is None else _side(r["b"], d),
             r["difference"]] for r in records]
    return "\n".join(["", f"all {len(records)} record(s) that differ at step {d.step} on rank {d.rank}:",
                      table(["phase", "name", "kind", "a", "b", "difference"], rows)])


def render(result: DiffResult, title: str | None = None) -> str:
    """The people-readable verdict: a headline, a table of the first divergence, counts."""
    counts = compared_counts(result.compared)
    said = diff_conclusion(result.to_dict())  # the sentence `samebits report` leads with
    lines = _headline(result, title or f"samebits diff {result.a} {result.b}", counts,
                      identical="bit for bit", searched="divergence", said=said)
    if result.verdict is Verdict.DIVERGED:
        d = result.first_divergence
        lines.append(escape(said))
        order = sorted(result.divergences.items(), key=lambda kv: (kv[1].step, kv[1].position, kv[0]))
        rows = [[div.step, rank, div.phase or "-", (div.name or "-") + (f" #{div.occurrence}" if div.occurrence else ""),
                 _side(div.a, div), _side(div.b, div), div.records_differing] for rank, div in order]
        lines += ["", table(["step", "rank", "phase", "name", "a", "b", "records differing"], rows[:_SHOWN])]
        if len(rows) > _SHOWN:
            lines.append(f"... and {len(rows) - _SHOWN} more rank(s), in step order (all of them: --json)")
        lines += ["", _rank_counts(result)]
        first = result.ranks_diverged_first
        shown = ", ".join(map(str, first[:_SHOWN])) + (f" ... ({len(first)} ranks)" if len(first) > _SHOWN else "")
        lines.append(f"ranks diverged first (step {d.step}): {shown}")
        if (d.reason.startswith("ended") or d.reason.startswith("only")) and d.name is not None:
            lines.append(escape(d.detail))  # (without a name, the headline above is this detail)
        lines.append(f"before it: {counts}")
    lines += [f"note: {escape(note)}" for note in result.notes]
    return "\n".join(lines)


_SHOWN = 10  # divergent ranks (and reasons) listed by name; a run of thousands of ranks stays readable


def _headline(result: DiffResult | GlobalDiffResult, title: str, counts: str, *, identical: str,
              searched: str, said: str | None = None) -> list[str]:
    """The title line and, unless the runs diverged, the whole verdict (IDENTICAL, or INCOMPLETE
    with its first reasons) with the counts; ``said``: the verdict's sentence, when made."""
    lines = [escape(title)]
    if result.verdict is Verdict.IDENTICAL:
        lines.append(escape(said) if said else f"IDENTICAL: {identical}. {counts}")
    elif result.verdict is Verdict.INCOMPLETE:
        lines.append(escape(said) if said else f"INCOMPLETE: could not decide (no {searched} found in what was "
                     "compared, but not everything could be compared)")
        lines.extend(f"  - {escape(reason)}" for reason in result.incomplete[:_SHOWN])
        if len(result.incomplete) > _SHOWN:
            lines.append(f"  ... and {len(result.incomplete) - _SHOWN} more reason(s) (all of them: --json)")
        lines.append(f"compared: {counts}")
    return lines


def _rank_counts(result: DiffResult) -> str:
    """Ranks by outcome, and the steps where ranks first diverged (earliest first)."""
    num_ranks, num_diverged = result.compared["ranks"], len(result.divergences)
    by_step = collections.Counter(div.step for div in result.divergences.values())
    steps = ", ".join(f"step {step}: {count}" for step, count in sorted(by_step.items())[:5])
    more = f", ... ({len(by_step)} steps)" if len(by_step) > 5 else ""
    return (f"ranks: {num_ranks} compared, {num_diverged} diverged ({steps}{more}), "
            f"{num_ranks - num_diverged} with no difference found (each compared at least up to step "
            f"{result.first_divergence.step})")


def _side(rec: dict | None, div) -> str:
    if rec is None:
        return "(missing)" if div.name else "-"
    if rec["kind"] == "metric":
        return f"{rec['value']!r} [{rec['bits']}]"
    shape = "x".join(map(str, rec["shape"])) or "scalar"
    return f"{shape} {rec['dtype']} {rec['digest'] or ('absent' if rec.get('absent') else 'capped')}"


def render_global(result: GlobalDiffResult, title: str | None = None) -> str:
    """The verdict of ``--by global``: per global tensor, equal or where it first differs."""
    c = result.compared
    counts = (f"{c['tensors']} global tensor(s) x {c['steps']} common step(s) compared "
              f"(a: {c['ranks_a']} rank(s) of world {c['world_size_a']}, b: {c['ranks_b']} of world {c['world_size_b']})")
    lines = _headline(result, title or f"samebits diff --by global {result.a} {result.b}", counts,
                      identical="every full tensor bit for bit at every common step", searched="difference")
    if result.verdict is Verdict.DIVERGED:
        at_first = result.differing_at_first_step
        num_differing = sum(t.status != "identical" for t in result.tensors)
        lines.append(f"DIVERGED at step {result.first_step}: {len(at_first)} of {len(result.tensors)} global "
                     f"tensor(s) differ there ({num_differing} differ at some step)")
    order = sorted(result.tensors, key=lambda t: (t.status == "identical", t.first_step or 0))
    rows = [[t.phase, t.name + (f" #{t.occurrence}" if t.occurrence else ""), _global_layout(t),
             t.status.replace("_", " "), "-" if t.first_step is None else t.first_step,
             (t.a or {}).get("digest") or "-", (t.b or {}).get("digest") or "-"]
            for t in order]
    if rows:
        lines += ["", table(["phase", "tensor", "global shape", "status", "first step", "digest a", "digest b"],
                            rows[:_GLOBAL_SHOWN])]
        if len(rows) > _GLOBAL_SHOWN:
            lines.append(f"... and {len(rows) - _GLOBAL_SHOWN} more tensor(s) (all of them: --json)")
        if any(t.status == "differs" for t in result.tensors):
            lines.append("max ulp: unknown, values not recorded (streams hold digests only)")
    if result.verdict is Verdict.DIVERGED:
        lines.append(f"compared: {counts}")
    lines += [f"note: {escape(note)}" for note in result.notes]
    return "\n".join(lines)


_GLOBAL_SHOWN = 20


def _global_layout(t) -> str:
    """The global shape and dtype (both sides' when they differ)."""
    sides = [f"{'x'.join(map(str, e['shape'])) or 'scalar'} {e['dtype']}" for e in (t.a, t.b) if e is not None]
    return sides[0] if len(set(sides)) == 1 else " / ".join(sides)
