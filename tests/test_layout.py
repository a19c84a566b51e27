"""The package's layout is its architecture: no import circles, nothing imported upwards,
a top level one can take in at a glance, and modules one reader can hold (issue 40)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "specui"
MAX_LINES = 350
MAX_TOP_MODULES = 10
# Lower floors never import higher ones. A package's own modules may import each other (but not
# in a circle). The old top-level paths kept for one release (specui.loading, specui.quantize)
# are shims above everything.
FLOORS = [
    {"errors"},
    {"settings"},
    {"heads"},
    {"engine"},
    {"weights"},
    {"chat"},
    {"service"},
    {"ui", "cli"},
    {"webapp"},
    {"bench"},
    {"train"},  # reads the bench's prompt sets and saves figures with its PNG writer
    {"loading", "quantize"},
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every specui module `path` imports, wherever the import sits (functions and
    TYPE_CHECKING blocks included): `from a.b import c` counts a.b.c where that is a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] == "specui" and name in known:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, known) - {m} for m, p in mods.items()}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "specui"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    edges = graph()
    # a package's __init__ importing its own modules is not a circle of responsibility
    assert cycles(edges) == []


def test_nothing_is_imported_upwards():
    upward = []
    for mod, deps in graph().items():
        if room(mod) == "specui":
            continue
        for dep in deps:
            if room(dep) != "specui" and FLOOR[room(dep)] > FLOOR[room(mod)]:
                upward.append(f"{mod} -> {dep}")
    assert upward == []


def test_every_room_has_a_floor():
    assert {room(m) for m in modules()} - {"specui"} <= set(FLOOR)


def test_the_engine_knows_nothing_of_loading():
    for mod, deps in graph().items():
        if room(mod) in ("engine", "heads"):
            assert not {d for d in deps if room(d) in ("weights", "service", "ui", "train", "bench")}, mod


def test_top_level_is_small_and_modules_fit_one_reader():
    top = [p for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= MAX_TOP_MODULES, sorted(p.name for p in top)
    long = {module_name(p): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_package_says_why_it_exists():
    for init in ROOT.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init.relative_to(ROOT.parent)} has no docstring saying what the package is"


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The checks above are not vacuous: a made-up graph with a circle is caught."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert FLOOR["engine"] < FLOOR["weights"] < FLOOR["service"]


def _text_mode(call: ast.Call) -> bool:
    """Whether an open(...) / Path.open(...) call opens a file as text (no "b" in a constant mode)."""
    positional = call.args[1:] if isinstance(call.func, ast.Name) else call.args
    modes = [a.value for a in positional[:1] if isinstance(a, ast.Constant)]
    modes += [k.value.value for k in call.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
    return "b" not in (modes[0] if modes else "r")


def unnamed_encodings(tree: ast.AST) -> list[int]:
    """The lines of `tree`'s read_text / write_text / text-mode open calls that name no encoding."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        opened = name == "open" and not (isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "os")
        if name in ("read_text", "write_text") or (opened and _text_mode(node)):
            lines.append(node.lineno)
    return lines


def test_every_text_file_is_read_and_written_as_utf8():
    """Text files (prompt sets, presets, caches, traces, READMEs) are UTF-8 whatever the machine's
    locale: Python's default encoding is the locale's (Latin-1 or cp1252 on some machines), where a
    prompt set or README with non-ASCII text would be misread or fail to write."""
    unspecified = [f"{path.relative_to(ROOT.parent)}:{line}"
                   for path in sorted(ROOT.rglob("*.py")) + [ROOT.parent / "app.py"]
                   for line in unnamed_encodings(ast.parse(path.read_text(encoding="utf-8")))]
    assert not unspecified, f"text files opened without encoding='utf-8': {unspecified}"
    made_up = 'p.read_text()\nopen(f, "w")\nopen(f, "rb")\nos.open(f, 0)\np.write_text(t, encoding="utf-8")\nf.open()'
    assert unnamed_encodings(ast.parse(made_up)) == [1, 2, 6]  # and the check is not vacuous
