"""pyproject.toml against the code: the Python it needs, one version, a license a tool can read,
extras that bring every optional import, and nothing a command needs outside the package."""
import ast
import os
import re
import sys
import tomllib

import burstengine
from burstengine.bench.usage import EXTRAS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "burstengine")
# import name -> distribution name, where they differ
DIST = {"liger_kernel": "liger-kernel"}


def _project():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _imports():
    """{top-level module: [files]} of every import in the package (lazy ones included)."""
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            tree = ast.parse(open(path).read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                for m in mods:
                    out.setdefault(m.split(".")[0], []).append(os.path.relpath(path, ROOT))
    return out


def _names(reqs):
    return {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in reqs}


def test_python_version_license_and_single_version():
    proj = _project()["project"]
    # tomllib (train configs) is 3.11's
    assert proj["requires-python"] == ">=3.11" and "tomllib" in _imports()
    # an SPDX expression (the TOML-table form is deprecated) and the file it names
    assert proj["license"] == "Apache-2.0"
    for f in proj["license-files"]:
        text = open(os.path.join(ROOT, f)).read()
        assert "Apache License" in text and "Version 2.0, January 2004" in text
    # the version lives in burstengine/__init__.py only
    assert "version" not in proj and "version" in proj["dynamic"]
    assert _project()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "burstengine.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", burstengine.__version__)


def test_extras_cover_the_optional_imports():
    proj = _project()["project"]
    required = _names(proj["dependencies"])
    extras = {k: _names(v) for k, v in proj["optional-dependencies"].items()}
    anywhere = set().union(*extras.values())
    third_party = {m: files for m, files in _imports().items()
                   if m not in sys.stdlib_module_names and m != "burstengine"}
    for mod, files in third_party.items():
        dist = DIST.get(mod, mod).lower()
        assert dist in required or dist in anywhere, f"{mod} (imported in {sorted(set(files))}) is in no extra"
    # the extra a missing-package message names brings that package
    for mod, extra in EXTRAS.items():
        assert DIST.get(mod, mod) in extras[extra], (mod, extra)
    # safetensors: the prefill CLI reads HF model directories and writes --save-kv with it
    assert "safetensors" in extras["hf"] and "tokenizers" in extras["train"]
    # the Gluon kernels were tested on Triton 3.6 only
    triton = [r for r in proj["optional-dependencies"]["triton"] if r.startswith("triton")]
    assert triton == ["triton>=3.6,<3.7"]


def test_commands_need_no_file_outside_the_package():
    """The package never opens a file relative to its own location or a checkout's folders:
    what a command needs is code in burstengine/ (the wheel holds exactly that).  Its location
    may still name the checkout for git (a record's commit) or a child's PYTHONPATH, through
    ``burstengine.__path__``."""
    pattern = re.compile(r"__file__|open\([^)]*benchmarks/|\"(?:tests|benchmarks)/[^\"]*\.(?:json|toml|txt)\"\)")
    for dirpath, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                code = "".join(line for line in open(path) if not line.lstrip().startswith("#"))
                assert not pattern.search(code), path
    found = _project()["tool"]["setuptools"]["packages"]["find"]
    assert found == {"include": ["burstengine*"]}
