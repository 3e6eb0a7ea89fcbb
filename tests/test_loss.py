"""The cross-entropy fused with the read-out (free_transformer.model.loss) against the plain one: the same loss
and gradients, IGNORE_INDEX respected, tied and untied heads, compiled and eager, and a training step
that never allocates a float tensor the size of all its logits."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

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
    torch.testing.assert_close(readout_cross_entropy(h, weight.detach(), targets, rows=4), by_hand,
                               **TOLERANCE[torch.float64])
    everything = torch.full_like(targets, IGNORE_INDEX)  # no target at all: 0 / 0, as F.cross_entropy
    assert readout_cross_entropy(h, weight.detach(), everything, rows=4).isnan()
    assert plain(h, weight.detach(), everything).isnan()


def test_the_loss_without_grad_mode_needs_no_gradient_buffers():
    x, norm, weight, targets = _inputs(torch.float64)
    with torch.no_grad():
        loss = readout_cross_entropy(norm(x), weight, targets, rows=4)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, plain(norm(x), weight, targets).detach(), **TOLERANCE[torch.float64])


def test_bf16_autocast_runs_the_read_out_in_bf16_and_the_softmax_in_float32():
    x, norm, weight, targets = _inputs(torch.float32, N=64, D=32, V=100)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _loss_and_grads(plain, x, norm, weight, targets)
        got = _loss_and_grads(lambda h, w, t: readout_cross_entropy(h, w, t, rows=16), x, norm, weight, targets)
    assert got[0].dtype == torch.float32 and got[3].dtype == torch.float32
    # the same bf16 matmuls; dL/dW is rounded to bf16 per chunk here, once in the plain path
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[1:], expected[1:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3 * b.abs().max().item())


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
    compiled = _loss_and_grads(lambda h, w, t: readout_cross_entropy(h, w, t, rows=16, compiled=True),
                               x, norm, weight, targets)
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
    assert N > model.config.dim  # so that the (V, D) weights and their gradients are smaller than N x V
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
