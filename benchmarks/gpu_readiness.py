"""What the GPU run prints first: versions, the flash kernels' schemas, the device, every self-check figure.

The first phase of ``benchmarks/gpu.sh`` (about 90 s at most): if anything later fails, these lines say on which
software and hardware, and whether prefix attention's kernels agree with the model's attention on this device
(every case, tensor and dtype of :mod:`lightning_dta.engine.attention_check`, the long multi-tile case on CUDA
included), and whether the recurrent mixers' kernels (fla, causal-conv1d, mamba_ssm where installed) agree with
their pure-PyTorch path, initial-state gradients included (:mod:`lightning_dta.engine.recurrent_check`, one
Gated DeltaNet, short-convolution and Mamba2 mixer each).
It also times a large matrix product, the rate the bench budgets are sized from, and writes
``readiness.json`` beside the results.

    python3 benchmarks/gpu_readiness.py --out bench_out/gpu --shape 16,8,128 --device cuda
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

from lightning_dta.engine.attention_backends import BACKENDS, argument_names, choose_backend
from lightning_dta.engine.attention_check import TENSORS, KernelRaised, measure, tolerance, verdict
from lightning_dta.engine.layer_kinds import LAYER_KINDS
from lightning_dta.engine.prefix_attention import AttentionShape
from lightning_dta.engine.recurrent_check import kernel_functions
from lightning_dta.engine.recurrent_check import measure as measure_recurrent
from lightning_dta.engine.recurrent_check import verdict as recurrent_verdict

COLUMNS = ("output", *TENSORS)
PACKAGES = ("transformers", "lightning", "accelerate", "numpy", "jsonargparse", "docstring_parser", "flash_attn",
            "prefix_grouper", "pytest", "xdist", "hypothesis", "peft", "fla", "causal_conv1d", "mamba_ssm")


def versions() -> dict[str, str]:
    """Python, torch (with its CUDA) and every package the project or its GPU run may use ("absent" if not
    importable)."""
    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # absent, or broken on this image: both are worth a line
            found[name] = f"absent ({type(error).__name__})"
            continue
        # optional library feature: not every package sets __version__
        found[name] = str(getattr(module, "__version__", "present"))
    return found


def kernel_schemas() -> dict[str, str]:
    """The schemas prefix attention calls by keyword: aten's varlen flash ops and, where installed, flash-attn's."""
    schemas = {name: str(getattr(torch.ops.aten, name).default._schema)
               for name in ("_flash_attention_forward", "_flash_attention_backward")}
    try:
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError as error:
        schemas["flash_attn"] = f"absent ({error})"
        return schemas
    for name in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"):
        fn = getattr(interface, name)
        schemas[f"flash_attn.{name}"] = f"{type(fn).__name__}: {argument_names(fn)}"
    return schemas


def device_facts(device: torch.device) -> dict[str, object]:
    if device.type != "cuda":
        return {"device": str(device), "processor": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    return {"device": str(device), "name": props.name, "capability": list(torch.cuda.get_device_capability(device)),
            "memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
            "flash_attention_available": torch.backends.cuda.is_flash_attention_available(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, seconds: float = 1.0) -> float:
    """The rate of a square matrix product in ``dtype`` on ``device`` (TFLOP/s), timed for about ``seconds``."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            a @ b
        count += 8
        sync()
    return 2.0 * size**3 * count / (time.perf_counter() - start) / 1e12


def self_check(device: torch.device, shapes: list[tuple[int, int, int]], dtypes: list[torch.dtype]) -> list[dict]:
    """Every figure of the self-check, per present backend, dtype and attention shape (heads, kv heads, head
    dim), printed as it is measured."""
    rows = []
    for dtype in dtypes:
        for name in BACKENDS:
            backend, reason = choose_backend(name, device, dtype)
            if backend is None:
                print(f"  {name:<10} {str(dtype):<15} not run: {reason}")
                rows.append({"backend": name, "dtype": str(dtype), "skipped": reason})
                continue
            for heads, kv_heads, head_dim in shapes:
                shape = AttentionShape(heads, kv_heads, head_dim, dtype, head_dim ** -0.5)
                label = f"{name:<10} {str(dtype):<15} {heads}/{kv_heads} heads x {head_dim}"
                start = time.perf_counter()
                try:
                    figures = measure(backend, device, shape)
                except KernelRaised as error:
                    print(f"  {label}: FAILED, the kernel raised ({error})")
                    rows.append({"backend": name, "dtype": str(dtype), "shape": [heads, kv_heads, head_dim],
                                 "raised": str(error)})
                    continue
                reason = verdict(backend, device, shape, figures)
                print(f"  {label}: {'agrees' if reason is None else 'DISAGREES'} (tolerance "
                      f"{tolerance(dtype):.0e}, {time.perf_counter() - start:.1f} s); columns: "
                      + ", ".join(COLUMNS))
                for case in dict.fromkeys(f.case for f in figures):
                    errors = {f.tensor: f.error for f in figures if f.case == case}
                    print("      " + " ".join(f"{errors[t]:8.1e}" if t in errors else f"{'-':>8}" for t in COLUMNS)
                          + f"  {case.what}")
                rows.append({"backend": name, "dtype": str(dtype), "shape": [heads, kv_heads, head_dim],
                             "verdict": reason, "tolerance": tolerance(dtype),
                             "figures": [{"case": f.case.what, "tensor": f.tensor, "error": f.error}
                                         for f in figures]})
    return rows


