"""Human-readable output never carries a control character from a file or a run: a name
holding an ANSI escape sequence must not be able to repaint the terminal.  JSON stays exact."""

from __future__ import annotations

import json

import pytest

from samebits.cli import main

ESC = "\x1b[2K\rIDENTICAL"


def test_check_config_escapes_key_names(tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"num_threads": 2, ESC: 1}))
    main(["check", "--config", str(config)])
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\r" not in out + err
    assert "\\x1b[2K\\x0dIDENTICAL" in out + err  # shown, visibly escaped
    main(["check", "--config", str(config), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert ESC in data["unchecked_keys"]  # JSON keeps the exact name


def test_echo_escapes_everything_but_newlines(capsys):
    from samebits.cli._format import echo

    echo("a\x1b[31mb\nc\u202ed\te")
    assert capsys.readouterr().out == "a\\x1b[31mb\nc\\u202ed\\x09e\n"


# Bidi marks, embeddings, overrides and isolates (U+061C, U+200E/F, U+202A-E, U+2066-9), other
# format characters (category Cf: zero-width, BOM, soft hyphen, tag characters), C0 and C1
# controls, line and paragraph separators: each could reorder or hide what a person reads.
UNSAFE = ["\u061c", "\u200e", "\u200f", "\u202a", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069", "\u200b",
          "\u200d", "\u2060", "\ufeff", "\u00ad", "\U000e0041", "\u2028", "\u2029", "\x1b", "\x7f", "\x85", "\x9b"]


@pytest.mark.parametrize("char", UNSAFE)
def test_format_and_bidi_characters_are_escaped_for_the_terminal_and_the_page(char):
    from samebits.cli._format import escape
    from samebits.runners.report.page import _esc

    code = ord(char)
    shown = f"\\x{code:02x}" if code < 0xa0 else f"\\u{code:04x}" if code <= 0xffff else f"\\U{code:08x}"
    assert escape(f"a{char}b") == f"a{shown}b"
    assert escape(f"a{char}b\n", keep_newlines=True) == f"a{shown}b\n"
    assert _esc(f"a{char}b") == f"a{shown}b"


def test_printable_text_is_left_alone():
    from samebits.cli._format import escape
    from samebits.runners.report.page import _esc

    text = "layer0.weight → grads/é ü 漢字 \u00a0 ok"
    assert escape(text) == text and _esc(text) == text


def test_check_escapes_an_arabic_letter_mark_in_a_key(tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"num_threads": 2, "seed\u061c\u2067x": 1}))
    main(["check", "--config", str(config)])
    out, err = capsys.readouterr()
    assert "\u061c" not in out + err and "\u2067" not in out + err
    assert "seed\\u061c\\u2067x" in out + err


def test_the_page_escapes_format_characters_from_the_runs(tmp_path):
    import samebits
    from samebits.runners.report import build_report

    for name, value in (("a", "x\u061cy"), ("b", "x\u202ey\u2066")):
        with samebits.Recorder(tmp_path / name, rank=0, world_size=1, config={"note": value}) as rec:
            rec.metrics(0, loss=1.0)
    page = build_report([tmp_path / "a", tmp_path / "b"], allow_config_diff=True).html
    assert "\u061c" not in page and "\u202e" not in page and "\u2066" not in page
    assert "x\\u061cy" in page and "x\\u202ey\\u2066" in page
