"""The sections of one compared pair of runs: the diff, the state census, the ulp growth, the
curves, the heatmap of where the runs differ, the records that differ by module, and the
environment and config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from samebits.compare import DiffResult
from samebits.errors import StreamError
from samebits.runners._state_positions import state_positions
from samebits.runners.report.evidence import (MAX_READ_RANKS, Pair, _GroupStep, _cell, _focus_rank, _group_sort,
                                           _key_label, _metric_sort, _metric_title, _records_by_step)
from samebits.runners.report.page import Page, _esc, _table
from samebits.runners.report.svg import COLOUR_A, COLOUR_B, _DASHED, _chart, _short_names, _state_chart, _ulp_plot
from samebits.stream import phases
from samebits.verdicts import Verdict


MAX_RANKS = 64  # heatmap rows of ranks; a larger world is binned, each row a range of ranks
MAX_STEPS = 120  # heatmap columns; more steps are binned, each column a range of steps
MAX_GROUP_ROWS = 32  # heatmap rows of record groups (one or two ranks)
MAX_TENSOR_ROWS = 40  # per-tensor table rows (records that differ at some step)
MAX_LEAVES = 4  # a module row names this many of its differing records per group, then "..."
MAX_TENSOR_STEPS = 12  # per-tensor table columns, from the first divergent step on (no sideways scroll)
MAX_CURVES = 12  # metric curves drawn per pair
MAX_STATE_CHARTS = 8  # census records drawn per pair (the rest are listed)
_OWN_VARIABLES = ("env.SAMEBITS_", "env.TORCHELASTIC_")  # set per run by samebits / torchrun, as in diff's notes
# Heatmap states, most telling first (a binned cell shows the first of its members'): the colour
# and what the legend says.
_HEAT = (("first", "#a40e26", "first divergence"), ("differs", "#f06b6b", "differs"),
         ("after", "#f5b7b1", "after this rank's first divergence (not compared further)"),
         ("cut", "repeating-linear-gradient(135deg,#d0d7de 0 3px,#f6f8fa 3px 6px)",
          "not run past the first divergence (live check)"),
         ("missing", "#d4a72c", "in one run only"), ("same", "#8fd19e", "identical"),
         ("outside", "#d0d7de", "outside the compared window"), ("none", "#eef1f4", "not recorded"))
_RANK = {state: index for index, (state, _, _) in enumerate(_HEAT)}


def pair_sections(page: Page, pair: Pair) -> None:
    page.h2(f"{pair.label}: {pair.verdict.value}", f"pair-{pair.label}")
    page.add(f'<p>a = {_esc(pair.names[0])}: <code>{_esc(pair.a)}</code><br>b = {_esc(pair.names[1])}: '
             f'<code>{_esc(pair.b)}</code>' + (f'<br><span class="window">{_esc(pair.window)}</span>'
                                               if pair.window else "") + "</p>"
             f'<p class="pair-conclusion"><b>{_esc(pair.conclusion)}</b></p>')
    if pair.stopped_b is not None:
        page.add(f'<p class="note">the live check stopped {_esc(pair.names[1])} at step {pair.stopped_b}, its '
                 "first step that differs from a: later steps were not run (run verify with --keep-going to "
                 "see the whole divergent curves)</p>")
    result = pair.result
    rank = _focus_rank(pair)
    if result is None:
        page.add(f'<p class="err">could not compare: {_esc(pair.error)}</p>')
    else:
        _diff_summary(page, result, pair.context)
    if result is not None and result.verdict is Verdict.IDENTICAL:  # nothing grows, nothing parts
        _heatmap(page, pair)
        _environment(page, pair, facts=False)
        return
    resumed = bool(pair.start_step)  # a resume's failure is explained by its state: that picture first
    if result is not None and resumed:
        _census(page, pair, rank)
    if result is not None:
        _ulp_growth(page, pair, rank)
    _curves(page, pair, rank)
    if result is not None and not resumed:
        _census(page, pair, rank)
    if result is not None:
        _heatmap(page, pair)
        _tensors(page, pair)
    _environment(page, pair)


def _diff_summary(page: Page, result: DiffResult, context: str = "") -> None:
    c = result.compared
    page.add(f'<p>verdict: <span class="verdict v-{result.verdict.value}">{_esc(result.verdict.value.upper())}'
             f"</span> {_esc(c.get('ranks'))} rank(s) x {_esc(c.get('steps'))} step(s), {_esc(c.get('records'))} "
             + ("records compared before the first divergence</p>" if result.first_divergence is not None
                else "records compared</p>"))
    d = result.first_divergence
    if d is not None:
        where = f"{d.phase}/{d.name}" if d.name is not None else d.detail
        said = f"{context}: " if context else "first divergence: "
        page.add(f"<p><b>{_esc(said)}step {_esc(d.step)}, rank {_esc(d.rank)}: {_esc(where)}</b> "
                 f"({_esc(d.records_differing)} record(s) differ in that step; ranks diverged first: "
                 f"{_esc(', '.join(map(str, result.ranks_diverged_first)))})</p>"
                 f"<p class=\"mono wrap\">{_esc(d.detail)}</p>")
    for reason in result.incomplete:
        page.add(f'<p class="err">incomplete: {_esc(reason)}</p>')


def _census(page: Page, pair: Pair, rank: int) -> None:
    """The training state at each step start (the state census), b against a: for each
    record that differs, the step of a whose state b holds (`state_positions`), drawn; the
    records equal throughout and those left out (with why) listed under it."""
    picture = state_positions(pair.a, pair.b, rank, pair.start_step or 0, independent=pair.independent)
    if picture is None:  # no census stream (a loop that records none): nothing to draw, nothing to say
        return
    label_a, label_b = _short_names(pair)
    pair.census_summary = {"says": [t.says(label_a, label_b) for t in picture.tracks], **picture.to_dict()}
    if not picture.tracks and not picture.left_out:
        return  # the state was the same throughout: the other sections say where the runs part
    page.h2(f"{pair.label}: the training state, step by step (rank {rank})", "census")
    page.add(f"<p>At each step start the state census records the bits of every generator, the optimizer's "
             f"step counts and learning rates, the LR scheduler's position and the step's input batch (the "
             f"data position). They are digests, so each chart places {_esc(label_b)}'s state at the step of "
             f"{_esc(label_a)} that holds the same bits: on the diagonal, {_esc(label_b)} holds "
             f"{_esc(label_a)}'s state of that very step; below it, {_esc(label_a)}'s of an earlier step (not "
             f"restored, or restored from another step); a cross in the top band: no step of "
             f"{_esc(label_a)} holds it. Generators carry ticks for the steps in which each run drew from "
             "them.</p>")
    if pair.stopped_b is not None:  # one or two points a chart: say how to see where the state goes on
        page.add(f'<p class="note" id="census-cut">{_esc(label_b)} was stopped at step {pair.stopped_b} by the '
                 f"live check (its first step whose records differ from {_esc(label_a)}'s), so the charts end there: "
                 "<code>samebits verify --keep-going</code> runs it to the end and draws where its state goes "
                 "after.</p>")
    if picture.tracks:
        charts = [_state_chart(track, picture, pair, label_a, label_b)
                  for track in picture.tracks[:MAX_STATE_CHARTS]]
        page.add('<ul id="census-says">' + "".join(f"<li>{_esc(t.says(label_a, label_b))}</li>"
                                                    for t in picture.tracks) + "</ul>")
        page.add('<div class="charts" id="census-plot">' + "".join(charts) + "</div>")
        if len(picture.tracks) > MAX_STATE_CHARTS:
            page.add(f"<p class=\"note\">{len(picture.tracks) - MAX_STATE_CHARTS} more differing record(s) "
                     "listed above, not drawn</p>")
    else:
        page.add(f"<p>no state record that could explain the difference differs between {_esc(label_a)} and "
                 f"{_esc(label_b)} at a step start.</p>")
    lines = []
    if picture.same:
        lines.append(f"the same in both runs at every compared step: {', '.join(picture.same)}")
    lines.extend(f"left out: {title}: {why}" for title, why in picture.left_out)
    if lines:
        page.add('<ul class="note" id="census-notes">' + "".join(f"<li>{_esc(x)}</li>" for x in lines)
                 + "</ul>")


def _ulp_growth(page: Page, pair: Pair, rank: int) -> None:
    """How far apart the runs are at each step: the largest ulp distance per metric (log
    scale), and for the digest-only tensor groups the steps where they differ."""
    page.h2(f"{pair.label}: ulp growth (rank {rank})", "ulps")
    try:
        evidence = pair.view(rank).evidence
    except StreamError as err:
        page.add(f'<p class="err">the records could not be read: {_esc(err)}</p>')
        return
    if not evidence:
        page.add("<p>no step recorded in both runs on this rank.</p>")
        return
    first = pair.result.first_divergence if pair.result is not None else None
    first_step = first.step if first is not None and first.rank == rank else \
        pair.first_by_rank.get(rank, (None, None))[0]
    page.add("<p>the largest distance between a and b in units in the last place (ulps) at each step, per "
             "metric, exact from the recorded bits, on a log scale (0: the same bits). Tensors are recorded "
             "as digests: for params, grads and optimizer state the bands under the plot mark the steps where "
             "they differ, with no magnitude (<b>values not recorded</b>).</p>")
    page.add(_ulp_plot(pair, rank, evidence, first_step))


def _heatmap(page: Page, pair: Pair) -> None:
    page.h2(f"{pair.label}: where the runs differ, step by step", "heat")
    ranks = sorted(set(pair.steps_a) | set(pair.steps_b))
    steps = sorted({s for steps in list(pair.steps_a.values()) + list(pair.steps_b.values()) for s in steps})
    if not ranks or not steps:
        page.add("<p>no steps recorded</p>")
        return
    columns = _bins(steps, MAX_STEPS)
    if pair.num_ranks <= 2:
        try:
            rows = _group_rows(pair, ranks, columns)
        except StreamError as err:
            page.add(f'<p class="err">the records could not be read: {_esc(err)}</p>')
            return
        what = "record groups (rows) x steps (columns)"
    else:
        rows = _rank_rows(pair, _bins(ranks, MAX_RANKS), columns)
        what = "ranks (rows) x steps (columns)"
    used = {state for _, cells in rows for state, _ in cells}
    every = max(1, math.ceil(len(columns) / 16))  # a step label every few columns
    header = "".join(f'<th title="step {_span(c)}">{_span(c) if i % every == 0 else ""}</th>'
                     for i, c in enumerate(columns))
    body = []
    for name, cells in rows:
        body.append(f'<tr><th class="row">{_esc(name)}</th>'
                    + "".join(f'<td class="h-{state}" title="{_esc(text)}"></td>' for state, text in cells)
                    + "</tr>")
    legend = "".join(f'<span style="background:{colour}"></span>{_esc(text)}' for state, colour, text in _HEAT
                     if state in used)
    binned = []
    if any(len(c) > 1 for c in columns):
        binned.append(f"{len(steps)} steps in {len(columns)} columns of up to {max(map(len, columns))} steps")
    if pair.num_ranks > 2 and len(rows) < len(ranks):
        binned.append(f"{len(ranks)} ranks in {len(rows)} rows of up to {math.ceil(len(ranks) / len(rows))} "
                      "ranks; a row shows the most telling state of its ranks (hover for the ranks)")
    page.add(f"<p>{_esc(what)}: each cell says whether the runs have the same bits there"
             + (f" ({_esc('; '.join(binned))})" if binned else "") + "; hover a cell for its detail.</p>"
             f'<table class="heat" id="heatmap"><colgroup><col class="row"></colgroup><tr><th></th>{header}</tr>'
             f'{"".join(body)}</table><p class="legend" id="heat-legend">{legend}</p>')
    if pair.first_by_rank:
        listed = sorted(pair.first_by_rank.items())
        by_rank = ", ".join(f"rank {r}: step {s}" for r, (s, _) in listed[:16])
        page.add(f"<p>first divergent step per rank: {_esc(by_rank)}"
                 + (f" ... ({len(listed)} ranks)" if len(listed) > 16 else "")
                 + f"; ranks with no divergence: {len(ranks) - len(listed)} of {len(ranks)}</p>")
    if pair.num_ranks > len(ranks):
        page.add(f"<p class=\"note\">{pair.num_ranks - len(ranks)} rank(s) beyond the first {MAX_READ_RANKS} "
                 "not drawn</p>")


def _tensors(page: Page, pair: Pair) -> None:
    title = f"{pair.label}: records that differ, by module, step by step"
    page.h2(title, "tensors")
    d = pair.result.first_divergence if pair.result is not None else None
    if d is None:
        page.add("<p>no record differs in the compared window.</p>")
        return
    rank = d.rank
    steps_a, steps_b = set(pair.steps_a.get(rank, [])), set(pair.steps_b.get(rank, []))
    after = sorted(s for s in steps_a | steps_b if s >= d.step)
    both = [s for s in after if s in steps_a and s in steps_b]
    cut = [s for s in after if s not in steps_b and pair.cut(s)]
    lone = [s for s in after if (s in steps_a) != (s in steps_b) and s not in cut]
    wanted = both[:MAX_TENSOR_STEPS]
    try:
        records_a = _records_by_step(pair.a, rank, set(wanted), wanted[-1]) if wanted else {}
        records_b = _records_by_step(pair.b, rank, set(wanted), wanted[-1]) if wanted else {}
    except StreamError as err:  # damaged after the first divergence: the divergence still stands
        page.add(f'<p class="err">the records after the first divergence could not be read: {_esc(err)}</p>')
        return
    differing: dict[tuple, dict[int, tuple[str, str]]] = {}
    present: dict[tuple, set[int]] = {}  # record -> the steps both runs hold it (a module's "of n")
    for step in wanted:
        at_a, at_b = records_a.get(step, {}), records_b.get(step, {})
        for key in list(at_a) + [k for k in at_b if k not in at_a]:
            present.setdefault(key, set()).add(step)
            ra, rb = at_a.get(key), at_b.get(key)
            if ra is not None and rb is not None and ra.same_content(rb):
                continue
            differing.setdefault(key, {})[step] = _cell(ra, rb, True, True)
    params = {key[2] for step in wanted for at in (records_a.get(step, {}),) for key in at
              if key[1] in (phases.PARAMS, phases.GRADS)}
    rows = _module_rows(differing, present, params)
    shown = rows[:MAX_TENSOR_ROWS]
    rows_html = []
    for row in shown:
        cells = []
        for step in wanted:
            css, text, short = row.cell(step)
            cells.append(f'<td class="{css}" title="{_esc(text)}">{_esc(short)}</td>')
        rows_html.append(f'<tr><th class="mono rec" title="{_esc(row.hover)}">{_esc(row.title)}</th>'
                         f"{''.join(cells)}</tr>")
    head = "".join(f"<th>{s}</th>" for s in wanted)
    page.add(f"<p>rank {rank} (the first to diverge), from step {d.step}: each metric on its own row, with its "
             "distance in ulps, exact from the recorded bits; the tensors grouped by the module they belong to "
             "(its parameters, their gradients and optimizer state, its activations), each cell saying how "
             "many of the module's records differ at that step (= none; hover for which). Tensors are "
             "<b>digests only: values not recorded</b> (no magnitude is known; `samebits bisect` dumps the "
             "origin op's elements).</p>"
             f'<table id="per-tensor" class="records"><colgroup><col class="rec"></colgroup>'
             f'<tr><th>module \\ step</th>{head}</tr>{"".join(rows_html)}</table>')
    lines = []
    if len(both) > len(wanted):
        lines.append(f"steps {both[len(wanted)]}-{both[-1]} ({len(both) - len(wanted)} more steps run by both) "
                     "are not listed: the ulp growth and the heatmap above show them")
    if cut:
        lines.append(f"steps {_span(cut)}: not run past the first divergence (the live check stopped "
                     f"{pair.names[1]} at step {pair.stopped_b})")
    if lone:
        lines.append(f"steps {_span(lone)}: recorded in one run only")
    if len(rows) > len(shown):
        lines.append(f"{len(rows) - len(shown)} more row(s) of differing records not listed")
    if lines:
        page.add('<ul class="note" id="tensor-notes">' + "".join(f"<li>{_esc(x)}</li>" for x in lines) + "</ul>")


def _curves(page: Page, pair: Pair, rank: int) -> None:
    try:
        view = pair.view(rank)
        metrics_a, metrics_b = view.metrics_a, view.metrics_b
    except StreamError as err:
        page.add(f"<p class=\"err\">metric curves: {_esc(err)}</p>")
        return
    labels = {n for m in list(metrics_a.values()) + list(metrics_b.values()) for n in m}
    names = sorted(labels, key=lambda n: _metric_sort(_metric_title(n)))
    title = f"{pair.label}: metric curves (rank {rank})"
    page.h2(title, "curves")
    if not names:
        page.add("<p>no metrics recorded (Recorder.metrics) on this rank.</p>")
        return
    first = pair.first_by_rank.get(rank, (None, None))[0]
    page.add(f'<p class="legend" id="curve-legend"><svg width="34" height="10"><line x1="0" y1="5" x2="34" y2="5" '
             f'stroke="{COLOUR_A}" stroke-width="2.5"/></svg> a: {_esc(pair.names[0])} (solid) '
             f'<svg width="34" height="10"><line x1="0" y1="5" x2="34" y2="5" stroke="{COLOUR_B}" '
             f'stroke-width="2.5" {_DASHED}/></svg> b: {_esc(pair.names[1])} (dashed) '
             '<svg width="10" height="10"><circle cx="5" cy="5" r="3.5" fill="#cf222e"/></svg> a step whose '
             "bits differ</p>")
    charts = [_chart(name, {s: m[name] for s, m in metrics_a.items() if name in m},
                     {s: m[name] for s, m in metrics_b.items() if name in m}, pair, first)
              for name in names[:MAX_CURVES]]
    page.add('<div class="charts">' + "".join(charts) + "</div>")
    if len(names) > MAX_CURVES:
        page.add(f"<p class=\"note\">{len(names) - MAX_CURVES} more metric(s) not drawn</p>")


def _environment(page: Page, pair: Pair, facts: bool = True) -> None:
    title = f"{pair.label}: environment and config"
    page.h2(title, "env")
    header_a, header_b = pair.headers
    if header_a is None and header_b is None:
        page.add("<p>the stream headers could not be read.</p>")
        return
    rows, same, own = [], 0, []
    for section in ("environment", "config"):
        flat_a, flat_b = (_flatten(getattr(header, section, None) or {}) for header in (header_a, header_b))
        for key in sorted(set(flat_a) | set(flat_b)):
            va, vb = flat_a.get(key, "(absent)"), flat_b.get(key, "(absent)")
            if va == vb:
                same += 1
            elif section == "environment" and key.startswith(_OWN_VARIABLES):
                own.append(key.removeprefix("env."))  # each run's own directory, reference, offset
            else:
                rows.append([f"{section}.{key}", va, vb])
    if rows:
        page.add(f"<p>{len(rows)} difference(s) in the recorded environment and config ({same} equal "
                 "entries not shown):</p>" + _table(["key", "a", "b"], rows, table_id="env-diff"))
    else:
        page.add(f"<p>the recorded environment and config are the same ({same} entries).</p>")
    if own:
        page.add(f"<p class=\"note\">not differences of the training: samebits' and the launcher's own per-run "
                 f"settings ({_esc(', '.join(own))})</p>")
    env = getattr(header_a, "environment", None) or {}
    rows = [[k, env.get(k)] for k in ("torch", "python", "platform", "hostname", "num_threads", "cuda",
                                      "device", "deterministic_algorithms") if k in env]
    if rows and facts:
        page.add("<h3>run a</h3>" + _table(["", "value"], rows))


def _flatten(data: Any, prefix: str = "") -> dict[str, str]:
    out = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}")
                       if isinstance(value, dict) else {f"{prefix}{key}": json.dumps(value, default=str)})
    return out


def _bins(items: list[int], most: int) -> list[list[int]]:
    """``items`` in at most ``most`` consecutive runs of equal size (the last may be shorter)."""
    size = max(1, math.ceil(len(items) / most))
    return [items[i:i + size] for i in range(0, len(items), size)]


def _span(steps: list[int]) -> str:
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def _rank_state(pair: Pair, rank: int, step: int) -> tuple[str, str]:
    """One rank at one step: its state on the heatmap and what it says."""
    in_a, in_b = pair.ran("a", rank, step), pair.ran("b", rank, step)
    first = pair.first_by_rank.get(rank)
    if step < (pair.start_step or 0):
        return "outside", "before the compared window"
    if first is not None and step == first[0]:
        return "first", "first divergence" + (f" (run {first[1]} has no such step)" if first[1] else "")
    if in_a and not in_b and pair.cut(step):
        return "cut", f"not run past the first divergence (the live check stopped {pair.names[1]} at step " \
                      f"{pair.stopped_b})"
    if first is not None and step > first[0]:
        return "after", "after this rank's first divergence"
    if in_a and in_b:
        return "same", "identical"
    if in_a or in_b:
        return "missing", f"only in run {'a' if in_a else 'b'}"
    return "none", "not recorded"


def _rank_rows(pair: Pair, rows: list[list[int]], columns: list[list[int]]) -> list[tuple[str, list]]:
    """Ranks x steps; a binned cell takes its members' most telling state."""
    out = []
    for ranks in rows:
        name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        cells = []
        for steps in columns:
            states = [(_rank_state(pair, rank, step), rank) for rank in ranks for step in steps]
            (state, text), _ = min(states, key=lambda found: _RANK[found[0][0]])
            if len(states) == 1:
                cells.append((state, f"rank {ranks[0]}, step {steps[0]}: {text}"))
                continue
            count = sum(1 for (s, _), _ in states if s == state)
            where = f"{name}, steps {_span(steps)}" if len(steps) > 1 else f"{name}, step {steps[0]}"
            members = sorted({rank for (s, _), rank in states if s == state})
            cells.append((state, f"{where}: {text} ({count} of {len(states)} rank-steps; ranks "
                                 f"{', '.join(map(str, members[:8]))}{' ...' if len(members) > 8 else ''})"))
        out.append((name, cells))
    return out


