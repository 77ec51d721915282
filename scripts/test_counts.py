"""Counts the test suite's assertions statically: assert statements, pytest.raises/warns, and the assert_* helpers of
numpy.testing, torch.testing and unittest-style calls, in tests/ (one figure to compare before and after a change)."""
import ast, sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests")
asserts = raises = helpers = tests = 0
for path in sorted(root.rglob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            asserts += 1
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("raises", "warns"):
                raises += 1
            elif name.startswith("assert_"):
                helpers += 1
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            tests += 1
print(f"test functions {tests}, assert statements {asserts}, pytest.raises/warns {raises}, assert_* calls {helpers}, "
      f"total {asserts + raises + helpers}")
