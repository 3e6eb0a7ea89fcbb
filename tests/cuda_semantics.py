"""Running the CUDA code paths on a CPU-only build of torch, for what a GPU would do differently from the CPU.

Three things make a CPU run behave as a CUDA run where it matters, without a GPU:
- tensors on the `meta` device carry shapes, dtypes and strides but no values, so a value read on the host
  (`.item()`, `bool(t)`, `.tolist()`) raises, as a graph capture or a launch-bound loop would want it to;
- `layers.gqa_route` is asked for its CUDA decision;
- SDPA is dispatched as its CUDA dispatcher picks a kernel: flash attention for fp16/bf16 without a mask,
  the memory-efficient kernel otherwise (it takes float32 and masks, not grouped heads), the math kernel only
  for float64. The fused kernels are called through their aten ops, whose meta functions return the real
  kernels' output layouts (the memory-efficient one's output is (B, M, H, K) in memory, seen as (B, H, M, K)).
  An attention that only the math kernel could run in float32 or half precision raises `MathKernelOnly`
  (on a GPU it runs, but materialises the T x T scores: the slow path the routes avoid).

`DeviceWork` additionally records every tensor made from host data (a Python number written into a device
tensor, a host-to-device copy): on a GPU each is a synchronising copy unless its source is pinned, and
inside a captured CUDA graph the value would be frozen at capture."""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from free_transformer.model import layers

META = torch.device("meta")


class MathKernelOnly(RuntimeError):
    """No fused SDPA kernel takes this call on CUDA."""


def cuda_kernel(query, key, attn_mask, enable_gqa: bool) -> str:
    """The kernel CUDA's SDPA dispatcher (flash, then memory-efficient, then math) picks for this call."""
    grouped = query.shape[1] != key.shape[1]
    head_dim_ok = query.shape[-1] % 8 == 0 and query.shape[-1] <= 256
    if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and head_dim_ok:
        return "flash"  # takes grouped heads (enable_gqa) natively
    if query.dtype in (torch.float32, torch.float16, torch.bfloat16) and not grouped and head_dim_ok:
        return "efficient"
    return "math"


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as it runs on CUDA, on meta tensors: the output has the layout
    of the kernel the CUDA dispatcher would pick."""
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise RuntimeError("query and key heads differ without enable_gqa")
    kernel = cuda_kernel(query, key, attn_mask, enable_gqa)
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[
            0
        ]
    if kernel == "efficient":
        bias = None
        if attn_mask is not None:  # SDPA turns a boolean mask into an additive one of the query's dtype
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
            bias = bias.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else attn_mask
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, query.requires_grad, dropout_p, is_causal, scale=scale
        )[0]
    if query.dtype != torch.float64:
        raise MathKernelOnly(
            f"only SDPA's math kernel takes q {tuple(query.shape)} k {tuple(key.shape)} "
            f"{query.dtype}, mask {attn_mask is not None}, enable_gqa {enable_gqa}"
        )
    return ORIGINAL_SDPA(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


ORIGINAL_SDPA = F.scaled_dot_product_attention
ORIGINAL_ROUTE = layers.gqa_route


@contextlib.contextmanager
def cuda_dispatch(monkeypatch):
    """Within: `layers.attend` takes its CUDA routes and SDPA picks CUDA's kernels (for meta tensors)."""
    with monkeypatch.context() as patch:
        patch.setattr(
            layers,
            "gqa_route",
            lambda device_type, *args: ORIGINAL_ROUTE("cuda" if device_type == "meta" else device_type, *args),
        )
        patch.setattr(F, "scaled_dot_product_attention", cuda_sdpa)
        yield


class HostValue(RuntimeError):
    """A device tensor was read on the host inside a step."""


class DeviceWork(TorchDispatchMode):
    """Watches the operators of a step run on meta tensors. Records in `uploads` every tensor made from
    host data (a CPU tensor copied to the device; a Python number written into a device tensor, which
    torch 2.13 does as a host-to-device copy of a CPU scalar) and raises HostValue on a host read
    (`.item()`, `bool()`, `.tolist()` of a device tensor). Scalars that torch's own formulas make on the
    device (say, the zero of clamp's backward) are device work and not recorded."""

    HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}

    def __init__(self):
        super().__init__()
        self.uploads: list[str] = []
        self._python_numbers: dict[int, weakref.ref] = {}  # id -> device scalar made from a Python number

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if func in self.HOST_READS or (
            packet is torch.ops.aten._to_copy
            and args[0].device == META
            and kwargs.get("device") is not None
            and kwargs["device"].type == "cpu"
        ):
            raise HostValue(f"{func} reads a device value on the host")
        if packet is torch.ops.aten._to_copy and kwargs.get("device") == META and args[0].device.type == "cpu":
            self.uploads.append(f"a CPU tensor {tuple(args[0].shape)} {args[0].dtype} copied to the device")
        if packet is torch.ops.aten.copy_ and args[0].device == META:
            if args[1].device.type == "cpu":
                self.uploads.append(f"a CPU tensor {tuple(args[1].shape)} {args[1].dtype} copied into a device tensor")
            elif self._python_numbers.get(id(args[1]), lambda: None)() is args[1]:
                self.uploads.append(f"a Python number written into a device tensor {tuple(args[0].shape)}")
        out = func(*args, **kwargs)
        if packet is torch.ops.aten.scalar_tensor and out.device == META:
            self._python_numbers[id(out)] = weakref.ref(out)
        return out
