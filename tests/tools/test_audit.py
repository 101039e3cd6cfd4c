"""The PTX audit (glm_mtp.tools.audit): its instruction check on synthetic PTX, on kernels that
break DESIGN.md §5 compiled for sm_90 (each caught, exit 1), and on every real drafter kernel at
the tiny, small and glm5 presets (all pass). No GPU needed: Triton compiles for the target and
ptxas assembles on the CPU. The compiling tests run the command line in a subprocess: this
process has TRITON_INTERPRET set (tests/conftest.py), which turns kernels into interpreter objects."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import glm_mtp.optimized as optimized_pkg
from glm_mtp.tools import audit
from glm_mtp.optimized.kernels import AUDITED, KERNEL_DTYPES
from glm_mtp.reference import MtpConfig

# ---- the instruction check on synthetic PTX -----------------------------------------------------

FORBIDDEN_LINES = [
    ("fma.rn.f32 %f4, %f1, %f2, %f3;", "fused multiply-add"),
    ("@%p1 fma.rn.f32 %f4, %f1, %f2, %f3;", "fused multiply-add"),
    ("fma.rn.ftz.f32 %f4, %f1, %f2, %f3;", "fused multiply-add"),
    ("mad.rn.f32 %f4, %f1, %f2, %f3;", "fused multiply-add"),
    ("fma.rn.bf16 %rs4, %rs1, %rs2, %rs3;", "fused multiply-add"),
    ("fma.rn.f64 %fd4, %fd1, %fd2, %fd3;", "fused multiply-add"),
    ("div.full.f32 %f3, %f1, %f2;", "approximate"),
    ("div.approx.f32 %f3, %f1, %f2;", "approximate"),
    ("div.approx.ftz.f32 %f3, %f1, %f2;", "approximate"),
    ("sqrt.approx.f32 %f2, %f1;", "approximate"),
    ("sqrt.approx.ftz.f32 %f2, %f1;", "approximate"),
    ("rsqrt.approx.f32 %f2, %f1;", "approximate"),
    ("rcp.approx.ftz.f64 %fd2, %fd1;", "approximate"),
    ("ex2.approx.f32 %f2, %f1;", "approximate"),
    ("ex2.approx.ftz.f32 %f2, %f1;", "approximate"),
    ("lg2.approx.f32 %f2, %f1;", "approximate"),
    ("sin.approx.f32 %f2, %f1;", "approximate"),
    ("cos.approx.ftz.f32 %f2, %f1;", "approximate"),
    ("tanh.approx.f32 %f2, %f1;", "approximate"),
    ("add.rn.ftz.f32 %f3, %f1, %f2;", "denormals"),
    ("mul.rn.ftz.f32 %f3, %f1, %f2;", "denormals"),
    ("div.rn.ftz.f32 %f3, %f1, %f2;", "denormals"),
    ("min.ftz.f32 %f3, %f1, %f2;", "denormals"),
    ("setp.lt.ftz.f32 %p1, %f1, %f2;", "denormals"),
    ("add.f32 %f3, %f1, %f2;", "no rounding modifier"),
    ("sub.f32 %f3, %f1, %f2;", "no rounding modifier"),
    ("mul.f32 %f3, %f1, %f2;", "no rounding modifier"),
    ("add.sat.f32 %f3, %f1, %f2;", "no rounding modifier"),
    ("add.ftz.f32 %f3, %f1, %f2;", "no rounding modifier"),
    ("mul.f64 %fd3, %fd1, %fd2;", "no rounding modifier"),
    ("add.f16x2 %r3, %r1, %r2;", "no rounding modifier"),
    ("$L__BB0_2: mul.f32 %f3, %f1, %f2;", "no rounding modifier"),  # after a label
    ("{ add.f32 %f3, %f1, %f2; }", "no rounding modifier"),  # inline asm
    ("mov.b32 %r1, 0; add.f32 %f3, %f1, %f2;", "no rounding modifier"),  # two statements
]

ALLOWED_LINES = [
    "add.rn.f32 %f3, %f1, %f2;",
    "sub.rn.f32 %f3, %f1, %f2;",
    "mul.rn.f32 %f3, %f1, %f2;",
    "@!%p2 mul.rn.f32 %f3, %f1, %f2;",
    "add.rz.f32 %f3, %f1, %f2;",
    "mul.rm.f64 %fd3, %fd1, %fd2;",
    "div.rn.f32 %f3, %f1, %f2;",
    "sqrt.rn.f32 %f2, %f1;",
    "rcp.rn.f32 %f2, %f1;",
    "add.rn.bf16 %rs3, %rs1, %rs2;",
    "add.s32 %r3, %r1, %r2;",
    "add.s64 %rd3, %rd1, %rd2;",
    "sub.s64 %rd3, %rd1, %rd2;",
    "mul.lo.s32 %r3, %r1, %r2;",
    "mul.wide.u32 %rd3, %r1, 8;",
    "mad.lo.s32 %r4, %r1, %r2, %r3;",
    "mad.wide.s32 %rd4, %r1, 4, %rd3;",
    "cvt.rn.bf16.f32 %rs1, %f1;",
    "cvt.f32.bf16 %f1, %rs1;",
    "max.f32 %f3, %f1, %f2;",
    "min.NaN.f32 %f3, %f1, %f2;",
    "setp.lt.f32 %p1, %f1, %f2;",
    "setp.nan.f32 %p1, %f1, %f1;",
    "selp.f32 %f3, %f1, %f2, %p1;",
    "ld.global.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];",
    "st.global.b16 [ %rd1 + 0 ], { %rs1 };",
    "mov.b32 %f1, 0f3F800000;",
    "// fma.rn.f32 %f4, %f1, %f2, %f3; in a comment",
    "mov.u32 %r1, %tid.x; // add.f32 in a trailing comment",
    ".loc 1 23 0 // embed.py:23:0",
    ".reg .f32 %f<9>;",
    '.file 1 "/src/fma.approx.py"',
    "$L__BB0_2:",
    "ret;",
]


@pytest.mark.parametrize("line,rule", FORBIDDEN_LINES)
def test_check_flags_each_forbidden_form(line, rule):
    found = audit.forbidden(line)
    assert len(found) == 1 and rule in found[0].rule, found
    assert found[0].line_no == 1 and found[0].line == line.strip()


@pytest.mark.parametrize("line", ALLOWED_LINES)
def test_check_allows_rounded_and_integer_forms(line):
    assert audit.forbidden(line) == []


def test_check_names_the_ptx_lines():
    ptx = "\n".join([
        ".version 9.4", ".target sm_90a", ".visible .entry k(", ".param .u64 k_param_0", ")", "{",
        "\tld.global.b32 %f1, [%rd1];",
        "\tmul.rn.f32 %f3, %f1, %f2;",
        "\tfma.rn.f32 %f4, %f1, %f2, %f3;",  # line 9
        "\t// begin inline asm",
        "\t@%p1 add.f32 %f5, %f4, %f1;",  # line 11
        "\tret;", "}",
    ])
    found = audit.forbidden(ptx)
    assert [(f.line_no, f.line) for f in found] == [(9, "fma.rn.f32 %f4, %f1, %f2, %f3;"),
                                                    (11, "@%p1 add.f32 %f5, %f4, %f1;")]


# ---- the registry --------------------------------------------------------------------------------


def _jit_functions(module) -> dict[str, object]:
    """The ``@triton.jit`` functions defined in ``module`` (real or interpreted)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, (JITFunction, InterpretedFunction)) and obj.fn.__module__ == module.__name__}


