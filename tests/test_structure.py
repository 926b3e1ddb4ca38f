"""The package's shape, checked: layers are folders and imports only run down them, no import cycle, no two modules
that name each other, few modules at the top, small classes with keyword-only constructors, short functions, and
docs/architecture.md's layer list equal to LAYERS.

A module of a package may import from the packages of lower layers and from its own package (without cycles). The
package faces (``__init__`` files) re-export and are exempt. Imports under ``if TYPE_CHECKING:`` do not run and count
only for "no two modules name each other".
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mfsdp_ext"
# Lowest first. "" is the top: the public API modules of mfsdp_ext itself; testing (the shared models) uses it.
LAYERS = ["_native", "core", "fp8", "comm", "params", "runtime", "sharding", "interop", "optim", "", "testing"]
MAX_TOP_MODULES = 6
MAX_FUNCTION_LINES = 60  # signature and code; the docstring is not counted (documenting is not a cost)
MAX_METHODS = 25
MAX_ATTRIBUTES = 25
MAX_POSITIONAL = 4  # a constructor's positional parameters besides self; the rest are keyword-only
# classes whose constructor is a torch class's, positional parameters included (a drop-in takes the same calls)
SAME_SIGNATURE_AS_TORCH = {"optim.adamw.AdamW": "torch.optim.AdamW", "optim.sgd.SGD": "torch.optim.SGD",
                           "fp8.linear.Fp8Linear": "torch.nn.Linear"}
LAYER_OF = {name: i for i, name in enumerate(LAYERS)}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name (relative to mfsdp_ext; a package by its own name) -> its file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts) or "__init__"] = path
    return found


def _is_face(name: str, path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _package_of(name: str) -> str:
    """The layer a module belongs to: its top folder under mfsdp_ext, or "" for a top-level module."""
    first = name.split(".")[0]
    return first if first in LAYER_OF and first else ("_native" if name == "_C" else "")


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: pathlib.Path, modules, runtime_only: bool = True) -> set[str]:
    """The package modules that ``name`` imports (at run time only, or also under ``if TYPE_CHECKING:``)."""
    package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
    if name == "__init__":
        package = []
    out = set()
    tree = ast.parse(path.read_text())
    for node in _runtime_nodes(tree) if runtime_only else ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "mfsdp_ext":
                base = []
            else:
                continue
            mod = (node.module or "").split(".")
            mod = mod[1:] if not node.level and mod[0] == "mfsdp_ext" else mod
            target = ".".join(base + [m for m in mod if m])
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                out.add(sub if sub in modules or alias.name == "_C" else target or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mfsdp_ext."):
                    out.add(alias.name[len("mfsdp_ext."):])
    out.discard(name)
    return {"_C" if m.endswith("_C") else m for m in out}


def _graph(runtime_only: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, runtime_only) for name, path in modules.items()}


def test_every_module_is_in_a_layer():
    strays = [name for name in _modules() if "." not in name and name not in LAYER_OF and name != "__init__"
              and not (PACKAGE / f"{name}.py").exists()]
    assert not strays, f"add these packages to LAYERS in {__file__}: {strays}"
    top = sorted(name for name, path in _modules().items() if "." not in name and path.parent == PACKAGE
                 and path.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, f"the top of mfsdp_ext holds the public API only: {top}"


def test_imports_run_down_the_layers_only():
    modules = _modules()
    upward = []
    for name, targets in _graph().items():
        if _is_face(name, modules[name]):
            continue
        own = _package_of(name)
        for target in targets:
            there = _package_of(target)
            if there != own and LAYER_OF[there] >= LAYER_OF[own]:
                upward.append(f"{name} -> {target}")
            elif there == own == "" and target != "__init__" and _is_face(target, modules.get(target, PACKAGE)):
                upward.append(f"{name} -> {target}")
    assert not upward, f"imports that do not run down the layers: {sorted(upward)}"


def test_no_import_cycle():
    graph = {n: {t for t in ts if t in _modules()} for n, ts in _graph().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    faces = {n for n, p in _modules().items() if _is_face(n, p)}
    cycles = [c for c in cycles if not any(part in faces for part in c.split(" -> "))]
    assert not cycles, cycles


def test_no_two_modules_name_each_other():
    """A lower module that needs a higher one's type takes a small protocol of its own instead."""
    modules = _modules()
    named = _graph(runtime_only=False)
    faces = {n for n, p in modules.items() if _is_face(n, p)}
    pairs = sorted({tuple(sorted((a, b))) for a, targets in named.items() for b in targets
                    if a in named.get(b, ()) and a not in faces and b not in faces})
    assert not pairs, f"modules that import each other: {pairs}"


