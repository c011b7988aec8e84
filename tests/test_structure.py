"""The package's shape: imports run one way between the sub-packages, no cycle, no module past 400 lines, and
imports at the top of each module except where a command's start-up time defers them."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "truneg"
# A module may import from its own layer and those below it, never from a layer above.
LAYERS = {"errors": 0, "synonyms": 1, "data": 1, "model": 2, "train": 3, "cluster": 4, "eval": 5, "cli": 6,
          "pretrain": 6}
# The modules that import inside functions, and why: each runs at a command's start, which would otherwise pay
# for torch, transformers, deepspeed or datasets before it parses its arguments.
DEFERRED_IMPORTS = {
    "truneg.cli": "`truneg --help` and every sub-command's parse stay free of torch",
    "truneg.data.commands": "the `truneg prepare` parser, built for every `truneg` command",
    "truneg.eval.commands": "the evaluation parsers, built for every `truneg` command",
    "truneg.data.blocks": "transformers, for the tokenizer only (the `truneg` parsers import this module)",
    "truneg.data.corpus": "datasets and pyarrow, for `hf:` corpora only (seconds to import)",
    "truneg.train.config.ds_config": "torch: the launch scripts run `python -m truneg.train.config.ds_config` before "
                                     "each launch",
    "truneg.cluster.hostfile": "deepspeed: the launch scripts run `python -m truneg.cluster.hostfile` before each "
                               "launch",
    "truneg.train.ranks.distributed": "mpi4py, an optional package that only mpirun/srun launches need",
    "truneg.eval.false_negatives": "matplotlib, for the plot only (its backend is chosen before pyplot's import)",
    "truneg.eval.paired": "scipy, for the t-interval only: `truneg report` of live evaluations alone needs none",
}
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    return LAYERS[module.split(".")[1]]


def imports_of(module: str) -> list[tuple[str, int, bool]]:
    """(imported truneg module, line, inside a function) for every import of `module`, function-level included."""
    tree = ast.parse(MODULES[module].read_text())
    top_level = {id(node) for node in tree.body}
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from truneg.train import checkpoint` imports the module truneg.train.checkpointing.checkpoint
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        in_function = id(node) not in top_level and not _in_type_checking(tree, node)
        found += [(name, node.lineno, in_function) for name in names if name.split(".")[0] == "truneg"]
    return found


def _in_type_checking(tree: ast.Module, target: ast.AST) -> bool:
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            if any(child is target for child in ast.walk(node)):
                return True
    return False


def function_level_imports(module: str) -> list[int]:
    tree = ast.parse(MODULES[module].read_text())
    return [node.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_every_module_has_a_layer():
    assert {m.split(".")[1] for m in MODULES if m != "truneg"} == set(LAYERS)


def test_imports_never_reach_a_higher_layer_nor_the_entry_script():
    upward = [f"{m}:{line} imports {target}" for m in MODULES if m != "truneg"
              for target, line, _ in imports_of(m)
              if target != "truneg" and (layer(target) > layer(m) or (target == "truneg.pretrain" and m != target))]
    assert upward == []


def test_the_import_graph_has_no_cycle():
    graph = {m: {t for t, _, _ in imports_of(m) if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target):], target] if target in path else [*path, target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[module] = 2
        return None

    cycles = [cycle for m in MODULES if m not in state and (cycle := visit(m, [m]))]
    assert cycles == []


def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The two checks above on a made-up package: a layer-1 module importing a layer-3 one, and a cycle."""
    fake = tmp_path / "truneg"
    for name, text in {"__init__.py": "", "errors.py": "", "data/__init__.py": "",
                       "data/a.py": "from truneg.data import b\n",
                       "data/b.py": "def f():\n    from truneg.data import a\n    from truneg.train import c\n",
                       "train/__init__.py": "", "train/c.py": ""}.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    monkeypatch.setattr(__import__(__name__), "MODULES", {module_name(p): p for p in sorted(fake.rglob("*.py"))})
    with pytest.raises(AssertionError, match=r"truneg.data.b:3 imports truneg.train.c"):
        test_imports_never_reach_a_higher_layer_nor_the_entry_script()
    with pytest.raises(AssertionError, match=r"truneg.data.a', 'truneg.data.b', 'truneg.data.a"):
        test_the_import_graph_has_no_cycle()


def test_no_module_is_longer_than_400_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_imports_sit_at_the_top_except_where_start_up_time_defers_them():
    deferring = {m for m in MODULES if function_level_imports(m)}
    assert deferring <= set(DEFERRED_IMPORTS), sorted(deferring - set(DEFERRED_IMPORTS))
    assert set(DEFERRED_IMPORTS) <= deferring, "a module listed as deferring imports no longer does: drop it"


# truneg/train's rooms, bottom up: a module imports from its own room or a lower floor, never from a peer room of
# its floor nor from above; the composition (build, heldout, loop, fused_grads: truneg/train/ itself) sits on top.
TRAIN_FLOORS = {"config": 0, "ranks": 0, "observe": 1, "checkpointing": 1}
COMPOSITION = 2


def train_room(module: str) -> str | None:
    """`module`'s room of truneg/train ("composition" for the modules at its top), None outside it."""
    parts = module.split(".")
    if parts[:2] != ["truneg", "train"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in TRAIN_FLOORS else "composition"


def floor(room: str) -> int:
    return TRAIN_FLOORS.get(room, COMPOSITION)


def test_train_rooms_import_one_way_and_their_packages_hold_no_imports():
    wrong = [f"{m}:{line} imports {target}" for m in MODULES if (room := train_room(m))
             for target, line, _ in imports_of(m)
             if (other := train_room(target)) and other != room and floor(other) >= floor(room)]
    assert not wrong, "\n".join(wrong)
    assert {train_room(m) for m in MODULES} - {None} == {*TRAIN_FLOORS, "composition"}
    # no re-export or shim: an import there would pull torch into what imports one module of the room
    for room in TRAIN_FLOORS:
        assert imports_of(f"truneg.train.{room}") == [], room
        assert "import" not in (PACKAGE / "train" / room / "__init__.py").read_text(), room


def test_the_rooms_check_finds_a_peer_and_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "truneg"
    for name, text in {"__init__.py": "", "train/__init__.py": "", "train/loop.py": "",
                       "train/config/__init__.py": "", "train/config/a.py": "from truneg.train.ranks import b\n",
                       "train/ranks/__init__.py": "", "train/ranks/b.py": "",
                       "train/observe/__init__.py": "", "train/observe/c.py": "from truneg.train import loop\n",
                       "train/checkpointing/__init__.py": "", "train/checkpointing/d.py": ""}.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    monkeypatch.setattr(__import__(__name__), "MODULES", {module_name(p): p for p in sorted(fake.rglob("*.py"))})
    with pytest.raises(AssertionError) as found:
        test_train_rooms_import_one_way_and_their_packages_hold_no_imports()
    assert "truneg.train.config.a:1 imports truneg.train.ranks.b" in str(found.value)
    assert "truneg.train.observe.c:1 imports truneg.train.loop" in str(found.value)
