"""DESIGN.md §5 read off the kernels' source: no library reduction, transcendental or approximate
division on floating data inside any ``@triton.jit`` function, and every launch the drafter builds
compiles without FMA contraction. (The PTX audit checks the compiled code; this checks what it
cannot name: a ``tl.sum`` whose order happens to compile to plain adds is still not the psum.)"""

from __future__ import annotations

import ast
import inspect
import pkgutil

import pytest
import torch

from glm_mtp.optimized import kernels as kernels_pkg
from glm_mtp.optimized.kernels import AUDITED, KERNEL_DTYPES
from glm_mtp.reference import MtpConfig

# Calls that compute on floating data in an order or precision the library picks.
FORBIDDEN_CALLS = {
    "dot", "dot_scaled", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "softmax", "fma", "fdiv", "erf",
    "sin", "cos", "xor_sum",
}
# Reductions and scans: exact on integers, order-dependent on floats. Allowed only on a line that
# says so (``# integer``), where the reviewer checked the operand is an integer tensor.
REDUCTIONS = {"sum", "cumsum", "cumprod", "reduce", "associative_scan"}
# tl.math functions with a pinned rounding.
MATH_ALLOWED = {"div_rn", "sqrt_rn"}


def kernel_modules():
    return [m for m in (importlib_module(info.name) for info in pkgutil.iter_modules(kernels_pkg.__path__,
                                                                                     "glm_mtp.optimized.kernels."))]


def importlib_module(name: str):
    import importlib

    return importlib.import_module(name)


def jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """Functions decorated ``@triton.jit`` (or ``@jit``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                name = ast.unparse(d)
                if name in ("triton.jit", "jit") or name.startswith(("triton.jit(", "jit(")):
                    out.append(node)
    return out


def findings(source: str) -> list[str]:
    """Each forbidden form in the jit functions of ``source``, as ``line: text``."""
    lines = source.splitlines()
    found = []
    for fn in jit_functions(ast.parse(source)):
        for node in ast.walk(fn):
            where = f"{getattr(node, 'lineno', 0)}: {lines[getattr(node, 'lineno', 1) - 1].strip()}"
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                found.append(f"'/' (use tl.math.div_rn; '//' for integers) at {where}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                chain = ast.unparse(node.func)
                attr = node.func.attr
                if chain.startswith("tl.math.") and attr not in MATH_ALLOWED:
                    found.append(f"{chain} at {where}")
                elif chain.startswith("tl.") and attr in FORBIDDEN_CALLS:
                    found.append(f"{chain} at {where}")
                elif chain.startswith("tl.") and attr in REDUCTIONS and "# integer" not in lines[node.lineno - 1]:
                    found.append(f"{chain} without '# integer' at {where}")
    return found


@pytest.mark.parametrize("module", kernel_modules(), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_kernel_sources_use_only_pinned_operations(module):
    assert findings(inspect.getsource(module)) == []


@pytest.mark.parametrize("form", [
    "x = tl.sum(p, axis=1)",
    "x = tl.exp(p)",
    "x = a / b",
    "x = tl.math.exp(p)",
    "x = tl.dot(a, b)",
    "x = tl.sqrt(p)",
    "x = tl.cumsum(p, axis=0)",
])
def test_the_scan_flags_each_forbidden_form(form):
    source = f"import triton\nimport triton.language as tl\n@triton.jit\ndef k(a, b, p):\n    {form}\n"
    assert len(findings(source)) == 1, findings(source)


def test_the_scan_allows_pinned_forms():
    source = ("import triton\nimport triton.language as tl\n@triton.jit\ndef k(a, b, p, q):\n"
              "    x = tl.math.div_rn(a, tl.math.sqrt_rn(b))\n"
              "    n = tl.sum(q.to(tl.int64), axis=0)  # integer\n"
              "    i = a // 2\n"
              "    m = tl.max(p, axis=0)\n")
    assert findings(source) == []


@pytest.mark.parametrize("preset", ["tiny", "small", "glm5"])
def test_every_launch_compiles_without_fp_fusion(preset):
    cfg = MtpConfig.preset(preset)
    for module in AUDITED:
        for dtype in KERNEL_DTYPES:
            for case in module.audit_launches(cfg, dtype):
                assert case.launch.meta.get("enable_fp_fusion") is False, (module.__name__, case.kernel, case.variant)


def test_kernel_dtypes_are_what_the_audit_compiles():
    assert set(KERNEL_DTYPES) == {torch.float32, torch.bfloat16}
