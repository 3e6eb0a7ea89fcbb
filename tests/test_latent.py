import math
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from reference import naive_kl_to_uniform, naive_mapper_project
from torch.utils._python_dispatch import TorchDispatchMode

from free_transformer.base.latent_choice import LatentChoice
from free_transformer.model.latent import (
    LATENT_KINDS,
    BinaryMapper,
    BitLinear,
    LatentPlan,
    binary_mapper,
    binary_mapper_project,
    free_bits_kl,
    index_to_bits,
    kl_to_uniform,
    latent_kind,
    project_latents,
    sample_bits,
)


def uniform_latents(shape, bits, generator=None, device=None):
    """The binary kinds' prior draws (every binary kind shares them)."""
    return BinaryMapper(bits, 1).prior(shape, generator, device)


def _inputs(n_rows, n_bits, dim, seed=0, device="cpu"):
    """Drawn on the CPU (the same values on every device), then moved."""
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(n_rows, n_bits, generator=g, dtype=torch.float64)).to(device).requires_grad_()
    weight = torch.randn(2**n_bits, dim, generator=g, dtype=torch.float64).to(device).requires_grad_()
    grad_out = torch.randn(n_rows, dim, generator=g, dtype=torch.float64).to(device)
    return logits, weight, grad_out


@pytest.mark.parametrize("n_bits", [1, 3, 6, 10])
@pytest.mark.parametrize("chunk_entries", [2**22, 64])  # one chunk, and many chunks
def test_mapper_matches_paper_formula(n_bits, chunk_entries, monkeypatch, device):
    entry_bytes = binary_mapper.chunk_entry_bytes(torch.float64, torch.float64)
    monkeypatch.setitem(binary_mapper.CHUNK_BYTES, device.type, chunk_entries * entry_bytes)
    logits, weight, grad_out = _inputs(n_rows=7, n_bits=n_bits, dim=5, device=device)
    r, index = binary_mapper_project(logits, weight, generator=torch.Generator(device).manual_seed(1))
    grad_logits, grad_weight = torch.autograd.grad((r * grad_out).sum(), (logits, weight))

    # the reference: the paper's formula on the CPU, float64, with the same sampled index
    cpu_logits, cpu_weight = (t.detach().cpu().requires_grad_() for t in (logits, weight))
    r_ref = naive_mapper_project(cpu_logits, cpu_weight, index.cpu())
    ref_logits, ref_weight = torch.autograd.grad((r_ref * grad_out.cpu()).sum(), (cpu_logits, cpu_weight))
    torch.testing.assert_close(r.cpu(), r_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_logits.cpu(), ref_logits, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_weight.cpu(), ref_weight, rtol=0, atol=1e-12)
    assert grad_logits.abs().max() > 0  # the check is not vacuous


def test_mapper_keeps_leading_shape_and_float32(device):
    logits = torch.randn(2, 3, 4, device=device, requires_grad=True)
    weight = torch.randn(16, 8, device=device, requires_grad=True)
    r, index = binary_mapper_project(logits, weight)
    assert r.shape == (2, 3, 8) and index.shape == (2, 3)
    assert torch.equal(r, weight[index])
    r.sum().backward()
    assert logits.grad.shape == logits.shape and logits.grad.dtype == torch.float32


