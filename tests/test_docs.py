"""The docs harness: every fenced block of README.md and docs/*.md says what it is, and the
runnable ones run (issue 27: a documented command that fails when pasted fails CI).

A block's fence names its language and one marker, e.g. ```` ```bash runnable ````:

* ``runnable``: shell commands the slow test runs as written, in a fresh folder per page, in page
  order, with ``samebits`` and ``python`` of this environment on PATH; ``runnable exit=1``: the
  command shown must fail with that code (a documented FAIL).  A ``python runnable`` block is
  run as a script there too.
* ``file``: a file the page's commands use; its first line is ``# file: NAME`` and the harness
  writes it into the page's folder before the page's first runnable block.
* ``illustrative``: not run (placeholders such as ``K`` or ``<your arguments>``, a GPU, a cluster,
  a fragment of a larger program, or a synopsis); its ``samebits`` commands must still name real
  commands and options, and a file it names that the page does not give (``train.py``, a config)
  is named in a comment line of the block, ``# needs: train.py (your training script)``, so
  that the reader knows what to bring (issue 35: ``recipe.toml`` was named and never given).
* ``output``: what a command prints, a layout or a file format.
* ``realcode``: a shell command that runs a trainer of the real-code corpus (``tests/realcode/``,
  paths from the repository root) under samebits; `tests/test_docs_realcode.py` (slow, with the
  ``realcode`` extra) runs it as written and it must PASS.

The fast tests check that every block is marked, that every ``samebits`` command in a block
names a command and options that exist, that runnable ones parse as samebits parses them (with
``--`` before a program), that every file a block names is given (a file block of the page, a
file of the repository, or a ``# needs:`` line), and that a script of the page is given only
options its argparse declares, and every one it requires (issue 35: ``--ckpt-dir`` missing);
the slow test (`test_runnable_blocks_run`) runs them.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from samebits.cli import build_parser, forgotten_separator
from samebits.cli._options import refuse_recipe_options
from samebits.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("runnable", "file", "illustrative", "output", "realcode")
SHELLS = ("bash", "sh", "console")
BLOCK_TIMEOUT_S = 600  # one block; a busy 2-core machine runs a verify several times slower


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    marker: str | None
    exit_code: int
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def file_name(self) -> str | None:
        first = self.body.splitlines()[0] if self.body else ""
        found = re.match(r"#\s*file:\s*(\S+)\s*$", first)
        return found.group(1) if found else None


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, in order."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)(.*)$", lines[i])
        if fence is None:
            i += 1
            continue
        words = fence.group(3).split()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(2))), None)
        assert end is not None, f"{page}:{i + 1}: a fence that is never closed"
        marker = next((w for w in words[1:] if w in MARKERS), None)
        exit_code = next((int(w[5:]) for w in words[1:] if re.fullmatch(r"exit=\d+", w)), 0)
        found.append(Block(page, i + 1, words[0] if words else "", marker, exit_code,
                           "\n".join(line[len(fence.group(1)):] for line in lines[i + 1 : end]) + "\n"))
        i = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]
RUNNABLE_PAGES = sorted({b.page for b in ALL if b.marker == "runnable"}, key=str)


def test_every_block_is_marked():
    unmarked = [f"{b.where}: ```{b.language} (give it a language and one of {', '.join(MARKERS)})"
                for b in ALL if not b.language or b.marker is None]
    assert unmarked == []
    assert len(ALL) > 50  # the reader finds the pages' blocks
    misplaced = [b.where for b in ALL if (b.marker == "file") != (b.file_name is not None)]
    assert misplaced == [], "a file block starts with '# file: NAME', and only a file block does"
    assert [b.where for b in ALL if b.marker == "runnable" and b.language not in SHELLS + ("python",)] == []
    assert [b.where for b in ALL if b.marker == "realcode" and b.language not in SHELLS] == []


def _logical_lines(body: str) -> list[str]:
    """Lines with backslash continuations joined, console prompts removed."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [re.sub(r"^\$\s+", "", line).strip() for line in joined.splitlines() if line.strip()]


