"""The package's layering: no module imports in a circle (module-level and lazy imports alike),
and the runtime, the spec, the checks and the kernels never import the vLLM patches
(``vllm_xmix/_vllm_compat`` depends on them, not the other way round)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "vllm_xmix"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its body, with the packages whose
    ``__init__`` such an import runs."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                root = base[: len(base) - node.level + 1]
                mod = ".".join(root + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets.append(mod)
            targets += [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        for t in targets:
            parts = t.split(".")
            for k in range(1, len(parts) + 1):  # a.b.c runs a, a.b and a.b.c
                m = ".".join(parts[:k])
                if m in known and m != name:
                    found.add(m)
    return found


def _graph():
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_no_import_cycles():
    g = _graph()
    # a package's __init__ that re-exports its submodules is not a cycle with them
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in g.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    # the check sees real edges
    assert "vllm_xmix.runtime.layout" in g["vllm_xmix.runtime.state"]


def test_runtime_and_checks_do_not_import_the_patches():
    g = _graph()
    for m, deps in g.items():
        if m.startswith(("vllm_xmix.runtime", "vllm_xmix.spec", "vllm_xmix.validation", "vllm_xmix.kernels")):
            bad = {d for d in deps if d.startswith("vllm_xmix._vllm_compat")}
            assert not bad, f"{m} imports {bad}"
