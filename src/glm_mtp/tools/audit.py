"""Compile every Triton kernel the optimized drafter launches for a CUDA GPU, without one, and
audit the instruction stream against DESIGN.md §5.

    python -m glm_mtp.tools.audit [--arch sm_90] [--presets tiny small glm5]

For each preset, each weight dtype the kernels take (``KERNEL_DTYPES``) and each launch the
drafter makes (every module in ``glm_mtp.optimized.kernels.AUDITED`` lists its own, built by the
function its launcher calls), the kernel is specialised exactly as ``JITFunction.run`` would
specialise it on a GPU (argument types, 16-byte alignment, constexprs, options), compiled by
``triton.compile`` for ``GPUTarget("cuda", cc, 32)`` (the PTX lands in ``TRITON_CACHE_DIR`` as
usual), then assembled again by the ptxas Triton uses for that target, with Triton's flags and
``-v``, for the registers, spills and shared memory. One row per launch; then every forbidden
instruction, named by kernel, preset and PTX line.

Forbidden in a drafter kernel's PTX (§5: correctly rounded ``+ - * / sqrt`` only, no FMA, no flush
of denormals, no approximate intrinsics):

- ``fma``/``mad`` on a float type (``fma.rn.f32``): one rounding where the order has two;
- any ``.approx`` or ``.full`` op (``div.full.f32`` is Triton's plain ``/``, ``sqrt.approx``
  its ``tl.sqrt``, ``ex2.approx`` its ``tl.exp``; also ``rsqrt``, ``rcp``, ``lg2``, ``sin``,
  ``cos``, ``tanh``);
- ``.ftz`` on any op (subnormal inputs or results become zero);
- ``add``/``sub``/``mul`` on a float type without a rounding modifier (``add.f32``, not
  ``add.rn.f32``): ptxas may contract those into an FMA.

Exit status: 0 when every launch compiles and none has a forbidden instruction, 1 otherwise,
2 on bad arguments. The kernels must be real ``@triton.jit`` functions: with ``TRITON_INTERPRET``
set they are interpreter objects, so the command line runs itself again without it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable, NoReturn, Sequence

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from glm_mtp.optimized.kernels import AUDITED, KERNEL_DTYPES
from glm_mtp.optimized.kernels.launch import AuditLaunch, Launch, abstract
from glm_mtp.reference.config import PRESETS, MtpConfig

DEFAULT_PRESETS = ("tiny", "small", "glm5")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# ---- the PTX check ----------------------------------------------------------------------------

FLOAT_TYPES = frozenset({"f16", "f16x2", "bf16", "bf16x2", "f32", "f32x2", "f64"})
ROUNDING = frozenset({"rn", "rz", "rm", "rp"})


@dataclass(frozen=True)
class Finding:
    """A forbidden instruction: its 1-based line in the PTX, the line, and the rule it breaks."""

    line_no: int
    line: str
    rule: str


def _statements(ptx: str) -> Iterable[tuple[int, str, str]]:
    """``(line_no, line, instruction)`` for every instruction in ``ptx``: comments, directives
    (``.reg``, ``.loc``, ...), labels, braces and guard predicates (``@%p1``) stripped; a line of
    inline asm may hold several statements."""
    for line_no, line in enumerate(ptx.splitlines(), 1):
        code = line.split("//", 1)[0]
        for stmt in code.split(";"):
            s = stmt.strip().lstrip("{}").strip()
            s = re.sub(r"^[$\w]+:\s*", "", s)  # a label
            s = re.sub(r"^@!?%?\w+\s+", "", s)  # a guard predicate
            if s and not s.startswith(".") and s[0] not in "{}":
                yield line_no, line.strip(), s


def instruction_rule(instruction: str) -> str | None:
    """The §5 rule ``instruction`` (one PTX statement, e.g. ``add.f32 %f1, %f2, %f3``) breaks,
    or ``None`` when it is allowed."""
    opcode = instruction.split(None, 1)[0]
    base, *parts = opcode.split(".")
    mods = set(parts)
    is_float = bool(mods & FLOAT_TYPES)
    broken = []
    if base in ("fma", "mad") and is_float:
        broken.append("fused multiply-add")
    if mods & {"approx", "full"}:
        broken.append("approximate (.approx/.full)")
    if "ftz" in mods:
        broken.append("flushes denormals (.ftz)")
    if base in ("add", "sub", "mul") and is_float and not mods & ROUNDING:
        broken.append("no rounding modifier (ptxas may contract it into an FMA)")
    return "; ".join(broken) or None


def forbidden(ptx: str) -> list[Finding]:
    """Every instruction of ``ptx`` that §5 forbids, in order."""
    found = []
    for line_no, line, stmt in _statements(ptx):
        rule = instruction_rule(stmt)
        if rule is not None:
            found.append(Finding(line_no, " ".join(line.split()), rule))
    return found


# ---- compiling and assembling -----------------------------------------------------------------


def parse_arch(arch: str) -> int:
    """``sm_90`` / ``sm_90a`` -> 90; ``ValueError`` naming the rule otherwise."""
    m = re.fullmatch(r"sm_(\d{2,3})a?", arch)
    if m is None or int(m.group(1)) < 75:
        raise ValueError(f"--arch must be a CUDA architecture sm_<cc> with cc >= 75, such as sm_90; got {arch!r}")
    return int(m.group(1))


@triton.jit
def _arch_probe(x_ptr, n, BLOCK: tl.constexpr):
    # A load, a cross-lane max (the warp shuffles a reduction compiles to) and a store: what an
    # architecture LLVM's NVPTX backend does not know fails on.
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(x_ptr + offs, v + tl.max(v, 0), mask=offs < n)


def compile_probe(capability: int) -> None:
    """Compile ``_arch_probe`` for ``sm_<capability>`` (in a child process: ``unknown_arch``)."""
    compile_launch(Launch(_arch_probe, (1,), (abstract((16,), torch.float32), 16),
                          {"BLOCK": 16, "enable_fp_fusion": False}),
                   GPUTarget("cuda", capability, 32))


def unknown_arch(arch: str, capability: int) -> str | None:
    """Why this Triton cannot compile for ``arch`` (its LLVM does not know the processor, and on
    such a target LLVM aborts the whole process: no Python error to catch), or ``None``. A probe
    kernel is compiled in a child process first, so the audit refuses the flag instead of dying."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from glm_mtp.tools.audit import compile_probe; compile_probe({capability})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    said = [line for line in lines if "not a recognized processor" in line or "LLVM ERROR" in line]
    if r.returncode == 0 and not said:
        return None
    why = (said or lines or [f"exit status {r.returncode}"])[0].strip()
    return f"--arch {arch}: this Triton's LLVM cannot compile for it ({why})"


