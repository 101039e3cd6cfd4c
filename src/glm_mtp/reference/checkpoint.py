"""Reading and writing GLM-5 style checkpoints: ``config.json`` plus safetensors, one file or
sharded with ``model.safetensors.index.json``. Only the tensors asked for are read.

Loading is strict (every rule names the file and the tensor): each file must be readable
safetensors, index entries plain file names inside the folder, every weight float16/bfloat16/
float32/float64 and, unless the caller casts, all one dtype (the routing bias may also be
float32), and finite unless ``allow_non_finite``. A checkpoint whose ``config.json`` declares
``quantization_config`` fp8 with 128 x 128 blocks may store the weights DESIGN.md §8 lists as
float8_e4m3fn, each with its ``*_scale_inv`` (rules in ``fp8.pair_scales``). One quantized in a format
this package does not read (modelopt NVFP4, MXFP4, ...) loads when the tensors read are all plain,
and is refused naming the format and the tensor otherwise (``quantization``). Saving replaces the
whole checkpoint or nothing (``save_checkpoint``).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import warnings
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from . import fp8
from .config import MtpConfig, read_hf_json, read_json_object, read_tie_word_embeddings
from .quantization import read_quantization, refuse_quantization_tensor, refuse_quantized_dtype

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


# Copies of the target's embedding and head that some checkpoints carry inside the MTP layer.
# Engines use the target's own tensors (DESIGN.md §2), so these are accepted and never read.
IGNORED_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def float32_tensor(cfg: MtpConfig, name: str) -> bool:
    """Whether a tensor stays float32 whatever the weights' dtype: the routing bias (both
    families) and, in glm5_next, the router itself (transformers keeps ``gate.weight`` in fp32)."""
    return name.endswith("e_score_correction_bias") or (cfg.is_next and name.endswith("mlp.gate.weight"))


class CheckpointError(ValueError):
    """A checkpoint that does not hold what its config promises."""


# ------------------------------------------------------------------------------------------------
# Reading.


def _unreadable(path: str, e: BaseException) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})")


def check_checkpoint_directory(call: str, directory: object) -> str:
    """``directory`` as a path string to an existing directory (a symbolic link to one is
    followed, as in a Hugging Face cache); ``ValueError`` naming the argument for another type,
    a missing path, a broken link or a path that is not a directory (a checkpoint is a folder:
    ``config.json`` and its safetensors)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"{call}: directory must be a path (str or os.PathLike), got {type(directory).__name__}")
    path = os.fspath(directory)
    if not isinstance(path, str):
        raise ValueError(f"{call}: directory must be a text path, got {type(path).__name__}")
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{call}: directory {path!r} is a broken symbolic link (to {os.readlink(path)!r})")
    if not os.path.exists(path):
        raise ValueError(f"{call}: directory {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{call}: directory {path!r} is not a directory (a checkpoint is a folder holding config.json and safetensors)")
    return path