def test_mapper_backward_matmul_follows_autocast(device):
    """Under bf16 autocast dR @ W^T runs in bf16 like every other matmul: close to float32, not equal.
    The table's gradient (a scatter-add) and the values stay float32."""
    logits, weight, grad_out = (t.float().detach() for t in _inputs(n_rows=64, n_bits=8, dim=32, device=device))
    grads = {}
    for name, context in (
        ("fp32", torch.autocast(device.type, enabled=False)),
        ("bf16", torch.autocast(device.type, torch.bfloat16)),
    ):
        x, w = logits.clone().requires_grad_(), weight.clone().requires_grad_()
        with context:
            r, _ = binary_mapper_project(x, w, generator=torch.Generator(device).manual_seed(1))
        grads[name] = torch.autograd.grad((r * grad_out).sum(), (x, w))
    (x32, w32), (x16, w16) = grads["fp32"], grads["bf16"]
    assert x16.dtype == torch.float32 and w16.dtype == torch.float32
    # The table's gradient is a float32 scatter-add in both runs, whose CUDA atomics add in any order:
    # equal up to float32 rounding (assert_close's float32 defaults), not bitwise.
    torch.testing.assert_close(w16, w32)
    assert not torch.equal(x16, x32)
    torch.testing.assert_close(x16, x32, rtol=0, atol=2e-2 * x32.abs().max().item())


def test_mapper_rejects_wrong_table_size():
    with pytest.raises(ValueError, match="2\\^H"):
        binary_mapper_project(torch.randn(3, 4), torch.randn(15, 8))


def test_bit_frequencies_follow_sigmoid(device):
    logits = torch.tensor([-2.0, -0.5, 0.0, 1.0, 3.0], device=device)
    index = sample_bits(logits.expand(40000, 5), torch.Generator(device).manual_seed(0))
    freq = index_to_bits(index, 5).float().mean(0)
    torch.testing.assert_close(freq, torch.sigmoid(logits), atol=0.01, rtol=0)


def test_uniform_prior_is_uniform(device):
    index = uniform_latents((60000,), 3, generator=torch.Generator(device).manual_seed(0), device=device)
    assert index.device.type == device.type
    counts = torch.bincount(index, minlength=8).double().cpu() / 60000
    torch.testing.assert_close(counts, torch.full((8,), 1 / 8, dtype=torch.float64), atol=0.006, rtol=0)
    # at H = 16 every one of the 16 bits is a fair coin and no index reaches 2^16
    index = uniform_latents((4, 10000), 16, generator=torch.Generator(device).manual_seed(1), device=device).cpu()
    assert index.min() >= 0 and index.max() < 2**16
    torch.testing.assert_close(index_to_bits(index, 16).float().mean((0, 1)), torch.full((16,), 0.5), atol=0.01, rtol=0)


def test_per_row_generators_make_rows_independent_of_batch():
    logits = torch.randn(3, 6)

    def gens():
        return [torch.Generator().manual_seed(s) for s in (5, 6, 7)]

    both = sample_bits(logits, gens())
    alone = sample_bits(logits[1:2], [torch.Generator().manual_seed(6)])
    assert both[1] == alone[0]
    assert torch.equal(
        uniform_latents((3, 4), 5, generator=gens())[2],
        uniform_latents((1, 4), 5, generator=[torch.Generator().manual_seed(7)])[0],
    )


@pytest.mark.parametrize("n_bits", [1, 4, 8])
def test_kl_matches_sum_over_all_values(n_bits):
    logits = 3 * torch.randn(5, n_bits, dtype=torch.float64)
    torch.testing.assert_close(kl_to_uniform(logits), naive_kl_to_uniform(logits), rtol=1e-10, atol=1e-12)


def test_kl_limits():
    assert kl_to_uniform(torch.zeros(4, 8)).abs().max() < 1e-6  # p = 1/2: the prior itself
    saturated = kl_to_uniform(torch.full((8,), 40.0))  # deterministic bits: H log 2
    assert abs(float(saturated) - 8 * math.log(2)) < 1e-4


def test_free_bits_is_mean_of_clamped_excess():
    kl = torch.tensor([[0.1, 0.5, 1.0], [0.0, 2.0, 0.3]])
    expected = torch.tensor([[0.0, 0.2, 0.7], [0.0, 1.7, 0.0]]).mean()
    torch.testing.assert_close(free_bits_kl(kl, 0.3), expected)