def recurrent_mixers(device: torch.device) -> dict[str, tuple[torch.nn.Module, int]]:
    """One mixer per recurrent kind, built from transformers' configs at a Qwen3.5-like head size on CUDA (tiny
    on the CPU), with the model's hidden size: Gated DeltaNet (Qwen3.5), short convolution (LFM2), Mamba2."""
    from transformers import Lfm2Config, Mamba2Config, Qwen3_5TextConfig
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    big = device.type == "cuda"
    hidden, heads, dim = (1024, 16, 128) if big else (32, 4, 8)
    torch.manual_seed(0)
    gdn = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(
        hidden_size=hidden, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_value_heads=heads,
        linear_num_key_heads=heads // 2, linear_key_head_dim=dim, linear_value_head_dim=dim), 0)
    conv = Lfm2ShortConv(Lfm2Config(hidden_size=hidden, num_hidden_layers=1, full_attn_idxs=[]), 0)
    mamba = Mamba2Mixer(Mamba2Config(hidden_size=hidden, num_heads=2 * hidden // 64, head_dim=64,
                                     state_size=128 if big else 16, n_groups=1, num_hidden_layers=1), 0)
    return {"Gated DeltaNet": (gdn, hidden), "short convolution": (conv, hidden), "Mamba2": (mamba, hidden)}


def recurrent_self_check(device: torch.device, dtypes: list[torch.dtype]) -> list[dict]:
    """Every figure of the recurrent mixers' self-check, per mixer kind and dtype, printed as it is measured."""
    rows = []
    for kind_name, (mixer, hidden) in recurrent_mixers(device).items():
        functions = sorted(kernel_functions(sys.modules[type(mixer).__module__]))
        for dtype in dtypes:
            mixer.to(device=device, dtype=dtype)
            label = f"{kind_name:<18} {str(dtype):<15}"
            start = time.perf_counter()
            try:
                figures = measure_recurrent(mixer, LAYER_KINDS[mixer.layer_type], hidden, device, dtype)
            except Exception as error:  # the kernel path raised: a verdict, printed and recorded
                print(f"  {label}: FAILED, the kernel path raised ({type(error).__name__}: {error})")
                rows.append({"mixer": kind_name, "dtype": str(dtype), "raised": str(error)})
                continue
            reason = recurrent_verdict(type(mixer).__name__, functions, device, dtype, figures)
            worst = max(figures, key=lambda f: f.error)
            print(f"  {label}: {'agrees' if reason is None else 'DISAGREES'} ({time.perf_counter() - start:.1f} s; "
                  f"worst {worst.error:.1e} in {worst.tensor}); "
                  + ", ".join(f"{f.tensor} {f.error:.1e}" for f in figures if "state" in f.tensor or
                              f.tensor in ("output", "input gradient")))
            rows.append({"mixer": kind_name, "dtype": str(dtype), "functions": functions, "verdict": reason,
                         "figures": [{"tensor": f.tensor, "error": f.error} for f in figures]})
    return rows


def _shape(text: str) -> tuple[int, int, int]:
    heads, kv_heads, head_dim = (int(x) for x in text.split(","))
    return heads, kv_heads, head_dim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", action="append", type=_shape, default=None,
                        help="heads,kv_heads,head_dim of an attention shape to self-check (repeatable)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="side of the timed matrix product")
    parser.add_argument("--out", default=None, help="directory for readiness.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = args.shape or [(16, 8, 128)]
    record: dict[str, object] = {"argv": sys.argv[1:] if argv is None else argv}
    print("== versions")
    record["versions"] = versions()
    for name, version in record["versions"].items():
        print(f"  {name:<16} {version}")
    print("== kernel schemas (prefix attention calls these by keyword)")
    record["schemas"] = kernel_schemas()
    for name, schema in record["schemas"].items():
        print(f"  {name}: {schema}")
    print("== device")
    record["device"] = device_facts(device)
    for name, value in record["device"].items():
        print(f"  {name:<26} {value}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    record["matmul_tflops"] = matmul_tflops(device, dtype, args.matmul_size)
    print(f"  {'matmul ' + str(dtype) + ' TFLOP/s':<26} {record['matmul_tflops']:.1f} "
          f"({args.matmul_size} x {args.matmul_size})")
    print("== prefix attention's self-check: relative difference from the model's attention, per case and tensor")
    dtypes = [torch.bfloat16, torch.float16] if device.type == "cuda" else [torch.float32, torch.bfloat16]
    record["self_check"] = self_check(device, shapes, dtypes)
    print("== recurrent mixers' self-check: the model's kernels against the pure-PyTorch path, initial-state "
          "gradients included")
    recurrent_dtypes = [torch.bfloat16, torch.float32] if device.type == "cuda" else [torch.float64]
    record["recurrent_self_check"] = recurrent_self_check(device, recurrent_dtypes)
    if args.out:
        path = Path(args.out) / "readiness.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str))
        print(f"wrote {path}")
    checks = (*record["self_check"], *record["recurrent_self_check"])
    failed = [r for r in checks if r.get("verdict") or r.get("raised")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
