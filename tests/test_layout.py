"""The import graph of train/ and model_parallel/ (docs/architecture.md), read from the source with ast: no import
circle, and every import runs down the layers. Lazy imports inside functions and `if TYPE_CHECKING:` imports count too:
they are dependencies all the same, and a lazy import is how a circle hides.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The layer order, written once: a room imports its own modules and the rooms of lower layers only.
LAYERS = (("config", "runtime"), ("model",), ("plan",), ("data",), ("trainer",), ("benchmarks",))
# model_parallel/ stands above the trainer: it may use every room but benchmarks.
MODEL_PARALLEL_MAY_USE = ("config", "runtime", "model", "plan", "data", "trainer")
COMMANDS = ("main", "cache", "export", "infer", "bench", "bench_data", "make_tiny", "demo")
LAYER_OF = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for top in ("train", "model_parallel") for p in sorted((REPO / top).rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports (anywhere in it). `from pkg import x` is an import of pkg.x when that is
    a module, else of pkg; the implicit import of a module's parent packages is not counted."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, set(modules)) for name, path in modules.items()}


def kind(module: str) -> tuple[str, str | None]:
    """('command', name) | ('room', room) | ('package', None) for train/__init__ | ('model_parallel', None)."""
    parts = module.split(".")
    if parts[0] == "model_parallel":
        return "model_parallel", None
    if len(parts) == 1:
        return "package", None
    if len(parts) == 2 and parts[1] in COMMANDS:
        return "command", parts[1]
    return "room", parts[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def direction_problem(src: str, dst: str) -> str | None:
    """Why `src` may not import `dst`, or None when it may."""
    (src_kind, src_room), (dst_kind, dst_room) = kind(src), kind(dst)
    if src_kind == "command":
        return f"{src} imports {dst}, another command; move what both need into a room" if dst_kind == "command" \
            else None
    if dst_kind == "command":
        return f"{src} (library) imports the command {dst}; move what it needs into a room"
    if src_kind == "model_parallel":
        return None if dst_kind == "model_parallel" or dst_room in MODEL_PARALLEL_MAY_USE else \
            f"{src} imports {dst}: model_parallel may use only {', '.join(MODEL_PARALLEL_MAY_USE)}"
    if dst_kind == "model_parallel":
        return f"{src} (train's library) imports {dst}; pass what it needs in from a command"
    if src_kind == "package" or dst_kind == "package":
        return f"{src} imports {dst}: train/__init__.py is empty and imports nothing"
    if src_room not in LAYER_OF or dst_room not in LAYER_OF:
        room = src_room if src_room not in LAYER_OF else dst_room
        return f"train/{room}/ is not a room of the layer order; add it to LAYERS in tests/test_layout.py"
    if src_room != dst_room and LAYER_OF[dst_room] >= LAYER_OF[src_room]:
        return f"{src} imports {dst}: train/{dst_room}/ is not below train/{src_room}/ in the layer order"
    return None


def layout_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = [p for src in sorted(graph) for dst in sorted(graph[src]) if (p := direction_problem(src, dst))]
    problems += [f"import circle: {' <-> '.join(c)}" for c in cycles(graph)]
    return problems


def test_the_repository_has_no_circle_and_no_upward_import():
    graph = import_graph()
    assert len(graph) > 40 and "train.trainer.loop" in graph and "model_parallel.runner" in graph
    assert sum(map(len, graph.values())) > 100  # the edges were read
    assert layout_problems(graph) == []


def test_every_command_exists_and_every_room_is_placed():
    """The names the rules rely on match the tree: the commands are files, the rooms folders in the order."""
    assert all((REPO / "train" / f"{c}.py").is_file() for c in COMMANDS)
    rooms = {p.name for p in (REPO / "train").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert rooms == set(LAYER_OF)
    assert {p.stem for p in (REPO / "train").glob("*.py")} - {"__init__"} == set(COMMANDS)


def test_the_checker_catches_planted_imports():
    """Each rule fires on a synthetic graph, and on the real graph with one import planted."""
    clean = {"train.config.schema": set(), "train.model.fp8": {"train.config.schema"},
             "train.trainer.loop": {"train.model.fp8"}, "model_parallel.plan": {"train.config.schema"},
             "train.main": {"train.trainer.loop", "model_parallel.plan"}}
    assert layout_problems(clean) == []
    planted = {
        ("train.model.fp8", "train.trainer.loop"): "is not below train/model/",  # upward (and a circle)
        ("train.config.schema", "train.runtime.engine"): "is not below train/config/",  # same layer
        ("train.data.pairs", "train.main"): "imports the command train.main",
        ("train.runtime.engine", "model_parallel.plan"): "(train's library) imports model_parallel.plan",
        ("model_parallel.plan", "train.benchmarks.peer"): "model_parallel may use only",
        ("train.cache", "train.main"): "another command",
        ("train.extras.x", "train.config.schema"): "train/extras/ is not a room",
    }
    for (src, dst), message in planted.items():
        graph = {k: set(v) for k, v in clean.items()}
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
        found = layout_problems(graph)
        assert any(message in p for p in found), (src, dst, found)
    circle = {"train.model.a": {"train.model.b"}, "train.model.b": {"train.model.c"},
              "train.model.c": {"train.model.a"}}
    assert layout_problems(circle) == ["import circle: train.model.a <-> train.model.b <-> train.model.c"]
    real = import_graph()
    real["train.config.schema"].add("train.model.qwen_image.components")
    assert any("train.config.schema imports train.model.qwen_image.components" in p for p in layout_problems(real))


def test_imports_are_read_from_functions_and_relative_forms(tmp_path):
    """A lazy import inside a function counts, and `from pkg import module` names the module."""
    path = REPO / "train" / "trainer" / "build.py"
    found = imports_of(path, "train.trainer.build", set(project_modules()))
    assert {"train.data.cache_reader", "train.trainer.loop", "train.config"} <= found
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from train.model import fp8\n    import train.runtime.engine\n")
    assert imports_of(lazy, "train.data.lazy", set(project_modules())) == {"train.model.fp8", "train.runtime.engine"}


def test_setup_cfg_installs_every_package():
    """A non-editable install ships every folder of train/ and model_parallel/ (setup.cfg's packages)."""
    import configparser

    import setuptools

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["options"]["packages"].strip() == "find:"
    include = [p.strip() for p in cfg["options.packages.find"]["include"].replace("\n", ",").split(",") if p.strip()]
    found = set(setuptools.find_packages(str(REPO), include=include))
    folders = {module_name(p) for top in ("train", "model_parallel") for p in (REPO / top).rglob("__init__.py")}
    assert found == folders and "train.config" in found


def test_readme_and_docs_name_paths_that_exist():
    """Every train/... or model_parallel/... file and every train.<room>.<module> the README and docs/ name
    exists (a move that left the prose behind fails here); a path written as git's COMMIT:path (7 hex digits)
    names a file in history, which a revert may have removed."""
    import re

    texts = {p.name: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    missing = []
    for name, text in texts.items():
        for path in set(re.findall(r"(?<![\w/])(?<![0-9a-f]{7}:)(?:train|model_parallel)/[\w/]+\.py\b", text)):
            if not (REPO / path).is_file():
                missing.append(f"{name}: {path}")
        for room, module in set(re.findall(rf"(?<![\w.])train\.({'|'.join(LAYER_OF)})\.(\w+)", text)):
            if room != "config" and not (REPO / "train" / room / f"{module}.py").is_file():
                missing.append(f"{name}: train.{room}.{module}")
    assert len(texts) > 3 and not missing, missing


MAX_FUNCTION_LINES = 60  # a function longer than this is split into named parts (STYLE: a screen or less)


def long_functions(paths, root: Path = REPO) -> list[str]:
    """Functions (and methods, nested ones too) over MAX_FUNCTION_LINES lines, decorators not counted."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_the_limit(tmp_path):
    assert long_functions(project_modules().values()) == []
    planted = tmp_path / "long.py"
    planted.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions([planted], tmp_path) == [f"long.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
