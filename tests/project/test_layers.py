"""The package's four layers, from its import graph: the core imports nothing from the integrations, the trainer or
the lab; the integrations and the trainer only the core. And the core alone loads none of the
lab's or the trainer's libraries."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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
    each with its Args / Returns / Raises for the API page; issue 49 the split by tokens (collator, attention,
    loss_mean, max_tokens, batch_sampler's lengths); issue 51 the loss weighting (weighting, backward): under 330
    lines (docstrings included), at most 27 public names."""
    import inspect

    from hetero import Balance

    lines, _ = inspect.getsourcelines(Balance)
    public = [n for n in vars(Balance) if not n.startswith("_")]
    assert len(lines) < 330, len(lines)
    assert len(public) <= 27, public


# -- issue 46: the floor under the front ------------------------------------------------------------------------
# What an integration may call on the engine (docs/api.md, the extension surface); everything else goes through the
# Balance's own verbs (bal.position, bal.set_weight, bal.begin_step, ...).
EXTENSION_SURFACE = {"micro", "running", "count_forward"}


def _public_names(path: Path, cls: str) -> set[str]:
    """A class's public names: methods, properties and `self.X =` targets without a leading underscore."""
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = {f.name for f in node.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self" \
                        and not e.attr.startswith("_"):
                    names.add(e.attr)
    return names


def test_the_engine_and_the_plan_are_small():
    """Issue 46: Engine had 28 public names and Plan 34; the parts beneath keep their state private. Issue 51 added
    the engine's `backward` (bal.backward: the loss door's weighted backward)."""
    engine = _public_names(PKG / "core" / "engine.py", "Engine")
    plan = _public_names(PKG / "core" / "plan.py", "Plan")
    assert len(engine) <= 11, sorted(engine)
    assert len(plan) <= 12, sorted(plan)
    assert EXTENSION_SURFACE <= engine


def test_nothing_outside_the_core_reaches_into_the_engine():
    """Outside hetero/core: no `.engine.plan` (or `.engine.link`), and `.engine.X` only for X in the documented
    extension surface; at most 4 such calls in all, each in an integration."""
    import re

    reach = re.compile(r"\.engine\.([A-Za-z_]+)")
    calls = []
    for path in sorted(PKG.rglob("*.py")):
        if path.is_relative_to(PKG / "core"):
            continue
        for ln, line in enumerate(path.read_text().splitlines(), 1):
            calls += [(str(path.relative_to(ROOT)), ln, m.group(1)) for m in reach.finditer(line)]
    assert all(name in EXTENSION_SURFACE for _, _, name in calls), calls
    assert all(f.startswith("hetero/integrations/") for f, _, _ in calls), calls
    assert len(calls) <= 4, calls


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_graph(layer: str) -> dict[str, set[str]]:
    """A layer's modules -> the modules of the same layer each imports, wherever the import stands (ast.walk sees a
    function's own imports too: a circle closed inside a function is a circle). An import of a module's own package
    (`from . import x`) names the package only to reach x: it is no edge to the package's __init__."""
    files = {_module_name(p): p for p in sorted((PKG / layer).rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # its packages
        graph[name] = {m for m in _imports(path) if m in files and m != name and m not in own}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        part.append(m)
                        if m == node:
                            break
                    if len(part) > 1:
                        out.append(sorted(part))
    return out


def test_no_layer_has_an_import_circle_not_even_through_a_function_local_import():
    """Issue 46: every layer's import graph, function-local imports included, has no strongly connected component of
    more than one module (a circle closed by an import inside a function is still a circle)."""
    found = {layer: _circles(_layer_graph(layer)) for layer in ALLOWED}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_the_circle_finder_sees_a_circle_closed_inside_a_function(tmp_path):
    # the rule above must be able to fail: a -> b at the top, b -> a inside a function, c apart
    pkg = tmp_path / "hetero" / "trainer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .c import x\n")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("from . import c\n\ndef f():\n    from .a import g\n    return g\n")
    (pkg / "c.py").write_text("x = 1\n")
    global ROOT, PKG
    saved, ROOT, PKG = (ROOT, PKG), tmp_path, tmp_path / "hetero"
    try:
        graph = _layer_graph("trainer")
    finally:
        ROOT, PKG = saved
    assert graph["hetero.trainer.b"] == {"hetero.trainer.a", "hetero.trainer.c"}
    assert _circles(graph) == [["hetero.trainer.a", "hetero.trainer.b"]]
    assert _circles({"x": {"y"}, "y": {"z"}, "z": set()}) == []


# the cases that launch processes
@pytest.mark.launch
def test_importing_the_core_loads_none_of_the_lab_or_trainer_libraries():
    # measured against `import torch` alone: torch itself imports tqdm when it is installed (as it is here)
    libs = ("pandas", "matplotlib", "seaborn", "papermill", "yaml", "torchvision", "tqdm", "lightning", "transformers",
            "accelerate", "IPython", "PIL")
    code = (f"import sys, torch; before = set(sys.modules); import hetero; hetero.Balance; hetero.HeteroError; "
            f"import hetero.core.fsdp; print(sorted(m for m in {libs!r} if m in sys.modules and m not in before))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