def checkpoint_weight_map(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Tensor name -> file name, from the index or from the single file's header.

    Raises ``CheckpointError`` when both an index and a single file exist (ambiguous: a stale
    save), and naming the file for an index that is not JSON, has no
    ``weight_map`` object, or maps a tensor to anything but a plain file name in ``directory``
    (``../other/model.safetensors``, an absolute path or a sub-folder would read another
    checkpoint's bytes), and for a single file that is not safetensors.
    """
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX_FILE)
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.exists(index) and os.path.exists(single):
        # Which one is current cannot be told (an older save over a newer one left both behind).
        raise CheckpointError(f"{directory}: holds both {INDEX_FILE} and {SINGLE_FILE}; which is current is ambiguous, remove one")
    if os.path.exists(index):
        body = read_json_object(index, CheckpointError)
        wmap = body.get("weight_map")
        if not isinstance(wmap, dict):
            raise CheckpointError(f"{index}: needs a 'weight_map' object (tensor name -> file name), got {wmap!r}")
        for name, file in wmap.items():
            if not isinstance(file, str) or file in ("", ".", "..") or os.path.basename(file) != file or "\\" in file:
                raise CheckpointError(
                    f"{index}: weight_map[{name!r}] = {file!r} must be a plain file name in the checkpoint folder"
                )
        return dict(wmap)
    if os.path.exists(single):
        try:
            with safe_open(single, "pt") as f:
                return {k: SINGLE_FILE for k in f.keys()}
        except Exception as e:  # the library's errors are bare (no file name)
            raise _unreadable(single, e) from e
    raise CheckpointError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")


def read_tensors(directory: str | os.PathLike[str], names: list[str], weight_map: dict[str, str]) -> dict[str, Tensor]:
    """Read exactly ``names``, opening each shard once; other tensors' bytes are never touched.
    Raises ``CheckpointError`` naming the file (and tensor) for a missing or unreadable file
    or a tensor the file does not hold."""
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(weight_map[n], []).append(n)
    out: dict[str, Tensor] = {}
    for file, wanted in by_file.items():
        path = os.path.join(os.fspath(directory), file)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such file (the checkpoint places tensor {wanted[0]!r} there)")
        try:
            with safe_open(path, "pt") as f:
                held = set(f.keys())
                for n in wanted:
                    if n not in held:
                        raise CheckpointError(f"{path}: tensor {n!r} is not in the file (the checkpoint places it there)")
                    out[n] = f.get_tensor(n)
        except CheckpointError:
            raise
        except Exception as e:
            raise _unreadable(path, e) from e
    return out


def check_shape(name: str, tensor: Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


# The dtypes a weight may be stored and computed in. float8 types count as floating in torch, but
# they need scale tensors this drafter does not read: a plain cast would be silently wrong.
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_dtypes(tensors: dict[str, Tensor], where: dict[str, str], reference: str, cast: bool = False,
                 float32_ok: "Callable[[str], bool] | None" = None) -> None:
    """Every tensor is stored in one of ``WEIGHT_DTYPES`` and, unless ``cast`` (the caller casts
    every weight to one requested dtype), in the dtype of ``tensors[reference]``, the checkpoint's
    dtype: the drafter computes in its weights' dtype, so a float32 matrix among bfloat16 would
    fail deep inside torch. A routing bias (``e_score_correction_bias``) may also be float32, as
    real checkpoints store it, and so may any tensor ``float32_ok`` names (glm5_next's router).
    ``where``: tensor name -> the file it came from, for the message."""
    for name in (reference, *tensors):
        if tensors[name].dtype not in WEIGHT_DTYPES:
            raise CheckpointError(
                f"{where[name]}: tensor {name!r} has dtype {tensors[name].dtype}; checkpoint weights must be floating point, "
                f"one of {', '.join(map(str, WEIGHT_DTYPES))} (or float8_e4m3fn with its *_scale_inv in a checkpoint whose "
                "config.json declares quantization_config fp8, block [128, 128])"
            )
    if cast:
        return
    want = tensors[reference].dtype
    for name, t in tensors.items():
        fp32 = name.endswith("e_score_correction_bias") or (float32_ok is not None and float32_ok(name))
        ok = t.dtype == want or (fp32 and t.dtype == torch.float32)
        if not ok:
            raise CheckpointError(
                f"{where[name]}: tensor {name!r} has dtype {t.dtype}, but the checkpoint's weights are {want} "
                f"(the dtype of {reference!r}); every weight must have that one floating dtype, or pass dtype= to cast all"
            )


def count_non_finite(t: Tensor) -> int:
    """How many NaN/inf values ``t`` holds. One read in the common case: a sum of finite values
    is finite unless it overflows, and any NaN/inf makes it non-finite, so only a non-finite
    sum (a broken tensor, or huge finite values) pays for the exact elementwise count."""
    if not t.dtype.is_floating_point:
        return 0
    total = t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()  # float16's range is small
    if bool(torch.isfinite(total)):
        return 0
    return int((~torch.isfinite(t)).sum())


def check_finite(tensors: dict[str, Tensor], where: dict[str, str]) -> None:
    for name, t in tensors.items():
        bad = count_non_finite(t)
        if bad:
            raise CheckpointError(
                f"{where[name]}: tensor {name!r} holds {bad} non-finite value(s) (NaN/inf) of {t.numel()}; "
                "pass allow_non_finite=True to load it anyway (e.g. to inspect a broken checkpoint)"
            )


def load_mtp_tensors(
    directory: str | os.PathLike[str],
    cfg: MtpConfig,
    expected: dict[str, tuple[int, ...]],
    experts: range | None = None,
    allow_non_finite: bool = False,
    cast: bool = False,
) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """The MTP layer's tensors (layer-relative names), the embedding and the head; of the routed
    experts only those in ``experts`` when given (an expert-parallel rank's block) are read.
    ``expected``: the layer's tensor names and shapes (``weights.mtp_tensor_shapes(cfg)``: the
    weights' layout, which this file layer does not know).

    Raises ``CheckpointError`` naming the tensor for a missing tensor, an unexpected tensor
    inside the MTP layer, or a wrong shape, and naming the file too for a dtype other than the
    checkpoint's (``check_dtypes``; with ``cast``, any of ``WEIGHT_DTYPES``, as the caller casts
    them all to one) or, unless ``allow_non_finite``, a NaN/inf value in a tensor read
    (``check_finite``).
    """
    wmap = checkpoint_weight_map(directory)
    prefix = cfg.layer_prefix
    embed_name = cfg.embed_tokens_name
    present = {k[len(prefix):] for k in wmap if k.startswith(prefix)}
    raw_config, config_file = read_hf_json(directory)
    try:
        quant = read_quantization(raw_config, config_file)
        if quant.unread is not None:  # the target's format: the MTP layer loads only if it is all plain
            refuse_quantization_tensor(quant.unread, prefix, set(expected), present)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    quantized = quant.block_scaled_fp8
    # A block-scaled weight's *_scale_inv sits beside it; which weights may have one is checked
    # once the dtypes are known (fp8.pair_scales). Without quantization_config a scale is unexpected.
    scales = {n for n in present if quantized and n.endswith(fp8.SCALE_SUFFIX)}
    present -= scales
    for name, shape in expected.items():
        if name not in present:
            raise CheckpointError(f"missing tensor {prefix + name!r} (expected shape {shape})")
    extra = sorted(present - expected.keys() - set(IGNORED_MTP_COPIES))
    if extra:
        why = ""
        if extra[0].endswith(fp8.SCALE_SUFFIX):
            why = ": a block scale, but config.json declares no quantization_config (quant_method fp8, weight_block_size [128, 128])"
        raise CheckpointError(f"unexpected tensor {prefix + extra[0]!r} in the MTP layer{why} ({len(extra)} unexpected in all)")
    outer = [embed_name, "lm_head.weight"]
    tied = False
    if "lm_head.weight" not in wmap:
        tied = read_tie_word_embeddings(directory)
        if not tied:
            raise CheckpointError(f"missing tensor 'lm_head.weight' (expected shape {(cfg.vocab_size, cfg.hidden_size)})")
        outer.remove("lm_head.weight")
    if embed_name not in wmap:
        raise CheckpointError(f"missing tensor {embed_name!r} (expected shape {(cfg.vocab_size, cfg.hidden_size)})")
    layer_names = set(expected)  # every weight of the layer, before a rank keeps its experts
    if experts is not None:
        skipped = {f"mlp.experts.{e}." for e in range(cfg.n_routed_experts) if e not in experts}
        expected = {n: s for n, s in expected.items() if not any(n.startswith(p) for p in skipped)}
    expected_scales = {fp8.scale_name(n) for n in expected} & scales
    orphans = sorted(s for s in scales if s[: -len(fp8.SCALE_SUFFIX)] not in layer_names)
    if orphans:
        raise CheckpointError(f"unexpected tensor {prefix + orphans[0]!r} in the MTP layer: a scale of no weight "
                              f"({len(orphans)} such scales)")
    tensors = read_tensors(directory, [prefix + n for n in expected] + outer + [prefix + n for n in sorted(expected_scales)], wmap)
    scale_tensors = {prefix + n: tensors.pop(prefix + n) for n in expected_scales}
    files = {n: os.path.join(os.fspath(directory), wmap[n]) for n in [*tensors, *scale_tensors]}
    if quant.unread is not None:
        try:
            refuse_quantized_dtype(quant.unread, tensors, files)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    mtp = {n: tensors[prefix + n] for n in expected}
    for name, shape in expected.items():
        check_shape(prefix + name, mtp[name], shape)
    embed = tensors[embed_name]
    head = embed if tied else tensors["lm_head.weight"]
    check_shape(embed_name, embed, (cfg.vocab_size, cfg.hidden_size))
    check_shape("lm_head.weight", head, (cfg.vocab_size, cfg.hidden_size))
    try:  # float8 weights with their scales become fp8.BlockScaledWeight; the §8 rules are checked there
        paired = fp8.pair_scales(tensors, scale_tensors, files, quantized, check_finite=not allow_non_finite)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    plain = {n: t for n, t in paired.items() if not fp8.is_block_scaled(t)}
    check_dtypes(plain, files, embed_name, cast=cast, float32_ok=lambda n: float32_tensor(cfg, n))
    if not allow_non_finite:
        check_finite(plain, files)
    mtp = {n: paired[prefix + n] for n in expected}
    return mtp, paired[embed_name], head if tied else paired["lm_head.weight"]


# ------------------------------------------------------------------------------------------------
# Writing: build the new checkpoint in a hidden sibling folder, then swap folders.


def is_checkpoint_file(name: str) -> bool:
    """Whether a file belongs to the checkpoint proper (replaced by a save), as opposed to a
    companion a save keeps (tokenizer, model card, logs)."""
    return name == CONFIG_FILE or name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def check_shard_size(shard_size: object) -> None:
    if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1):
        raise ValueError(f"shard_size must be a positive integer (tensors per file) or None (one file), got {shard_size!r}")


def writable_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU tensors safetensors accepts. Tensors whose bytes overlap another's (tied
    embedding and head, or any aliasing view) are cloned: safetensors refuses shared memory, and
    each name must come back with its own bytes. Disjoint views of one storage (the stacked
    experts) are written as they are, without a copy."""
    flat: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, Tensor):
            raise ValueError(f"save: tensors must map names (str) to torch.Tensor, got {name!r}: {type(t).__name__}")
        flat[name] = t.detach().cpu().contiguous()
    spans: dict[int, list[tuple[int, int, str]]] = {}  # storage -> (start, end, name) byte spans
    for name, t in flat.items():
        if t.numel():
            start = t.data_ptr()
            spans.setdefault(t.untyped_storage().data_ptr(), []).append((start, start + t.numel() * t.element_size(), name))
    for group in spans.values():
        end = -1
        for start, stop, name in sorted(group):
            if start < end:
                flat[name] = flat[name].clone()
            else:
                end = stop
    return flat


def _fsync(path: str) -> None:
    """Flush a file's (or a folder's entries') bytes to disk. Some file systems cannot fsync a
    folder (EINVAL): that is no error of ours."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (os.path.isdir(path) and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _sibling(target: str, kind: str) -> str:
    """A fresh hidden name beside ``target`` (same file system, so renames are atomic)."""
    parent, base = os.path.split(target)
    return os.path.join(parent, f".{base}.{kind}-{secrets.token_hex(4)}")


def write_checkpoint_files(directory: str, config: dict[str, Any], flat: dict[str, Tensor], shard_size: int | None) -> None:
    """``config.json`` and the safetensors (one file, or ``shard_size`` tensors a file plus the
    index, laid out as the hub's sharded checkpoints), each flushed to disk."""
    written = []
    path = os.path.join(directory, CONFIG_FILE)
    with open(path, "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
    written.append(path)
    if shard_size is None:
        path = os.path.join(directory, SINGLE_FILE)
        save_file(flat, path, metadata={"format": "pt"})
        written.append(path)
    else:
        names = sorted(flat)
        chunks = [names[i : i + shard_size] for i in range(0, len(names), shard_size)]
        weight_map: dict[str, str] = {}
        total = 0
        for i, chunk in enumerate(chunks):
            file = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
            path = os.path.join(directory, file)
            save_file({k: flat[k] for k in chunk}, path, metadata={"format": "pt"})
            written.append(path)
            weight_map.update({k: file for k in chunk})
            total += sum(flat[k].numel() * flat[k].element_size() for k in chunk)
        path = os.path.join(directory, INDEX_FILE)
        with open(path, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
        written.append(path)
    for path in written:
        _fsync(path)
    _fsync(directory)


def swap_in(new: str, target: str) -> None:
    """Make folder ``new`` the folder ``target``: move ``target``'s companion entries into
    ``new``, rename ``target`` aside, rename ``new`` into place, delete the old folder. Any
    failure before the last rename puts everything back where it was."""
    if not os.path.exists(target):
        os.rename(new, target)
        return
    os.chmod(new, stat.S_IMODE(os.stat(target).st_mode))
    moved: list[str] = []
    try:
        for entry in sorted(os.listdir(target)):
            if not is_checkpoint_file(entry):
                os.rename(os.path.join(target, entry), os.path.join(new, entry))
                moved.append(entry)
        aside = _sibling(target, "old")
        try:
            os.rename(target, aside)
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            raise OSError(e.errno, f"cannot move {target} aside to swap the new checkpoint in ({e.strerror}); "
                          "a mount point cannot be renamed: save into a folder inside it") from e
        try:
            os.rename(new, target)
        except BaseException:
            try:
                os.rename(aside, target)
            except OSError as e:
                raise OSError(f"save failed and the previous checkpoint could not be moved back: it is at {aside}") from e
            raise
    except BaseException:
        for entry in reversed(moved):  # target is the previous folder again; return its companions
            os.rename(os.path.join(new, entry), os.path.join(target, entry))
        raise
    try:
        shutil.rmtree(aside)
    except OSError as e:  # the save itself succeeded: the new checkpoint is in place
        warnings.warn(f"saved, but the previous checkpoint at {aside} could not be deleted: {e}", stacklevel=3)


def check_save_target(directory: str | os.PathLike[str]) -> str:
    """Where a save may go, as ``save_checkpoint`` resolves it (a link to a folder is followed):
    a new path, an empty folder or one holding a checkpoint, never a file, a non-empty folder
    without a checkpoint or the working directory. ``ValueError`` otherwise; nothing is written
    (callers check an output path before a long run with it)."""
    target = os.path.realpath(os.fspath(directory))
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise ValueError(f"save: {target} exists and is not a folder")
        entries = os.listdir(target)
        if entries and SINGLE_FILE not in entries and INDEX_FILE not in entries:
            raise ValueError(
                f"save: refusing to write into {target}: it is not empty and holds no checkpoint "
                f"({SINGLE_FILE} or {INDEX_FILE}); save into a new or empty folder"
            )
        if target == os.path.realpath(os.getcwd()):
            raise ValueError(f"save: {target} is the current working directory, which a save replaces; pass another path")
    return target


def save_checkpoint(
    directory: str | os.PathLike[str], config: dict[str, Any], tensors: dict[str, Tensor], shard_size: int | None = None
) -> None:
    """Write ``config.json`` and the tensors into ``directory``, replacing any checkpoint there as
    a whole: with ``shard_size``, at most that many tensors per file plus
    ``model.safetensors.index.json``; without, one ``model.safetensors``.

    Atomic replacement: everything is written (and flushed) into a hidden sibling folder
    ``.NAME.saving-*``, which then takes the place of ``directory`` by two renames (the old folder
    aside as ``.NAME.old-*``, the new one in), and the old folder is deleted. A failure at any
    step (a full disk, an interrupt) leaves ``directory`` exactly as it was and removes the
    partial folder; no shard or index of an older save survives a successful one. Once the new
    folder is in place the save has succeeded: failing to delete the old folder or to flush the
    parent is a warning, not an error. Only a crash of the process (SIGKILL, power loss) in the
    middle of the swap leaves ``directory`` incomplete or missing, with nothing lost: the
    previous checkpoint is at ``.NAME.old-*`` and the companions in ``.NAME.saving-*``.

    What is replaced: the checkpoint files (``config.json``, ``*.safetensors``,
    ``*.safetensors.index.json``). Every other entry (a tokenizer, a model card, logs) is a
    companion and is kept, moved unchanged into the new folder just before the swap (a reader
    looking at that instant may miss it); the folder keeps its permissions.
    ``directory`` must be new, empty, or already hold a checkpoint (``model.safetensors`` or the
    index): a non-empty folder without one is refused with ``ValueError``, so a mistyped path
    does not turn, say, a home folder into a checkpoint. So is the current working directory
    (it is the folder being replaced) and a path that is a file. A symbolic link to a folder
    is followed (the folder it names is replaced). The parent folder must be writable (the new
    folder is built beside the old one); a mount point cannot be replaced (save inside it).

    ``shard_size`` must be a positive int or None, and every value a tensor; both are checked
    before anything is written. Tensors sharing memory (e.g. a tied embedding and head) are
    written as separate copies and load back bit-exact.
    """
    check_shard_size(shard_size)
    flat = writable_tensors(tensors)
    target = check_save_target(directory)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    new = _sibling(target, "saving")
    os.mkdir(new)
    try:
        write_checkpoint_files(new, config, flat, shard_size)
        swap_in(new, target)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    try:
        _fsync(parent)  # make the renames durable
    except OSError as e:  # the new checkpoint is in place; an error now would claim it is not
        warnings.warn(f"saved {target}, but flushing its parent folder failed: {e}", stacklevel=3)
