"""The charts of the page, drawn as inline SVG: the ulp growth per step (log scale), the state
census (which step of a each step of b holds), and the metric curves of both runs.
"""

from __future__ import annotations

import math

from samebits.runners._state_positions import StatePicture, StateTrack
from samebits.runners.distance import float_value, metric_distance
from samebits.runners.report.evidence import Pair, _GroupStep, _group_sort, _metric_title
from samebits.runners.report.page import _esc
from samebits.stream import Record


_COLOURS = ("#0969da", "#8250df", "#1a7f37", "#bc4c00", "#1b7c83", "#bf3989", "#6e7781", "#953800")
COLOUR_A, COLOUR_B = "#0969da", "#e36209"
_DASHED = 'stroke-dasharray="7,4"'


def _log_ticks(decades: int) -> list[int]:
    step = max(1, math.ceil(decades / 6))
    return list(range(0, decades + 1, step))


def _ulp_plot(pair: Pair, rank: int, evidence: dict[int, dict[tuple[str, str], _GroupStep]],
              first_step: int | None) -> str:
    """The ulp distance per step per metric on a log axis (0 on its own line below 1), the
    digest-only groups as bands of differing steps, the first divergence and the steps the
    live check cut, as one inline SVG and a legend."""
    steps = sorted(set(evidence) | {s for s in pair.steps_a.get(rank, []) if pair.cut(s)})
    groups = sorted({g for at in evidence.values() for g in at}, key=_group_sort)
    lines = [g for g in groups if g[1] == "metric" and any(at.get(g) is not None and at[g].max_ulp is not None
                                                            for at in evidence.values())]
    bands = [g for g in groups if g not in lines]
    width, left, right, top = 1100, 124, 24, 34
    plot_h, band_h = 210, 18
    bottom_axis = top + plot_h
    height = bottom_axis + 30 + band_h * len(bands) + 8
    low, high = steps[0], steps[-1]
    span = high - low + 1

    def x(step: float) -> float:
        return left + (step - low + 0.5) / span * (width - left - right)

    biggest = max([at[g].max_ulp or 0 for at in evidence.values() for g in lines if g in at] + [1])
    decades = max(1, math.ceil(math.log10(biggest + 0.5)))
    zero_y, one_y = bottom_axis - 6, bottom_axis - 30

    def y(ulp: int) -> float:
        return zero_y if ulp == 0 else one_y - math.log10(ulp) / decades * (one_y - top)

    parts = [f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{plot_h}" fill="#fbfcfd" '
             'stroke="#d0d7de"/>']
    for k in _log_ticks(decades):
        label = f"{10 ** k:,}" if k < 4 else f"1e{k}"
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(10 ** k):.1f}" y2="{y(10 ** k):.1f}" '
                     f'stroke="#e5e9ee"/><text x="{left - 6}" y="{y(10 ** k) + 4:.1f}" text-anchor="end" '
                     f'font-size="12">{label}</text>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{zero_y}" y2="{zero_y}" stroke="#8c959f" '
                 f'stroke-dasharray="2,3"/><text x="{left - 6}" y="{zero_y + 4}" text-anchor="end" font-size="12">'
                 "0</text>")
    parts.append(f'<text x="40" y="{top + plot_h / 2:.0f}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 40 {top + plot_h / 2:.0f})" class="axis-title">ulps (log scale)</text>')
    cut = [s for s in steps if pair.cut(s)]
    if cut:
        x0 = x(cut[0] - 0.5)
        parts.append(f'<rect class="cut" x="{x0:.1f}" y="{top}" width="{width - right - x0:.1f}" '
                     f'height="{height - top - 8}" fill="#eef1f4"><title>not run past the first divergence</title>'
                     f'</rect><text x="{(x0 + width - right) / 2:.0f}" y="{top + plot_h / 2:.0f}" text-anchor="middle" '
                     f'font-size="12" fill="#57606a">{_esc(pair.names[1])}: not run past the first divergence'
                     f'</text><text x="{(x0 + width - right) / 2:.0f}" y="{top + plot_h / 2 + 16:.0f}" '
                     f'text-anchor="middle" font-size="11" fill="#57606a">(the live check stopped it at step '
                     f'{pair.stopped_b}; verify --keep-going runs it on)</text>')
    for index, group in enumerate(lines):
        colour = _COLOURS[index % len(_COLOURS)]
        points = [(s, evidence[s][group].max_ulp) for s in sorted(evidence)
                  if group in evidence[s] and evidence[s][group].max_ulp is not None]
        path = " ".join(f"{x(s):.1f},{y(u):.1f}" for s, u in points)
        parts.append(f'<polyline class="ulp-line" fill="none" stroke="{colour}" stroke-width="2.2" points="{path}"/>')
        for s, u in points:
            parts.append(f'<circle cx="{x(s):.1f}" cy="{y(u):.1f}" r="3" fill="{colour}"><title>'
                         f'{_esc(group[0])}, step {s}: {u:,} ulp</title></circle>')
    parts += _ulp_bands(evidence, bands, x, left, width - right, bottom_axis + 28, band_h, span)
    every = max(1, math.ceil(span / 12))
    for s in range(low, high + 1):
        if (s - low) % every == 0 or s == high:
            parts.append(f'<text x="{x(s):.1f}" y="{bottom_axis + 16}" text-anchor="middle" font-size="12">{s}'
                         "</text>")
    parts.append(f'<text x="{left - 6}" y="{bottom_axis + 16}" text-anchor="end" font-size="12" '
                 'fill="#57606a">step</text>')
    if first_step is not None and low <= first_step <= high:
        fx = x(first_step)
        parts.append(f'<line class="first-divergence" x1="{fx:.1f}" x2="{fx:.1f}" y1="{top - 6}" y2="{height - 8}" '
                     f'stroke="#a40e26" stroke-width="2" stroke-dasharray="6,3"/>'
                     f'<text x="{fx + 5:.1f}" y="{top - 9}" font-size="12" font-weight="700" fill="#a40e26">'
                     f"first divergence: step {first_step}</text>")
    legend = "".join(f'<span style="background:{_COLOURS[i % len(_COLOURS)]}"></span>{_esc(g[0])}'
                     for i, g in enumerate(lines))
    if bands:
        legend += ('<span style="background:#cf222e"></span>tensor group differs (digests: ulps unknown)'
                   '<span style="background:#d4a72c"></span>in one run only')
    return (f'<svg class="ulp-plot" id="ulp-plot" data-scale="log" width="100%" viewBox="0 0 {width} {height}" '
            f'role="img"><title>ulp distance between a and b per step (log scale)</title>{"".join(parts)}</svg>'
            f'<p class="legend" id="ulp-legend">{legend or "no metric recorded on this rank"}</p>')


