"""The shape of the package: its stages import one way only (a module imports from its own stage
or earlier ones), no import circle between its modules (counting module-level and deferred imports
alike), and every module opens with a docstring that says its job."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "private_engine"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set) -> set:
    """The package's modules that ``path`` imports anywhere in its body (not for type checking)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in modules:
                c = c.rpartition(".")[0]
            # importing a.b.c runs the packages a.b and a first: arrows to them too (but not to
            # the top package, nor to the importing module's own packages)
            while c.count("."):
                if c != name and not name.startswith(c + "."):
                    found.add(c)
                c = c.rpartition(".")[0]
    return found


def _graph():
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: _imports(p, set(paths)) for m, p in paths.items()}


def test_no_import_circle():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # a package's __init__ re-exporting its modules is not a circle; only module-to-module arrows
    cycles = [c for c in cycles if not any(_is_init_edge(a, b) for a, b in zip(c, c[1:]))]
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _is_init_edge(a: str, b: str) -> bool:
    """``b`` is ``a``'s own package (``__init__``) or the reverse."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_the_engine_core_never_imports_the_demo_or_the_opacus_door():
    graph = _graph()
    layers = {"foundation", "capture", "layers", "clipping", "optim", "guards", "accounting",
              "engine"}
    core = [m for m in graph if m.split(".")[1:2] and m.split(".")[1] in layers]
    for m in core:
        bad = {n for n in graph[m] if n.split(".")[1:2] in (["demo"], ["opacus_compat"])}
        assert not bad, f"{m} imports {bad}"


#: the core packages: they never import Opacus (the Opacus door, opacus_compat, builds on them)
CORE = ("foundation", "layers", "capture", "guards", "clipping", "optim", "accounting", "engine")
#: the one module of the core that is the door to Opacus' accountants
OPACUS_BRIDGE = "private_engine.accounting.opacus_bridge"
#: core modules allowed to import Opacus anyway, and why
OPACUS_IN_CORE = {
    "private_engine.accounting.pld": "PLDAccountant implements Opacus' accountant interface "
    "(IAccountant), so the engine, its budget and its checkpoints use it as Opacus' own; the "
    "bridge imports it, so it cannot import the interface from the bridge without a circle",
    "private_engine.guards.model_check": "fix_model runs Opacus' ModuleValidator.fix, and the "
    "coverage check skips the parameter aliases of Opacus' DP RNNs (RenameParamsMixin)",
    "private_engine.layers.recurrent": "fix_recurrent replaces torch RNNs by Opacus' DP RNN "
    "layers, whose per-step Linear calls the layer rules clip",
}
#: heads modules allowed to import the demo anyway, and why
DEMO_IN_HEADS = {
    "private_engine.heads.features": "extract_features builds a model given by name with the "
    "demo's model factory (private_engine.demo.models.create_model, a public path)",
}


def _external_imports(path: Path) -> set:
    """Top-level names of the packages outside private_engine that ``path`` imports anywhere in
    its body (deferred imports included; not those for type checking)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
    return found


