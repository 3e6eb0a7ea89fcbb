"""The cross-entropy fused with the read-out (free_transformer.model.loss) against the plain one: the same loss
and gradients, IGNORE_INDEX respected, tied and untied heads, compiled and eager, and a training step
that never allocates a float tensor the size of all its logits."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from free_transformer.model import loss as loss_module
from free_transformer.model.loss import IGNORE_INDEX, cross_entropy, readout_cross_entropy

# float64: both paths compute the same sums in another order; float32: the same at its rounding.
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _inputs(dtype, N=23, D=16, V=37, seed=0, ignored=(0, 5, 6, 22)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    norm = torch.nn.RMSNorm(D, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    weight = torch.randn(V, D, generator=g, dtype=dtype).mul_(0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[list(ignored)] = IGNORE_INDEX
    return x, norm, weight, targets


def _loss_and_grads(loss_fn, x, norm, weight, targets):
    for t in (x, norm.weight, weight):
        t.grad = None
    loss = loss_fn(norm(x), weight, targets)
    loss.backward()
    return loss.detach(), x.grad, norm.weight.grad, weight.grad


def plain(h, weight, targets):
    return cross_entropy(F.linear(h, weight), targets)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 23, 64])  # one row a chunk, a remainder chunk, exactly one, more than N
def test_chunked_loss_and_gradients_equal_the_plain_cross_entropy(dtype, rows):
    x, norm, weight, targets = _inputs(dtype)
    expected = _loss_and_grads(plain, x, norm, weight, targets)
    got = _loss_and_grads(lambda h, w, t: readout_cross_entropy(h, w, t, rows=rows), x, norm, weight, targets)
    assert got[0].dtype == expected[0].dtype == dtype
    for a, b in zip(got, expected):  # loss, dL/dx, dL/d(norm weight), dL/d(read-out weight)
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])
    assert x.grad[[0, 5, 6, 22]].abs().max() == 0  # ignored positions get no gradient


def test_ignore_index_is_the_mean_over_the_targets_that_remain():
    x, norm, weight, targets = _inputs(torch.float64)
    kept = targets != IGNORE_INDEX
    h = norm(x).detach()
    by_hand = -torch.log_softmax(h @ weight.detach().T, -1)[kept].gather(1, targets[kept, None]).mean()
    torch.testing.assert_close(
        readout_cross_entropy(h, weight.detach(), targets, rows=4), by_hand, **TOLERANCE[torch.float64]
    )
    everything = torch.full_like(targets, IGNORE_INDEX)  # no target at all: 0 / 0, as F.cross_entropy
    assert readout_cross_entropy(h, weight.detach(), everything, rows=4).isnan()
    assert plain(h, weight.detach(), everything).isnan()


def test_the_loss_without_grad_mode_needs_no_gradient_buffers():
    x, norm, weight, targets = _inputs(torch.float64)
    with torch.no_grad():
        loss = readout_cross_entropy(norm(x), weight, targets, rows=4)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, plain(norm(x), weight, targets).detach(), **TOLERANCE[torch.float64])


def addmm_into_float32(acc, a, b, *, beta, out_dtype, out):
    """cuBLAS's addmm of bf16 operands with out_dtype=float32 and out=acc, on the CPU: the exact products
    summed in float32 and added to beta * acc (beta 0: acc's values are not read)."""
    assert out is acc and out_dtype == acc.dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16
    return (acc.zero_() if beta == 0 else acc).addmm_(a.float(), b.float())


@pytest.fixture(params=["float32-accumulating matmul", "bf16 product, then added"])
def weight_grad_sum(request, monkeypatch):
    """The two ways a bf16 read-out weight gradient is summed over chunks into float32: by the matmul itself
    (CUDA's addmm with out_dtype, emulated) or, where addmm cannot (the CPU), each chunk's product made in
    bf16 and added."""
    if request.param == "float32-accumulating matmul":
        monkeypatch.setattr(loss_module, "_adds_into_float32", lambda device: True)
        monkeypatch.setattr(torch, "addmm", addmm_into_float32)
    return request.param


def test_the_weight_gradient_is_summed_inside_the_chunk_matmuls(weight_grad_sum):
    """_add_product: a bf16 product into a float32 sum. The float32-accumulating matmul (CUDA) equals the
    float64 sum of the exact products to float32 rounding; a bf16 product rounded then added (the CPU)
    misses it by bf16's rounding. The first chunk overwrites whatever the buffer held."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3, 40, 30, generator=g).to(torch.bfloat16)  # 3 chunks: (40, 30) @ (30, 50)
    b = torch.randn(3, 50, 30, generator=g).to(torch.bfloat16)
    acc = torch.full((40, 50), float("nan"))
    for k in range(3):
        loss_module._add_product(acc, a[k], b[k].T, first=k == 0)
    exact = sum(a[k].double() @ b[k].double().T for k in range(3)).float()
    error = ((acc - exact).abs().max() / exact.abs().max()).item()
    if weight_grad_sum == "float32-accumulating matmul":
        assert error < 1e-6
    else:
        assert 1e-4 < error < 2**-7
    same = torch.full((40, 50), float("nan"))  # float32 operands: addmm_ in place, first chunk beta 0
    for k in range(3):
        loss_module._add_product(same, a[k].float(), b[k].float().T, first=k == 0)
    torch.testing.assert_close(same, exact, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_either_weight_gradient_sum_equals_the_plain_cross_entropy(weight_grad_sum):
    """Under bf16 autocast (the read-out in bf16, the softmax in float32), 4 chunks: dL/dW (float32) equals
    the plain path's (one bf16 matmul over every row, rounded to bf16 once) within 2^-8 of its largest
    entry, and the loss and the other gradients equal the plain path's."""
    x, norm, weight, targets = _inputs(torch.float32, N=64, D=32, V=100)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _loss_and_grads(plain, x, norm, weight, targets)
        got = _loss_and_grads(lambda h, w, t: readout_cross_entropy(h, w, t, rows=16), x, norm, weight, targets)
    assert got[0].dtype == torch.float32 and got[3].dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[3], expected[3], rtol=2**-8, atol=2**-8 * expected[3].abs().max().item())
    for a, b in zip(got[1:3], expected[1:3]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3 * b.abs().max().item())


