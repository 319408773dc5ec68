"""The package's functions stay short enough to read: none over ``MAX_LINES`` lines (signature,
docstring and body), so a long one is split into steps whose names say what they do."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 80


def test_no_function_over_80_lines():
    long = []
    for folder, _, files in os.walk(os.path.join(REPO, "ttrace_megatron")):
        for f in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, f)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)