def samebits_commands(body: str) -> list[list[str]]:
    """The argument lists of every `samebits ...` (or `python -m samebits ...`) in a shell block,
    up to a shell operator or comment."""
    found = []
    for line in _logical_lines(body):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # a synopsis with an unbalanced bracket or quote
            words = line.split("#", 1)[0].split()
        for i, word in enumerate(words):
            if word == "samebits" and (i == 0 or words[i - 1] in ("&&", "||", ";", "-m", "|")):
                argv = []
                for arg in words[i + 1 :]:
                    if arg in ("&&", "||", ";", "|"):
                        break
                    argv.append(arg)
                found.append(argv)
    return found


def _subparsers():
    parser = build_parser()
    return parser, parser._subparsers._group_actions[0].choices


def test_documented_commands_name_real_commands_and_options():
    parser, commands = _subparsers()
    wrong = []
    for block in ALL:
        if block.language not in SHELLS and not (block.language == "text" and block.marker == "illustrative"):
            continue
        for argv in samebits_commands(block.body):
            words = [w.strip("[]") for w in argv]
            name = words[0] if words else ""
            if name.startswith("-"):
                known = {o for a in parser._actions for o in a.option_strings}
                options = [w for w in words if w.startswith("-")]
            elif name not in commands:
                wrong.append(f"{block.where}: samebits {name}: no such command")
                continue
            else:
                known = {o for a in commands[name]._actions for o in a.option_strings}
                ours = words[1 : words.index("--")] if "--" in words else words[1:]
                options = [w for w in ours if w.startswith("-") and w not in ("-", "...")]
            for option in options:
                if option.split("=", 1)[0] not in known:
                    wrong.append(f"{block.where}: samebits {name} has no option {option.split('=', 1)[0]}")
    assert wrong == []