def _group_rows(pair: Pair, ranks: list[int], columns: list[list[int]]) -> list[tuple[str, list]]:
    """Record groups x steps, for one or two ranks: where each group differs, step by step."""
    out = []
    for rank in ranks:
        evidence = pair.view(rank).evidence
        groups = sorted({g for at in evidence.values() for g in at}, key=_group_sort)[:MAX_GROUP_ROWS]
        first_step = pair.first_by_rank.get(rank, (None, None))[0]  # this rank's own first divergence
        for group in groups:
            name = f"rank {rank}: {group[0]}" if len(ranks) > 1 else group[0]
            cells = []
            for steps in columns:
                states = [_group_state(pair, rank, step, evidence.get(step, {}).get(group), step == first_step)
                          for step in steps]
                state, text = min(states, key=lambda found: _RANK[found[0]])
                where = f"step {steps[0]}" if len(steps) == 1 else f"steps {_span(steps)}"
                cells.append((state, f"{name}, {where}: {text}"))
            out.append((name, cells))
    return out


def _group_state(pair: Pair, rank: int, step: int, cell: _GroupStep | None, first: bool) -> tuple[str, str]:
    if step < (pair.start_step or 0):
        return "outside", "before the compared window"
    if cell is None:
        state, text = _rank_state(pair, rank, step)
        return ("none", "not recorded at this step") if state in ("same", "after", "first") else (state, text)
    if cell.differ:
        how = f"{cell.differ} of {cell.records} record(s) differ"
        if cell.max_ulp is not None:
            how += f", {cell.max_ulp} ulp"
        elif cell.kind == "tensor":
            how += " (digests: values not recorded)"
        return ("first", "first divergence: " + how) if first else ("differs", how)
    if cell.missing:
        return "missing", f"{cell.missing} of {cell.records} record(s) in one run only"
    return "same", f"identical ({cell.records} record(s))"


