"""Every link between the project's Markdown pages resolves on GitHub and on the site: the file
exists and its anchor is a heading's slug as GitHub makes it (lower case, punctuation dropped,
each space a hyphen, repeats numbered), which mkdocs.yml's toc also uses (pymdownx.slugs)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def github_slug(text: str) -> str:
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its words
    text = text.replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, seen, fence = set(), {}, False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        m = None if fence else HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path):
    fence = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield from LINK.findall(line)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if ROOT in dest.parents else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


def test_the_slug_is_githubs():
    assert github_slug("Fewer rounds at equal bytes (P = 16, `int8`)") == "fewer-rounds-at-equal-bytes-p--16-int8"
    assert github_slug("HiSo vs DeComFL: 1.4x") == "hiso-vs-decomfl-14x"


def test_the_user_docs_start_with_the_quickstart_and_hold_no_runbooks_or_issue_numbers():
    text = (ROOT / "mkdocs.yml").read_text()
    nav = [line.strip() for line in text[text.index("\nnav:"):].splitlines() if line.strip().startswith("- ")]
    assert nav[0] == "- Quickstart: quickstart.md"
    assert not any("gpu.md" in line for line in nav)  # a runbook for lent machines: bench/gpu.md
    user = [p for p in (ROOT / "docs").glob("*.md") if p.name not in ("results.md", "changelog.md")]
    cited = [f"{p.name}: {line.strip()[:80]}" for p in user for line in p.read_text().splitlines()
             if re.search(r"\bissues? #?\d+", line)]
    assert not cited, cited
