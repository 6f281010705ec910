"""Find hand-typed numbers in the book's prose.

Every measured figure in a chapter comes from a results row through ``myst_nb.glue``; a number typed into the
prose goes stale when the rows change. :func:`number_tokens` masks everything that is not prose, then returns each
standalone number token that is left, with its line number and the line it stands in.

Masked (never counted):

- the YAML front matter at the top of the file;
- fenced blocks whose content is code: a fence with no info string, a language name, or one of the directives in
  :data:`CODE_DIRECTIVES` (``{code-cell}``, ``{code}``, ``{math}``, ...), with backtick, tilde or colon fences of
  any length. Other directives (``{dropdown}``, ``{note}``, ``{admonition}``...) hold prose: only their fence lines
  and their ``:key: value`` option lines are masked;
- ``$$...$$`` display math and ``$...$`` inline math;
- inline code ```...``` and every role with its target (``{glue:text}`key```, ``{numref}`fig```...);
- ``(label)=`` targets, heading anchors ``{#anchor}``, link targets ``](...)``, reference definitions
  ``[name]: url``, bare URLs, HTML comments and tags, substitutions ``{{ name }}``, footnote marks ``[^1]``;
- ordered-list markers (``1.`` at the start of a line).

Counted: digits with optional ``,`` thousands separators, a decimal part, an exponent (``1e133``), a leading sign,
a trailing ``%`` or a unit of :data:`UNITS` written against it (``0.46s``, ``63MB``), a fraction ``3/2``,
and the multiplier forms ``8x``, ``8×``, ``x8``, ``×8``. Digits that are part
of an identifier are not standalone: a letter, digit, ``_`` or identifier joiner (``-``, ``.``, ``/`` after a
letter, ``(`` after a letter) directly before them, or a letter directly after them (``float64``, ``H200``,
``cuda13``, ``Matérn-5/2``, ``AVX-512``, ``AR(1)``, ``2nd``, ``1.x``).

:func:`unexplained_numbers` drops the tokens listed in the allow-list (``book/_prose_allow.txt``, one
``token | why`` a line, ``#`` comments), which is for small definitions, never for measurements.
"""
from __future__ import annotations

import re
from pathlib import Path

__all__ = ["CODE_DIRECTIVES", "UNITS", "ALLOW_LIST_NAME", "mask_non_prose", "number_tokens", "load_allow_list",
           "unexplained_numbers"]

ALLOW_LIST_NAME = "_prose_allow.txt"

#: Directives whose body is code or data, not prose: masked whole.
CODE_DIRECTIVES = frozenset({
    "code-cell", "code", "code-block", "sourcecode", "literalinclude", "math", "raw", "eval-rst", "glue:figure",
    "glue:math", "csv-table", "mermaid", "graphviz",
})
#: Directives whose argument is a path, not a title.
_PATH_ARGUMENT = frozenset({"figure", "image", "include", "literalinclude"})

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,}|:{3,})(?P<info>.*)$")
_OPTION = re.compile(r"^\s*:[\w.-]+:(\s.*)?$")
_LABEL = re.compile(r"^\s*\([^()\s]+\)=\s*$")
_LIST_MARKER = re.compile(r"^(\s*)(\d+)([.)])(?=\s)", re.M)

# Inline spans masked in the text that survives the line pass, in this order.
_INLINE = [
    re.compile(r"<!--.*?-->", re.S),                                   # HTML comments
    re.compile(r"(\{[^{}\s`]+\})?(`+)(?!`)(?:(?!\n\s*\n).)+?(?<!`)\2(?!`)", re.S),  # roles + inline code
    re.compile(r"\$\$.*?\$\$", re.S),                                  # display math
    re.compile(r"(?<!\\)\$(?!\s)(?:\\.|[^$\\\n]|\n(?!\s*\n))+?(?<!\\)\$"),  # inline math
    re.compile(r"\{\{.*?\}\}", re.S),                                  # substitutions
    re.compile(r"\{#[^}]*\}"),                                         # heading anchors
    re.compile(r"\]\([^)]*\)"),                                        # link targets
    re.compile(r"^\s*\[[^\]]+\]:\s*\S+.*$", re.M),                     # reference definitions
    re.compile(r"\[\^[^\]]+\]"),                                       # footnote marks
    re.compile(r"<https?://[^>]*>|https?://\S+"),                      # URLs
    re.compile(r"</?[A-Za-z][^<>]*>"),                                 # HTML tags
]

_NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?"
_TOKEN = re.compile(
    r"(?P<tok>"
    r"[x×]" + _NUM +                                   # x8, ×8
    r"|[+\-−±]?" + _NUM + r"(?:/\d+)?(?:%|[x×](?![\w])|×)?"   # 2,727  0.46  1e133  -2  3/2  12%  8x  8×
    r")"
)
#: Units that, written against a number (``0.46s``, ``63MB``), leave it a measurement rather than a name.
UNITS = frozenset({"s", "ms", "us", "µs", "ns", "h", "min", "d", "B", "KB", "kB", "MB", "GB", "TB", "KiB", "MiB",
                   "GiB", "TiB", "Hz", "kHz", "MHz", "GHz", "GFLOPS", "TFLOPS"})
_UNIT_TAIL = re.compile(r"([A-Za-zµ]+)(?![\w/])")
_IDENT_BEFORE = re.compile(r"[\w]$")
_JOINER = re.compile(r"[\w][-./(]$")


