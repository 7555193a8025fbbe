"""The simple commands of a RUN instruction, as a shell would split them.

What a RUN step installs (pip: pipwords.py, apt: aptwords.py) is read from its words before
the build. This is where those words come from: the line tokenized as a POSIX shell would
(quotes, separators, redirections), `VAR=value` and wrappers (`sudo`, `env -i`, `exec` ...)
before a program dropped, and `sh -c "..."` read as a line of its own.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator, Sequence

WRAPPERS = {"sudo", "exec", "time", "nice", "nohup", "command", "env", "xargs"}
SHELLS = {"sh", "bash", "dash"}
_SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", "{", "}", "!", "\n"}
_REDIRECTS = {">", ">>", "<", "<<", ">&", "<&", "&>", ">|"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def simple_commands(value: Sequence[str], json_form: bool) -> Iterator[list[str]]:
    """Each simple command of one RUN instruction (its words as BuildKit parsed them), its
    program first."""
    lines = [list(value)] if json_form else _split(" ".join(value))
    for words in lines:
        while words and (_ASSIGNMENT.match(words[0]) or os.path.basename(words[0]) in WRAPPERS
                         or (words[0].startswith("-") and len(words) > 1)):
            words = words[1:]  # VAR=value, sudo, env -i ... before the program
        if not words:
            continue
        if os.path.basename(words[0]) in SHELLS and len(words) >= 3 and words[1] == "-c":
            yield from simple_commands([words[2]], False)
        else:
            yield words


def _split(text: str) -> Iterator[list[str]]:
    """Words between separators, redirections left out (a backslash-newline joins lines)."""
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    skip = False
    try:
        for token in lexer:
            if skip:
                skip = False
            elif token in _SEPARATORS:
                if words:
                    yield words
                words = []
            elif token in _REDIRECTS or (token and token.strip("<>&|") == ""):
                if words and words[-1].isdigit():  # 2>&1: the 2 is the redirection's
                    words.pop()
                skip = True
            else:
                words.append(token)
    except ValueError:  # an unbalanced quote: BuildKit's shell would fail on it too
        pass
    if words:
        yield words
