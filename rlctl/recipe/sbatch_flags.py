"""Which sbatch flags a list item of `slurm.sbatch_args` sets, read as sbatch reads it.

Each item becomes one `#SBATCH ITEM` line of the batch script. sbatch splits such a line into
words as its `_get_argument` does (whitespace separates, quotes group, a backslash escapes the
next character, an unquoted `#` ends the line) and hands the words to getopt_long. So one item
may hold several flags (`--exclusive -o/tmp/x`), a short flag may carry its value attached
(`-N5`) or sit in a cluster (`-vo/tmp/x`), and a long flag may be written abbreviated
(`--out=/tmp/x` is --output, when no other option starts so). `managed_flag` finds a flag of a
given set in all of these forms; a word that is only a value (`/tmp/x` after `--output`) is never
taken for a flag, but a value that looks like a managed flag is refused too: rlctl errs on the
side of refusing.
"""

from __future__ import annotations

SHORT_WITH_VALUE = frozenset("aABcCdDeFGiJLmMnNopqStwx")
"""sbatch's short options that take a value (its getopt string); the others take none."""
EXACT_LONG = frozenset({"--gpus", "--ntasks"})
"""sbatch options whose names begin longer ones (getopt_long takes an exact name as itself):
--gpus is not an abbreviation of --gpus-per-node, nor --ntasks of --ntasks-per-node."""


def sbatch_words(line: str) -> list[str]:
    """The words of an `#SBATCH` line after the directive, as sbatch splits them."""
    words: list[str] = []
    word: list[str] | None = None
    quote, escaped = "", False
    for c in line:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
            word = word if word is not None else []
            continue
        elif quote:
            if c == quote:
                quote = ""
                continue
        elif c in "\"'":
            quote, word = c, word if word is not None else []
            continue
        elif c == "#":
            break
        elif c.isspace():
            if word is not None:
                words.append("".join(word))
                word = None
            continue
        word = word if word is not None else []
        word.append(c)
    if word is not None:
        words.append("".join(word))
    return words


def _long_flag(word: str, managed: dict[str, str]) -> str | None:
    """The managed long flag `word` sets: its name exactly, or a beginning of exactly that name."""
    name = word.split("=", 1)[0]
    if name in managed:
        return name
    if name in EXACT_LONG or len(name) < 3:  # "--": the end of the options
        return None
    return next((flag for flag in managed if flag.startswith("--") and flag.startswith(name)), None)


def _short_flags(word: str, managed: dict[str, str]) -> str | None:
    """The managed flag a cluster of short flags (`-vN5`) sets, reading it as getopt does: each
    letter a flag, until one that takes a value (the rest of the word)."""
    for c in word[1:]:
        if f"-{c}" in managed:
            return f"-{c}"
        if c in SHORT_WITH_VALUE:
            return None
    return None


def managed_flag(item: str, managed: dict[str, str]) -> str | None:
    """The first flag of `managed` (flag -> what sets it instead; short and long forms) that the
    sbatch_args item sets, in any form sbatch reads; None if it sets none."""
    for word in sbatch_words(item):
        if word.startswith("--"):
            found = _long_flag(word, managed)
        elif word.startswith("-") and len(word) > 1:
            found = _short_flags(word, managed)
        else:
            continue
        if found is not None:
            return found
    return None