def test_explicit_latents_are_a_lookup_without_logit_gradient():
    weight = torch.randn(8, 4, requires_grad=True)
    index = torch.tensor([[1, 7], [0, 1]])
    r = project_latents(None, weight, index)
    assert torch.equal(r, weight[index])
    r.sum().backward()
    assert weight.grad[1].eq(2).all() and weight.grad[2].eq(0).all()


def test_bit_linear_gradient_is_the_per_bit_straight_through():
    """R = W s with s = 2B - 1; from s + (2p - 1) - detach(2p - 1): dL_h = (dR . W_h) 2 p_h (1 - p_h), dW = dR^T s."""
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(7, 5, generator=g, dtype=torch.float64)).requires_grad_()
    mapper = BitLinear(5, 3).double()
    torch.nn.init.normal_(mapper.weight, generator=g)
    grad_out = torch.randn(7, 3, generator=g, dtype=torch.float64)
    r, index = mapper.sample(logits, torch.Generator().manual_seed(1))
    grad_logits, grad_weight = torch.autograd.grad((r * grad_out).sum(), (logits, mapper.weight))

    bits = index_to_bits(index, 5).double()
    assert torch.equal(index, sample_bits(logits, torch.Generator().manual_seed(1)))  # the same draws as the mapper
    signs = 2 * bits - 1
    p = torch.sigmoid(logits.detach())
    torch.testing.assert_close(r, signs @ mapper.weight.detach().T, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        grad_logits, (grad_out @ mapper.weight.detach()) * 2 * p * (1 - p), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(grad_weight, grad_out.T @ signs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mapper.embed(index), r.detach())


def test_mapper_chunks_follow_the_device_budget():
    # paper-1.5b on a GPU: 8192 tokens, bf16 g, float32 low factor and product -> 8 chunks of 2^13 values
    assert binary_mapper.chunk_entry_bytes(torch.bfloat16, torch.float32) == 10
    assert binary_mapper.chunk_bits(8192, 16, 10, torch.device("cuda")) == 13
    assert binary_mapper.chunk_bits(8192, 16, 12, torch.device("cpu")) == 8
    assert binary_mapper.chunk_bits(10**9, 16, 4, torch.device("cpu")) == 1  # never below one bit
    assert binary_mapper.chunk_bits(3, 6, 4, torch.device("cuda")) == 6  # one chunk holds every value


def test_compiled_chunk_body_gives_the_eager_gradient(monkeypatch, device):
    monkeypatch.setitem(binary_mapper.CHUNK_BYTES, device.type, 64 * 4)  # several chunks
    logits, weight, grad_out = (t.float().detach() for t in _inputs(n_rows=16, n_bits=8, dim=8, device=device))
    eager = binary_mapper._bit_logit_grad(logits, weight, grad_out)
    compiled = binary_mapper._bit_logit_grad(logits, weight, grad_out, compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert eager.abs().max() > 0


def test_the_documented_example_registers_a_latent_variant_that_trains():
    """docs/latent-variants.md's worked example, run as written: the kind builds, trains, and its
    encoder gets no gradient through R (only the KL's, which is zero here: kappa above any KL)."""
    from pathlib import Path

    from free_transformer import FreeTransformer, named_config
    from free_transformer.model.config import LatentConfig
    from free_transformer.model.latent import LATENT_KINDS

    page = (Path(__file__).parents[1] / "docs" / "latent-variants.md").read_text()
    block = page.split("## A worked example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert len(block.splitlines()) <= 50
    LATENT_KINDS.pop("table_no_encoder_gradient", None)
    exec(compile(block, "docs/latent-variants.md", "exec"), {})
    try:
        config = named_config("debug", latent=LatentConfig("table_no_encoder_gradient"))
        model = FreeTransformer(config)
        assert model.num_params() == config.num_params()
        tokens = torch.randint(0, config.vocab_size, (2, 9))
        out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=100.0)
        out.loss.backward()
        assert model.latent.mapper.weight.grad.abs().sum() > 0
        assert model.latent.readout.weight.grad is None or model.latent.readout.weight.grad.abs().sum() == 0
    finally:
        LATENT_KINDS.pop("table_no_encoder_gradient", None)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by the storages that operators make inside it (views and `out=`
    results of a storage counted once; inputs made before it not at all)."""

    def __init__(self):
        super().__init__()
        self.held: dict[int, list] = {}  # data_ptr -> [bytes, live tensors on it]
        self.peak = 0

    def _release(self, pointer):
        entry = self.held[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            del self.held[pointer]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            a.untyped_storage().data_ptr()
            for a in pytree.tree_leaves((args, kwargs or {}))
            if isinstance(a, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            pointer = tensor.untyped_storage().data_ptr()
            if pointer in self.held:
                self.held[pointer][1] += 1
            elif pointer in inputs or tensor.untyped_storage().nbytes() == 0:
                continue  # a view or an out= of a tensor made before
            else:
                self.held[pointer] = [tensor.untyped_storage().nbytes(), 1]
            weakref.finalize(tensor, self._release, pointer)
        self.peak = max(self.peak, sum(nbytes for nbytes, _ in self.held.values()))
        return out


@pytest.mark.parametrize("matmul_dtype", [torch.float32, torch.bfloat16])
def test_mapper_backward_stays_within_its_chunk_budget(matmul_dtype, monkeypatch):
    """What the backward holds at its peak is its chunk budget (g, G's low factor and their product, each
    (N, 2^c)) plus tensors of a row's or a value's size: its chunk arithmetic counts every chunk buffer."""
    n_rows, n_bits, dim = 64, 12, 8
    budget = 64 * 2**8 * binary_mapper.chunk_entry_bytes(matmul_dtype, torch.float32)  # chunks of 2^8 values
    monkeypatch.setitem(binary_mapper.CHUNK_BYTES, "cpu", budget)
    logits, weight, grad_out = (t.detach().float() for t in _inputs(n_rows, n_bits, dim, device=torch.device("cpu")))
    table_copy = 0 if matmul_dtype == torch.float32 else weight.numel() * matmul_dtype.itemsize  # one cast, all chunks
    with LiveBytes() as live:
        binary_mapper._bit_logit_grad(logits, weight, grad_out, matmul_dtype)
    # the rest, tensors of (N, H), (N, 2^(H-c)) or (2^c, c), is under a third of the budget at these sizes; an
    # uncounted chunk buffer would let c grow by one and double the chunk buffers
    assert budget / 2 < live.peak <= budget + table_copy + budget // 3


@pytest.mark.parametrize("kind", sorted(LATENT_KINDS))
def test_a_plan_hands_out_values_for_a_call_of_no_positions(kind):
    """A call for no new positions gets (B, 0, *value_shape) values (it got None, which is no source), and
    draws nothing from the rows' generators."""
    space = latent_kind(kind)(4, 8)

    def plan(seed=1):
        generators = [torch.Generator().manual_seed(seed + row) for row in range(2)]
        return LatentPlan(2, space, prompt_source=LatentChoice.PRIOR, generators=generators)

    planned = plan()
    empty = planned.source(0, 0)
    assert isinstance(empty, torch.Tensor) and empty.shape == (2, 0, *space.value_shape)
    planned.record(0, planned.source(0, 3))
    assert torch.equal(planned.latents(), plan().draw(3))  # the empty call drew nothing
    empty = planned.source(3, 0)
    assert isinstance(empty, torch.Tensor) and empty.shape == (2, 0, *space.value_shape)


def test_a_baselines_plan_hands_out_prior_and_refuses_to_draw():
    plan = LatentPlan(2, None)
    assert plan.source(0, 5) == LatentChoice.PRIOR and plan.latents() is None
    with pytest.raises(RuntimeError, match="a baseline decoder has no latent space"):
        plan.draw(3)