def _ulp_bands(evidence: dict[int, dict[tuple[str, str], _GroupStep]], bands: list[tuple[str, str]], x,
               left: float, right_x: float, first_y: float, band_h: int, span: int) -> list[str]:
    """The digest-only record groups under the ulp plot: one band each, the steps where they
    differ (or are in one run only) marked, with no magnitude."""
    parts = []
    for row, group in enumerate(bands):
        y0 = first_y + row * band_h
        parts.append(f'<text x="{left - 6}" y="{y0 + 12}" text-anchor="end" font-size="12">{_esc(group[0])}</text>'
                     f'<rect x="{left}" y="{y0}" width="{right_x - left}" height="{band_h - 4}" fill="#f1f4f7"/>')
        cell_w = max((right_x - left) / span, 2)
        for s in sorted(evidence):
            cell = evidence[s].get(group)
            if cell is None or not (cell.differ or cell.missing):
                continue
            colour, what = ("#cf222e", f"{cell.differ} of {cell.records} record(s) differ (digests: no magnitude)") \
                if cell.differ else ("#d4a72c", f"{cell.missing} record(s) in one run only")
            parts.append(f'<rect class="band-diff" x="{x(s) - cell_w / 2:.1f}" y="{y0}" width="{cell_w:.1f}" '
                         f'height="{band_h - 4}" fill="{colour}"><title>{_esc(group[0])}, step {s}: {_esc(what)}'
                         "</title></rect>")
    return parts


def _short_names(pair: Pair) -> tuple[str, str]:
    """What sentences call the two runs: verify's A, B, C, else a and b."""
    names = []
    for name, fallback in zip(pair.names, ("a", "b")):
        word = name.removeprefix("run ").split(" ")[0] if name.startswith("run ") else ""
        names.append(word if word in ("A", "B", "C") else fallback)
    return names[0], names[1]