def _short(text: str) -> str:
    """A records-table cell: the ulps of a metric, or one word (the whole text on hover)."""
    if " ulp" in text:
        ulp = int(text.split(" ulp")[0])
        return f"{ulp} ulp" if ulp < 10_000 else f"{ulp:.1e} ulp".replace("e+0", "e").replace("e+", "e")
    return {"digest differs": "digest"}.get(text, "only a" if text.endswith("run a") else
                                            "only b" if text.endswith("run b") else "differs")


@dataclass
class _ModuleRow:
    """One row of the records table: a metric (its own cells, with ulps) or a module (its
    tensor records together: how many differ at each step, which on hover)."""

    title: str
    hover: str
    differing: dict[int, list[tuple[str, str, str]]]  # step -> [(record, css class, how it differs)]
    records: dict[int, int]  # step -> the module's records both runs hold there
    metric: bool = False

    def cell(self, step: int) -> tuple[str, str, str]:
        """(css class, hover text, cell text) at ``step``."""
        found = self.differing.get(step)
        if not found:
            return "t-eq", "bit-identical", "="
        if self.metric:
            _, css, how = found[0]
            return css, how, _short(how)
        count = self.records.get(step) or len(found)
        return ("t-ne", f"{len(found)} of {count} record(s) differ: "
                + "; ".join(f"{name} ({how})" for name, _, how in found), f"{len(found)} of {count}")

    @property
    def first(self) -> int:
        return min(self.differing)