def _blank(s: str) -> str:
    """The same text with every character but newlines replaced by a space (keeps lines and columns)."""
    return re.sub(r"[^\n]", " ", s)


def _directive(info: str) -> tuple[str | None, str]:
    """``(name, argument)`` of a fence's info string: name ``None`` for a plain or language fence."""
    m = re.match(r"^\s*\{([^{}]+)\}\s*(.*)$", info)
    if m:
        return m.group(1).strip(), m.group(2)
    return None, info


def _mask_lines(lines: list[str]) -> list[str]:
    out = list(lines)
    i = 0
    if lines and lines[0].strip() == "---":  # YAML front matter
        for j in range(1, len(lines)):
            if lines[j].strip() in ("---", "..."):
                for k in range(0, j + 1):
                    out[k] = ""
                i = j + 1
                break
    stack: list[tuple[str, int]] = []  # open prose directives: (fence char, fence length)
    in_options = False
    while i < len(lines):
        line = lines[i]
        m = _FENCE.match(line)
        if m and stack and m.group("fence")[0] == stack[-1][0] and len(m.group("fence")) >= stack[-1][1] \
                and not m.group("info").strip():
            stack.pop()                       # closes the innermost prose directive
            out[i] = ""
            in_options = False
            i += 1
            continue
        if m and not (m.group("fence")[0] == "`" and "`" in m.group("info")):
            fence, info = m.group("fence"), m.group("info")
            name, arg = _directive(info)
            code = name is None or name in CODE_DIRECTIVES
            if fence[0] == ":" and name is None:
                code = False              # a bare colon line is not a fence
                m = None
            if m is not None and code:
                out[i] = ""
                j = i + 1
                while j < len(lines):
                    c = _FENCE.match(lines[j])
                    out[j] = ""
                    if c and c.group("fence")[0] == fence[0] and len(c.group("fence")) >= len(fence) \
                            and not c.group("info").strip():
                        break
                    j += 1
                i = j + 1
                continue
            if m is not None:
                stack.append((fence[0], len(fence)))
                keep = "" if name in _PATH_ARGUMENT else arg
                out[i] = " " * (len(line) - len(keep)) + keep if keep else ""
                in_options = True
                i += 1
                continue
        if _OPTION.match(line) or _LABEL.match(line):
            out[i] = ""
        elif in_options and not line.strip():
            in_options = False
        i += 1
    return out


def mask_non_prose(markdown_text: str) -> str:
    """The text with everything that is not prose blanked out (same lines, same columns)."""
    lines = markdown_text.split("\n")
    text = "\n".join(_mask_lines(lines))
    for pattern in _INLINE:
        text = pattern.sub(lambda m: _blank(m.group(0)), text)
    text = _LIST_MARKER.sub(lambda m: m.group(1) + " " * (len(m.group(2)) + 1), text)
    return text


def number_tokens(markdown_text: str) -> list[tuple[int, str, str]]:
    """Standalone number tokens in the prose: ``(line number from 1, token, the stripped source line)``."""
    if not isinstance(markdown_text, str):
        raise TypeError(f"markdown_text must be a str, got {type(markdown_text).__name__}")
    original = markdown_text.split("\n")
    found = []
    for n, line in enumerate(mask_non_prose(markdown_text).split("\n"), start=1):
        for m in _TOKEN.finditer(line):
            tok, start, end = m.group("tok"), m.start(), m.end()
            before, after = line[:start], line[end:]
            if _IDENT_BEFORE.search(before) or _JOINER.search(before):
                continue                      # H200, Matérn-5/2, AVX-512, v1.2
            if tok[0] in "+-−±" and before and not before[-1].isspace() and before[-1] not in "([{":
                continue
            unit = _UNIT_TAIL.match(after)
            if unit and unit.group(1) in UNITS:
                tok += unit.group(1)          # 0.46s, 63MB: a unit written against the number
            elif after[:1].isalnum() or after[:1] == "_" or re.match(r"\.[A-Za-z_]", after):
                continue                      # float64-like tails, 2nd, 1.x
            found.append((n, tok, original[n - 1].strip()))
    return found


def load_allow_list(path: str | Path) -> dict[str, str]:
    """``{token: why}`` from an allow-list file (``token | why`` a line; blank lines and ``#`` comments skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"allow-list path {str(path)!r} is not a file")
    allow: dict[str, str] = {}
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        token, sep, why = (part.strip() for part in line.partition("|"))
        if not sep or not token or not why:
            raise ValueError(f"allow-list {path.name} line {n}: expected 'token | why', got {raw!r}")
        allow[token] = why
    return allow


def unexplained_numbers(path: str | Path, allow: dict[str, str] | str | Path | None = None
                        ) -> list[tuple[int, str, str]]:
    """Number tokens of a chapter that the allow-list does not explain.

    ``allow`` is a ``{token: why}`` mapping or an allow-list path; by default ``_prose_allow.txt`` beside the
    chapter (no allow-list file means nothing is allowed).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chapter path {str(path)!r} is not a file")
    if allow is None:
        default = path.parent / ALLOW_LIST_NAME
        allow = load_allow_list(default) if default.is_file() else {}
    elif not isinstance(allow, dict):
        allow = load_allow_list(allow)
    return [t for t in number_tokens(path.read_text(encoding="utf-8")) if t[1] not in allow]