def test_commands_in_the_prose_name_real_options():
    """An inline `samebits COMMAND --option` of a page's prose names an option the command has
    (a renamed option's old spelling, left in a sentence, fails here); a span whose second word
    is no command (`samebits COMMAND --help`, the typo `samebits verfy`) is prose about commands."""
    commands = _subparsers()[1]
    wrong = []
    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`samebits ([a-z]+)((?: [^`]*)?)`", prose):
            name, rest = span
            if name not in commands:
                continue
            try:
                words = shlex.split(rest)
            except ValueError:
                words = rest.split()
            words = [w.strip("[]") for w in next((words[:i] for i, w in enumerate(words) if w in SHELL_OPERATORS), words)]
            ours = words[: words.index("--")] if "--" in words else words
            known = {o for a in commands[name]._actions for o in a.option_strings}
            for word in ours:
                for option in word.split("/"):
                    if option.startswith("-") and option not in ("-", "...") and option.split("=", 1)[0] not in known:
                        wrong.append(f"{page.relative_to(ROOT)}: `samebits {name}{rest}`: no option {option}")
    assert wrong == []


@pytest.mark.parametrize("block", [b for b in ALL if b.marker in ("runnable", "realcode") and b.language in SHELLS],
                         ids=lambda b: b.where)
def test_runnable_commands_parse(block):
    """As samebits parses them: options in place, values of the right type, no recipe option with a command."""
    parser = build_parser()
    for argv in samebits_commands(block.body):
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{block.where}: `samebits {shlex.join(argv)}` does not parse")
        try:
            refuse_recipe_options(args)
        except ConfigError as err:
            pytest.fail(f"{block.where}: `samebits {shlex.join(argv)}`: {err}")
        forgotten = forgotten_separator(argv, parser)
        assert forgotten is None, f"{block.where}: `samebits {shlex.join(argv)}`: {forgotten}"


# What a command line reads that the reader must have: scripts and configs.  A value of an
# option that names what the command writes (``--out gpu_check.json``) is an output.
INPUT_SUFFIXES = (".py", ".toml", ".yaml", ".yml", ".json", ".cfg", ".sh")
OUTPUT_OPTIONS = ("--out", "-o", "--output", "--output-dir", "--save")
SHELL_OPERATORS = ("&&", "||", ";", "|")


def _needs(block: Block) -> set[str]:
    """The files a block says the reader brings: ``# needs: train.py (your script), recipe.toml``."""
    found = set()
    for line in block.body.splitlines():
        said = re.match(r"^\s*(?:\$\s+)?#\s*needs:\s*(.+)$", line)
        if said:
            found.update(re.findall(r"[\w./-]+\.\w+", said.group(1)))
    return found


def _commands(block: Block) -> list[list[str]]:
    """The words of each command line of a shell block, and of each command quoted in one
    (``--resume-with 'python train.py ...'``, ``sh -c '...'``), comments dropped."""
    found = []

    def add(words: list[str]) -> None:
        found.append(words)
        for word in words:
            if " " in word.strip():
                try:
                    add(shlex.split(word, comments=True))
                except ValueError:
                    pass

    for line in _logical_lines(block.body):
        try:
            add(shlex.split(line, comments=True))
        except ValueError:  # a synopsis with an unbalanced bracket or quote
            add(line.split("#", 1)[0].split())
    return found


def _placeholder(word: str) -> bool:
    return any(mark in word for mark in ("{", "<", "$", "*", "..."))


def _input_files(words: list[str]) -> list[str]:
    """The words of one command that name a file it reads (see `INPUT_SUFFIXES`)."""
    files = []
    for i, word in enumerate(words):
        word = word.strip("[]")
        if word.startswith("-") or not word.endswith(INPUT_SUFFIXES) or _placeholder(word) or " " in word:
            continue
        if i > 0 and words[i - 1].split("=", 1)[0] in OUTPUT_OPTIONS:
            continue
        files.append(word)
    return files


def missing_files(block: Block, page_blocks: list[Block]) -> list[str]:
    """The files ``block`` names that the reader does not have (`test_every_file_an_example_names_is_given`)."""
    if block.language not in SHELLS or block.marker not in ("runnable", "illustrative"):
        return []
    given = {b.file_name for b in page_blocks if b.marker == "file"}
    needs, missing = _needs(block), []
    for words in _commands(block):
        for word in _input_files(words):
            name = word.split("/")[-1]
            if block.marker == "runnable" and name not in given:
                missing.append(f"{block.where}: {word} is no file block of the page")
            elif block.marker == "illustrative" and name not in given and word not in needs \
                    and name not in needs and not (ROOT / word).is_file():
                missing.append(f"{block.where}: {word} is neither given by the page nor named in a "
                               "'# needs:' line of the block")
    return missing


def test_every_file_an_example_names_is_given():
    """A runnable block's files are file blocks of its page (its folder holds nothing else); an
    illustrative block's are file blocks, files of the repository (``tests/scripts_invariant/...``),
    or named in its ``# needs:`` line, so that no example silently assumes a file the reader lacks."""
    assert [line for page in PAGES for block in blocks(page) for line in missing_files(block, blocks(page))] == []


def _declared_options(source: str) -> tuple[set[str], set[str]] | None:
    """The options a script's argparse declares, and those it requires; None when it declares
    none (no argparse: its words are its own business)."""
    declared, required = set(), set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
        declared.update(flags)
        if flags and any(k.arg == "required" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in node.keywords):
            required.add(flags[0])
    return (declared, required) if declared else None


def wrong_script_options(block: Block, page_blocks: list[Block]) -> list[str]:
    """The options ``block`` gives a script of its page that the script does not declare, and
    those it requires that the block leaves out."""
    if block.language not in SHELLS or block.marker not in ("runnable", "illustrative", "realcode"):
        return []
    scripts = {b.file_name: _declared_options(b.body) for b in page_blocks
               if b.marker == "file" and (b.file_name or "").endswith(".py")}
    wrong = []
    for words in _commands(block):
        for i, word in enumerate(words):
            options = scripts.get(word.split("/")[-1]) if word.endswith(".py") else None
            if options is None:
                continue
            declared, required = options
            given = []
            for arg in words[i + 1:]:
                if arg in SHELL_OPERATORS:
                    break
                if arg.startswith("--"):
                    given.append(arg.split("=", 1)[0])
            wrong += [f"{block.where}: {word} has no option {option}" for option in given
                      if option not in declared and not _placeholder(option)]
            wrong += [f"{block.where}: {word} requires {option}, which the example leaves out"
                      for option in sorted(required - set(given))]
    return wrong


def test_a_page_s_script_gets_only_options_it_declares_and_all_it_requires():
    """`python train.py --ckpt-dir X` where the page's train.py declares --ckpt-dir: an example
    that gives a script an option it lacks, or leaves out one it requires, fails as pasted."""
    assert [line for page in PAGES for block in blocks(page) for line in wrong_script_options(block, blocks(page))] == []


_PAGE = """# a page
```python file
# file: train.py
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--resume", default=None)
```

```sh runnable
samebits verify --resume-at 2 --resume-with 'python train.py --ckpt-dir {out} --resume {from}/s.pt' \\
  -- python train.py --out {out}