def compile_launch(launch: Launch, target: GPUTarget) -> Any:
    """``triton.compile`` of ``launch`` for ``target``, specialised as ``JITFunction.run`` does on
    a device (triton/runtime/jit.py): the same binder, the same ``_pack_args``. Returns the
    ``CompiledKernel`` (``.asm['ptx']``, ``.metadata``). Those are launcher internals (written
    against triton 3.9): if a Triton upgrade moves them, every row fails loudly, none passes."""
    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise TypeError(f"{kernel!r} is not a JITFunction (TRITON_INTERPRET must be unset when triton is imported)")
    backend = make_backend(target)
    kwargs = dict(launch.meta)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # as run() sets them
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


@dataclass(frozen=True)
class Resources:
    """What ptxas -v reports for one kernel, plus the shared memory Triton asks for at launch."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    smem: int  # bytes: ptxas's static shared memory + Triton's dynamic allocation


def ptxas_resources(ptx: str, capability: int, fp_fusion: bool, dynamic_smem: int) -> Resources:
    """Assemble ``ptx`` with the ptxas Triton uses for ``capability`` and Triton's flags
    (backends/nvidia/compiler.py ``make_cubin``), plus ``-v``; parse its report."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(capability).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o", os.path.join(tmp, "kernel.cubin")]
        done = subprocess.run(cmd, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed (exit {done.returncode}):\n{log}")

    def number(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    if re.search(r"Used \d+ registers", log) is None:
        raise RuntimeError(f"ptxas -v reported no register count:\n{log}")
    return Resources(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack=number(r"(\d+) bytes stack frame"),
        smem=number(r"(\d+) bytes smem") + dynamic_smem,
    )


# ---- the audit --------------------------------------------------------------------------------


@dataclass
class Row:
    """One launch's result: ``error`` (the compiler's message) or its resources and findings."""

    kernel: str
    variant: str
    preset: str
    dtype: str
    error: str | None = None
    resources: Resources | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.variant}] preset={self.preset} dtype={self.dtype}"


def audit_one(case: AuditLaunch, preset: str, dtype: torch.dtype, capability: int) -> Row:
    row = Row(case.kernel, case.variant, preset, DTYPE_NAMES.get(dtype, str(dtype)))
    try:
        compiled = compile_launch(case.launch, GPUTarget("cuda", capability, 32))
        ptx = compiled.asm["ptx"]
        md = compiled.metadata
        row.resources = ptxas_resources(ptx, capability, md.enable_fp_fusion, md.shared)
    except Exception as e:  # reported in the table; the audit fails
        row.error = f"{type(e).__name__}: {e}".strip()
        return row
    row.findings = forbidden(ptx)
    return row


