"""The sections that show what a command's summary says: verify's checks, `verify --across`'s
layouts and certificate, bisect's stages and origin, matrix's cells.
"""

from __future__ import annotations

from samebits.runners.across import AcrossResult
from samebits.runners.bisect import BisectResult, Origin
from samebits.runners.report.evidence import Pair
from samebits.runners.report.page import Page, _esc, _table
from samebits.verdicts import Verdict


def verify_summary(page: Page, summary: dict, pairs: list[Pair]) -> None:
    page.h2("Verdicts", "verdicts")
    rows = []
    for name, check in (summary.get("checks") or {}).items():
        if check is None:
            rows.append([name, "not checked", "-", "-"])
            continue
        first = check.get("first_divergence") or {}
        where = "-" if not first else (f"step {first.get('step')}, rank {first.get('rank')}: "
                                       + (f"{first.get('phase')}/{first.get('name')}" if first.get("name")
                                          else str(first.get("detail", ""))))
        c = check.get("compared") or {}
        rows.append([name, check.get("verdict"), f"{c.get('ranks')} x {c.get('steps')} x {c.get('records')}", where])
    page.add(_table(["guarantee", "verdict", "ranks x steps x records", "first divergence"], rows,
                    verdict_column=1))
    if summary.get("resume_at") is not None:
        page.add(f"<p>resume at step {_esc(summary['resume_at'])}: C is compared with A from that step on.</p>")
    runs = summary.get("runs") or []
    if runs:
        page.add("<h3>Runs</h3>" + _table(["run", "exit", "ended", "seconds", "command"],
                                         [[r.get("name"), r.get("exit_code"), r.get("ended"), r.get("seconds"),
                                           r.get("command")] for r in runs]))
    for check, lines in (summary.get("explanations") or {}).items():
        page.add(f"<h3>{_esc(check)}: what differs (most specific first)</h3><ul>"
                 + "".join(f"<li>{_esc(line)}</li>" for line in lines) + "</ul>")
    for key in ("bisect_command", "resume_bisect_command"):
        if summary.get(key):
            page.add(f"<p>to find the origin: <code>{_esc(summary[key])}</code></p>")


def across_summary(page: Page, result: AcrossResult) -> None:
    page.h2("Verdicts", "verdicts")
    reference = result.layouts[0] if result.layouts else None
    rows = [[f"{reference} = {check.layout}", check.verdict, check.by, check.compared.get("steps"), check.where()]
            for check in result.checks.values()]
    page.add(_table(["layouts", "verdict", "compared by", "steps", "first divergence"], rows, verdict_column=1))
    if result.resume:
        page.h2("Resume across layouts", "resume-across")
        rows = [[f"resume-{check.layout}", check.verdict, check.compared.get("steps"), check.where()]
                for check in result.resume.values()]
        page.add(f"<p>{_esc(reference)} saved its checkpoint of step {_esc(result.resume_at)}; each "
                 "other layout resumed it (--allow-layout-change) and must equal its uninterrupted run bit for "
                 "bit from there to the end (global digests at every step, rank 0's metrics).</p>"
                 + _table(["run", "verdict", "steps", "first divergence"], rows, verdict_column=1))
    page.h2("Negative controls", "controls")
    if result.controls is None:
        page.add(f"<p>{_esc(result.controls_note or 'not run')}</p>")
    else:
        page.add("<p>each layout without the switches, against the reference without them, on the same global "
                 "batch: each must differ at step 0 or 1, or the comparison cannot tell layouts apart.</p>"
                 + _table(["control", "differs", "first step", "verdict", "detail"],
                          [[c.run, "yes" if c.differs else "NO", c.first_step, c.verdict, c.detail]
                           for c in result.controls], verdict_column=3))
    if result.runs:
        page.add("<h3>Runs</h3>" + _table(["run", "exit", "seconds", "command"],
                                         [[r.name, r.exit_code, r.seconds, r.command] for r in result.runs]))


def across_certificate(page: Page, cert: dict) -> None:
    page.h2("Certificate", "certificate")
    env = cert.get("environment") or {}
    page.add("<h3>Environment</h3>" + _table(["", ""], [[k, v] for k, v in env.items()]))
    layouts = cert.get("layouts") or []
    page.add("<h3>Layouts</h3>" + _table(["cell", "world size", "overrides", "command"],
                                        [[l.get("cell"), l.get("world_size"), " ".join(l.get("overrides") or []),
                                          l.get("command")] for l in layouts]))
    roots = cert.get("roots") or {}
    steps = [str(s) for s in cert.get("steps") or []]
    names = list(roots)
    page.add("<h3>Global root per step</h3>")
    if names and steps and cert.get("roots_equal"):
        first = roots[names[0]]
        page.add(f"<p>every layout ({_esc(', '.join(names))}) holds the same global root at every step "
                 f"({len(steps)} steps), collapsed into one column:</p>"
                 + _table(["step", "global root (all layouts)"], [[s, first.get(s)] for s in steps]))
    else:
        page.add(_table(["step", *names], [[s, *[roots[n].get(s, "(missing)") for n in names]] for s in steps]))
    checkpoints = cert.get("checkpoints") or {}
    page.add("<h3>Checkpoints</h3>")
    if checkpoints:
        equal = {True: "every layout's final checkpoint holds the same training state (content hashes equal)",
                 False: "the final checkpoints' content hashes DIFFER: the saved training state is not the same",
                 None: "the final checkpoints' content hashes were not all computed"}[cert.get("checkpoints_equal")]
        page.add(f"<p>{_esc(equal)}</p>" + _table(
            ["layout", "step", "content sha256", "files", "files sha256"],
            [[n, c.get("step"), c.get("content_sha256") or c.get("content_error") or "-", c.get("files"),
              c.get("files_sha256") or c.get("sha256")] for n, c in checkpoints.items()])
                 + f"<p class=\"note\">{_esc(cert.get('checkpoints_note') or '')}</p>")
    else:
        page.add("<p>no checkpoint saved (a command, or runs of one step)</p>")
    reductions = cert.get("invariant_reductions") or []
    page.add("<h3>Invariant reductions</h3>" + (
        _table(["switch", "size", "covers"], [[r.get("switch"), r.get("size"), r.get("covers")] for r in reductions])
        if reductions else "<p>none listed (one rank only, or a command: its own)</p>"))


