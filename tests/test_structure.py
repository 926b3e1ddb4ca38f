"""The package's shape: imports only run down the layers below (so there is no cycle), no two modules name each other
(type-only imports included), and no function is long.

The layers, lowest first; a module may import only from lower layers. The package faces (``mfsdp_ext``,
``mfsdp_ext.comm``'s, ``mfsdp_ext.comm.symmetric``'s, ``mfsdp_ext.fp8``'s and ``mfsdp_ext.optim``'s ``__init__``) re-export and are exempt. Imports under ``if TYPE_CHECKING:`` do not run
and do not count.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mfsdp_ext"
LAYERS = [
    ["_C", "_native.build_config"],
    ["_native.jit"],
    ["_native", "layout", "mixed_precision", "states", "marks", "dtensor_norms", "replaced_params",
     "tensor_tree", "comm.hosts"],
    ["placements", "device"],
    ["flat_buffer", "comm.dist_ops", "comm.symmetric.comm", "fp8.tensor", "spmd_mesh"],
    ["comm.collectives", "fp8.linear"],
    ["comm.symmetric.collectives", "comm.native", "comm.copy_engine"],
    ["comm.symmetric.choose", "group_grads"],
    ["param_group"],
    ["context", "summary", "fp8.group", "finite_grads", "same_model", "step_prefetch"],
    ["reduction", "capture"],
    ["unit"],
    ["module"],
    ["checkpoint"],
    ["shard_init"],
    ["api"],
    ["as_fsdp2"],
    ["optim.flat_state"],
    ["optim.base"],
    ["optim.adamw", "optim.sgd"],
    ["graphs"],
]
FACES = {"__init__", "comm", "comm.symmetric", "fp8", "optim"}
MAX_FUNCTION_LINES = 60
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


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
    package = name.split(".")[:-1] if path.name != "__init__.py" else [p for p in name.split(".") if p != "__init__"]
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
    return {m.split(".")[-1] if m.endswith("._C") else m for m in out}


def test_every_module_has_a_layer():
    modules = _modules()
    missing = sorted(set(modules) - set(LAYER_OF) - FACES)
    assert not missing, f"add these modules to LAYERS in {__file__}: {missing}"


def test_imports_run_down_the_layers_only():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name in FACES:
            continue
        for target in _imports(name, path, modules):
            if target in FACES or LAYER_OF.get(target, -1) >= LAYER_OF[name]:
                upward.append(f"{name} -> {target}")
    assert not upward, f"imports that do not run down the layers: {sorted(upward)}"


def test_no_two_modules_name_each_other():
    """A lower module that needs a higher one's type takes a small protocol of its own instead."""
    modules = _modules()
    named = {name: _imports(name, path, modules, runtime_only=False) for name, path in modules.items()}
    pairs = sorted({tuple(sorted((a, b))) for a, targets in named.items() for b in targets
                    if a in named.get(b, ()) and a not in FACES and b not in FACES})
    assert not pairs, f"modules that import each other: {pairs}"


def test_no_long_functions():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long
