"""mkdocs hooks (mkdocs.yml `hooks:`): the site's home page is README.md itself, so the front page has one source.

The README's links point into docs/ from the repository root (`docs/trainer.md`, `docs/img/demo.png`); on the site
the home page sits in docs/, so they become `trainer.md`, `img/demo.png`. Any other relative link would point
outside the site, and the strict build fails on it as on any broken link.
"""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
INTO_DOCS = re.compile(r"(\]\(|<img src=\")docs/")  # a markdown link or image, or an <img>, into docs/


def home_markdown(readme: str) -> str:
    """The README with its links into docs/ made relative to docs/."""
    return INTO_DOCS.sub(r"\1", readme)


def on_files(files, config):
    """Add index.md, generated from README.md (there is no docs/index.md to drift from it)."""
    files.append(File.generated(config, "index.md", content=home_markdown((ROOT / "README.md").read_text())))
    return files
