"""The package's shape, checked rather than drawn (docs/architecture.md): sizes, which layer may import which,
E(k) written once, no method replaced at run time. Each check reads the source with `ast`; none imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("cli", "convert", "native", "models")
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def package_files() -> list[Path]:
    """The package's modules: the root's and those of its sub-packages (tests and benchmarks aside)."""
    return sorted(list(ROOT.glob("*.py")) + [f for d in PACKAGE_DIRS for f in (ROOT / d).rglob("*.py")])


def module_name(f: Path) -> str:
    parts = f.relative_to(ROOT).with_suffix("").parts
    return ".".join(("specq",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def imported_modules(f: Path, executed: bool = False) -> set[str]:
    """Every module `f` imports, relative imports resolved (and `from X import name` as X.name too); `executed`:
    less those under `if TYPE_CHECKING:` (annotations only: they run nothing)."""
    package = module_name(f) if f.name == "__init__.py" else module_name(f).rsplit(".", 1)[0]
    tree = ast.parse(f.read_text(encoding="utf-8"))
    if executed:
        for node in ast.walk(tree):
            for field in ("body", "orelse"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    setattr(node, field, [n for n in block if not (isinstance(n, ast.If)
                                                                   and "TYPE_CHECKING" in ast.unparse(n.test))])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def under(f: Path, folder: str) -> bool:
    return f.relative_to(ROOT).as_posix().startswith(folder + "/")


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's body in lines, its docstring left out."""
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def test_no_class_over_300_lines_and_no_function_body_over_80():
    too_big = []
    for f in package_files():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            where = f"{f.relative_to(ROOT)}:{getattr(node, 'lineno', 0)} {getattr(node, 'name', '')}"
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"class {where}: {node.end_lineno - node.lineno + 1} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > MAX_FUNCTION_LINES:
                too_big.append(f"function {where}: {body_lines(node)} lines")
    assert not too_big, too_big


def test_only_the_c_boundary_imports_llama_cpp():
    offenders = [f.relative_to(ROOT).as_posix() for f in package_files()
                 if not under(f, "native/llama") and any(m.split(".")[0] == "llama_cpp" for m in imported_modules(f))]
    assert not offenders, offenders


def test_nothing_under_native_imports_convert():
    offenders = [f.relative_to(ROOT).as_posix() for f in package_files()
                 if under(f, "native") and any(m.startswith("specq.convert") for m in imported_modules(f))]
    assert not offenders, offenders


@pytest.mark.parametrize("layer", ["native/core", "native/runtime", "native/drafters", "native/control"])
def test_the_speculative_core_never_imports_the_server_or_the_commands(layer):
    """The core, its drafters and controllers look down only: never at the server, placement, the VRAM planner,
    chat or the other per-command libraries (native/commands), nor the CLI."""
    banned = ("specq.native.serving", "specq.native.commands", "specq.cli")
    offenders = {f.relative_to(ROOT).as_posix(): sorted(m for m in imported_modules(f) if m.startswith(banned))
                 for f in package_files() if under(f, layer)}
    assert not {f: m for f, m in offenders.items() if m}


def _expected_tokens_sites(f: Path) -> list[int]:
    """Lines that compute expected tokens from acceptances: the closed form (1 − α^(k+1)) / (1 − α), or the
    running product of per-position acceptances (`prod *= a`)."""
    sites = []
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and isinstance(node.right, ast.BinOp) \
                and isinstance(node.right.op, ast.Add) and isinstance(node.right.right, ast.Constant) \
                and node.right.right.value == 1:
            sites.append(node.lineno)
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Mult) and isinstance(node.target, ast.Name) \
                and isinstance(node.value, (ast.Name, ast.Subscript)):
            sites.append(node.lineno)
    return sites


def test_expected_tokens_are_written_once():
    sites = {f.relative_to(ROOT).as_posix(): _expected_tokens_sites(f) for f in package_files()}
    assert {f for f, lines in sites.items() if lines} == {"native/control/expected.py"}, sites


