"""The README and docs/ pages (named by their path from the repository root): their text, sections and code blocks."""

import re
import textwrap
from functools import cache
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
# Every page, each after those it builds on: the order their Python examples run in (tests/project/test_readme.py).
DOCS = """pipeline hub backbones lora index training emoji data coco evaluation analysis conventions benchmarks
speed-gpu ablation shapes-runs"""
PAGES = ("README.md", *(f"docs/{name}.md" for name in DOCS.split()))
# The languages of the command blocks: each one must be run by a test (tests/project/test_documents.py).
COMMAND_LANGUAGES = ("bash", "sh", "console")


@cache
def text(page: str) -> str:
    """The whole text of `page`."""
    return (ROOT / page).read_text(encoding="utf-8")


@cache
def prose(page: str) -> str:
    """The text of `page` with every run of whitespace as one space: a sentence matches however its lines wrap."""
    return " ".join(text(page).split())


def texts(*pages: str) -> str:
    """The texts of `pages` one after another (every page when none is named)."""
    return "\n\n".join(text(page) for page in pages or PAGES)


def headings(markdown: str) -> list[tuple[int, int, str]]:
    """The headings of Markdown text as (line index, level, title), code blocks' `#` comments left out."""
    found, fenced = [], False
    for index, line in enumerate(markdown.splitlines()):
        fenced = fenced != line.lstrip(" ").startswith("```")
        if not fenced and (match := re.match(r"(#+) (.*)", line)):
            found.append((index, len(match.group(1)), match.group(2).strip()))
    return found


def section(page: str, title: str) -> str:
    """The text of `page` under the heading `title` (without its #s), to the next heading of its level or above."""
    lines, found = text(page).splitlines(), headings(text(page))
    [(start, level)] = [(index, level) for index, level, heading in found if heading == title]
    end = next((index for index, depth, _ in found if index > start and depth <= level), len(lines))
    return "\n".join(lines[start + 1 : end]) + "\n"


def blocks(source: str, language: str) -> list[str]:
    """The code blocks of `language` in `source` (a page's path or Markdown text), indented ones dedented."""
    markdown = text(source) if source in PAGES else source
    found = re.findall(rf"^( *)```{language}\n(.*?)^\1```", markdown, flags=re.DOTALL | re.MULTILINE)
    return [textwrap.dedent(code) for _, code in found]


def block(page: str, title: str, language: str = "bash") -> str:
    """The one code block of `language` under the heading `title` of `page`."""
    [found] = blocks(section(page, title), language)
    return found
