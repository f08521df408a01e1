"""Which environment variable names hold secrets: `slurm.env` refuses them, since a recipe is
copied into the run directory (recipe.yaml) that a project group may read.

A name is read as words: split at `_`, digits and camelCase humps (`GH_PAT` -> GH, PAT;
`githubToken` -> GITHUB, TOKEN). It is a secret's when a word is one of SECRET_WORDS, or a word
ends in a token or key word (`AUTHTOKEN`, `OPENAIAPIKEY`), or holds one of the words that mean
nothing else (`CLIENTSECRET`, `DBPASSWORD`). Whole words, so that PATH, PYTHONPATH, KEYBOARD,
MONKEY, TOKENIZERS_PARALLELISM and PASSTHROUGH stay ordinary names; PWD alone is the shell's
working directory, a secret only as a word of a longer name (MYSQL_PWD).
"""

from __future__ import annotations

import re

SECRET_WORDS = frozenset(
    {
        "TOKEN",
        "TOKENS",
        "PAT",
        "PATS",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWORDS",
        "PASSWD",
        "PASS",
        "PASSPHRASE",
        "KEY",
        "KEYS",
        "APIKEY",
        "CREDENTIAL",
        "CREDENTIALS",
        "CREDS",
    }
)
"""Words that make a name a secret's on their own."""
SECRET_ENDINGS = ("TOKEN", "TOKENS", "APIKEY", "ACCESSKEY", "PRIVATEKEY")
"""A word ending so is a secret's (HFTOKEN, OPENAIAPIKEY); TOKENIZERS does not end so."""
SECRET_INSIDE = ("SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
"""A word holding one of these anywhere is a secret's: they mean nothing else."""
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")


def name_words(name: str) -> list[str]:
    """`name`'s words in capitals: split at `_`, digits and camelCase humps."""
    return [w.upper() for part in re.split(r"[_\d]+", name) for w in _WORDS.findall(part)]


def secret_name(name: str) -> bool:
    """Whether an environment variable named so holds a secret (a token, PAT, key, password or
    credential), by its words (module docstring)."""
    words = name_words(name)
    if len(words) > 1 and "PWD" in words:
        return True
    return any(w in SECRET_WORDS or w.endswith(SECRET_ENDINGS) or any(s in w for s in SECRET_INSIDE) for w in words)
