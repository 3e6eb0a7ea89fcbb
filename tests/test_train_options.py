"""Training options that must not change results: activation checkpointing and torch.compile; and what bf16
autocast costs them in weight casts."""

import collections
import copy

import pytest
import torch
from conftest import tiny_config
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table
from torch.utils._python_dispatch import TorchDispatchMode

from free_transformer.distributed.parallelize import apply_activation_checkpointing, apply_compile
from free_transformer.model.config import named_config
from free_transformer.model.transformer import FreeTransformer
from free_transformer.train import trainer
from free_transformer.train.config import load_train_config
from free_transformer.train.metrics import read_metrics
from free_transformer.train.validation import autocast_context


def _step(model, tokens, seed=None):
    """Forward + backward of the training loss; Z from the global RNG (seeded here) or a generator."""
    if seed is not None:
        torch.manual_seed(seed)
    out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.05)
    out.loss.backward()
    return out


def _saved_bytes(model, tokens):
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.05)
    return sum(storages.values())


def test_activation_checkpointing_gives_the_same_gradients_and_keeps_less():
    torch.manual_seed(0)
    plain = FreeTransformer(tiny_config(n_layers=4, latent_units=4)).double().train()
    with torch.no_grad():
        plain.latent.mapper.weight.normal_(0, 0.5)  # a latent path that matters
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain))
    tokens = torch.randint(0, plain.config.vocab_size, (3, 21))

    a = _step(plain, tokens, seed=5)
    after_a = torch.rand(4)  # the global RNG stream after forward + backward
    b = _step(checkpointed, tokens, seed=5)
    after_b = torch.rand(4)
    assert torch.equal(a.latents, b.latents)  # the same Z, sampled once
    assert torch.equal(after_a, after_b)  # the recomputation drew nothing from the stream
    assert a.loss.item() == b.loss.item()
    names = [n for n, _ in plain.named_parameters()]
    assert names == [n for n, _ in checkpointed.named_parameters()]  # state dict and groups unchanged
    for name, p, q in zip(names, plain.parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert _saved_bytes(checkpointed, tokens) < 0.5 * _saved_bytes(plain, tokens)


@pytest.mark.slow  # Inductor compiles every block on a CPU; fast case: test_trainer_applies_the_options[compile]
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
def test_compiled_blocks_give_eager_losses_and_gradients():
    """Inductor on the debug size: three graphs (plain block, injection block, encoder block). Measured on
    a shared 2-core CPU: 80 s the first time (C++ compilation, load average 5), 10 s once inductor's
    on-disk cache holds them."""
    torch.manual_seed(0)
    eager = FreeTransformer(named_config("debug")).train()
    compiled = apply_compile(copy.deepcopy(eager))
    tokens = torch.randint(0, eager.config.vocab_size, (2, 17))
    a = _step(eager, tokens, seed=3)
    b = _step(compiled, tokens, seed=3)
    assert torch.equal(a.latents, b.latents)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert any(p.grad.abs().max() > 0 for p in compiled.latent.mapper.parameters())
    assert compiled.latent.mapper.compiled_backward and not eager.latent.mapper.compiled_backward  # fused chunks too
    assert compiled.readout_loss.compiled and not eager.readout_loss.compiled  # the read-out's cross-entropy too


@pytest.mark.parametrize("option", ["activation_checkpointing", "compile"])
def test_trainer_applies_the_options(tmp_path, monkeypatch, option):
    """The trainer calls the option's transform on the model; checkpointing (real) keeps the losses
    bit-identical, compile (replaced by a spy here; its numerics are tested above) is wired in."""
    calls = []
    if option == "compile":
        monkeypatch.setattr(trainer, "apply_compile", lambda model: calls.append(model) or model)
    args = [
        "model.size=debug",
        "model.vocab_size=256",
        "model.max_seq_len=72",
        "batch_size=4",
        "log_every=1",
        "optim.warmup_steps=2",
        "progress=false",
        "kappa_bits=0.25",
        "steps=3",
        "validate_every=3",
    ]
    trainer.train(load_train_config(None, args), tmp_path / "plain")
    trainer.train(load_train_config(None, args + [f"{option}=true"]), tmp_path / "option")
    losses = [[m["loss"] for m in read_metrics(tmp_path / run / "metrics.jsonl")] for run in ("plain", "option")]
    assert losses[0] == losses[1]
    if option == "compile":
        assert len(calls) == 1


class WeightCasts(TorchDispatchMode):
    """Counts, per parameter, the elements that casts to bfloat16 read from its storage."""

    CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)

    def __init__(self, model):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
        self.elements = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.CASTS and out.dtype == torch.bfloat16:
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.elements[name] += args[0].numel()
        return out


def test_an_eager_bf16_step_casts_each_weight_once():
    """Under precision=bf16 an eager training step casts every matrix to bf16 once (autocast's cache keeps
    the copy for backward) and the fused cross-entropy casts the tied read-out once for all its chunks: the
    casts a float32 master copy needs, and no more (activation checkpointing, which recomputes the
    forward, would make them two)."""
    torch.manual_seed(0)
    model = FreeTransformer(tiny_config(n_layers=4, latent_units=4, tie_embeddings=True)).train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 33))
    with WeightCasts(model) as casts:
        with autocast_context("bf16", tokens.device):
            out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.05)
        out.loss.backward()
    for name, p in model.named_parameters():
        expected = p.numel() if p.dim() == 2 else 0  # norms and zeta stay float32; the tied embedding: its read-out
        if name == "latent.readout.bias":
            expected = p.numel()  # F.linear's bias follows its weight
        assert casts.elements[name] == expected, name


def test_a_compiled_bf16_block_casts_each_weight_once():
    """A decoder block compiled the way compile=true compiles it (Inductor's decompositions and partitioner;
    the graphs kept instead of turned into kernels) casts each weight to bf16 once, in forward: backward
    reads the saved bf16 copy and never casts a weight again. (A partitioner told to save less memory,
    torch._functorch.config.activation_memory_budget = 0, recomputes the casts in backward and fails this.)
    A dispatch mode cannot count this: under one, torch.compile runs the block eagerly."""
    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(graph_module, example_inputs):
            graphs[kind].append(graph_module.graph)
            return make_boxed_func(graph_module.forward)

        return compiler

    backend = aot_autograd(
        fw_compiler=keep("forward"),
        bw_compiler=keep("backward"),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    model = FreeTransformer(tiny_config(n_layers=2, latent_units=0))
    block = model.layers[0]
    block.compile(backend=backend, dynamic=False)
    x = torch.randn(2, 32, model.config.dim, requires_grad=True)
    with autocast_context("bf16", x.device):
        y = block(x, model.rope_cos[:32], model.rope_sin[:32])
    y.float().sum().backward()

    weight_shapes = sorted(tuple(p.shape) for p in block.parameters() if p.dim() == 2)

    def weight_casts(kind):  # the shapes of the graphs' inputs of a weight's shape that they cast to bf16
        shapes = []
        for node in (node for graph in graphs[kind] for node in graph.nodes):
            source = node.args[0] if node.target in WeightCasts.CASTS else None
            if source is not None and source.op == "placeholder" and _cast_dtype(node) == torch.bfloat16:
                shapes.append(tuple(source.meta["val"].shape))
        return sorted(shape for shape in shapes if shape in weight_shapes)

    assert weight_casts("forward") == weight_shapes
    assert weight_casts("backward") == []


def _cast_dtype(node):
    return node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