def bisect_summary(page: Page, result: BisectResult) -> None:
    """What the bisection found (its stages, as their own sentences), then its origin."""
    page.h2("Verdicts", "verdicts")
    page.add(f"<p>compared: {_esc(result.compared)}; wall time {_esc(result.seconds)} s</p>")
    if result.conclusion:
        page.add(f"<p><b>{_esc(result.conclusion)}</b></p>")
    page.add(_table(["stage", "rung", "traced", "runs (s)", "verdict", "finding"],
                    [[f"{i}. {s.name}", s.rung, s.scope, " ".join(f"{k} {v}" for k, v in s.runs.items()), s.verdict,
                      s.summary] for i, s in enumerate(result.stages, 1)]))
    page.h2("Origin", "origin")
    control = result.control_flow
    if control:
        page.add(f"<p>control flow differs: rank {_esc(control.rank)}, step {_esc(control.step)}: "
                 f"{_esc(control.detail)}</p>")
    if result.origin is None:
        page.add("<p>no origin: " + ("the runs are identical" if result.verdict is Verdict.IDENTICAL
                                     else "the bisection did not localise one (see the stages)") + "</p>")
        return
    _origin(page, result.origin)


def _origin(page: Page, found: Origin) -> None:
    """The origin as bisect writes it (its public fields, in its order), and the elements of its
    output that differ, from the element dumps."""
    origin = found.to_dict()
    rows = [[key, origin.get(key)] for key in ("conclusion", "kind", "classification", "step", "rank", "phase",
                                               "module", "op", "id", "category", "call_site", "detail",
                                               "catalog") if origin.get(key) not in (None, "")]
    for key in ("state_differs", "params", "ranks"):
        if origin.get(key):
            rows.append([key, ", ".join(map(str, origin[key]))])
    page.add('<table id="origin">' + "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
             + "</table>")
    elements = origin.get("elements")
    if not elements:
        return
    page.add("<h3>Elements of the origin's output (from the element dumps)</h3>"
             f"<p>{_esc(elements.get('differing'))} of {_esc(elements.get('total'))} elements differ in output "
             f"{_esc(elements.get('output'))} ({_esc(elements.get('dtype'))} {_esc(elements.get('shape'))}); "
             f"max {_esc(elements.get('max_ulp'))} ulp"
             + ("; the same values in another order" if elements.get("same_values") else "")
             + (f"; inputs identical: {_esc(elements.get('inputs_identical'))}" if "inputs_identical" in elements
                else "") + "</p>")
    values = elements.get("values") or []
    if values:
        page.add(_table(["index", "a", "b", "ulp"], [[v.get("index"), repr(v.get("a")), repr(v.get("b")),
                                                      v.get("ulp")] for v in values]))
    if elements.get("dumps"):
        page.add("<p class=\"note\">dumps: " + ", ".join(f"<code>{_esc(d)}</code>" for d in elements["dumps"])
                 + "</p>")


def matrix_summary(page: Page, summary: dict) -> None:
    page.h2("Verdicts", "verdicts")
    cells = summary.get("cells") or []
    rows = []
    for c in cells:
        agreement = c.get("agreement") or {}
        agree = agreement.get("status", "")
        if agreement.get("first_step") is not None:
            agree += f" at step {agreement['first_step']}"
        if agreement.get("max_ulp") is not None:
            agree += f", {agreement['max_ulp']} ulp"
        rows.append([c.get("cell"), c.get("precision"), c.get("world_size"), "yes" if c.get("required") else "",
                     c.get("verdict"), c.get("repeatable"), c.get("resume"), agree, c.get("reason") or ""])
    page.add(f"<p>baseline: {_esc(summary.get('baseline'))}</p>")
    page.add(_table(["cell", "precision", "world", "required", "verdict", "A = B", "A = C", "agrees with baseline",
                     "reason"], rows, verdict_column=4))
    for line in summary.get("failures") or []:
        page.add(f"<p class=\"err\">{_esc(line)}</p>")
    for c in cells:  # what the terminal printed under the table: the census, then the bisection
        where = f"{c.get('cell')} {c.get('precision')}"
        for check, lines in (c.get("explanations") or {}).items():
            page.add(f"<h3>{_esc(where)}, {_esc(check)}: what differs (most specific first)</h3><ul>"
                     + "".join(f"<li>{_esc(line)}</li>" for line in lines) + "</ul>")
        found = c.get("bisect")
        if found:
            of = " of the resume" if found.get("of") == "resume" else ""
            said = found.get("conclusion") or found.get("error")
            page.add(f"<h3>{_esc(where)}, bisect{_esc(of)}</h3><p><b>{_esc(said)}</b></p>"
                     + (f"<p class=\"note\">streams and summary: <code>{_esc(found.get('out'))}</code></p>"
                        if found.get("out") else ""))
