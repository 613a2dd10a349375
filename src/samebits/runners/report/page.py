"""The HTML page: escaping, the frame (title, conclusion, verdict, contents, notes), tables, and
the `Report` it becomes.

One file, no network: inline CSS, no script, and a Content-Security-Policy that forbids scripts
and remote loads.  Every name and value passes through `_esc`.
"""

from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field
from typing import Any

from samebits.runners.report.evidence import Pair, _pair_summary
from samebits.visible import visible
from samebits.verdicts import EXIT_STOPPED, ToDict, Verdict, serialised


def _esc(value: Any) -> str:
    """Text for the page: made visible as the terminal shows it (`visible`), then HTML-escaped,
    quotes included (safe in attributes too)."""
    return html.escape(visible(value), quote=True)


@dataclass
class Report(ToDict):
    """The page and what it says: ``kind`` (verify, bisect, matrix, diff), the overall
    ``verdict`` (as the command that produced the inputs decided it, or the diff's), the
    section headings, the HTML text."""

    dict_keys = ("kind", "verdict", "exit_code", "conclusion", "inputs", "out", "sections", "pairs", "notes")

    kind: str
    inputs: list[str]
    verdict: Verdict
    sections: list[str]
    html: str = field(metadata=serialised(skip=True))  # the page itself, written to `out`
    pairs: list[Pair] = field(metadata=serialised(convert=lambda pairs: [_pair_summary(p) for p in pairs]))
    notes: list[str] = field(default_factory=list)
    out: str = ""
    conclusion: str = ""  # the sentence the page leads with, as the terminal printed it
    stopped: str = ""  # why the command did not finish (its summary says "stopped"): no verdict, exit 3

    @property
    def exit_code(self) -> int:
        return EXIT_STOPPED if self.stopped else self.verdict.exit_code

    def dict_extras(self) -> dict:
        return {"exit_code": self.exit_code, **({"stopped": self.stopped} if self.stopped else {})}


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1150px;color:#1d232a;padding:0 16px}
h1{font-size:22px;margin:0 0 6px}h2{font-size:18px;margin:30px 0 8px;border-bottom:1px solid #d5dbe1;padding-bottom:4px}
h3{font-size:15px;margin:14px 0 4px}code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px}
table{border-collapse:collapse;margin:6px 0 10px}td,th{border:1px solid #d5dbe1;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f1f4f7}.verdict{display:inline-block;padding:3px 10px;border-radius:4px;font-weight:700;color:#fff}
.v-pass,.v-identical{background:#1a7f37}.v-fail,.v-diverged{background:#c62828}.v-incomplete{background:#9a6700}
.conclusion{font-size:17px;line-height:1.5;padding:10px 14px;margin:10px 0;border-left:6px solid #8c959f;background:#f6f8fa;overflow-wrap:anywhere}
.conclusion.v-fail,.conclusion.v-diverged{border-color:#c62828;background:#fdf0f0}.conclusion.v-pass,.conclusion.v-identical{border-color:#1a7f37;background:#eefbf1}
.conclusion.v-incomplete{border-color:#9a6700;background:#fff8e5}
.note{color:#57606a}.err{color:#c62828;white-space:pre-wrap}.wrap{overflow-wrap:anywhere;white-space:normal}.small{font-size:11.5px}
table.heat{width:100%;table-layout:fixed;border-collapse:separate;border-spacing:1px}table.heat col.row{width:170px}
table.heat td{height:18px;padding:0;border:0;min-width:3px}table.heat th{font-weight:400;font-size:11px;padding:0 2px;border:0;background:none;overflow:hidden;white-space:nowrap}
table.heat th.row{text-align:right;padding-right:6px;overflow:hidden;text-overflow:ellipsis}
td.h-same{background:#8fd19e}td.h-first{background:#a40e26}td.h-differs{background:#f06b6b}td.h-after{background:#f5b7b1}td.h-missing{background:#d4a72c}
td.h-none{background:#eef1f4}td.h-outside{background:#d0d7de}td.h-cut{background:repeating-linear-gradient(135deg,#d0d7de 0 3px,#f6f8fa 3px 6px)}
.legend span{display:inline-block;width:14px;height:12px;margin:0 5px 0 14px;vertical-align:middle;border-radius:2px}
.legend svg{vertical-align:middle;margin:0 4px 0 12px}
table.records{width:100%;table-layout:fixed;font-size:12px}table.records col.rec{width:260px}
table.records th.rec{overflow-wrap:anywhere;font-weight:400}table.records td{padding:2px 3px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
td.t-eq{color:#1a7f37;text-align:center}td.t-ne{background:#fbe3e3;color:#8b1a1a;text-align:center}td.t-miss{background:#fff1c2;text-align:center}
.charts{display:grid;grid-template-columns:1fr 1fr;gap:6px 22px}.chart-box h3 .note{font-weight:400;margin-left:8px}
.chart,.ulp-plot{display:block;margin:4px 0 6px}
"""


class Page:
    """A page being written: its sections, in order, and what it leads with."""

    def __init__(self, kind: str, title: str, verdict: Verdict):
        self.kind, self.title, self.verdict = kind, title, verdict
        self.conclusion = ""  # the sentence the terminal printed (`samebits.runners.conclusion`): the page leads with it
        self.parts: list[str] = []
        self.sections: list[str] = []
        self.notes: list[str] = []
        self.stopped = ""  # a command that did not finish: why

    def h2(self, text: str, anchor: str) -> None:
        self.sections.append(text)
        self.parts.append(f'<h2 id="{_esc(anchor)}">{_esc(text)}</h2>')

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def finish(self, inputs: list[str], pairs: list[Pair], notes: list[str] = ()) -> Report:
        notes = list(notes) + self.notes + [n for p in pairs for n in p.notes]
        if notes:
            self.h2("Notes", "notes")
            self.add("<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
        lead = (f'<p class="conclusion v-{self.verdict.value}" id="conclusion">{_esc(self.conclusion)}</p>'
                if self.conclusion else "")
        head = (f'<h1>{_esc(self.title)}</h1>{lead}<p>verdict: <span class="verdict v-{self.verdict.value}" '
                f'id="verdict">{_esc("STOPPED" if self.stopped else self.verdict.value.upper())}</span> '
                f'<span class="note">({_esc(self.kind)}; exit code {EXIT_STOPPED if self.stopped else self.verdict.exit_code})</span></p>'
                f'<p class="note">made by samebits report at {_esc(time.strftime("%Y-%m-%d %H:%M:%S %Z"))} from '
                + ", ".join(f"<code>{_esc(i)}</code>" for i in inputs) + "</p>")
        toc = "<p>" + " &middot; ".join(f'<a href="#s{i}">{_esc(s)}</a>' for i, s in enumerate(self.sections)) + "</p>"
        body, index = [], 0
        for part in self.parts:
            if part.startswith("<h2 id="):  # number the anchors so the contents links work
                part = re.sub(r'^<h2 id="[^"]*">', f'<h2 id="s{index}">', part)
                index += 1
            body.append(part)
        page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
                "img-src data:\">"
                f"<title>{_esc(self.title)}</title><style>{_CSS}</style></head><body>"
                + head + toc + "\n".join(body) + "</body></html>\n")
        return Report(kind=self.kind, inputs=inputs, verdict=self.verdict, sections=list(self.sections),
                      html=page, pairs=pairs, notes=notes, conclusion=self.conclusion, stopped=self.stopped)


def _table(headers: list[str], rows: list[list[Any]], verdict_column: int | None = None,
           table_id: str | None = None) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, value in enumerate(row):
            text = "" if value is None else _esc(value)
            css = f' class="verdict v-{text}"' if i == verdict_column and text in {v.value for v in Verdict} else ""
            cells.append(f"<td{css}>{text}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    ident = f' id="{_esc(table_id)}"' if table_id else ""
    return f"<table{ident}><tr>{head}</tr>{''.join(body)}</table>"