def cases(modules: Sequence[Any], cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """Every launch the ``modules`` make at ``cfg`` with ``dtype``."""
    return [case for module in modules for case in module.audit_launches(cfg, dtype)]


HEADER = f"{'kernel':<18} {'variant':<10} {'preset':<7} {'dtype':<5} {'compiled':<8} {'regs':>4} " \
         f"{'spill st/ld B':>13} {'stack B':>7} {'smem B':>6} {'forbidden':>9}"


def format_row(row: Row) -> str:
    head = f"{row.kernel:<18} {row.variant:<10} {row.preset:<7} {row.dtype:<5}"
    if row.error is not None:
        return f"{head} {'ERROR':<8}"
    r = row.resources
    assert r is not None  # a compiled row has its resources
    spills = f"{r.spill_stores}/{r.spill_loads}"
    return f"{head} {'yes':<8} {r.registers:>4} {spills:>13} {r.stack:>7} {r.smem:>6} {len(row.findings):>9}"


def run_audit(presets: Sequence[str], capability: int, modules: Sequence[Any], out=sys.stdout) -> list[Row]:
    """Audit every launch of ``modules`` at ``presets`` for ``sm_<capability>``, printing the
    table row by row to ``out``; returns the rows."""
    rows = []
    print(HEADER, file=out, flush=True)
    for preset in presets:
        cfg = MtpConfig.preset(preset)
        for dtype in KERNEL_DTYPES:
            for case in cases(modules, cfg, dtype):
                rows.append(audit_one(case, preset, dtype, capability))
                print(format_row(rows[-1]), file=out, flush=True)
    return rows


def report(rows: Sequence[Row], arch: str, out=sys.stdout) -> int:
    """Print the errors and forbidden instructions after the table; the exit status."""
    errors = [r for r in rows if r.error is not None]
    for r in errors:
        lines = (r.error or "").splitlines()
        shown = lines if len(lines) <= 40 else lines[:20] + ["..."] + lines[-19:]
        print(f"\nERROR {r.name}: does not compile for {arch}:", file=out)
        print("\n".join("    " + s for s in shown), file=out)
    found = sum(len(r.findings) for r in rows)
    for r in rows:
        for f in r.findings:
            print(f"FORBIDDEN {r.name}: PTX line {f.line_no}: {f.line}   <- {f.rule}", file=out)
    print(f"\naudit {arch}: {len(rows)} launches, {len(rows) - len(errors)} compiled, {len(errors)} failed to compile, "
          f"{found} forbidden instructions", file=out, flush=True)
    return 1 if errors or found else 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints the usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m glm_mtp.tools.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90", help="CUDA architecture to compile for (default sm_90)")
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), metavar="PRESET",
                        help=f"MtpConfig presets (default {' '.join(DEFAULT_PRESETS)}; known: "
                             f"{' '.join(sorted(PRESETS))})")
    parser.add_argument("--modules", nargs="+", metavar="MODULE",
                        help="audit these modules' audit_launches(cfg, dtype) instead of the drafter's kernels "
                             "(a kernel in development; the audit's own tests)")
    args = parser.parse_args(argv)
    try:
        capability = parse_arch(args.arch)
    except ValueError as e:
        parser.error(str(e))
    unknown = [p for p in args.presets if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown preset {unknown[0]!r}; known: {' '.join(sorted(PRESETS))}")
    modules: list[Any] = list(AUDITED)
    if args.modules:
        modules = []
        for name in args.modules:
            try:
                module = importlib.import_module(name)
            except Exception as e:
                parser.error(f"--modules: cannot import {name!r}: {type(e).__name__}: {e}")
            if not callable(getattr(module, "audit_launches", None)):
                parser.error(f"--modules: {name!r} has no audit_launches(cfg, dtype)")
            modules.append(module)
    if knobs.runtime.interpret:
        parser.error("TRITON_INTERPRET is set: the kernels are interpreter objects; unset it to compile them")
    if why := unknown_arch(args.arch, capability):
        parser.error(why)
    rows = run_audit(args.presets, capability, modules)
    return report(rows, args.arch)


if __name__ == "__main__":
    if knobs.runtime.interpret:  # triton saw TRITON_INTERPRET at import: start again without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", "glm_mtp.tools.audit", *sys.argv[1:]], env)
    sys.exit(main())