def test_the_core_never_imports_opacus():
    """Allowed order: Opacus enters through the Opacus door (opacus_compat) and the accountants'
    bridge only; the listed exceptions say why they need it (and must still need it)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    core = [m for m in paths if m.split(".")[1:2] and m.split(".")[1] in CORE]
    using = {m for m in core if "opacus" in _external_imports(paths[m])}
    bad = using - {OPACUS_BRIDGE} - set(OPACUS_IN_CORE)
    assert not bad, f"core modules importing opacus: {sorted(bad)}"
    stale = set(OPACUS_IN_CORE) - using
    assert not stale, f"allowed exceptions that no longer import opacus: {sorted(stale)}"


def test_heads_never_import_the_demo():
    graph = _graph()
    using = {m for m in graph if m.startswith("private_engine.heads")
             and any(n.startswith("private_engine.demo") for n in graph[m])}
    bad = using - set(DEMO_IN_HEADS)
    assert not bad, f"heads modules importing the demo: {sorted(bad)}"
    stale = set(DEMO_IN_HEADS) - using
    assert not stale, f"allowed exceptions that no longer import the demo: {sorted(stale)}"


def test_every_module_says_its_job():
    missing = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing


#: the package's stages, bottom first: a module may import only from its own stage or earlier ones
#: (a top-level module or subpackage of private_engine names its stage; the top package itself,
#: which re-exports the public names, is above them all). So the foundation imports nothing else
#: from the package.
STAGES = (
    ("foundation",),  # dtype and matmul helpers, the randomness policy, the atomic write
    ("layers",),  # the layer rules: per-sample norms and clipped sums
    ("capture",),  # recording (a, g) and per-sample gradients
    ("guards",),  # what the engine checks and refuses
    ("clipping",),  # the clipping core
    ("optim", "process_group"),  # the private step, noise, data-parallel and sharded training
    ("accounting",),  # the accountants and the budget
    # the engine and around it
    ("engine", "engine_config", "checkpoint", "data", "training", "step_metrics"),
    ("opacus_compat", "heads", "pretrain", "integrations", "demo"),  # built on the engine
    ("audit",),  # privacy audits of the engine and of the Opacus door
    ("commands", "cli"),  # the command line
)
#: imports against the stage order allowed anyway, ``(importer, imported): reason``
STAGE_EXCEPTIONS: dict = {}


def _stage(module: str) -> int:
    """Index in :data:`STAGES` of the stage of ``module`` (``private_engine.<name>…``)."""
    name = module.split(".")[1]
    for i, names in enumerate(STAGES):
        if name in names:
            return i
    raise AssertionError(f"{module} belongs to no stage: add private_engine.{name} to STAGES")


def test_every_stage_imports_only_its_own_and_earlier_ones():
    graph = _graph()
    modules = [m for m in graph if m != "private_engine"]
    against = {(m, n) for m in modules for n in graph[m]
               if n != "private_engine" and _stage(n) > _stage(m)}
    bad = against - set(STAGE_EXCEPTIONS)
    assert not bad, "imports against the stage order (importer -> imported):\n" + "\n".join(
        f"{m} (stage {STAGES[_stage(m)][0]}) -> {n} (stage {STAGES[_stage(n)][0]})"
        for m, n in sorted(bad))
    stale = set(STAGE_EXCEPTIONS) - against
    assert not stale, f"allowed exceptions that no longer import against the order: {sorted(stale)}"

#: the longest a module may be without a reason (a line starting with "Length:" in its docstring)
MAX_LINES = 400
#: modules over MAX_LINES lines without a "Length:" line, and what keeps them long
LONG_MODULES = {
    "private_engine.engine": "PrivacyEngine is one class whose constructor checks and wires the "
    "options of every stage (clipping, noise, accounting, guards, data parallel, FSDP2)",
    "private_engine.checkpoint": "the engine's public state, its checks against the engine, the "
    "step ledger's discovery and the one-file model + optimizer + engine checkpoint",
    "private_engine.clipping.clipper": "PerSampleClipper: the norm pass, the clip factors and the "
    "clipped sums' writer share one step's per-layer state",
    "private_engine.optim.topology": "the three topologies behind one interface; the sharded one "
    "routes FSDP2's clipping (the ranks' agreement, the per-unit streamed backward)",
    "private_engine.optim.sharded": "ShardedDataParallel: the FSDP2 step (unsharded clipping, "
    "reduce-scatter of each unit's sums, each shard's noise) over one class's state",
    "private_engine.layers.conv": "ConvRule: one layer rule with all its maths (ghost norm, the "
    "im2col and grouped-convolution per-sample gradients, clipped sums, their certified bounds)",
    "private_engine.guards.batch_flow.rules": "one small rule per family of aten ops and the "
    "table that registers them by op",
    "private_engine.guards.batch_flow.mode": "BatchFlow, the TorchDispatchMode: dispatch, tags, "
    "writes and the backward's roots share the mode's state",
    "private_engine.layers.gram": "one error analysis of fast Grams (about 100 lines of module "
    "docstring) that the fast bound, its float32 slack, the second try and the token bound all "
    "follow term by term",
}


def _gives_length_reason(path: Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return any(line.strip().startswith("Length:") for line in doc.splitlines())


def test_long_modules_say_why():
    """Every module is at most MAX_LINES lines, or says why in a docstring line starting with
    "Length:", or is listed in LONG_MODULES with its reason; a listed module (or a "Length:"
    line) that is no longer long is stale and must go."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    lines = {m: len(p.read_text().splitlines()) for m, p in paths.items()}
    reasoned = {m for m, p in paths.items() if _gives_length_reason(p)}
    long_ = {m for m, n in lines.items() if n > MAX_LINES}
    unexplained = sorted(long_ - reasoned - set(LONG_MODULES))
    assert not unexplained, (
        f"modules over {MAX_LINES} lines without a reason (split them, or give a line starting "
        f"with 'Length:' in the docstring): {[(m, lines[m]) for m in unexplained]}")
    stale = sorted((set(LONG_MODULES) | reasoned) - long_)
    assert not stale, (f"length reasons for modules of at most {MAX_LINES} lines (or gone): "
                       f"{[(m, lines.get(m)) for m in stale]}")
    twice = sorted(set(LONG_MODULES) & reasoned)
    assert not twice, f"modules with a 'Length:' line that LONG_MODULES also lists: {twice}"


def test_every_import_of_the_package_names_a_module_of_it():
    """``from ..x import y`` and ``import private_engine.x`` name modules or packages that exist in
    this tree (an editable install elsewhere could otherwise hide a moved module)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    missing = []
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("private_"):
                target = node.module
            else:
                continue
            if not target.startswith("private_engine") or target in paths:
                continue
            # ``from package import module`` names the module as one of the imported names
            if not node.module and all(f"{target}.{a.name}" in paths for a in node.names):
                continue
            missing.append(f"{name}: {target}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
