"""PEFT LoRA adapters: read `adapter_config.json` + `adapter_model.safetensors` and check them
against the base model before anything reaches a device.

What is supported is what the batched compute (runtime/lora/layers.py) implements: plain LoRA
(`peft_type: LORA`) on the Llama family's q/k/v/o and gate/up/down projections, one rank per adapter
up to `--max-lora-rank`, `lora_alpha / r` scaling (`lora_alpha / sqrt(r)` with `use_rslora`).
Everything else an adapter may carry (DoRA, bias training, `modules_to_save`, embedding LoRA,
per-module rank or alpha patterns) is refused by name, never silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.lora.errors import AdapterPathError, LoRAError
from kvpilot.runtime.models import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's saved names; the adapter's
# own name is not part of them)
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's full (unsharded) weights on the host, scaling not yet applied."""

    name: str
    path: Path
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rslora
    # (layer index, target module) -> (A [rank, in], B [out, rank])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


def module_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """Pure: target module -> (in features, out features) of the base model's full linear."""
    h, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (h, arch.q_size),
        "k_proj": (h, arch.kv_size),
        "v_proj": (h, arch.kv_size),
        "o_proj": (arch.q_size, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def read_adapter_config(name: str, path: Path) -> dict[str, Any]:
    """The folder's adapter_config.json; AdapterPathError (naming the path) when there is none to read."""
    if not path.exists():
        raise AdapterPathError(name, f"{path} does not exist")
    if not path.is_dir():
        raise AdapterPathError(name, f"{path} is not a directory (a PEFT adapter is a folder)")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterPathError(name, f"{CONFIG_FILE} is missing in {path}")
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterPathError(name, f"{cfg_path} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise AdapterPathError(name, f"cannot read {cfg_path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise AdapterPathError(name, f"{cfg_path} must hold a JSON object")
    return data


def check_adapter_config(name: str, cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """Pure: refuse what the compute does not implement; returns (rank, scaling)."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type} is not supported (only LORA)")
    for flag in ("use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise LoRAError(f"LoRA adapter {name!r}: {flag}=true is not supported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise LoRAError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise LoRAError(
            f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} is not supported "
            "(only low-rank updates of the projections)"
        )
    for pattern in ("rank_pattern", "alpha_pattern"):
        if cfg.get(pattern):
            raise LoRAError(f"LoRA adapter {name!r}: a per-module {pattern} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted({str(t) for t in targets} - set(SUPPORTED_TARGETS))
        if unknown:
            raise LoRAError(
                f"LoRA adapter {name!r}: unknown target modules {unknown} "
                f"(supported: {', '.join(SUPPORTED_TARGETS)})"
            )
    try:
        rank = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json needs an integer rank `r`") from None
    if rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: rank r={rank} must be at least 1")
    if rank > max_rank:
        raise LoRAError(
            f"LoRA adapter {name!r}: rank {rank} is over the limit of {max_rank} (raise --max-lora-rank)"
        )
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, scaling


def parse_weights(
    name: str, tensors: dict[str, torch.Tensor], rank: int, arch: ModelArchConfig
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Pure: PEFT tensor names -> (layer, module) -> (A, B), checked against the base model's shapes."""
    shapes = module_shapes(arch)
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(
                f"LoRA adapter {name!r}: unsupported tensor {key!r} (only lora_A/lora_B of "
                f"{', '.join(SUPPORTED_TARGETS)})"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise LoRAError(
                f"LoRA adapter {name!r}: unknown target module {module!r} in {key!r} "
                f"(supported: {', '.join(SUPPORTED_TARGETS)})"
            )
        if layer >= arch.num_hidden_layers:
            raise LoRAError(
                f"LoRA adapter {name!r}: layer {layer} is beyond the base model's {arch.num_hidden_layers} "
                "layers (an adapter for a different base model?)"
            )
        pieces.setdefault((layer, module), {})[which] = tensor
    if not pieces:
        raise LoRAError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pieces.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"LoRA adapter {name!r}: {where} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if a.dim() != 2 or b.dim() != 2:
            raise LoRAError(f"LoRA adapter {name!r}: {where} weights must be matrices")
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            what = (
                "hidden size" if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else "width"
            )
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} maps {a.shape[1]} -> {b.shape[0]} features, the base "
                f"model's maps {fan_in} -> {fan_out} ({what} differs: an adapter for a different base model?)"
            )
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} has rank {a.shape[0]}/{b.shape[1]}, adapter_config.json "
                f"says r={rank}"
            )
        weights[(layer, module)] = (a.float().contiguous(), b.float().contiguous())
    return weights


def load_adapter(name: str, path: str | Path, arch: ModelArchConfig, max_rank: int) -> LoRAAdapter:
    """Read and check one PEFT adapter folder; raises LoRAError naming the adapter and the problem."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path).expanduser()
    cfg = read_adapter_config(name, folder)
    rank, scaling = check_adapter_config(name, cfg, max_rank)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        extra = (
            " (adapter_model.bin is not read: save with safetensors)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise AdapterPathError(name, f"{WEIGHTS_FILE} is missing in {folder}{extra}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise AdapterPathError(name, f"cannot read {weights_path}: {exc}") from None
    return LoRAAdapter(name, folder, rank, scaling, parse_weights(name, tensors, rank, arch))


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """Pure: `--lora-modules NAME=PATH ...` -> {name: path}; raises ValueError naming the flag."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected NAME=PATH, got {item!r}")
        if name in out:
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice")
        out[name] = path
    return out