class OpsOfShape(TorchDispatchMode):
    """Records the ops that return a tensor of the given shape."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.ops = torch.Size(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.shape == self.shape:
            self.ops.append(str(func))
        return out


def test_on_cuda_each_chunk_adds_its_weight_gradient_in_its_matmul():
    """On the meta device, where addmm takes out_dtype as on CUDA: bf16 weights, 4 chunks. The float32
    dL/dW is allocated once, each chunk's product is added to it by one addmm, and no (V, D) product or
    addition of its own exists (before, 4 bf16 products and 4 float32 additions)."""
    V, D, N = 100, 32, 64
    h = torch.randn(N, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    targets = torch.randint(0, V, (N,), device="meta")
    with OpsOfShape((V, D)) as mode:
        readout_cross_entropy(h, weight, targets, rows=16)
    assert mode.ops == ["aten.empty.memory_format"] + ["aten.addmm.dtype_out"] * 4 + ["aten._to_copy.default"]


def _model_loss_and_grads(model, inputs, targets, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(inputs, targets, kappa_nats=0.05, generator=torch.Generator().manual_seed(0), **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("latent_units", [0, 4])
def test_the_model_loss_and_every_gradient_equal_those_from_the_full_logits(tie, latent_units):
    model = tiny_model(tie_embeddings=tie, latent_units=latent_units).train()  # float64
    tokens = torch.randint(0, 50, (3, 14), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, 8:] = IGNORE_INDEX  # a padded row
    fused, fused_grads = _model_loss_and_grads(model, inputs, targets)
    full, full_grads = _model_loss_and_grads(model, inputs, targets, return_logits=True)
    assert fused.logits is None and full.logits.shape == (3, 13, 50)
    torch.testing.assert_close(fused.loss, full.loss, **TOLERANCE[torch.float64])
    torch.testing.assert_close(fused.cross_entropy_nats, full.cross_entropy_nats, **TOLERANCE[torch.float64])
    assert fused_grads.keys() == full_grads.keys() and ("lm_head.weight" in fused_grads) != tie
    for name in full_grads:
        torch.testing.assert_close(fused_grads[name], full_grads[name], **TOLERANCE[torch.float64], msg=name)


def test_ignored_targets_in_the_model():
    model = tiny_model(latent_units=0).train()
    tokens = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(2))
    targets = tokens[:, 1:].clone()
    targets[1, 4:] = IGNORE_INDEX
    fused = model(tokens[:, :-1], targets).loss
    full = model(tokens[:, :-1], targets, return_logits=True)
    by_hand = F.cross_entropy(full.logits[targets != IGNORE_INDEX], targets[targets != IGNORE_INDEX])
    torch.testing.assert_close(fused, by_hand, **TOLERANCE[torch.float64])


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
def test_compiled_chunks_equal_eager():
    x, norm, weight, targets = _inputs(torch.float32, N=40, V=64)
    eager = _loss_and_grads(lambda h, w, t: readout_cross_entropy(h, w, t, rows=16), x, norm, weight, targets)
    compiled = _loss_and_grads(
        lambda h, w, t: readout_cross_entropy(h, w, t, rows=16, compiled=True), x, norm, weight, targets
    )
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, **TOLERANCE[torch.float32])


class FloatSizes(TorchDispatchMode):
    """Records the element count of every floating-point tensor an op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
@pytest.mark.parametrize("tie, compiled", [(True, False), (False, False), (True, True)])
def test_a_training_step_at_vocabulary_32768_never_holds_all_its_logits(tie, compiled):
    """Forward and backward of the model's training loss (float32, the default chunk size for the CPU):
    no float tensor of N x V elements or more, N the step's tokens; compiled: each chunk's softmax and
    gradient run by Inductor (compile=true), compiled before the recorded step. With return_logits=True
    (the plain path) the same step does allocate one, so the check can fail."""
    V, B, T = 32768, 4, 128
    model = tiny_model(dtype=torch.float32, vocab_size=V, max_seq_len=T, tie_embeddings=tie).train()
    if compiled:
        model.readout_loss.compile()
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(0))
    N = B * T
    assert model.config.dim < N  # so that the (V, D) weights and their gradients are smaller than N x V
    if compiled:
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    sizes = {}
    for return_logits in (False, True):
        model.zero_grad(set_to_none=True)
        with FloatSizes() as mode:
            model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.05, return_logits=return_logits).loss.backward()
        sizes[return_logits] = mode.largest
    assert sizes[False] < N * V <= sizes[True]
    assert sizes[False] <= N * V // 2  # at least two chunks at this size