def _state_chart(track: StateTrack, picture: StatePicture, pair: Pair, label_a: str, label_b: str) -> str:
    """One census record of b against a as an inline SVG: x the step, y the step of a whose state
    the run holds (a on the diagonal, b dashed; a cross in the top band: no step of a), the
    generators' draws as ticks, the steps the live check cut hatched."""
    width, left, right, top, band = 540, 74, 14, 40, 22
    plot_h = 150
    draws = 2 if track.is_generator else 0
    axis_y = top + band + plot_h
    height = axis_y + 22 + draws * 14 + 6
    start = min(picture.window) if picture.window else 0
    xs = sorted(set(picture.window) | {s for s in picture.steps_a if s >= start})
    low_x, high_x = xs[0], max(xs[-1], xs[0] + 1)
    ys = picture.steps_a or [0]
    low_y, high_y = min(ys), max(max(ys), min(ys) + 1)

    def x(step: float) -> float:
        return left + (step - low_x) / (high_x - low_x) * (width - left - right)

    def y(step: float) -> float:
        return top + band + (high_y - step) / (high_y - low_y) * plot_h

    parts = [f'<rect x="{left}" y="{top + band}" width="{width - left - right}" height="{plot_h}" fill="#fbfcfd" '
             'stroke="#d0d7de"/>',
             f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{band - 4}" fill="#f6f8fa"/>'
             f'<text x="{left - 5}" y="{top + 13}" text-anchor="end" font-size="10" fill="#57606a">no step</text>']
    cut = [s for s in xs if pair.cut(s)]
    if cut:
        x0 = x(cut[0] - 0.5)
        parts.append(f'<rect class="cut" x="{x0:.1f}" y="{top}" width="{max(width - right - x0, 0):.1f}" '
                     f'height="{axis_y - top}" fill="#eef1f4"><title>{_esc(pair.names[1])}: not run past the first '
                     f'divergence (live check)</title></rect><text x="{(x0 + width - right) / 2:.0f}" '
                     f'y="{top + band + 14}" text-anchor="middle" font-size="11" fill="#57606a">'
                     + (f"{_esc(label_b)} not run past the first divergence" if width - right - x0 > 220 else
                        "not run") + "</text>")
    for k in _ticks(low_y, high_y):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(k):.1f}" y2="{y(k):.1f}" stroke="#e5e9ee"/>'
                     f'<text x="{left - 5}" y="{y(k) + 4:.1f}" text-anchor="end" font-size="11">{k}</text>')
    for k in _ticks(low_x, high_x):
        parts.append(f'<text x="{x(k):.1f}" y="{axis_y + 14}" text-anchor="middle" font-size="11">{k}</text>')
    parts.append(f'<text x="{left - 5}" y="{axis_y + 14}" text-anchor="end" font-size="11" fill="#57606a">step'
                 f'</text><text x="16" y="{top + band + plot_h / 2:.0f}" font-size="11" text-anchor="middle" '
                 f'transform="rotate(-90 16 {top + band + plot_h / 2:.0f})">{_esc(label_a)}\'s step held</text>')
    diagonal = [s for s in picture.steps_a if low_x <= s <= high_x]
    if diagonal:
        parts.append(f'<polyline class="state-a" fill="none" stroke="{COLOUR_A}" stroke-width="2.4" points="'
                     + " ".join(f"{x(s):.1f},{y(s):.1f}" for s in diagonal) + '"/>')
    held = [(s, t) for s, t in sorted(track.positions.items()) if t is not None]
    if held:
        parts.append(f'<polyline class="state-b" fill="none" stroke="{COLOUR_B}" stroke-width="2.4" {_DASHED} '
                     'points="' + " ".join(f"{x(s):.1f},{y(t):.1f}" for s, t in held) + '"/>')
    parts += _state_marks(track, x, y, top, label_a, label_b)
    for row, (who, colour, steps) in enumerate(((label_a, COLOUR_A, track.drawn_a),
                                                (label_b, COLOUR_B, track.drawn_b))[:draws]):
        y0 = axis_y + 22 + row * 14
        parts.append(f'<text x="{left - 5}" y="{y0 + 8}" text-anchor="end" font-size="10" fill="#57606a">'
                     f"{_esc(who)} drew</text>")
        for s in steps:
            parts.append(f'<rect class="draw-{"a" if row == 0 else "b"}" x="{x(s) - 3:.1f}" y="{y0}" width="6" '
                         f'height="10" fill="{colour}"><title>{_esc(f"step {s}: {who} drew from the {track.title}")}'
                         "</title></rect>")
    legend = _legend(left, f"{_esc(label_a)}: {_esc(pair.names[0])}", f"{_esc(label_b)}: {_esc(pair.names[1])}")
    svg = (f'<svg class="chart state-chart" data-record="{_esc(track.name)}" width="100%" '
           f'viewBox="0 0 {width} {height}" role="img"><title>{_esc(track.title)}: the step of {_esc(label_a)} '
           f"whose state each run holds</title>{legend}{''.join(parts)}</svg>")
    return (f'<div class="chart-box"><h3>{_esc(track.title)}<span class="note mono">{_esc(track.name)}</span></h3>'
            f'{svg}<p class="mono wrap small">{_esc(track.says(label_a, label_b))}</p></div>')