def test_no_method_is_replaced_at_run_time():
    """Library code never binds a method (or a lambda) to another object's attribute
    (`controller.verify_s = shared.verify_s`): behaviour is shared by passing objects, not by patching them."""
    trees = {f: ast.parse(f.read_text(encoding="utf-8")) for f in package_files()}
    methods = {fn.name for t in trees.values() for c in ast.walk(t) if isinstance(c, ast.ClassDef)
               for fn in c.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
               and not fn.name.startswith("__")}
    # a callback slot a class declares (`self.on_decode = None` in its own code) may be given a bound method
    declared = {el.attr for t in trees.values() for c in ast.walk(t) if isinstance(c, ast.ClassDef)
                for node in ast.walk(c) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for tg in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for el in (tg.elts if isinstance(tg, ast.Tuple) else [tg])
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self"}
    methods -= declared

    def is_method(value: ast.AST) -> bool:
        return isinstance(value, ast.Lambda) or (isinstance(value, ast.Attribute) and value.attr in methods)

    patched = []
    for f, t in trees.items():
        for node in ast.walk(t):
            if not isinstance(node, ast.Assign):
                continue
            for tg in node.targets:
                pairs = zip(tg.elts, node.value.elts) if isinstance(tg, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                    else [(tg, node.value)]
                patched += [f"{f.relative_to(ROOT)}:{node.lineno} .{el.attr}" for el, value in pairs
                            if isinstance(el, ast.Attribute) and el.attr in methods and is_method(value)]
    assert not patched, patched


def test_the_roots_modules_import_none_of_the_folders():
    """The root's modules (errors, atomic, manifest, machine) lie below every folder: any folder may import them,
    and they import no folder's module, lazily or not (atomic once reached up to native/llama, manifest to
    native/commands for the cache folder: one import circle through every layer)."""
    folders = tuple(f"specq.{d}" for d in PACKAGE_DIRS)
    found = {f.name: sorted(m for m in imported_modules(f) if m.startswith(folders)) for f in ROOT.glob("*.py")
             if f.name != "__init__.py"}  # the package's face, above everything (test_the_face_imports_only_the_api)
    assert {name: mods for name, mods in found.items() if mods} == {}


def test_the_face_imports_only_the_api():
    """`import specq` is the public API's face: it imports native/api.py (lazily, on first use of a public name)
    and the version, nothing else of the package's, so that `import specq` stays cheap and the API is its one
    door (every module reads the version from version.py, not from the face: no folder imports the face)."""
    assert imported_modules(ROOT / "__init__.py") == {"specq.native", "specq.native.api", "specq.version",
                                                      "specq.version.__version__"}


def folder(module: str) -> str:
    """A module's folder: native's sub-packages each one, the root's modules one, the package's face (its
    __init__: `import specq`) one above them all."""
    if module == "specq":
        return "face"
    parts = module.split(".")[1:]
    if parts[:1] == ["native"] and len(parts) > 1 and (ROOT / "native" / parts[1]).is_dir():
        return f"native/{parts[1]}"
    return parts[0] if parts and parts[0] in PACKAGE_DIRS else "root"


def folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for f in package_files():
        a = folder(module_name(f))
        for m in imported_modules(f, executed=True):
            if m.startswith("specq.") and folder(m) != a:
                graph.setdefault(a, set()).add(folder(m))
    return graph


def test_no_import_circle_between_folders():
    """Counted by folder (the root's modules one), lazy imports included and TYPE_CHECKING ones not, no two
    folders reach each other: primitives (core) below the drafters, the runtime above them, and so on up to the
    CLI, each layer readable and testable from below."""
    graph = folder_graph()

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in graph.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    circles = sorted({tuple(sorted((a, b))) for a in graph for b in reach(a) if a in reach(b) and a != b})
    assert circles == []
    assert "native/runtime" in reach("cli") and "native/drafters" in reach("native/runtime")  # the graph is real


def test_the_drafters_never_import_the_runtime():
    offenders = {f.relative_to(ROOT).as_posix(): sorted(m for m in imported_modules(f, executed=True)
                                                       if m.startswith("specq.native.runtime"))
                 for f in package_files() if under(f, "native/drafters") or under(f, "native/core")
                 or under(f, "native/control")}
    assert not {f: m for f, m in offenders.items() if m}
