"""The reading path: how many lines a reader opens to follow one GRPO step, helpers included.

    python -m bench reading            # the README's table, as markdown
    python -m bench reading --by-def   # every definition reached, with its lines

From the step's entry points (STEP) it follows every name the code uses into the core modules
(bench/ and tests/ left out), transitively, and counts each function or class reached once, its
docstring and decorators included: a bare name defined or imported in the module, `module.name`,
`self.name` within a class, and `x.name` where exactly one core class has a method of that name.
A class counts its body without its methods, plus `__init__`, `__call__`, `forward`, `__enter__`
and `__exit__` when it is named. What static names cannot show (callbacks, getattr) is left out,
so the figure is a floor. tests/test_bench.py checks that the README's table is this output.
"""
import ast
import os
from collections import defaultdict

from bench.common import ROOT

# the step as train.py runs it (train_step: tasks, rollouts, mixed groups kept, advantages), and what
# it calls through the run's fields at their defaults: the scorer, the estimator and the update
STEP = ["train.py:train_step", "train.py:score_groups", "grpo.py:grpo_advantages", "grpo.py:grpo_step"]
IMPLICIT = ("__init__", "__call__", "forward", "__post_init__", "__enter__", "__exit__")
FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


def lines(node) -> int:
    """A definition's lines, decorators included; a class's without its methods."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    methods = sum(lines(n) for n in node.body if isinstance(n, FUNCTION)) if isinstance(node, ast.ClassDef) else 0
    return node.end_lineno - first + 1 - methods


def index(root=ROOT):
    """(definitions {(module, name): node}, imports {module: {local name: module or (module, name)}},
    owners {method name: [(module, Class.method)]}) over the core modules at the root."""
    defs, imports, owners = {}, {}, defaultdict(list)
    modules = {f[:-3] for f in os.listdir(root) if f.endswith(".py")}
    for mod in modules:
        tree = ast.parse(open(os.path.join(root, mod + ".py"), encoding="utf-8").read())
        imports[mod] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports[mod].update({a.asname or a.name: a.name for a in node.names if a.name in modules})
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                imports[mod].update({a.asname or a.name: (node.module, a.name) for a in node.names})
        for node in tree.body:
            if isinstance(node, FUNCTION + (ast.ClassDef,)):
                defs[mod, node.name] = node
            if isinstance(node, ast.ClassDef):
                for item in (i for i in node.body if isinstance(i, FUNCTION)):
                    defs[mod, f"{node.name}.{item.name}"] = item
                    owners[item.name].append((mod, f"{node.name}.{item.name}"))
    return defs, imports, owners


def named(key, defs):
    """A definition as a name reaches it: a class brings its implicit methods."""
    return {key} | {(key[0], f"{key[1]}.{m}") for m in IMPLICIT if (key[0], f"{key[1]}.{m}") in defs}


def references(key, defs, imports, owners):
    """The core definitions the body of `key` names."""
    mod, qual = key
    node, cls = defs[key], qual.split(".")[0] if "." in qual else None
    body = ([i for i in node.body if not isinstance(i, FUNCTION)] + node.bases) if isinstance(node, ast.ClassDef) else node.body
    found = set()
    for n in (n for part in body for n in ast.walk(part)):
        if isinstance(n, ast.Name):
            target = (mod, n.id) if (mod, n.id) in defs else imports[mod].get(n.id)
            found |= named(target, defs) if isinstance(target, tuple) and target in defs else set()
        elif isinstance(n, ast.Attribute):
            base = n.value.id if isinstance(n.value, ast.Name) else None
            if isinstance(imports[mod].get(base), str):                   # module.name
                found |= named((imports[mod][base], n.attr), defs) if (imports[mod][base], n.attr) in defs else set()
            elif base in ("self", "cls") and (mod, f"{cls}.{n.attr}") in defs:
                found.add((mod, f"{cls}.{n.attr}"))
            elif len(owners.get(n.attr, [])) == 1 and not n.attr.startswith("__"):
                method = owners[n.attr][0]
                found |= {method, (method[0], method[1].split(".")[0])}
    return found - {key}


def reading_path(roots=STEP, root=ROOT) -> dict:
    """{(module, name): lines} of every definition the roots reach."""
    defs, imports, owners = index(root)
    todo = [(path[:-3], name) for path, name in (r.split(":") for r in roots)]
    seen = set()
    while todo:
        key = todo.pop()
        if key not in seen:
            seen.add(key)
            todo += references(key, defs, imports, owners)
    return {key: lines(defs[key]) for key in seen}


def table(path) -> str:
    """The README's table: lines per module, most first, and the total."""
    per_module = defaultdict(int)
    for (mod, _), n in path.items():
        per_module[mod] += n
    rows = [f"| `{mod}.py` | {n} |" for mod, n in sorted(per_module.items(), key=lambda kv: (-kv[1], kv[0]))]
    return "\n".join(["| module | lines |", "| --- | --- |", *rows, f"| **total** | **{sum(path.values())}** |"])


def bench_reading(args):
    path = reading_path()
    if getattr(args, "by_def", False):
        for (mod, name), n in sorted(path.items()):
            print(f"{n:5}  {mod}.py:{name}")
    print(table(path))