# Modules whose kernels serve one family only: at the other family's presets they launch nothing.
ONE_FAMILY = {"glm_mtp.optimized.kernels.kpool": "glm5_next"}


def test_every_kernel_is_audited():
    """Every module of glm_mtp.optimized that defines a Triton kernel is in ``AUDITED``, and each
    of its kernels (``*_kernel``; the rest are helpers they call) has a launch at every preset of
    each family it serves (nothing at the others'). A module of helpers only (``kernels.rounding``)
    is compiled inside the kernels that call them."""
    with_kernels = set()
    for info in pkgutil.walk_packages(optimized_pkg.__path__, "glm_mtp.optimized."):
        module = importlib.import_module(info.name)
        if any(name.endswith("_kernel") for name in _jit_functions(module)):
            with_kernels.add(module.__name__)
    assert with_kernels == {m.__name__ for m in AUDITED}
    for module in AUDITED:
        entries = {obj for name, obj in _jit_functions(module).items() if name.endswith("_kernel")}
        assert entries
        for preset in (*audit.DEFAULT_PRESETS, "glm5next_tiny", "glm5next"):
            cfg = MtpConfig.preset(preset)
            launched = {c.launch.kernel for dtype in KERNEL_DTYPES for c in module.audit_launches(cfg, dtype)}
            if ONE_FAMILY.get(module.__name__, cfg.family) != cfg.family:
                assert not launched, (module.__name__, preset)
            else:  # its own kernels, and perhaps one it reuses (kpool's pool top-k is indexer's top-k)
                assert entries <= launched, (module.__name__, preset)


