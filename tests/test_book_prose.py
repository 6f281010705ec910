"""msrm_lab.prose: the scan for hand-typed numbers, on crafted snippets and on every book chapter."""
from __future__ import annotations

from pathlib import Path

import pytest

from msrm_lab.prose import load_allow_list, number_tokens, unexplained_numbers

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "book").glob("*.md"))


def toks(text: str) -> list[str]:
    return [t for _, t, _ in number_tokens(text)]


@pytest.mark.parametrize("text, expected", [
    ("a size of 2,727 nodes", ["2,727"]),
    ("took 0.46 s", ["0.46"]),
    ("a ratio of 1e133 and 2.5E-3", ["1e133", "2.5E-3"]),
    ("a factor of 8x, x8 and ×8 and 8×", ["8x", "x8", "×8", "8×"]),
    ("at 63 MB each", ["63"]),
    ("down by -2 and +3.5", ["-2", "+3.5"]),
    ("about 12% of it", ["12%"]),
    ("Matern 3/2 here", ["3/2"]),
    ("nine steps, five at K = 5.", ["5"]),
    ("the year 2026, twice", ["2026"]),
    ("(7) items", ["7"]),
    ("took 0.46s and 20ms, 63MB in all", ["0.46s", "20ms", "63MB"]),
])
def test_counts_each_token_form(text, expected):
    assert toks(text) == expected


@pytest.mark.parametrize("text", [
    "float64 on an H200 with cuda13 and AVX-512 or AVX2",
    "a Matérn-5/2 kernel and Matérn-3/2",
    "the 2nd and 3rd runs, x86_64, jaxlib 1.x, AR(1) draws, a 2D grid",
    "one-eighth of it, two of three",
    "the device cpu-amd-epyc-avx512-2c",
])
def test_identifiers_and_words_are_not_numbers(text):
    assert toks(text) == []


@pytest.mark.parametrize("text", [
    "---\ntitle: 12\nn: 3\n---\nprose",
    "```{code-cell} ipython3\nx = 2727\n```\nprose",
    "```\nplain 12\n```\nprose",
    "```python\nx = 12\n```\nprose",
    "~~~\n12\n~~~\nprose",
    "````{dropdown} How\n```{code-cell}\nx = 5\n```\nprose\n````",
    "$$\nx = 12\n$$\nprose",
    "inline $K = 5$ and $10^{-10}$ math",
    "math over a line break $a = 1 +\n2$ here",
    "inline `jax==0.10.2` code and ``a `3` b``",
    "a {glue:text}`g_12` role and {glue}`x_3` and {numref}`fig-2`",
    "(sec-12)=\n# Heading {#anchor-3}",
    "a [link](https://x.org/a/12) and <https://y.org/5> and https://z.org/7",
    "<!-- 12 hidden\n 13 too -->prose",
    "```{figure} figs/a12.png\n:name: fig-3\n:width: 90%\n\nThe caption.\n```",
    "1. first\n2. second",
    "{{ sub_12 }} and [^3]",
    ":::{note}\n:class: dropdown\nprose\n:::",
])
def test_each_exclusion_masks_its_numbers(text):
    assert toks(text) == []


def test_prose_inside_a_dropdown_and_after_blocks_is_scanned_with_line_numbers():
    text = ("# T\n\n```{code-cell}\nx = 1\n```\n\nLine six has 12 in it.\n"
            "````{dropdown} How the code does it\n:open:\n\nIt takes 7 steps.\n````\n$a$ then 9\n")
    found = number_tokens(text)
    assert [(n, t) for n, t, _ in found] == [(7, "12"), (11, "7"), (13, "9")]
    assert found[0][2] == "Line six has 12 in it."


def test_allow_list_parses_and_filters(tmp_path):
    allow = tmp_path / "_prose_allow.txt"
    allow.write_text("# comment\n\n3/2 | Matérn order\n")
    assert load_allow_list(allow) == {"3/2": "Matérn order"}
    chapter = tmp_path / "c.md"
    chapter.write_text("A Matérn 3/2 kernel took 4 s.\n")
    assert [t for _, t, _ in unexplained_numbers(chapter)] == ["4"]
    bad = tmp_path / "bad.txt"
    bad.write_text("3/2 without a reason\n")
    with pytest.raises(ValueError, match="line 1"):
        load_allow_list(bad)
    with pytest.raises(FileNotFoundError, match="chapter"):
        unexplained_numbers(tmp_path / "missing.md")
    with pytest.raises(TypeError, match="markdown_text"):
        number_tokens(b"bytes")


def test_the_book_allow_list_is_short_and_explained():
    allow = load_allow_list(ROOT / "book" / "_prose_allow.txt")
    assert len(allow) <= 12 and all(why for why in allow.values())


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_has_no_hand_typed_number(chapter):
    found = unexplained_numbers(chapter)
    lines = "\n".join(f"  line {n}: {tok!r} in: {ctx}" for n, tok, ctx in found)
    assert not found, (f"{chapter.name}: {len(found)} hand-typed number(s) in prose; glue them from rows or "
                       f"reference_rows, or add a definition to book/_prose_allow.txt:\n{lines}")
