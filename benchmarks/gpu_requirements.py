"""Whether this Python can run the package from the tree: the first step of ``benchmarks/gpu.sh``, before any phase.

The GPU image brings its own torch (a CUDA build far too big to carry, and there is no network), so the package is
never pip-installed there: ``gpu.sh`` puts the tree on ``PYTHONPATH`` and this script checks what pip would have, the
requirements of ``pyproject.toml`` against the installed distributions, and then what no version number says, that
every torch API the package calls exists in this torch. Anything missing is printed with its name and the run is
refused at the start (exit status 1), instead of failing halfway through the window. ``jsonargparse`` alone may be
missing: only the bench runs need it (``gpu.sh`` installs it from carried wheels; without them the bench is skipped).

The torch APIs are the package's uses that are newest in torch (FSDP2's per-module settings, the Hugging Face storage
of ``torch.distributed.checkpoint``, autocast queries, the flash-attention ops); the claim ``torch>=2.11`` rests on
them being present in 2.11 (the device image's) as in 2.13 (the tested one), and this check verifies it on the image.

    python3 benchmarks/gpu_requirements.py
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the TOML reader pip carries (tomllib is Python >= 3.11)
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
OPTIONAL = frozenset({"jsonargparse"})  # the bench CLI's parser: without it the bench runs are skipped, not refused

TORCH_APIS = (  # module:attribute[.attribute]
    "torch.distributed.fsdp:fully_shard",
    "torch.distributed.fsdp:MixedPrecisionPolicy",
    "torch.distributed.fsdp:CPUOffloadPolicy",
    "torch.distributed.fsdp:OffloadPolicy",
    *(f"torch.distributed.fsdp:FSDPModule.{name}" for name in (
        "set_requires_gradient_sync", "set_reshard_after_forward", "set_reshard_after_backward",
        "set_gradient_divide_factor", "set_force_sum_reduction_for_comms", "unshard", "reshard")),
    "torch.distributed.tensor:DTensor.full_tensor",
    "torch.distributed.tensor:DTensor.to_local",
    "torch.distributed.tensor:Replicate",
    *(f"torch.distributed.tensor.parallel:{name}" for name in (
        "ColwiseParallel", "RowwiseParallel", "ParallelStyle", "parallelize_module")),
    "torch.distributed.device_mesh:init_device_mesh",
    "torch.distributed.checkpoint:HuggingFaceStorageReader",
    "torch.distributed.checkpoint:HuggingFaceStorageWriter",
    "torch.distributed.checkpoint:CheckpointException",
    "torch.distributed.checkpoint.state_dict:get_model_state_dict",
    "torch.distributed.checkpoint.state_dict:set_model_state_dict",
    "torch.distributed.checkpoint.state_dict:StateDictOptions",
    "torch:get_autocast_dtype",
    "torch:OutOfMemoryError",
    "torch.library:custom_op",
    "torch.cuda:set_sync_debug_mode",
    "torch.cuda:get_sync_debug_mode",
    "torch.ops.aten:_scaled_dot_product_flash_attention_for_cpu",
    "torch.ops.aten:_scaled_dot_product_flash_attention_for_cpu_backward",
    "torch.ops.aten:_flash_attention_forward",
    "torch.ops.aten:_flash_attention_backward",
)
TORCH_PARAMETERS = (  # (module:attribute, keyword arguments the package passes)
    ("torch.distributed.checkpoint:HuggingFaceStorageWriter", ("save_distributed", "enable_consolidation")),
    ("torch.distributed.checkpoint:load", ("no_dist",)),
    ("torch.distributed.fsdp:fully_shard", ("mesh", "reshard_after_forward", "mp_policy", "offload_policy")),
)


def missing_fsdp_internals() -> list[str]:
    """FSDP2's private state that ``lightning_dta.distributed.sharding`` saves and restores around a step (a unit's
    reshard-after-forward setting has no public getter): a unit's parameter groups (``_fsdp_param_groups``, or the
    single ``_fsdp_param_group`` of torch < 2.12) and each group's ``post_forward_mesh_info``."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        state = FSDPState()
    except (ImportError, TypeError) as error:
        return [f"FSDP2's FSDPState ({error})"]
    missing = []
    if not (hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group")):
        missing.append("FSDPState._fsdp_param_groups (or _fsdp_param_group)")
    if "post_forward_mesh_info" not in inspect.getsource(FSDPParamGroup):
        missing.append("FSDPParamGroup.post_forward_mesh_info")
    return missing


def resolve(path: str) -> object:
    """The object ``module:attribute.attribute`` names (raises if any part is missing)."""
    module, _, attributes = path.partition(":")
    found = importlib.import_module(module) if module != "torch.ops.aten" else importlib.import_module("torch").ops.aten
    for name in attributes.split("."):
        found = getattr(found, name)
    return found


def missing_torch_apis() -> list[str]:
    """The torch APIs (and keyword arguments) the package uses that this torch lacks."""
    missing = []
    for path in TORCH_APIS:
        try:
            resolve(path)
        except (ImportError, AttributeError, RuntimeError):  # torch.ops raises RuntimeError for an unknown op
            missing.append(path)
    for path, keywords in TORCH_PARAMETERS:
        try:
            parameters = inspect.signature(resolve(path)).parameters
        except (ImportError, AttributeError, RuntimeError):
            missing.append(path)
            continue
        missing += [f"{path}({keyword}=...)" for keyword in keywords if keyword not in parameters]
    return missing + missing_fsdp_internals()


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """``[project] dependencies`` of ``pyproject``."""
    return [Requirement(line) for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def unmet(requirement: Requirement, found: str | None) -> str | None:
    """Why the installed version ``found`` (``None``: not installed) does not meet ``requirement`` (``None``: it
    does), as pip compares them; pre-releases count (an NGC image's torch is ``2.12.0a0+...``), local tags too
    (``+cu130``)."""
    if found is None:
        return "not installed"
    if not requirement.specifier.contains(Version(found), prereleases=True):
        return f"found {found}, needs {requirement.specifier}"
    return None


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    refused = []
    print(f"requirements of {REPO / 'pyproject.toml'} on Python {sys.version.split()[0]}:")
    for requirement in requirements():
        found = installed(requirement.name)
        reason = unmet(requirement, found)
        optional = requirement.name in OPTIONAL
        print(f"  {str(requirement):<40} {'ok, ' + str(found) if reason is None else reason}"
              + (" (only the bench runs need it)" if reason and optional else ""))
        if reason and not optional:
            refused.append(f"{requirement.name}: {reason}")
    missing = missing_torch_apis()
    print(f"torch APIs the package calls: {len(TORCH_APIS) + len(TORCH_PARAMETERS)} checked, "
          + (f"missing: {', '.join(missing)}" if missing else "all present"))
    refused += [f"torch {installed('torch')} lacks {path}" for path in missing]
    if refused:
        print("cannot run the package from this tree on this Python: " + "; ".join(refused))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
