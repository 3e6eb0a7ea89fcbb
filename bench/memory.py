"""Peak memory of a training step on a GPU, estimated on a CPU: the step's ops on fake tensors, live storages summed.

bench/step.py measures a GPU's peak (torch.cuda.max_memory_allocated) and needs that GPU; this estimate
runs anywhere in seconds, so a change's effect on a GPU's peak can be read before a GPU is at hand. The
model and its optimizer are built under FakeTensorMode (shapes, dtypes and storages, no data) and run
what bench/step.py's memory run runs: two of the trainer's steps (forward, backward, gradient clipping,
the fused AdamW, zero_grad). bf16 autocast on the CPU stands in for CUDA's (both run the matmuls in
bf16 and the losses in float32), and the chunk budgets of the fused cross-entropy and of the Binary
Mapper's backward are set to their CUDA values. A dispatch mode adds the bytes of every new storage an
op returns and subtracts them when the storage is freed; the estimate is the peak of that sum.

Left out: the caching allocator's rounding and fragmentation, cuBLAS and cuDNN workspaces, the CUDA
context: how far the estimate falls from a GPU's measured peak, and on which GPU and commit, is in
docs/results.md ("Speed on a GPU"). Eager only: torch.compile does not run on fake tensors.

--check first runs a small step twice, on real CPU tensors and on fake ones, and stops unless both
give the same peak: the estimate counts what a real run allocates.

    PYTHONPATH=src python bench/memory.py [--size paper-1.5b|narrow|demo|demo-narrow] [--bits H ...]
                                          [--batch B] [--seq-len T] [--dtype fp32|bf16] [--vocab V]
                                          [--compare-loss] [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import weakref

import torch
from common import add_smoke_argument
from step import (
    BATCH,
    DEMO,
    DEMO_NARROW,
    PAPER,
    PAPER_BATCH,
    PAPER_SEQ_LEN,
    SEQ_LEN,
    TARGET_PEAK_GIB,
    build,
    make_batch,
    model_config,
    train_step,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from free_transformer.model import loss
from free_transformer.model.latent import binary_mapper

GIB, MIB = 2**30, 2**20


class LiveStorages(TorchDispatchMode):
    """The bytes of the storages that ops have returned and that are still alive: now and at the peak."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}  # a storage's address (its C++ object) -> bytes
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.sizes:
                    self.sizes[storage._cdata] = storage.nbytes()
                    self.now += storage.nbytes()
                    # torch keeps a storage's Python object alive as long as the storage itself
                    weakref.finalize(storage, self._freed, storage._cdata)
        self.peak = max(self.peak, self.now)
        return out


@contextlib.contextmanager
def cuda_chunk_budgets():
    """The fused cross-entropy and the Binary Mapper's backward chunk their work as they would on CUDA."""
    saved = loss.CHUNK_BYTES["cpu"], binary_mapper.CHUNK_BYTES["cpu"]
    loss.CHUNK_BYTES["cpu"], binary_mapper.CHUNK_BYTES["cpu"] = (
        loss.CHUNK_BYTES["cuda"],
        binary_mapper.CHUNK_BYTES["cuda"],
    )
    try:
        yield
    finally:
        loss.CHUNK_BYTES["cpu"], binary_mapper.CHUNK_BYTES["cpu"] = saved


def peak_bytes(
    cfg, batch: int, seq_len: int, precision: str, return_logits: bool, fake: bool = True
) -> tuple[int, int]:
    """(peak, after the second step) bytes of building the model and optimizer and running two steps."""
    with FakeTensorMode() if fake else contextlib.nullcontext(), cuda_chunk_budgets(), LiveStorages() as live:
        model, optimizer = build(cfg, "cpu")
        tokens = make_batch(cfg, batch, seq_len, "cpu")
        for _ in range(2):  # the first step creates the Adam moments
            train_step(model, optimizer, tokens, precision, return_logits)
        return live.peak, live.now


def in_units(n_bytes: int) -> str:
    return f"{n_bytes / GIB:.1f} GiB" if n_bytes >= GIB else f"{n_bytes / MIB:.1f} MiB"


def check(precision: str) -> None:
    cfg = model_config(16, 2, vocab=512)
    real, fake = (peak_bytes(cfg, 2, 64, precision, False, fake=fake)[0] for fake in (False, True))
    print(
        f"check: a step of L=2, D=256, H=16, vocab 512, B=2, T=64: real tensors {real / MIB:.2f} MiB, "
        f"fake {fake / MIB:.2f} MiB"
    )
    if real != fake:
        raise SystemExit("check failed: the fake-tensor count differs from the real one")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("narrow", DEMO, DEMO_NARROW, PAPER), default=PAPER)
    parser.add_argument("--bits", type=int, nargs="+", default=[16, 0], help="latent bits H per model (0: baseline)")
    parser.add_argument("--layers", type=int, default=28, help="L for --size narrow")
    parser.add_argument("--batch", type=int, help=f"B (default {PAPER_BATCH} at {PAPER}, else {BATCH})")
    parser.add_argument("--seq-len", type=int, help=f"T (default {PAPER_SEQ_LEN} at {PAPER}, else {SEQ_LEN})")
    parser.add_argument("--dtype", dest="precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--vocab", type=int, help="the vocabulary size (default the size's own)")
    parser.add_argument(
        "--compare-loss",
        action="store_true",
        help="also the plain cross-entropy over the logits of every token (return_logits=True)",
    )
    parser.add_argument("--check", action="store_true", help="first compare the count on real and fake tensors")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.size, args.layers, args.bits, args.batch, args.seq_len, args.check = "narrow", 2, [4, 0], 2, 16, True
    batch = args.batch or (PAPER_BATCH if args.size == PAPER else BATCH)
    seq_len = args.seq_len or (PAPER_SEQ_LEN if args.size == PAPER else SEQ_LEN)
    if args.check:
        check(args.precision)
    losses = {"fused": False, "plain": True} if args.compare_loss else {"fused": False}
    print(
        f"{args.size}, B={batch}, T={seq_len}, {args.precision}, eager: the bytes of live tensor storages "
        f"(at paper-1.5b an H100's max_memory_allocated was 4% above them)"
    )
    print(f"{'model':>9} {'loss':>6} | {'peak':>10} | {'after step':>10}")
    for bits in args.bits:
        cfg = model_config(bits, args.layers, args.size, args.vocab)
        for name, return_logits in losses.items():
            peak, after = peak_bytes(cfg, batch, seq_len, args.precision, return_logits)
            model = f"H={bits}" if bits else "baseline"
            print(f"{model:>9} {name:>6} | {in_units(peak):>10} | {in_units(after):>10}")
    if args.size == PAPER and (batch, seq_len, args.precision) == (PAPER_BATCH, PAPER_SEQ_LEN, "bf16"):
        print(f"target: <= {TARGET_PEAK_GIB} GiB compiled on a GPU (bench/step.py --compile); the estimate is eager")


if __name__ == "__main__":
    main()
