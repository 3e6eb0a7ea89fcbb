"""One parser for every `--device` / `device=` an entry point accepts: a typo or a device this machine
lacks is one clear line (DeviceError, exit 2), never a torch traceback at first use. torch is imported
when a device or dtype is asked for, not by a command's --help."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from .errors import UserError

if TYPE_CHECKING:
    import torch

CHOICES = "auto, cpu, cuda, cuda:N or mps"
Precision = Literal["fp32", "bf16"]  # the dtype names that options take (--dtype, param_dtype, precision)
DTYPE_NAMES: tuple[str, ...] = get_args(Precision)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a command runs its model and in what precision it decodes: the `--device` and `--dtype` options,
    declared once for every command that takes them (base/settings.add_option)."""

    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps."""
    dtype: Literal["auto", Precision] = "auto"
    """Weights and KV cache while decoding: auto is bf16 on a CUDA device that supports it (half the bytes read
    per token), else fp32."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name of DTYPE_NAMES."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}: choose {', '.join(DTYPE_NAMES)}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


class DeviceError(UserError, ValueError):
    pass


def _available(kind: str) -> int:
    """How many devices of this kind the machine has (0: none)."""
    import torch

    if kind == "cpu":
        return 1
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "mps":
        return int(torch.backends.mps.is_available())
    return 0


def parse_device(name: str | torch.device | None) -> torch.device:
    """auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps, checked against this machine."""
    import torch

    text = "auto" if name is None else str(name).strip().lower()
    if text == "auto":
        return torch.device("cuda" if _available("cuda") else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DeviceError(f"unknown device {str(name)!r}: choose {CHOICES}") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"device {str(name)!r} is not supported: choose {CHOICES}")
    count = _available(device.type)
    if count == 0:
        raise DeviceError(
            f"device {str(name)!r} requested but this machine has no {device.type.upper()} "
            f"device available (torch {torch.__version__}); use --device cpu or auto"
        )
    if device.index is not None and device.index >= count:
        raise DeviceError(f"device {str(name)!r} requested but this machine has {count} {device.type} device(s)")
    return device


def decoding_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weights' and KV cache's dtype for `--dtype`: fp32, bf16, or auto: bf16 on a CUDA device that
    supports it (decoding reads every weight and cached key once per token: half the bytes), else fp32."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}: choose auto, {', '.join(DTYPE_NAMES)}")
    return torch_dtype(name)
