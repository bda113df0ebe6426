"""The package's layering, read from its imports (module level and inside functions), as
/work/shared/tools/layering.py reads them:

1. no import circle between files;
2. no circle between the top-level parts (subpackages and top-level modules);
3. the ground floor (masks, schedule, costmodel) imports neither torch.distributed nor the
   attention runtime nor comm;
4. library code reads the environment (os.environ, os.getenv) only in the planning module and
   the command-line modules listed in ENV_READERS;
5. every function-level import of a burstengine module says why on its line or the line above;
6. nothing outside the tools wing (burstengine/cli/: the commands, burstengine/bench/: the
   benchmarks and the runtime they share; and ``python -m burstengine``'s __main__) imports it.

Each rule is a function of a source tree, tested on the package and on a small synthetic tree
that breaks it (so no rule passes for want of anything to check).
"""
import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "burstengine"

GROUND = ("masks", "schedule", "costmodel")  # parts that must stay pure
FORBIDDEN_FOR_GROUND = ("torch.distributed", "burstengine.attention", "burstengine.comm")
# the files that may read the environment: the planning module (every BURST_* knob of the
# library) and the command-line layer (flags' defaults, launcher variables, records of a run)
ENV_READERS = {
    "attention/planning.py",
    "cli/*",  # the commands
    "bench/*",  # the benches, and the commands' runtime: launch.py, records.py (a run's environment in its record)
    "testing.py",
    "processes.py",  # hands the launcher's whole environment to its forked ranks (reads no setting)
}
# the tools wing: above everything, imported by nothing else (the parts, and python -m burstengine's entry)
WING = ("cli", "bench", "__main__")


# --- reading a tree ----------------------------------------------------------------------------------

def modules(root: str, pkg: str = PKG) -> dict[str, tuple[str, bool]]:
    """module name -> (path, is a package __init__)."""
    out = {}
    for d, _, fs in os.walk(os.path.join(root, pkg)):
        for f in fs:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                rel = os.path.relpath(p, root)[:-3].replace(os.sep, ".")
                mod = rel[:-9] if rel.endswith(".__init__") else rel
                out[mod] = (p, rel.endswith(".__init__"))
    return out


def imports(mod: str, path: str, is_pkg: bool):
    """(absolute module name, node, inside a function) of every import in the file."""
    tree = ast.parse(open(path).read())
    base = mod if is_pkg else mod.rpartition(".")[0]
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inner = {id(x) for f in funcs for x in ast.walk(f) if x is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node, id(node) in inner
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                b = base
                for _ in range(node.level - 1):
                    b = b.rpartition(".")[0]
                m = f"{b}.{node.module}" if node.module else b
            else:
                m = node.module or ""
            for a in node.names:
                yield f"{m}.{a.name}", node, id(node) in inner
            yield m, node, id(node) in inner


def edges(files) -> dict[str, set[str]]:
    def resolve(name):
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    out = defaultdict(set)
    for mod, (path, is_pkg) in files.items():
        for target, _, _ in imports(mod, path, is_pkg):
            if target.startswith(PKG):
                r = resolve(target)
                if r and r != mod:
                    out[mod].add(r)
    return out


def circles(graph, nodes) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def part(m: str) -> str:
    bits = m.split(".")
    return ".".join(bits[:2]) if len(bits) > 1 else m


# --- the rules ----------------------------------------------------------------------------------------

def file_circles(root: str) -> list[list[str]]:
    files = modules(root)
    g = edges(files)
    # a package's __init__ re-exporting its children is not a circle of meaning
    g = {m: {t for t in ts if not (files[m][1] and t.startswith(m + "."))} for m, ts in g.items()}
    return circles(g, sorted(files))


def part_circles(root: str) -> list[list[str]]:
    files = modules(root)
    g = defaultdict(set)
    for m, ts in edges(files).items():
        for t in ts:
            a, b = part(m), part(t)
            if a != b and a != PKG and b != PKG:
                g[a].add(b)
    return circles(g, sorted({part(m) for m in files}))


def ground_violations(root: str) -> list[str]:
    out = []
    for mod, (path, is_pkg) in modules(root).items():
        if part(mod).split(".")[-1] not in GROUND or part(mod) == PKG:
            continue
        for target, node, _ in imports(mod, path, is_pkg):
            if any(target == f or target.startswith(f + ".") for f in FORBIDDEN_FOR_GROUND):
                out.append(f"{mod}:{node.lineno} imports {target}")
    return sorted(set(out))


def _env_reader(rel: str) -> bool:
    return any(rel == a or (a.endswith("/*") and rel.startswith(a[:-1])) for a in ENV_READERS)


def env_violations(root: str) -> list[str]:
    out = []
    for mod, (path, _) in modules(root).items():
        rel = os.path.relpath(path, os.path.join(root, PKG)).replace(os.sep, "/")
        if _env_reader(rel):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            reads = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")
                     and isinstance(node.value, ast.Name) and node.value.id == "os")
            reads |= isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv") for a in node.names)
            if reads:
                out.append(f"{rel}:{node.lineno}")
    return out


