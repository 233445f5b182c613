"""The documentation site, built once (strict, as `make docs`, about 7 s): it loads nothing from off this machine
(no web fonts, scripts or stylesheets fetched when a page is viewed), its home page is README.md, and the API page
renders. Skipped without the [docs] extra."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import ROOT

pytest.importorskip("mkdocs")
pytest.importorskip("material")

# an element that makes the browser fetch: a script, a stylesheet, a font, a preconnect, an image, a frame
FETCHING_TAG = re.compile(r"<(script|link|img|iframe|source|video|audio|embed|object)\b[^>]*>", re.I)
URL_ATTR = re.compile(r"""\b(src|href|data|srcset)\s*=\s*["']?\s*(https?:)?//""", re.I)
CSS_REMOTE = re.compile(r"""(@import\s+(url\()?\s*["']?|url\(\s*["']?)\s*(https?:)?//""", re.I)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    out = tmp_path_factory.mktemp("site")
    cfg = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True)
    build(cfg)  # strict: a broken link or anchor raises instead of building
    cfg.plugins.on_shutdown()
    return out


def remote_loads(site: Path) -> list[str]:
    """Every place in the built site where a page would fetch something from http(s) or a //host URL."""
    found = []
    for page in site.rglob("*.html"):
        text = page.read_text(errors="replace")
        for tag in FETCHING_TAG.finditer(text):
            if URL_ATTR.search(tag.group(0)):
                found.append(f"{page.relative_to(site)}: {tag.group(0)[:160]}")
        for style in re.findall(r"<style\b[^>]*>(.*?)</style>", text, re.S | re.I):
            found += [f"{page.relative_to(site)}: inline style {m.group(0)}" for m in CSS_REMOTE.finditer(style)]
        if re.search(r"""class=["'][^"']*\bmermaid\b""", text):  # material's bundle then loads mermaid from unpkg
            found.append(f"{page.relative_to(site)}: a mermaid diagram (fetched from unpkg.com)")
    for css in site.rglob("*.css"):
        text = css.read_text(errors="replace")
        found += [f"{css.relative_to(site)}: {m.group(0)}" for m in CSS_REMOTE.finditer(text)]
    return found


def test_the_site_loads_nothing_from_off_this_machine(site):
    assert not remote_loads(site), remote_loads(site)


def test_the_scan_sees_a_web_font_and_a_remote_script(tmp_path):
    # what mkdocs-material writes with its default theme.font, and a CDN script: the scan must name both
    (tmp_path / "a.html").write_text(
        '<link rel="preconnect" href="https://fonts.gstatic.com" crossorigin>\n'
        '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">\n'
        '<script src="//cdn.example.org/x.js"></script><a href="https://example.org/">a link is fine</a>')
    (tmp_path / "b.css").write_text('@import url("https://fonts.googleapis.com/css?family=Roboto");'
                                    'a{background:url("data:image/svg+xml;utf8,<svg xmlns=\'http://www.w3.org/2000/svg\'/>")}')
    found = remote_loads(tmp_path)
    assert len(found) == 4 and sum(f.startswith("b.css") for f in found) == 1, found  # the link and data: URI pass


def test_no_setting_makes_the_theme_fetch(site):
    from mkdocs.config import load_config

    cfg = load_config(str(ROOT / "mkdocs.yml"))
    assert cfg.theme["font"] is False  # else mkdocs-material links Google Fonts into every page
    assert not cfg.repo_url  # else its bundle asks api.github.com for the repository's stars
    assert not [u for u in list(cfg.extra_css) + [str(s) for s in cfg.extra_javascript] if "//" in u]


def test_the_home_page_is_the_readme_with_its_links_into_the_site(site):
    home = (site / "index.html").read_text()
    readme = (ROOT / "README.md").read_text()
    first = readme.split("\n\n")[1].split("\n")[0]  # the README's first line of prose
    assert " ".join(first.replace("**", "").split()[:8]) in re.sub(r"<[^>]+>", "", home)
    assert 'href="docs/' not in home and 'src="docs/' not in home
    assert 'href="quickstart/"' in home and 'src="img/demo-curves-time.png"' in home


def test_the_api_page_renders_the_balance(site):
    api = (site / "api" / "index.html").read_text()
    assert 'id="hetero.core.balance.Balance"' in api


def test_the_api_page_shows_the_balances_arguments_as_a_table_with_their_meanings(site):
    api = (site / "api" / "index.html").read_text()
    start = api.index('id="hetero.core.balance.Balance"')
    table = api[start:api.index("</table>", start)]
    cells = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", table))
    for name, meaning in [("global_batch", "samples per step over every rank"), ("rebalance_every", "decide every K"),
                          ("micro_batch", "each rank runs its own count"), ("worker_id", "identity")]:
        assert name in cells and meaning in cells, (name, cells[:400])
    assert 'id="hetero.core.engine.Engine"' in api  # the extension surface, apart from the user's verbs


def test_the_api_page_lists_the_extension_surface_apart_with_its_args_returns_and_raises(site):
    """Issue 46: the extension surface is a short, named list (the front's host verbs and three engine verbs), each
    entry with its sections; the engine renders those three and none of its own insides."""
    api = (site / "api" / "index.html").read_text()
    surface = api[api.index('id="the-extension-surface"'):api.index('id="migrating"')]
    engine = surface[surface.index('id="hetero.core.engine.Engine"'):]
    shown = set(re.findall(r'id="hetero\.core\.engine\.Engine\.(\w+)"', engine))
    assert shown == {"micro", "running", "count_forward"}, shown

    def section(name: str) -> str:  # one entry's rendered text, to the next entry's heading
        start = surface.index(f'id="{name}"')
        end = re.compile(r'<h[1-6] id="').search(surface, start + 1)
        return re.sub(r"<[^>]+>", " ", surface[start:end.start() if end else None])
    front = "hetero.core.balance.Balance."
    for name, parts in [(front + "begin_step", ("Parameters:", "Returns:", "Raises:")),
                        (front + "end_step", ("Returns:", "Raises:")),
                        (front + "set_weight", ("Parameters:", "Raises:")),
                        (front + "mark_backward", ("Raises:",)),
                        (front + "position", ()), (front + "workers", ()),
                        ("hetero.core.records.Position", ("steps_per_epoch",)),
                        ("hetero.core.engine.Engine.micro", ("Parameters:", "Returns:", "Raises:")),
                        ("hetero.core.engine.Engine.running", ("Parameters:", "Returns:", "Raises:")),
                        ("hetero.core.engine.Engine.count_forward", ("Parameters:", "Raises:"))]:
        text = section(name)
        assert all(p in text for p in parts), (name, parts, text[:300])
    user = api[api.index('id="the-users-verbs"'):api.index('id="the-extension-surface"')]
    assert f'id="{front}begin_step"' not in user and f'id="{front}step"' in user  # each entry rendered once