# ---- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--arch", "gfx90"], "--arch must be"),
    (["--arch", "sm_9"], "--arch must be"),
    (["--arch", "sm_70"], "--arch must be"),
    (["--presets", "tiny", "huge"], "unknown preset 'huge'"),
    (["--presets"], "--presets"),
    (["--modules", "glm_mtp.no_such_module"], "cannot import 'glm_mtp.no_such_module'"),
    (["--modules", "glm_mtp.reference.config"], "has no audit_launches"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        audit.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.fixture(scope="session")
def triton_cache(tmp_path_factory) -> str:
    """A fresh TRITON_CACHE_DIR for this session's compiles (nothing from an earlier run)."""
    return str(tmp_path_factory.mktemp("triton-cache"))


def _run_audit(
    args: list[str], cache: str, pythonpath: str | None = None, keep_interpret: bool = False
) -> subprocess.CompletedProcess:
    """The command line in a subprocess, without TRITON_INTERPRET unless ``keep_interpret`` (then
    the command restarts itself without it: one more interpreter start)."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    if not keep_interpret:
        env.pop("TRITON_INTERPRET", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "glm_mtp.tools.audit", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def _table(stdout: str) -> list[list[str]]:
    """The table's rows, split into columns (kernel variant preset dtype compiled regs spills
    stack smem forbidden); the header and everything after the table left out."""
    lines = stdout.splitlines()
    assert lines[0].split()[:4] == ["kernel", "variant", "preset", "dtype"], stdout
    return [line.split() for line in lines[1 : lines.index("")]]


# Kernels that each break §5 in one way (and one that keeps it), compiled by the audit as a
# module of its own (--modules). Written to a file: Triton reads a kernel's source from it.
BROKEN = '''
"""Kernels that break DESIGN.md section 5, one way each, and one that keeps it."""
import torch
import triton
import triton.language as tl

from glm_mtp.optimized.kernels.launch import AuditLaunch, Launch, abstract


@triton.jit
def _op_kernel(x_ptr, y_ptr, z_ptr, out_ptr, N, OP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + i, mask=m)
    y = tl.load(y_ptr + i, mask=m)
    z = tl.load(z_ptr + i, mask=m)
    if OP == 0:
        r = x / y
    elif OP == 1:
        r = tl.exp(x)
    elif OP == 2:
        r = x * y + z
    elif OP == 3:
        r = tl.inline_asm_elementwise("add.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True, pack=1)
    elif OP == 4:
        r = tl.sqrt(x)
    else:  # allowed: each op rounded on its own, correctly rounded division and root
        r = tl.math.div_rn(x * y + z, tl.math.sqrt_rn(y))
    tl.store(out_ptr + i, r, mask=m)


def launch(cfg, op, fusion=False, block=None):
    N = cfg.hidden_size
    v = [abstract((N,), torch.float32) for _ in range(4)]
    meta = dict(OP=op, BLOCK=block or triton.next_power_of_2(N), enable_fp_fusion=fusion)
    return Launch(_op_kernel, (1,), (*v, N), meta)


def clean(cfg):
    return [AuditLaunch("clean", "rn", launch(cfg, 5))]


def audit_launches(cfg, dtype):
    if dtype != torch.float32:
        return []
    return [
        AuditLaunch("broken", "div", launch(cfg, 0)),
        AuditLaunch("broken", "exp", launch(cfg, 1)),
        AuditLaunch("broken", "fma", launch(cfg, 2, fusion=True)),
        AuditLaunch("broken", "add.f32", launch(cfg, 3)),
        AuditLaunch("broken", "sqrt", launch(cfg, 4)),
        AuditLaunch("broken", "block", launch(cfg, 5, block=cfg.hidden_size + 1)),  # arange of 65: no compile
        *clean(cfg),
    ]
'''

CLEAN = '''
import torch
from audit_broken import clean


def audit_launches(cfg, dtype):
    return clean(cfg) if dtype == torch.float32 else []
'''


def test_broken_kernels_fail_the_audit(tmp_path, triton_cache):
    (tmp_path / "audit_broken.py").write_text(textwrap.dedent(BROKEN))
    (tmp_path / "audit_clean.py").write_text(textwrap.dedent(CLEAN))

    done = _run_audit(["--presets", "tiny", "--modules", "audit_broken"], triton_cache, str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    rows = {(r[0], r[1]): r for r in _table(out)}
    assert rows[("broken", "block")][4] == "ERROR"
    assert "ERROR broken[block] preset=tiny dtype=fp32: does not compile for sm_90" in out
    assert "arange" in out.split("ERROR broken[block]")[1]  # the compiler's own message
    assert rows[("clean", "rn")][4] == "yes" and rows[("clean", "rn")][9] == "0"
    for variant, instruction, rule in [("div", "div.full.f32", "approximate"), ("exp", "ex2.approx", "approximate"),
                                       ("fma", "fma.rn.f32", "fused multiply-add"),
                                       ("add.f32", "add.f32", "no rounding"),
                                       ("sqrt", "sqrt.approx.ftz.f32", "denormals")]:
        assert rows[("broken", variant)][4] == "yes" and int(rows[("broken", variant)][9]) >= 1, variant
        flagged = [
            line
            for line in out.splitlines()
            if line.startswith(f"FORBIDDEN broken[{variant}] preset=tiny dtype=fp32: PTX line ")
        ]
        assert any(instruction in line and rule in line for line in flagged), (variant, flagged)
    assert "FORBIDDEN clean" not in out

    done = _run_audit(["--presets", "tiny", "--modules", "audit_clean"], triton_cache, str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failed to compile, 0 forbidden instructions" in done.stdout


# The glm5_next family's own kernels and the cache write that stores its gates, at glm5next's
# widths (H 4096, index_topk 2048, kpool 4: 512 pools listed): compiled in the default run (tens of launches).
FAMILY_MODULES = ("glm_mtp.optimized.kernels.kpool", "glm_mtp.optimized.kernels.rope_cache")


def test_the_glm5_next_kernels_pass_at_glm5next(triton_cache):
    """The pooled-key write, pool scores, pool selection and pools_forget (step, rows and batch
    launches) and cache_rows_write with the gates, both dtypes, compiled for sm_90: 0 forbidden."""
    done = _run_audit(["--presets", "glm5next", "--modules", *FAMILY_MODULES], triton_cache)
    assert done.returncode == 0, done.stdout + done.stderr
    modules = [importlib.import_module(m) for m in FAMILY_MODULES]
    want = [
        (c.kernel, c.variant)
        for dtype in KERNEL_DTYPES
        for c in audit.cases(modules, MtpConfig.preset("glm5next"), dtype)
    ]
    rows = _table(done.stdout)
    assert [tuple(r[:2]) for r in rows] == want
    assert {"kpool:pool_keys_write", "kpool:pool_scores", "kpool:select_pool_rows", "kpool:pools_forget",
            "cache_rows_write"} <= {k for k, _ in want}
    for r in rows:
        assert r[4] == "yes" and r[9] == "0", r
    assert f"{len(want)} launches, {len(want)} compiled, 0 failed to compile, 0 forbidden instructions" in done.stdout


# The preset the suite audits: glm5's real widths, what a GPU runs. tiny and small (smaller blocks,
# masked tails) are in the CLI's default run (``python -m glm_mtp.tools.audit``), at the cost of
# another ~300 compiles that CI's time budget leaves to that command (docs/performance.md: the PTX audit).
AUDITED_PRESETS = ("glm5", "glm5next")


@pytest.mark.slow
def test_every_drafter_kernel_passes_at_glm5_and_glm5next(triton_cache):
    """The acceptance run: every launch of every audited kernel, both cache dtypes, at glm5 and
    glm5next (the real widths of both families), compiled for sm_90 and free of forbidden instructions.
    TRITON_INTERPRET is left set where this process has it, so the restart is exercised too."""
    done = _run_audit(["--presets", *AUDITED_PRESETS], triton_cache, keep_interpret=True)
    assert done.returncode == 0, done.stdout + done.stderr
    launches = [(c, preset, dtype) for preset in AUDITED_PRESETS for dtype in KERNEL_DTYPES
                for c in audit.cases(AUDITED, MtpConfig.preset(preset), dtype)]
    want = [(c.kernel, c.variant, preset, audit.DTYPE_NAMES[dtype]) for c, preset, dtype in launches]
    rows = _table(done.stdout)
    assert [tuple(r[:4]) for r in rows] == want
    for r in rows:
        assert r[4] == "yes" and int(r[5]) > 0 and r[9] == "0", r
    assert "FORBIDDEN" not in done.stdout and "ERROR" not in done.stdout
    assert f"{len(want)} launches, {len(want)} compiled, 0 failed to compile, 0 forbidden instructions" in done.stdout
    # The PTX landed in TRITON_CACHE_DIR: each kernel's, at most one file per launch.
    ptx_files = [f for _, _, files in os.walk(triton_cache) for f in files if f.endswith(".ptx")]
    for fn_name in {c.launch.kernel.fn.__name__ for c, _, _ in launches}:
        n = ptx_files.count(f"{fn_name}.ptx")
        assert 1 <= n <= sum(c.launch.kernel.fn.__name__ == fn_name for c, _, _ in launches), (fn_name, n)