def _state_marks(track: StateTrack, x, y, top: float, label_a: str, label_b: str) -> list[str]:
    """Each step of b on a census chart: a cross in the top band (no step of a holds its state),
    a red mark off the diagonal, a dot on it, and a square where one run only records it."""
    parts = []
    for s, t in sorted(track.positions.items()):
        if t is None:
            tip = f"step {s}: {label_b}'s {track.title} matches no step of {label_a}"
            parts.append(f'<text class="state-none" x="{x(s):.1f}" y="{top + 14}" text-anchor="middle" '
                         f'font-size="15" font-weight="700" fill="#cf222e">&#215;<title>{_esc(tip)}</title></text>')
        elif t != s:
            tip = f"step {s}: {label_b} holds {label_a}'s {track.title} of step {t}"
            parts.append(f'<circle class="state-differs" cx="{x(s):.1f}" cy="{y(t):.1f}" r="4.5" fill="#cf222e">'
                         f"<title>{_esc(tip)}</title></circle>")
        else:
            tip = f"step {s}: {label_b}'s {track.title} is {label_a}'s of this step"
            parts.append(f'<circle class="state-same" cx="{x(s):.1f}" cy="{y(t):.1f}" r="3" fill="{COLOUR_B}">'
                         f"<title>{_esc(tip)}</title></circle>")
    for s, where in sorted(track.only_in.items()):
        tip = f"step {s}: only {label_a if where == 'a' else label_b} records its {track.title}"
        parts.append(f'<rect class="state-only" x="{x(s) - 4:.1f}" y="{top + 5}" width="8" height="8" fill="#d4a72c">'
                     f"<title>{_esc(tip)}</title></rect>")
    return parts


def _legend(left: float, text_a: str, text_b: str, attributes: str = "") -> str:
    """A chart's legend in its top margin: a solid line for a, dashed for b (texts already escaped)."""
    return (f'<g{attributes} font-size="12"><line x1="{left}" y1="14" x2="{left + 30}" y2="14" stroke="{COLOUR_A}" '
            f'stroke-width="2.4"/><text x="{left + 36}" y="18">{text_a}</text>'
            f'<line x1="{left + 230}" y1="14" x2="{left + 260}" y2="14" stroke="{COLOUR_B}" stroke-width="2.4" '
            f'{_DASHED}/><text x="{left + 266}" y="18">{text_b}</text></g>')


def _ticks(low: int, high: int) -> list[int]:
    """At most about 6 whole-step ticks from ``low`` to ``high``."""
    every = max(1, math.ceil((high - low) / 6))
    return list(range(low, high + 1, every))


def _chart_caption(series_a: dict[int, Record], series_b: dict[int, Record], steps: list[int]) -> str:
    """What a metric chart says under it: how many common steps are bit-identical, and the first
    that differs (both values, ulps and relative difference)."""
    equal = sum(1 for s in steps if s in series_a and s in series_b and series_a[s].raw == series_b[s].raw)
    both = sum(1 for s in steps if s in series_a and s in series_b)
    first_diff = next((s for s in steps if s in series_a and s in series_b and series_a[s].raw != series_b[s].raw), None)
    caption = f"{equal} of {both} common step(s) bit-identical"
    if first_diff is not None:
        ulp, relative = metric_distance(series_a[first_diff], series_b[first_diff])
        caption += (f"; first differing step {first_diff}: a = {series_a[first_diff].summary()}, "
                    f"b = {series_b[first_diff].summary()}" + (f", {ulp} ulp" if ulp is not None else "")
                    + (f", relative {relative:.3e}" if relative is not None else ""))
    return caption


