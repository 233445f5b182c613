"""The package's four layers, from its import graph: the core imports nothing from the integrations, the trainer or
the lab; the integrations and the trainer only the core. And the core alone loads none of the
lab's or the trainer's libraries.
Here the cases in one process; those that launch processes: tests/integration/test_layers_launch.py."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hetero"
# what each layer may import from the package (besides itself and the top-level hetero/__init__.py)
ALLOWED = {"core": set(), "integrations": {"core"}, "trainer": {"core"}, "lab": {"core", "integrations", "trainer"}}


def _imports(path: Path) -> set[str]:
    """Absolute names of the hetero modules a file imports (relative imports resolved)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1]  # the file's package: ("hetero", "core") for hetero/core/x.py
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "hetero"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "hetero":
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}  # `from . import x` imports hetero.layer.x
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_module_sits_in_a_layer():
    loose = [p.name for p in PKG.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside the layers: {loose}"


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((PKG / layer).rglob("*.py")):
            for mod in _imports(path):
                other = _layer(mod)
                if other is not None and other != layer and other not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not wrong, "\n".join(wrong)


def test_the_import_checker_sees_a_relative_import_across_layers(tmp_path):
    # the rule above must be able to fail: a core module importing the trainer is seen as such
    (tmp_path / "hetero" / "core").mkdir(parents=True)
    bad = tmp_path / "hetero" / "core" / "bad.py"
    bad.write_text("from ..trainer.config import Config\nfrom . import partition\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert _imports(bad) == {"hetero.trainer.config", "hetero.trainer.config.Config", "hetero.core",
                                 "hetero.core.partition"}
    finally:
        ROOT = saved
    assert _layer("hetero.trainer.config") == "trainer"


def _names(reqs) -> set[str]:
    import re
    return {re.split(r"[<>=\[ ;]", r.strip(), maxsplit=1)[0].lower() for r in reqs}


def test_the_core_needs_torch_and_numpy_alone_and_environment_yml_agrees_with_pyproject():
    import tomllib
    import yaml
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _names(project["dependencies"]) == {"torch", "numpy"}
    extras = project["optional-dependencies"]
    pip_names = _names(project["dependencies"]) | {n for reqs in extras.values() for n in _names(reqs)
                                                    if n != "hetero"}
    if "mkdocstrings" in pip_names:  # pip's mkdocstrings[python] is conda's mkdocstrings-python
        pip_names = pip_names - {"mkdocstrings"} | {"mkdocstrings-python"}
    if "ray" in pip_names:  # pip's ray[train] is conda-forge's ray-train
        pip_names = pip_names - {"ray"} | {"ray-train"}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    conda = {{"pytorch": "torch"}.get(n, n) for n in _names(d for d in env if isinstance(d, str))} - {"python", "pip"}
    assert conda == pip_names, (conda - pip_names, pip_names - conda)


def _core_graph() -> dict[str, set[str]]:
    """hetero.core's modules -> the core modules each imports (TYPE_CHECKING blocks included: ast sees them)."""
    core = {p.stem for p in (PKG / "core").glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name in core:
        mods = _imports(PKG / "core" / f"{name}.py")
        graph[name] = {m.split(".")[2] for m in mods if m.startswith("hetero.core.") and m.split(".")[2] in core}
    return graph


def test_no_part_of_the_core_imports_the_front_or_the_package_root():
    """The parts beneath hetero.Balance (engine, plan, hook, guard, sampler, probe, fsdp, ...) never call up into it:
    none imports balance.py, not even for a type, and the core takes nothing from the package root."""
    graph = _core_graph()
    assert not [m for m, deps in graph.items() if "balance" in deps], graph
    rooted = [p.name for p in (PKG / "core").glob("*.py") if "hetero" in _imports(p) or any(
        m in {"hetero.__version__", "hetero.Balance"} for m in _imports(p))]
    assert not rooted, rooted


def test_the_core_import_graph_has_no_cycle():
    graph, done = _core_graph(), set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, " -> ".join([*path, m])
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, (*path, m))
        done.add(m)
    for m in sorted(graph):
        visit(m, ())
    assert graph["balance"] >= {"engine", "settings", "sampler"} and graph["engine"] >= {"plan"}  # top-down


def test_the_front_stays_thin():
    """Issue 33: the Balance class holds the user's verbs and delegates, the parts beneath it doing the work. Issue
    46 put the hosts' verbs on it (position, workers, world, set_weight, mark_backward; size and global_step went),
    each with its Args / Returns / Raises for the API page: under 295 lines (docstrings included) and at most 26
    public names."""
    import inspect

    from hetero import Balance

    lines, _ = inspect.getsourcelines(Balance)
    public = [n for n in vars(Balance) if not n.startswith("_")]
    assert len(lines) < 295, len(lines)
    assert len(public) <= 26, public
