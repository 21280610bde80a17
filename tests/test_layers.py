"""The house rules of docs/design.md, checked on the source: imports point down the layers, no import
cycle, module and function sizes, and no branch on an algorithm's name outside the registries."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "covey"

# Layer of each top-level package or module of covey (docs/design.md, "The house").
LAYERS = {
    "config": 0, "algos": 0, "batch": 0, "runtime": 0,
    "tasks": 1, "models": 1,
    "passes": 2,
    "rollout": 3, "rewards": 3,
    "rm": 4, "serve": 4, "envs": 4,
    "training": 5,
    "report": 6,
    "cli": 7,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def covey_imports(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported covey module, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("covey") and name in known:
                out.append((name, node.lineno, id(node) in top_level))
    return out


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_package_has_a_layer():
    tops = {m.split(".")[1] for m in modules() if m.count(".") >= 1}
    assert tops <= set(LAYERS), f"packages without a layer: {sorted(tops - set(LAYERS))}"


def test_imports_point_down_only():
    mods = modules()
    bad = []
    for name, path in mods.items():
        own = layer_of(name)
        if own is None:  # covey/__init__.py: the public API on top of everything
            continue
        for target, line, _ in covey_imports(path, set(mods)):
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target} (layer {theirs} > {own})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    mods = modules()
    graph = {name: {t for t, _, _ in covey_imports(path, set(mods))} - {name} for name, path in mods.items()}
    # A package's __init__ is imported by its submodules' imports: an edge from a submodule to its
    # own package's __init__ is not a cycle the package can cause.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_module_and_function_sizes():
    limits = {"covey.training.loop": 450}
    bad = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        limit = limits.get(name, 250 if name.startswith("covey.algos.") else 400)
        if len(lines) > limit:
            bad.append(f"{path.relative_to(ROOT.parent)}: {len(lines)} lines > {limit}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 50:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}() is {length} lines > 50")
    assert not bad, "\n".join(bad)


def test_covey_imports_inside_functions_only_in_cli():
    mods = modules()
    bad = [f"{path.relative_to(ROOT.parent)}:{line} imports {target} inside a function"
           for name, path in mods.items() if not name.startswith("covey.cli") and name != "covey"
           for target, line, top in covey_imports(path, set(mods)) if not top]
    assert not bad, "\n".join(bad)


def test_no_branch_on_algorithm_names_outside_registries():
    pattern = re.compile(r"algo\.name|estimator (==|!=|in) ")
    bad = [f"{p.relative_to(ROOT.parent)}:{i}: {line.strip()}"
           for p in sorted(ROOT.rglob("*.py")) if not p.is_relative_to(ROOT / "algos")
           for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, "\n".join(bad)


def test_every_package_init_opens_with_a_docstring():
    bad = [str(p.relative_to(ROOT.parent)) for p in sorted(ROOT.rglob("__init__.py"))
           if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not bad, f"package __init__ without a docstring: {bad}"


def test_importing_covey_config_loads_no_torch():
    """The config is layer 0 and torch-free: the registry checks that need covey.algos run in make_plan."""
    import subprocess
    import sys
    code = "import sys, covey.config; print(sorted(m for m in ('torch', 'covey.algos') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT.parent)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_the_run_holds_the_plan_not_the_config():
    """The Config stops at the top: `Run` has no `cfg` field and no untyped state dict, and nothing
    under covey/training/ reads a `.cfg` attribute (what a step needs is in the Plan)."""
    tree = ast.parse((ROOT / "training" / "setup.py").read_text())
    run = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run")
    fields = {n.target.id for n in run.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert "plan" in fields and not fields & {"cfg", "config", "extra_state"}, sorted(fields)
    bad = [f"{p.relative_to(ROOT.parent)}:{node.lineno}" for p in sorted((ROOT / "training").glob("*.py"))
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.Attribute) and node.attr in ("cfg", "extra_state")]
    assert not bad, "reads of .cfg / .extra_state under covey/training: " + ", ".join(bad)


DOC_PATH = re.compile(r"(?<![\w./<-])((?:covey|tests|bench|scripts|docs|examples|dev)/[\w./*<>{}-]*|test_[\w*]+\.py)")
DOC_LINK = re.compile(r"\]\(([^)\s]+)")
DOC_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S*")
DOC_OUTPUT = re.compile(r"--out[= ]+\S+")  # what a command shown in a doc writes need not exist yet


def test_every_path_cited_in_the_docs_exists():
    """Repository paths named in README.md and docs/*.md (in prose, code and links) exist. Bare test
    file names must exist somewhere under tests/; `<placeholder>` and `{a,b}` paths are not checked."""
    repo = ROOT.parent
    skipped = ("bench/",) if globals().get("PENDING_BENCH") else ()
    missing = []
    for doc in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            line = DOC_OUTPUT.sub("", DOC_URL.sub("", line))
            cited = [(p.rstrip("."), p) for p in DOC_PATH.findall(line)]
            for target in DOC_LINK.findall(line):
                if target.startswith(("#", "mailto:")):
                    continue
                path = (doc.parent / target.split("#")[0]).resolve()
                cited.append((path.relative_to(repo).as_posix() if path.is_relative_to(repo) else str(path), target))
            for path, as_written in cited:
                if any(c in path for c in "<>{}") or path.startswith(skipped) or path.startswith("runs/"):
                    continue
                found = any((repo / "tests").rglob(path)) if path.startswith("test_") else any(repo.glob(path))
                if not found:
                    missing.append(f"{doc.relative_to(repo)}:{number}: {as_written}")
    assert not missing, "paths cited in the docs that do not exist:\n" + "\n".join(missing)


def test_nothing_under_bench_assigns_to_a_covey_module_attribute():
    """Benchmarks drive a run through open_run / steps / finish and module hooks (DESIGN.md): no
    `loop.train_step = f`, `loop.x += 1` or `setattr(loop, "x", f)` on a name bound to a covey module
    (`import covey.training.loop as loop`, `from covey.training import loop`, `import covey.training.loop`)."""
    known = set(modules())

    def dotted(node) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        return f"{base}.{node.attr}" if isinstance(node, ast.Attribute) and (base := dotted(node.value)) else None

    bad = []
    for path in sorted((ROOT.parent / "bench").rglob("*.py")):
        tree, bound = ast.parse(path.read_text()), {}
        for node in ast.walk(tree):  # names bound to covey modules, at any depth
            if isinstance(node, ast.Import):
                bound.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                              for a in node.names if a.name.startswith("covey")})
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("covey"):
                bound.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                              if f"{node.module}.{a.name}" in known})
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            owners = [(t.value, t.attr) for t in targets if isinstance(t, ast.Attribute)]
            if isinstance(node, ast.Call) and (dotted(node.func) or "").split(".")[-1] == "setattr" and node.args:
                attr = node.args[1] if len(node.args) > 1 else None
                owners.append((node.args[0], attr.value if isinstance(attr, ast.Constant) else "?"))
            for owner, attr in owners:
                root, _, rest = (dotted(owner) or "").partition(".")
                module = ".".join(filter(None, [bound.get(root), rest]))
                if root in bound and module in known:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} assigns {module}.{attr}")
    assert not bad, "bench/ replaces covey's functions at run time:\n" + "\n".join(bad)


def test_no_covey_module_is_imported_under_another_name():
    """A covey module keeps its own name wherever it is imported, in covey/, tests/ and bench/:
    `from covey.passes import logprobs` (or `import covey.passes.logprobs as logprobs`), never
    `... import logprobs as forward`. Names other than modules (a function, a class) are not checked."""
    repo, known = ROOT.parent, set(modules())
    bad = []
    for path in sorted(p for folder in ("covey", "tests", "bench") for p in (repo / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                pairs = [(a.name, a.asname) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                pairs = [(f"{node.module}.{a.name}", a.asname) for a in node.names]
            else:
                continue
            bad += [f"{path.relative_to(repo)}:{node.lineno} imports {name} as {alias}" for name, alias in pairs
                    if alias and name in known and alias != name.rsplit(".", 1)[-1]]
    assert not bad, "covey modules imported under another name:\n" + "\n".join(bad)


CITED_TEST = re.compile(r"((?:tests|bench)/[\w/.-]+\.py)::(\w+)")


def test_every_path_cited_in_the_code_exists():
    """Repository paths named in the code, comments and docstrings of covey/, tests/ and bench/ exist
    (a bare test file name somewhere under tests/), and so does a test cited as `tests/<file>.py::<test>`;
    `<placeholder>`, `{a,b}` and `*` paths are not checked."""
    repo = ROOT.parent
    missing = []
    for path in sorted(p for folder in ("covey", "tests", "bench") for p in (repo / folder).rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            line = DOC_URL.sub("", line)
            for cited in (p.rstrip(".") for p in DOC_PATH.findall(line)):
                if any(c in cited for c in "<>{}*"):
                    continue
                found = any((repo / "tests").rglob(cited)) if cited.startswith("test_") else any(repo.glob(cited))
                if not found:
                    missing.append(f"{path.relative_to(repo)}:{number}: {cited}")
            for file, name in CITED_TEST.findall(line):
                source = repo / file
                if source.is_file() and not re.search(rf"^\s*(def|class) {name}\b", source.read_text(), re.M):
                    missing.append(f"{path.relative_to(repo)}:{number}: {file}::{name}")
    assert not missing, "paths cited in the code that do not exist:\n" + "\n".join(missing)


def test_every_package_docstring_names_its_modules():
    """A package's `__init__` docstring names each of its modules and sub-packages (DESIGN: "Every package
    `__init__` opens with a docstring that names what it owns, module by module"): by its own name, as a
    word that is not part of a dotted or slashed path."""
    bad = []
    for init in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        owned = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        owned += [p.parent.name for p in init.parent.glob("*/__init__.py")]
        bad += [f"{init.relative_to(ROOT.parent)}: {name}" for name in sorted(owned)
                if not re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w/-]|\.py)", doc)]
    assert not bad, "modules their package's docstring does not name:\n" + "\n".join(bad)