def class_sizes() -> list[tuple[str, int, int, int]]:
    """(class, methods, attributes, constructor positional parameters) of every class in the package."""
    rows = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            attributes = {t.id for n in node.body for t in _targets(n) if isinstance(t, ast.Name)}
            for method in methods:
                for n in ast.walk(method):
                    attributes |= {t.attr for t in _targets(n) for t in ast.walk(t) if isinstance(t, ast.Attribute)
                                   and isinstance(t.value, ast.Name) and t.value.id == "self"}
            init = next((m for m in methods if m.name == "__init__"), None)
            positional = len(init.args.posonlyargs) + len(init.args.args) - 1 if init is not None else 0
            rows.append((f"{name}.{node.name}", len(methods), len(attributes), positional))
    return rows


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def test_small_classes_with_keyword_only_constructors():
    big = [f"{c}: {m} methods, {a} attributes" for c, m, a, _ in class_sizes() if m > MAX_METHODS or a > MAX_ATTRIBUTES]
    assert not big, f"split these classes by responsibility: {big}"
    wide = [f"{c}: {p} positional" for c, _, _, p in class_sizes()
            if p > MAX_POSITIONAL and c not in SAME_SIGNATURE_AS_TORCH]
    assert not wide, f"make the extra constructor parameters keyword-only (or take a policy object): {wide}"


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    value = first.value if isinstance(first, ast.Expr) else None
    is_doc = isinstance(value, ast.Constant) and isinstance(value.value, str)
    return first.end_lineno - first.lineno + 1 if is_doc else 0


def test_no_long_functions():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_architecture_page_lists_the_layers():
    """docs/architecture.md's layer line names LAYERS in order, and its folder list names every package."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    line = re.search(r"^Layers, lowest first: (.*)$", page, re.M)
    assert line is not None, "docs/architecture.md lost its 'Layers, lowest first: ...' line"
    named = [p.strip().strip("`").rstrip("/") for p in line.group(1).rstrip(".").split(" < ")]
    assert named == [p or "the top modules" for p in LAYERS], (named, LAYERS)
    for name in LAYERS:
        if name:
            assert f"  {name}/" in page, f"docs/architecture.md's folder list misses {name}/"


def import_levels() -> int:
    """The longest chain of run-time imports inside the package (a figure of how deep the house is)."""
    graph = {n: {t for t in ts if t in _modules()} for n, ts in _graph().items()}
    depth: dict[str, int] = {}

    def level(node: str) -> int:
        if node not in depth:
            depth[node] = 0  # cycles are caught by test_no_import_cycle
            depth[node] = 1 + max((level(t) for t in graph.get(node, ())), default=0)
        return depth[node]

    return max(level(n) for n in graph)


if __name__ == "__main__":  # the figures: python3 tests/test_structure.py
    mods = _modules()
    folders: dict[str, int] = {}
    for path in mods.values():
        folders[str(path.parent.relative_to(ROOT))] = folders.get(str(path.parent.relative_to(ROOT)), 0) + 1
    print("files per folder:", dict(sorted(folders.items())))
    print("import levels:", import_levels())
    c, m, a, p = max(class_sizes(), key=lambda r: (r[1] + r[2]))
    print(f"largest class: {c} ({m} methods, {a} attributes, {p} positional)")


def test_public_functions_document_args_and_raises():
    """Each public function of ``mfsdp_ext`` says what it takes (``Args:``) or returns (``Returns:``), and what it
    raises (``Raises:``) when its own body raises."""
    import inspect
    import textwrap

    import mfsdp_ext

    missing = []
    for name in mfsdp_ext.__all__:
        obj = getattr(mfsdp_ext, name)
        if not inspect.isfunction(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        body = ast.parse(textwrap.dedent(inspect.getsource(obj)))
        raises = any(isinstance(n, ast.Raise) for n in ast.walk(body))
        if not ("Args:" in doc or "Returns:" in doc) or (raises and "Raises:" not in doc):
            missing.append(name)
    assert not missing, f"public functions without Args:/Returns:/Raises: sections: {missing}"