def uncommented_function_imports(root: str) -> list[str]:
    out = []
    for mod, (path, is_pkg) in modules(root).items():
        lines = open(path).read().splitlines()
        seen = set()
        for target, node, inner in imports(mod, path, is_pkg):
            if not inner or not target.startswith(PKG) or id(node) in seen:
                continue
            seen.add(id(node))
            here, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ""
            end = lines[node.end_lineno - 1]
            if "#" not in here and "#" not in end and not above.strip().startswith("#"):
                out.append(f"{os.path.relpath(path, root)}:{node.lineno}: {here.strip()}")
    return out


def _in_wing(mod: str) -> bool:
    return any(mod == f"{PKG}.{w}" or mod.startswith(f"{PKG}.{w}.") for w in WING)


def wing_imports(root: str) -> list[str]:
    out = []
    for mod, (path, is_pkg) in modules(root).items():
        if _in_wing(mod):
            continue
        for target, node, _ in imports(mod, path, is_pkg):
            if _in_wing(target):
                out.append(f"{mod}:{node.lineno} imports {target}")
    return sorted(set(out))


RULES = {
    "file circles": file_circles,
    "part circles": part_circles,
    "ground floor imports": ground_violations,
    "environment reads": env_violations,
    "function-level imports without a reason": uncommented_function_imports,
    "imports of the tools wing": wing_imports,
}


@pytest.mark.parametrize("rule", list(RULES))
def test_package_keeps_the_rule(rule):
    assert RULES[rule](ROOT) == [], rule


# --- each rule fails on a tree that breaks it ---------------------------------------------------------

def _tree(tmp_path, files: dict[str, str]) -> str:
    for rel, text in {"__init__.py": "", **files}.items():
        p = tmp_path / PKG / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.exists() or text:
            p.write_text(text)
    return str(tmp_path)


def test_file_circle_is_found(tmp_path):
    root = _tree(tmp_path, {"a.py": "from . import b\n", "b.py": "def f():\n    from .a import x  # lazy\n"})
    assert file_circles(root) == [["burstengine.a", "burstengine.b"]]
    # an __init__ re-exporting its children is not a circle
    root = _tree(tmp_path / "ok", {"p/__init__.py": "from .m import y\n", "p/m.py": "from . import n\n", "p/n.py": ""})
    assert file_circles(root) == []


def test_part_circle_is_found(tmp_path):
    root = _tree(tmp_path, {"x/__init__.py": "", "x/a.py": "from ..y import b\n",
                            "y/__init__.py": "", "y/b.py": "", "y/c.py": "from ..x import a\n"})
    assert file_circles(root) == []
    assert part_circles(root) == [["burstengine.x", "burstengine.y"]]


def test_ground_floor_violation_is_found(tmp_path):
    root = _tree(tmp_path, {"masks.py": "import torch\n",
                            "schedule/__init__.py": "", "schedule/blocks.py": "import torch.distributed as dist\n",
                            "costmodel.py": "def f():\n    from .attention import api  # lazy\n",
                            "attention/__init__.py": "", "attention/api.py": "import torch.distributed\n"})
    assert ground_violations(root) == ["burstengine.costmodel:2 imports burstengine.attention",
                                       "burstengine.costmodel:2 imports burstengine.attention.api",
                                       "burstengine.schedule.blocks:1 imports torch.distributed"]


def test_environment_read_is_found(tmp_path):
    root = _tree(tmp_path, {"kernels/__init__.py": "", "kernels/k.py": "import os\n\ndef f():\n    return os.getenv('X')\n",
                            "comm/__init__.py": "", "comm/c.py": "from os import environ\n",
                            "attention/__init__.py": "", "attention/planning.py": "import os\nX = os.environ.get('X')\n",
                            "bench/b.py": "import os\nY = os.environ['Y']\n"})
    assert sorted(env_violations(root)) == ["comm/c.py:1", "kernels/k.py:4"]


def test_uncommented_function_import_is_found(tmp_path):
    root = _tree(tmp_path, {"a.py": "def f():\n    from . import b\n\n\ndef g():\n    # b is heavy\n    from . import b\n",
                            "b.py": "def h():\n    import json\n    from .a import f  # a imports b\n"})
    assert uncommented_function_imports(root) == [f"{PKG}/a.py:2: from . import b"]


def test_import_of_the_tools_wing_is_found(tmp_path):
    # the library importing the wing, at module level or in a function, breaks the rule; the wing
    # importing the library or itself, and __main__ importing the commands, do not
    root = _tree(tmp_path, {"train/__init__.py": "", "train/loop.py": "from ..bench.records import write_record\n",
                            "model/__init__.py": "",
                            "model/m.py": "def f():\n    from burstengine import cli  # lazy\n",
                            "cli/__init__.py": "from ..train import loop\n",
                            "cli/demo.py": "from ..bench import launch\n",
                            "bench/__init__.py": "", "bench/launch.py": "from ..model import m\n",
                            "bench/records.py": "", "__main__.py": "from .cli import main\n"})
    assert wing_imports(root) == ["burstengine.model.m:2 imports burstengine.cli",
                                  "burstengine.train.loop:1 imports burstengine.bench.records",
                                  "burstengine.train.loop:1 imports burstengine.bench.records.write_record"]