CONFIG_LIMIT = 8
"""At most this many functions outside covey/config/ take the Config (DESIGN.md: the Config stops at the top)."""
CONFIG_PENDING: dict[str, set[str]] = {}
"""Functions that take the Config today and are to take the config sections or plan options they read instead:
outside the count until then, and listed only while they still take it (the list only shrinks)."""


def imports_covey_config(tree: ast.Module) -> bool:
    """The module imports covey.config's Config: there a parameter named `config` is a covey Config (elsewhere,
    in models/, runtime/ and rollout/, `config` is a Hugging Face model's configuration)."""
    return any(isinstance(node, ast.ImportFrom) and node.module == "covey.config"
               and any(a.name == "Config" for a in node.names) for node in ast.walk(tree))


def config_names(tree: ast.Module) -> set[str]:
    return {"cfg", "config"} if imports_covey_config(tree) else {"cfg"}


def takes_config(fn: ast.FunctionDef | ast.AsyncFunctionDef, names: set[str]) -> bool:
    """A parameter annotated Config (or covey.config.Config), or named as a covey Config is named."""
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    return any(a.arg in names or (a.annotation is not None
                                  and ast.unparse(a.annotation).strip("'\"").split(".")[-1] == "Config")
               for a in args)


def test_at_most_a_handful_of_functions_take_the_config():
    """Outside covey/config/, at most CONFIG_LIMIT functions (by the syntax tree: a parameter annotated `Config`,
    or named `cfg`, or `config` in a module that imports covey.config's Config) see the Config; set-up functions
    take the Plan's sections (covey/training/plan_setup.py)."""
    found: dict[str, set[str]] = {}
    for name, path in modules().items():
        if name.startswith("covey.config"):
            continue
        tree = ast.parse(path.read_text())
        names = config_names(tree)
        found[name] = {node.name for node in ast.walk(tree)
                       if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and takes_config(node, names)}
    stale = [f"{module}.{fn}" for module, fns in CONFIG_PENDING.items()
             for fn in sorted(fns - found.get(module, set()))]
    assert not stale, "no longer take the Config: remove them from CONFIG_PENDING: " + ", ".join(stale)
    counted = sorted(f"{module}.{fn}" for module, fns in found.items()
                     for fn in fns - CONFIG_PENDING.get(module, set()))
    assert len(counted) <= CONFIG_LIMIT, f"{len(counted)} functions take the Config:\n" + "\n".join(counted)


