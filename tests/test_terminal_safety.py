"""Human-readable output never carries a control character from a file or a run: a name
holding an ANSI escape sequence must not be able to repaint the terminal.  JSON stays exact."""

from __future__ import annotations

import json

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
