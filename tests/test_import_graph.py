"""The package's import graph, read from the source: no module imports itself back through others,
the comparison core imports no adapter, every adapter module sits in a room of ``adapter.ROOMS`` and
imports only the rooms before its own.

Every import counts, the ones inside functions too: a lazy import keeps a start-up cheap, not a
circle harmless. The graph is read with ``ast`` (nothing is imported), so a failure names the file
and the line of the import that breaks the rule.
"""

import ast
import os

from ttrace_megatron.adapter import ROOMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ttrace_megatron"
ADAPTER = PACKAGE + ".adapter"
# above everything: the public face (its lazy training-loop API) and the command
TOP = {PACKAGE, PACKAGE + ".cli"}


def _modules():
    """{module name: (path, is a package)} of every module of the package."""
    out = {}
    for folder, _, files in os.walk(os.path.join(REPO, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                is_package = name.endswith(".__init__")
                out[name[:-len(".__init__")] if is_package else name] = (path, is_package)
    return out


def _imports(modules):
    """{module: [(imported module of the package, line)]}: ``from X import Y`` counts as Y where Y
    is a module, else as X."""
    graph = {}
    for name, (path, is_package) in modules.items():
        edges = []
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here[:len(here) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules and target != name:
                        edges.append((target, node.lineno))
            elif isinstance(node, ast.Import):
                edges += [(a.name, node.lineno) for a in node.names if a.name in modules and a.name != name]
        graph[name] = edges
    return graph


def _room(module):
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "adapter" else None


def _where(modules, module, line):
    return f"{os.path.relpath(modules[module][0], REPO)}:{line}"


def test_no_import_circle():
    modules = _modules()
    graph = {m: sorted({t for t, _ in edges}) for m, edges in _imports(modules).items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other (directly or through others): {circles}"


def test_the_core_imports_no_adapter():
    modules = _modules()
    wrong = [f"{_where(modules, m, line)} imports {t}" for m, edges in _imports(modules).items()
             if not m.startswith(ADAPTER) and m not in TOP for t, line in edges if t.startswith(ADAPTER)]
    assert not wrong, wrong


def test_every_adapter_module_is_in_a_room():
    modules = _modules()
    rooms = {m.split(".")[2] for m in modules if m.startswith(ADAPTER + ".")}
    assert rooms == set(ROOMS), f"adapter/ holds {sorted(rooms)}, adapter.ROOMS names {ROOMS}"
    loose = [m for m, (_, is_package) in modules.items()
             if m.startswith(ADAPTER + ".") and _room(m) is None and not is_package]
    assert not loose, f"adapter modules outside a room: {loose}"
    # a regular package each (find_packages ships only those), its docstring saying what the room holds
    for room in ROOMS:
        path, is_package = modules.get(f"{ADAPTER}.{room}", (None, False))
        assert is_package, f"adapter/{room}/ has no __init__.py"
        assert ast.get_docstring(ast.parse(open(path).read())), f"adapter/{room}/__init__.py says nothing of the room"


def test_a_room_imports_only_the_rooms_before_it():
    modules = _modules()
    wrong = []
    for m, edges in _imports(modules).items():
        if _room(m) is None:
            continue
        for target, line in edges:
            if _room(target) is not None and ROOMS.index(_room(target)) > ROOMS.index(_room(m)):
                wrong.append(f"{_where(modules, m, line)}: {m} ({_room(m)}) imports {target} ({_room(target)})")
            elif target in TOP:
                wrong.append(f"{_where(modules, m, line)}: {m} imports {target}, which imports the adapter")
    assert not wrong, "\n".join(wrong)


def test_the_graph_sees_function_level_imports():
    """The reader itself: a lazy import inside a function is an edge like any other."""
    modules = _modules()
    edges = dict(_imports(modules))
    session = [t for t, _ in edges[ADAPTER + ".run.session"]]
    assert ADAPTER + ".record.recorder" in session  # imported inside start's helpers only
    assert PACKAGE + ".adapter.megatron_lm.api" in [t for t, _ in edges[PACKAGE]]