def test_no_getattr_or_hasattr_on_the_config_outside_config():
    """A config field is read by its name (the schema is typed): no getattr / hasattr on the Config or on one of
    its sections outside covey/config/ (`getattr(cfg.optim, "name", ...)` would hide a renamed key)."""
    bad = []
    for name, path in modules().items():
        if name.startswith("covey.config"):
            continue
        tree = ast.parse(path.read_text())
        names = config_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                continue
            root = node.args[0]
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if isinstance(root, ast.Name) and root.id in names:
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "getattr / hasattr on the Config:\n" + "\n".join(bad)


def test_nothing_under_bench_assigns_to_another_objects_attributes_or_reads_its_private_ones():
    """bench/ patches nothing: it assigns only to attributes of its own objects' `self` (no `x.attr = ...`,
    `x.attr += ...`, `del x.attr`, `setattr(x, ...)` on an engine, model, config or module of covey's, nor on any
    other object) and reads no private attribute (`x._name`) of another object; `super()` stands for `self`."""
    def own(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "self") or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")

    def targets(node) -> list:
        found = {ast.Assign: "targets", ast.Delete: "targets", ast.AugAssign: "target", ast.AnnAssign: "target",
                 ast.For: "target", ast.comprehension: "target", ast.withitem: "optional_vars"}.get(type(node))
        found = getattr(node, found) if found else None
        stack, out = (found if isinstance(found, list) else [found] if found is not None else []), []
        while stack:
            t = stack.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                stack.extend(t.elts)
            elif isinstance(t, ast.Starred):
                stack.append(t.value)
            else:
                out.append(t)
        return out

    bad = []
    for path in sorted((ROOT.parent / "bench").rglob("*.py")):
        where = path.relative_to(ROOT.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            bad += [f"{where}:{node.lineno} assigns {ast.unparse(t)}" for t in targets(node)
                    if isinstance(t, ast.Attribute) and not own(t.value)]
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) in ("setattr", "delattr")
                                               or getattr(node.func, "attr", None) in ("__setattr__", "__delattr__")):
                bad.append(f"{where}:{node.lineno} calls {ast.unparse(node.func)}")
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not own(node.value)
                    and not (node.attr.startswith("__") and node.attr.endswith("__"))):
                bad.append(f"{where}:{node.lineno} reads the private {ast.unparse(node)}")
    assert not bad, "bench/ reaches into other objects:\n" + "\n".join(bad)


