"""The package's layout rules, checked statically: no import circles between its modules, no
imports inside functions (but optional heavy dependencies and the compiled library), no module
importing another's private names, no module over 400 lines, and inference (everything but
``training`` and ``cli``) never importing ``jakiro_ext.training``. Exit 1 and a list of what
breaks them."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jakiro_ext"
MAX_LINES = 400
LAZY = ("transformers", "safetensors", "gguf", "tqdm", "matplotlib", "torch.utils.cpp_extension", "jakiro_ext._C", "vllm",
        "sglang")  # (the serving engines: only when the engine itself calls the plugin)
OUTSIDE_INFERENCE = ("jakiro_ext.training", "jakiro_ext.cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node, modules) -> list:
    """The package modules an import statement loads (a package's own __init__ is not counted
    for its submodules: importing jakiro_ext.ops.reference runs jakiro_ext.ops first anyway)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    found = []
    for a in node.names:
        full = f"{node.module}.{a.name}"
        if full in modules:
            found.append(full)
        elif node.module in modules:
            found.append(node.module)
    return found


def strongly_connected(graph: dict) -> list:
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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


def problems() -> list:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p): p for p in paths}
    graph, found = {}, []
    for name, path in modules.items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            found.append(f"{path.relative_to(PACKAGE.parent)}: {text.count(chr(10))} lines (at most {MAX_LINES})")
        tree = ast.parse(text)
        edges = set()
        type_only = {id(n) for guard in tree.body if isinstance(guard, ast.If) and "TYPE_CHECKING" in ast.unparse(guard.test)
                     for n in ast.walk(guard)}  # imports for annotations only
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or (isinstance(node, ast.ImportFrom) and node.level):
                continue
            if id(node) in type_only:  # never run, but a dependency all the same: no circle through it
                edges.update(t for t in imported(node, modules) if t != name and not name.startswith(t + "."))
                continue
            source = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            names = [f"{source}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else [source]
            if node.col_offset > 0 and not any(n == lazy or n.startswith(lazy + ".") or source.startswith(lazy)
                                               for n in names for lazy in LAZY):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: import inside a function: "
                             f"{ast.get_source_segment(text, node)}")
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: imports the private {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_") and f"{node.module}.{a.name}" not in modules
                          and a.name != "_C"]
            for target in imported(node, modules):
                if target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
        inference = not name.startswith(OUTSIDE_INFERENCE) and name != "jakiro_ext.__main__"
        if inference:
            found += [f"{path.relative_to(PACKAGE.parent)}: inference imports {t}" for t in sorted(edges)
                      if t.startswith("jakiro_ext.training")]
    found += [f"import circle: {' -> '.join(c)}" for c in strongly_connected(graph)]
    return found


if __name__ == "__main__":
    listed = problems()
    print("\n".join(listed) if listed else "layout: no import circles, no imports inside functions, no private "
          f"imports, no module over {MAX_LINES} lines, inference apart from training")
    sys.exit(1 if listed else 0)