```

```console illustrative
$ samebits check --config recipe.toml --env
$ samebits check --config tests/conftest.py
```

```console illustrative
# needs: recipe.toml (your config)
$ samebits check --config recipe.toml --env
```
"""


def test_the_checks_name_a_missing_option_a_missing_file_and_accept_a_needs_line(tmp_path):
    """The two failures issue 35 met, on a page made for the test: `python train.py` without the
    `--ckpt-dir` its train.py requires (and with an --out it lacks), and a recipe.toml no block
    gives; the same config named in a `# needs:` line, and a file of the repository, pass."""
    page = ROOT / "docs" / "made-for-the-test.md"  # `where` is relative to the root; never written
    page_blocks = [Block(page, b.line, b.language, b.marker, b.exit_code, b.body)
                   for b in blocks(_write(tmp_path / "page.md", _PAGE))]
    options = [line for block in page_blocks for line in wrong_script_options(block, page_blocks)]
    assert options == ["docs/made-for-the-test.md:10: train.py has no option --out",
                       "docs/made-for-the-test.md:10: train.py requires --ckpt-dir, which the example leaves out"]
    files = [line for block in page_blocks for line in missing_files(block, page_blocks)]
    assert files == ["docs/made-for-the-test.md:15: recipe.toml is neither given by the page nor named in a "
                     "'# needs:' line of the block"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("block", [b for b in ALL if b.language == "python" and b.marker in ("file", "runnable")],
                         ids=lambda b: b.where)
def test_python_files_and_scripts_compile(block):
    compile(block.body, block.where, "exec")


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "2")
    for name in [n for n in env if n.startswith("SAMEBITS_") or n.startswith("PYTEST_")]:
        del env[name]  # a page's commands run as a user's shell would
    return env


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_blocks_run(page, tmp_path):
    """Every runnable block of the page, in order, in one fresh folder holding the page's files."""
    page_blocks = blocks(page)
    for block in page_blocks:
        if block.marker == "file":
            (tmp_path / block.file_name).write_text(block.body)
    env = _environment()
    for block in page_blocks:
        if block.marker != "runnable":
            continue
        if block.language == "python":
            argv = [sys.executable, "-c", block.body]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", "\n".join(_logical_lines(block.body))]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        said = (done.stdout + done.stderr)[-4000:]
        assert done.returncode == block.exit_code, (f"{block.where}: exit {done.returncode}, documented "
                                                    f"{block.exit_code}:\n{block.body}\n--- output:\n{said}")