def test_bench_is_at_most_1750_lines():
    """bench/ is one harness with its workloads, small enough to read in a sitting."""
    lines = {p.name: len(p.read_text().splitlines()) for p in sorted((ROOT.parent / "bench").rglob("*.py"))}
    assert sum(lines.values()) <= 1750, f"bench/ has {sum(lines.values())} lines: {lines}"


MAX_PARAMETERS = 7
AUTOGRAD_METHODS = ("forward", "backward")
"""torch.autograd.Function's forward and backward take one argument per input tensor (and ctx): their count
is the op's, not a design choice."""


def is_autograd_function(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(base).endswith("autograd.Function") or ast.unparse(base) == "Function"
               for base in cls.bases)


def test_no_function_takes_more_than_seven_parameters():
    """Beyond seven parameters a function takes an inputs object (docs/design.md); constructors excepted, and an
    autograd Function's forward/backward (one argument per tensor)."""
    bad = []
    for path in modules().values():
        tree = ast.parse(path.read_text())
        exempt = {id(node) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and is_autograd_function(cls)
                  for node in cls.body if isinstance(node, ast.FunctionDef) and node.name in AUTOGRAD_METHODS}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name == "__init__":
                continue
            a = node.args
            params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")]
            count = len(params) + bool(a.vararg) + bool(a.kwarg)
            if count > MAX_PARAMETERS and id(node) not in exempt:
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} takes {count}")
    assert not bad, "\n".join(bad)


def test_engines_are_called_through_their_interface():
    """One engine interface (covey/rollout/base.py, `Engine`): no wrapper in rollout/ or train/ forwards unknown
    names (`__getattr__`), and nothing asks an engine what it can do by attribute name (getattr / hasattr on
    an engine): what an engine can do is a declared member of the interface."""
    bad = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
                    and name.split(".")[1:2] in (["rollout"], ["training"])):
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: __getattr__ forwarding")
            probe = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                   "hasattr")
            if probe and node.args and "engine" in ast.unparse(node.args[0]).lower():
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