def _module_of(key: tuple, params: set[str]) -> str:
    """The module a tensor record belongs to: a parameter's or gradient's owner (``fc`` of
    ``fc.weight``), the parameter an optimizer state belongs to (``fc.weight.exp_avg``), the
    module whose output or input it is (``GPT.fc.0``: ``GPT.fc``)."""
    _, phase, name, _ = key
    if phase == phases.OPTIMIZER:
        owner = max((p for p in params if name.startswith(p + ".")), key=len, default=None)
        name = owner if owner is not None else name.rpartition(".")[0] or name
    elif phase not in (phases.PARAMS, phases.GRADS):
        parts = name.split(".")
        while len(parts) > 1 and parts[-1].isdigit():  # output or input index
            parts.pop()
        return ".".join(parts)
    return name.rpartition(".")[0] or "(top level)"


def _module_rows(differing: dict[tuple, dict[int, tuple[str, str]]], present: dict[tuple, set[int]],
                 params: set[str]) -> list[_ModuleRow]:
    """The records table's rows: each differing metric, then each module with a differing tensor
    record, earliest first divergence first (then in record order)."""
    rows: dict[str, _ModuleRow] = {}
    for key, at in differing.items():
        kind, phase, name, _ = key
        if kind == "metric":
            label = _key_label(key)
            title = _metric_title(label)  # what a person calls it (backward/root is the loss), then its record
            rows[f"metric {label}"] = _ModuleRow(title if title == label else f"{title} ({label})", kind, {s: [(label, css, how)] for s, (css, how) in at.items()},
                                                 {}, metric=True)
            continue
        module = _module_of(key, params)
        row = rows.setdefault(f"module {module}", _ModuleRow(module, "", {}, {}))
        for step, (css, how) in at.items():
            row.differing.setdefault(step, []).append((_key_label(key), css, how))
    for key, steps in present.items():  # each module's count of records, step by step
        if key[0] != "metric":
            row = rows.get(f"module {_module_of(key, params)}")
            if row is not None:
                for step in steps:
                    row.records[step] = row.records.get(step, 0) + 1
    for row in rows.values():
        if row.metric:
            continue
        by_group: dict[str, list[str]] = {}  # what differs in the module: group -> its records, leaf names
        for found in row.differing.values():
            for label, _, _ in found:
                phase, _, name = label.partition("/")
                leaf = name[len(row.title) + 1:] if name.startswith(row.title + ".") else name
                names = by_group.setdefault(phases.report_group(phase), [])
                if leaf not in names:
                    names.append(leaf)
        order = phases.REPORT_GROUPS
        groups = sorted(by_group, key=lambda g: order.index(g) if g in order else len(order))
        said = "; ".join(f"{g}: {', '.join(by_group[g][:MAX_LEAVES])}" + (" ..." if len(by_group[g]) > MAX_LEAVES
                                                                          else "") for g in groups)
        row.hover = f"module {row.title}: " + "; ".join(f"{g}: {', '.join(by_group[g])}" for g in groups)
        row.title = f"{row.title} ({said})"
    return sorted(rows.values(), key=lambda r: (not r.metric, r.first))
