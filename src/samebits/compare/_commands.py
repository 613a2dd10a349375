"""Recorded command lines that differ only in where the two runs wrote (`--out runs/a` vs
`--out runs/b`): not a config difference, so the comparator notes it instead of refusing."""

from __future__ import annotations

import os
import re
import shlex


# Options whose value may be where a run writes (`--out`, `--ckpt-dir`, `--output-dir`,
# `--save-path`, `--log-dir`); a name alone proves nothing (`--log debug`, `--output softmax`,
# `--model-checkpoint bert-base`), so the value must also be a path the run wrote: on disk, inside
# the run's own folder.  Options that name what a run reads are never outputs.
_OUTPUT_OPTION = re.compile(r"^--?(?:[\w-]*[-_])?(?:out|output|outdir|ckpt|checkpoint|checkpoints|save|logdir|log|logs)"
                            r"(?:[-_](?:dir|path|folder|root|prefix|file|to))?$")
_INPUT_WORD = re.compile(r"resume|load|init|from|restore|pretrained|model|input|source|src|read", re.IGNORECASE)


def output_paths_only(command_a: str, command_b: str, run_a: str | os.PathLike | None = None,
                      run_b: str | os.PathLike | None = None) -> list[tuple[str, str, str]] | None:
    """The (option, a's value, b's value) where two recorded command lines differ, when they
    differ only in where the runs wrote: an output option by name (`--out`, never one that
    reads such as `--resume-from-checkpoint`) whose values are existing paths inside each
    run's own folder (``run_a``, ``run_b``).  None when anything else differs."""
    try:
        words_a, words_b = shlex.split(command_a), shlex.split(command_b)
    except ValueError:
        return None
    if len(words_a) != len(words_b):
        return None
    found = []
    for i, (word_a, word_b) in enumerate(zip(words_a, words_b)):
        if word_a == word_b:
            continue
        option_a, _, value_a = word_a.partition("=")
        option_b, _, value_b = word_b.partition("=")
        if "=" in word_a and "=" in word_b and option_a == option_b and option_a.startswith("-"):
            option = option_a  # --out=runs/a
        elif i > 0 and words_a[i - 1] == words_b[i - 1]:
            option, value_a, value_b = words_a[i - 1], word_a, word_b  # --out runs/a
        else:
            return None
        if not _OUTPUT_OPTION.match(option) or _INPUT_WORD.search(option) or _is_number(value_a) \
                or _is_number(value_b):
            return None  # an input or a setting (--save-at 4 vs 5 is a step, not a folder)
        if not (_written_by(value_a, run_a) and _written_by(value_b, run_b)):
            return None  # not a path this run wrote: a config difference (--log debug / warning)
        found.append((option, value_a, value_b))
    return found


def _written_by(value: str, run: str | os.PathLike | None) -> bool:
    """Whether ``value`` names a path on disk inside the run folder ``run`` (or the folder itself)."""
    if run is None or not value:
        return False
    try:
        path = os.path.realpath(os.path.expanduser(value))
        folder = os.path.realpath(run)
        return os.path.exists(path) and os.path.commonpath([path, folder]) == folder
    except (OSError, ValueError):
        return False


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
