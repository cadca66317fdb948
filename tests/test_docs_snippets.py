"""Every ```python block of README.md and docs/*.md runs as written.

The blocks of one page run in order in a fresh namespace (a page is read top to bottom, so a block
may use what an earlier block of the same page defined), in an empty temporary directory; all pages
run in one new interpreter, so that torch is imported once.
A block that cannot run here (torchrun, GPUs) is preceded in the page by the visible marker
``<!-- not run: reason -->``; it is still compiled, and the attributes it reads from the modules
it imports are looked up, so a renamed function or an unreachable subpackage is caught.
"""
import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S[^>]*?)\s*-->\s*$")


def python_blocks(page: Path):
    """``[(line, source, reason_not_run or None)]`` for every ```python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").splitlines()
        marker = _NOT_RUN.search(before[-1]) if before else None
        line = text.count("\n", 0, m.start()) + 2
        blocks.append((line, m.group(1), marker.group(1) if marker else None))
    return blocks


ALL = [(page, *block) for page in PAGES for block in python_blocks(page)]


def test_the_pages_have_blocks_and_most_of_them_run():
    ran = [b for b in ALL if b[3] is None]
    skipped = [b for b in ALL if b[3] is not None]
    assert len(ALL) >= 7, [str(b[0]) for b in ALL]
    assert len(ran) >= 5 and len(skipped) <= 2, (
        f"{len(ran)} blocks run, {len(skipped)} marked not run: "
        + ", ".join(f"{p.name}:{line} ({why})" for p, line, _, why in skipped))
    assert all(why.strip() for *_, why in skipped)


_RUNNER = r"""
import json, os, sys, traceback
pages, out = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for name, workdir, blocks in pages:
    os.makedirs(workdir)
    os.chdir(workdir)
    ns = {"__name__": "__main__"}   # a fresh namespace for each page
    try:
        for where, source in blocks:
            exec(compile(source, where, "exec"), ns)
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()
with open(out, "w") as f:
    json.dump(results, f)
"""

RUNNABLE_PAGES = [p for p in PAGES if any(r is None for *_, r in python_blocks(p))]


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    """Run every page's runnable blocks in one fresh interpreter (one import of torch), each page
    in its own namespace and empty directory; ``{page name: traceback or None}``."""
    tmp = tmp_path_factory.mktemp("docs")
    pages = [(str(p.relative_to(ROOT)), str(tmp / p.stem),
              [(f"{p.relative_to(ROOT)}:{line}", source)
               for line, source, reason in python_blocks(p) if reason is None])
             for p in RUNNABLE_PAGES]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(pages), str(tmp / "out.json")],
                         cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda p: p.name)
def test_page_blocks_run(page, page_results):
    error = page_results[str(page.relative_to(ROOT))]
    assert error is None, error


def _read_attributes(tree: ast.AST, modules):
    """Dotted names ``module.a.b`` read in ``tree`` whose root is an imported module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in modules:
                yield cur.id, chain[::-1]


@pytest.mark.parametrize("page, line, source, reason",
                         [b for b in ALL if b[3] is not None],
                         ids=lambda v: v.name if isinstance(v, Path) else str(v)[:20])
def test_blocks_not_run_compile_and_name_what_exists(page, line, source, reason):
    tree = compile(source, f"{page.name}:{line}", "exec", flags=ast.PyCF_ONLY_AST)
    modules = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = importlib.import_module(alias.name)
                if alias.asname:
                    modules[alias.asname] = top
                else:
                    modules[alias.name.split(".")[0]] = importlib.import_module(
                        alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(base, alias.name)
                if isinstance(value, type(os)):
                    modules[alias.asname or alias.name] = value
    for root, chain in _read_attributes(tree, modules):
        obj = modules[root]
        for i, attr in enumerate(chain):
            if not isinstance(obj, type(os)):
                break   # an attribute of a class or a function: not followed
            assert hasattr(obj, attr), f"{page.name}:{line}: {root}.{'.'.join(chain[:i + 1])}"
            obj = getattr(obj, attr)