def _chart(name: str, series_a: dict[int, Record], series_b: dict[int, Record], pair: Pair,
           first_step: int | None) -> str:
    """One metric of both runs as an inline SVG line chart: a solid, b dashed in another colour,
    the steps whose bits differ marked, the first divergence and the steps the live check cut."""
    title = _metric_title(name)
    width, height, left, right, top, bottom = 540, 230, 74, 14, 38, 30
    cut = [s for s in series_a if s not in series_b and pair.cut(s)]
    steps = sorted(set(series_a) | set(series_b))
    values = [v for s in steps for v in (float_value(series_a[s]) if s in series_a else None,
                                        float_value(series_b[s]) if s in series_b else None)
              if v is not None and math.isfinite(v)]
    caption = _chart_caption(series_a, series_b, steps)
    recorded = f" (recorded as {name})" if title != name else ""
    head = f'<div class="chart-box"><h3>{_esc(title)}<span class="note mono">{_esc(recorded)}</span></h3>'
    if not steps or not values:
        return f"{head}<p class=\"mono wrap\">{_esc(caption)} (no finite values to draw)</p></div>"
    low, high = min(values), max(values)
    if high == low:
        low, high = low - 1.0 if low == 0 else low - abs(low) * 0.05, high + 1.0 if high == 0 else high + abs(high) * 0.05
    first, last = steps[0], steps[-1]
    span = max(last - first, 1)

    def x(step: float) -> float:
        return left + (step - first) / span * (width - left - right)

    def y(value: float) -> float:
        return top + (high - value) / (high - low) * (height - top - bottom)

    def line(series: dict[int, Record], extra: str, colour: str, css: str) -> str:
        points = [f"{x(s):.1f},{y(v):.1f}" for s in steps if s in series
                  for v in [float_value(series[s])] if v is not None and math.isfinite(v)]
        if not points:
            return ""
        return (f'<polyline class="{css}" fill="none" stroke="{colour}" stroke-width="2.4" {extra} '
                f'points="{" ".join(points)}"/>')

    parts = []
    start = pair.start_step or 0
    if start > first:
        parts.append(f'<rect x="{left}" y="{top}" width="{max(x(start) - left, 0):.1f}" '
                     f'height="{height - top - bottom}" fill="#eef1f4"><title>before the compared window</title>'
                     '</rect>')
    if cut:
        x0 = x(min(cut) - 0.5)
        parts.append(f'<rect class="cut" x="{x0:.1f}" y="{top}" width="{width - right - x0:.1f}" '
                     f'height="{height - top - bottom}" fill="#eef1f4"><title>{_esc(pair.names[1])}: not run past '
                     f'the first divergence (live check)</title></rect><text x="{(x0 + width - right) / 2:.0f}" '
                     f'y="{top + 14}" text-anchor="middle" font-size="11" fill="#57606a">'
                     + ("b not run past the first divergence" if width - right - x0 > 220 else "not run") + "</text>")
    for fraction in (0.0, 0.5, 1.0):
        value = low + (high - low) * fraction
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
                     'stroke="#e5e9ee"/>'
                     f'<text x="{left - 5}" y="{y(value) + 4:.1f}" text-anchor="end" font-size="11">'
                     f'{_esc(f"{value:.5g}")}</text>')
    parts.append(f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" '
                 'stroke="#8c959f"/>'
                 f'<text x="{left}" y="{height - 10}" font-size="11">step {first}</text>'
                 f'<text x="{width - right}" y="{height - 10}" text-anchor="end" font-size="11">step {last}</text>')
    if first_step is not None and first <= first_step <= last:
        parts.append(f'<line class="first-divergence" x1="{x(first_step):.1f}" x2="{x(first_step):.1f}" y1="{top}" '
                     f'y2="{height - bottom}" stroke="#a40e26" stroke-width="1.5" stroke-dasharray="5,3"/>'
                     f'<text x="{x(first_step) + 4:.1f}" y="{height - bottom - 4}" font-size="11" fill="#a40e26">'
                     f"first divergence</text>")
    parts.append(line(series_a, "", COLOUR_A, "curve-a") + line(series_b, _DASHED, COLOUR_B, "curve-b"))
    for s in steps:
        if s not in series_a or s not in series_b or series_a[s].raw == series_b[s].raw:
            continue
        value = float_value(series_b[s])
        if value is None or not math.isfinite(value):
            continue
        ulp, _ = metric_distance(series_a[s], series_b[s])
        tip = (f"step {s}: bits differ; a = {series_a[s].summary()}, b = {series_b[s].summary()}"
               + (f", {ulp} ulp" if ulp is not None else ""))
        parts.append(f'<circle class="mark-ne" cx="{x(s):.1f}" cy="{y(value):.1f}" r="2.6" fill="#cf222e">'
                     f"<title>{_esc(tip)}</title></circle>")
    legend = _legend(left, f"a: {_esc(pair.names[0])}", f"b: {_esc(pair.names[1])}", ' class="chart-legend"')
    svg = (f'<svg class="chart" width="100%" viewBox="0 0 {width} {height}" role="img">'
           f'<title>{_esc(title)}</title>{legend}{"".join(parts)}</svg>')
    return f"{head}{svg}<p class=\"mono wrap small\">{_esc(caption)}</p></div>"
