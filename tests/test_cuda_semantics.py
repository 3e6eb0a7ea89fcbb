"""The CUDA code paths, checked on the CPU (cuda_semantics.py says how): the attention routes a GPU takes, on
the kernels and output layouts CUDA's SDPA would pick, and every step a GPU runs in a loop (training forward
and backward, the trainer's step, prefill, cached decoding steps, the decoding engine's step, with Z from the prior
or from a policy head, the Binary Mapper, the Hugging Face wrapper) with no value read on the host and nothing
copied from it."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model, tiny_run_config
from cuda_semantics import META, DeviceWork, HostValue, MathKernelOnly, cuda_dispatch, cuda_kernel, cuda_sdpa
from torch.utils._python_dispatch import TorchDispatchMode

from free_transformer.inference.engine import DecodeEngine, Row
from free_transformer.inference.params import GenerationConfig
from free_transformer.inference.row_draws import PolicyRows
from free_transformer.inference.sampling import SamplingVariant
from free_transformer.inference.step_runner import step_core
from free_transformer.model import layers
from free_transformer.model.latent import binary_mapper, binary_mapper_project, counter_policy_noise
from free_transformer.train.rl.trainer import with_policy_head

DTYPES = [torch.float32, torch.bfloat16]
B = 2


def _meta_model(dtype, **overrides):
    return tiny_model(dtype=dtype, **overrides).to(META)


def _tokens(T):
    return torch.zeros(B, T, dtype=torch.int64, device=META)


# ---- the layer itself ---------------------------------------------------------------------------------


def test_the_layer_sees_what_a_gpu_would_show():
    """Its checks are not vacuous: a host read raises, a Python number written into a device tensor is
    recorded (torch 2.13 copies it from the host), the memory-efficient kernel's output keeps its
    head-minor layout, and grouped float32 attention that only the math kernel takes is refused."""
    totals = torch.zeros(4, device=META)
    with pytest.raises(HostValue), DeviceWork():
        bool(totals[0] > 0)
    with DeviceWork() as work:
        totals[3] = float(True)
    assert work.uploads == ["a Python number written into a device tensor ()"]
    with DeviceWork() as work:
        totals[3].fill_(True)
        torch.where(totals > 0, 3, totals)
    assert work.uploads == []
    q = torch.empty(1, 16, 4, 64, device=META)
    assert cuda_sdpa(q, q, q).stride() == (4096, 64, 1024, 1)
    assert cuda_sdpa(q.bfloat16(), q.bfloat16(), q.bfloat16()).shape == (1, 16, 4, 64)
    kv = torch.empty(1, 4, 4, 64, device=META)
    with pytest.raises(MathKernelOnly):
        cuda_sdpa(q, kv, kv, enable_gqa=True)


def test_fold_route_gives_native_gqa_values_whatever_the_kernels_output_layout(monkeypatch):
    """Values on the CPU: SDPA made to return the memory-efficient kernel's layout (rows head-minor in
    memory), the fold route still gives SDPA's own grouped-query attention, masked and one-token."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    mask = torch.rand(5, 5, generator=g) < 0.7
    mask[:, 0] = True
    expected = [
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        F.scaled_dot_product_attention(q[:, :, :1], k, v, enable_gqa=True),
    ]
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda *args, **kw: sdpa(*args, **kw).transpose(1, 2).contiguous().transpose(1, 2),
    )
    monkeypatch.setattr(layers, "gqa_route", lambda *args: "fold")
    torch.testing.assert_close(layers.attend(q, k, v, mask, False), expected[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(layers.attend(q[:, :, :1], k, v, None, False), expected[1], rtol=0, atol=1e-14)


# ---- attention ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case, route",
    [
        ("training", {torch.float32: "expand", torch.bfloat16: "native"}),
        ("masked chunk", "fold"),
        ("one-token query", "fold"),
    ],
)
def test_every_gqa_route_runs_a_fused_kernel_and_gives_query_heads(dtype, case, route, monkeypatch):
    """Each route of `layers.attend` as CUDA takes it: a fused kernel (flash or memory-efficient, never
    the math kernel) and (B, heads, T, head_dim) out of whatever layout that kernel returns."""
    T, S = {"training": (12, 12), "masked chunk": (4, 9), "one-token query": (1, 9)}[case]
    q = torch.empty(B, 4, T, 16, dtype=dtype, device=META)
    k = v = torch.empty(B, 2, S, 16, dtype=dtype, device=META)
    mask = torch.ones(T, S, dtype=torch.bool, device=META) if case == "masked chunk" else None
    kernels = []
    with cuda_dispatch(monkeypatch), monkeypatch.context() as patch:
        patch.setattr(
            F,
            "scaled_dot_product_attention",
            lambda *args, **kw: (
                kernels.append(cuda_kernel(args[0], args[1], kw.get("attn_mask"), kw.get("enable_gqa", False)))
                or cuda_sdpa(*args, **kw)
            ),
        )
        expected = route[dtype] if isinstance(route, dict) else route
        assert layers.gqa_route("meta", dtype, T, mask is not None) == expected
        out = layers.attend(q, k, v, mask, is_causal=case == "training")
    assert out.shape == (B, 4, T, 16) and out.dtype == dtype
    assert kernels and "math" not in kernels


# ---- steps run in a loop ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent_units", [0, 4])
def test_training_forward_and_backward_as_on_cuda(dtype, latent_units, monkeypatch):
    model = _meta_model(dtype, latent_units=latent_units).train()
    tokens = _tokens(13)
    with cuda_dispatch(monkeypatch), DeviceWork() as work:
        out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.1)
        out.loss.backward()
    assert work.uploads == []
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


def test_trainer_step_as_on_cuda(tmp_path, monkeypatch):
    """`trainer.train_step` (the batch to the device, forward, backward, the stop flag, the gradient
    norm, the fused AdamW given the clipping scale and told to skip a non-finite step) uploads the batch
    and nothing else, and reads nothing back. Fused AdamW has no meta check, so it is let through for this
    test (its kernel has a meta function)."""
    from free_transformer.data import build_dataset
    from free_transformer.distributed import setup
    from free_transformer.train.optim import build_optimizer
    from free_transformer.train.trainer import Run, StopSignals, train_step

    config = tiny_run_config("model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=64")
    env = setup("none", None, torch.device("cpu"))
    monkeypatch.setattr(env, "device", META)
    model = tiny_model(
        dtype=torch.float32,
        **{k: v for k, v in config.model.to_dict().items() if k in ("vocab_size", "max_seq_len", "latent_units")},
    ).to(META)
    optimizer = build_optimizer(model, config.optim)
    monkeypatch.setattr(
        importlib.import_module("torch.optim.adam"), "_device_dtype_check_for_fused", lambda *args, **kwargs: None
    )
    optimizer.defaults["fused"] = True
    for group in optimizer.param_groups:
        group["fused"] = True
    dataset = build_dataset(config.data, config.seed)
    run = Run(config, tmp_path, env, dataset, model.train(), model, optimizer, {})
    signals = StopSignals()
    with cuda_dispatch(monkeypatch), DeviceWork() as work:
        for step in range(2):
            result = train_step(run, step, signals)
    batch = (config.batch_size, dataset.sequence_length + 1)
    assert work.uploads == [f"a CPU tensor {batch} torch.int64 copied to the device"] * 2
    assert result.non_finite.device == META and optimizer.found_inf.device == META
    assert optimizer.grad_scale.device == META  # the clipping scale, handed to the fused step
    assert result.grad_norm.device == META and result.means.device == META


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent_units", [0, 4])
def test_prefill_and_cached_decoding_steps_as_on_cuda(dtype, latent_units, monkeypatch):
    """Prefill (Z from the encoder), a masked chunk after it, and one-token steps with prior Z."""
    model = _meta_model(dtype, latent_units=latent_units)
    with cuda_dispatch(monkeypatch), DeviceWork() as work, torch.inference_mode():
        cache = model.new_cache(B, capacity=16)
        model(_tokens(5), cache=cache)
        model(_tokens(3), latents="prior", cache=cache)
        for _ in range(3):
            out = model(_tokens(1), latents="prior", cache=cache)
    assert work.uploads == [] and cache.length == 11
    assert out.logits.shape == (B, 1, 50) and out.logits.dtype == dtype


VARIANTS = [
    SamplingVariant(sampled=False, filtered=False),
    SamplingVariant(sampled=True, filtered=True),
    SamplingVariant(sampled=True, filtered=False, mixed=True),
]
VARIANT_IDS = ["greedy", "filtered", "mixed"]


# a baseline, a Free Transformer, and one whose rows may draw Z from a policy head in the step (SOME: what a
# compiled step and its CUDA graph run, whatever the mix of rows)
LATENTS = [(0, PolicyRows.NONE), (4, PolicyRows.NONE), (4, PolicyRows.SOME)]
LATENT_IDS = ["baseline", "free", "free-policy"]


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent_units, policy", LATENTS, ids=LATENT_IDS)
def test_the_engines_step_as_on_cuda(dtype, latent_units, policy, variant, monkeypatch):
    """What the engine captures per bucket: every slot's token, Z and position from its buffers (with a policy
    head, each Z drawn from the head's output with the slot's noise, or the slot's own, and kept), the model, each
    row's sampling with its settings as tensors, the token and position kept for the next step; a bucket of one row
    and one of every slot, nothing read on the host or copied from it."""
    model = tiny_model(dtype=dtype, latent_units=latent_units)
    if policy:
        model = with_policy_head(model, seed=0).to(dtype)
    model = model.to(META)
    with torch.inference_mode():
        engine = DecodeEngine(model, B, capacity=12)
        if policy:  # what a row of the policy joining makes: its noise at every position, its flag
            positions = torch.arange(engine.capacity, device=META)[None, :]
            engine.draws.noise = counter_policy_noise(model.latent_space, engine.draws.key[:, None], positions)
            engine.draws.policy[:1].fill_(True)
    with cuda_dispatch(monkeypatch), DeviceWork() as work, torch.inference_mode():
        for size in (1, B, B):
            view = engine.cache.cache.view(slice(0, size), engine.capacity)
            tokens, ended, non_finite, logits = engine.runner.body(engine.model, size, view, variant, policy, step_core)
    assert work.uploads == []
    assert tokens.shape == ended.shape == non_finite.shape == (B,) and logits.shape == (B, 50)
    assert tokens.dtype == torch.int64 and ended.dtype == non_finite.dtype == torch.bool


class ExternalStorages(TorchDispatchMode):
    """The storage of every tensor an operator reads that no operator inside made, in order: what a
    captured CUDA graph would read at a fixed address."""

    def __init__(self):
        super().__init__()
        self.made, self.read = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for arg in torch.utils._pytree.tree_leaves((args, kwargs or {})):
            if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() not in self.made:
                self.read.append((str(func), arg.untyped_storage().data_ptr()))
        out = func(*args, **(kwargs or {}))
        self.made |= {
            t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        }
        return out


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("latent_units, policy", LATENTS, ids=LATENT_IDS)
def test_the_engines_step_reads_the_same_storages_at_every_step(latent_units, policy, variant):
    """Graph capture freezes addresses: every tensor the step reads from outside itself (weights, the cache,
    the token, latent, position, noise and settings buffers; with a policy head, its weights and the rows' policy
    noise, flags and Z fed before) is the same storage at every step, with rows of different lengths and settings in
    flight (one of them of the policy)."""
    model = tiny_model(dtype=torch.float32, latent_units=latent_units)
    if policy:
        model = with_policy_head(model, seed=0)
    config = GenerationConfig(max_new_tokens=5, temperature=0.8, top_k=10, top_p=0.9)
    engine = DecodeEngine(model, B, capacity=12, compile=True)
    first = Row([1, 2, 3, 4, 5], config, 1, "policy" if policy else "prior")
    engine.add([first, Row([7, 8], GenerationConfig(max_new_tokens=5), None)])
    view = engine.cache.cache.view(slice(0, B), engine.capacity)
    reads = []
    with torch.inference_mode():
        # the warm-up run a capture follows (it makes the views)
        engine.runner.body(engine.model, B, view, variant, policy, step_core)
        for _ in range(2):
            with ExternalStorages() as external:
                engine.runner.body(engine.model, B, view, variant, policy, step_core)
            reads.append(external.read)
    assert reads[0] == reads[1] and len(reads[0]) > 10


@pytest.mark.parametrize("matmul_dtype", DTYPES)
def test_binary_mapper_forward_and_backward_as_on_cuda(matmul_dtype, monkeypatch):
    """Sampling, the row lookup and the chunked exact backward (several chunks) on the device only."""
    monkeypatch.setitem(binary_mapper.CHUNK_BYTES, "cpu", 64 * 2**4 * 10)  # meta takes the CPU budget: 16 chunks
    logits = torch.empty(64, 8, device=META, requires_grad=True)
    weight = torch.empty(2**8, 16, device=META, requires_grad=True)
    with DeviceWork() as work:
        r, index = binary_mapper_project(logits, weight)
        grad_logits, grad_weight = torch.autograd.grad(r.sum(), (logits, weight))
        grad_bf16 = binary_mapper._bit_logit_grad(logits.detach(), weight.detach(), r.detach(), matmul_dtype)
    assert work.uploads == []
    assert grad_logits.shape == grad_bf16.shape == (64, 8) and grad_weight.shape == (2**8, 16)


def test_hugging_face_wrapper_forward_as_on_cuda(monkeypatch):
    """FreeTransformerForCausalLM's forward with labels (encoder Z) and a cached continuation (prior Z). The
    token ids are read on the host once per sequence, by design, where it starts (a clear error instead of
    a device-side assert); never for a continuation."""
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from free_transformer.hf import FreeTransformerForCausalLM

    wrapper = FreeTransformerForCausalLM.from_free_transformer(tiny_model(dtype=torch.float32)).to(META)
    checked = []
    monkeypatch.setattr(wrapper.model, "check_tokens", lambda tokens: checked.append(tuple(tokens.shape)))
    tokens = _tokens(6)
    with cuda_dispatch(monkeypatch), DeviceWork() as work:
        out = wrapper(input_ids=tokens, labels=tokens)
        with torch.no_grad():
            cache = DynamicCache()
            wrapper(input_ids=tokens, past_key_values=cache, use_cache=True)
            step = wrapper(input_ids=tokens[:, :1], past_key_values=cache, use_cache=True)
    assert work.uploads == [] and checked == [(B, 6), (B, 6)]
    assert out.loss.device == META and step.logits.shape == (B, 1, 50)


class HostSyncs:
    """Counts, while on, what would make the host wait for a GPU: a value read from a tensor (`.item()`,
    `.tolist()`, `bool(t)`, `.cpu()`, `.to("cpu")`), a blocking copy (`copy_` without non_blocking) and a read of
    a host buffer (`.numpy()`, which follows the wait for the copy that fills it). A CPU engine cannot show a
    GPU's waits, so the methods themselves are watched. `log` holds them in order, with the step launches."""

    WATCHED = ("item", "tolist", "__bool__", "cpu", "numpy")

    def __init__(self, monkeypatch, runner_module):
        self.log: list[str] = []
        self.on = False
        for name in self.WATCHED:
            monkeypatch.setattr(torch.Tensor, name, self._watch(name, getattr(torch.Tensor, name)))
        to, copy = torch.Tensor.to, torch.Tensor.copy_

        def watched_to(tensor, *args, **kwargs):
            target = args[0] if args else kwargs.get("device")
            if str(target) == "cpu" and not kwargs.get("non_blocking", False):
                self._record("to cpu")
            return to(tensor, *args, **kwargs)

        def watched_copy(tensor, source, non_blocking=False):
            if not non_blocking:
                self._record("blocking copy")
            return copy(tensor, source, non_blocking)

        monkeypatch.setattr(torch.Tensor, "to", watched_to)
        monkeypatch.setattr(torch.Tensor, "copy_", watched_copy)
        core = runner_module.step_core

        def launched(*args, **kwargs):
            self._record("launch")
            return core(*args, **kwargs)

        monkeypatch.setattr(runner_module, "step_core", launched)

    def _record(self, what: str) -> None:
        if self.on:
            self.log.append(what)

    def _watch(self, name, method):
        def watched(tensor, *args, **kwargs):
            self._record(name)
            return method(tensor, *args, **kwargs)

        return watched


@pytest.mark.parametrize("deferred", [False, True], ids=["read-each-step", "deferred"])
def test_the_engine_waits_for_the_device_once_a_step_and_deferred_after_the_next_launch(deferred, monkeypatch):
    """k steps of 3 rows, one of which ends at a stop token on the way: a step's one host read is of the host
    buffer its tokens and ends were copied into (without blocking), or of the step's own tensor; deferred (as
    on CUDA), step n is read only after step n + 1 is launched, nothing of a step reads a device value, and the
    stopped row keeps no token of the step launched after its end."""
    engine_module = importlib.import_module("free_transformer.inference.engine")
    model = tiny_model(latent_units=4, dtype=torch.float32)
    config = GenerationConfig(max_new_tokens=9, temperature=0.8)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    alone = Row(prompts[1], config, 1)
    list(engine_module.run_rows(engine_module.DecodeEngine(model, 1, capacity=16), [alone]))
    stop = alone.tokens[2]  # row 1 stops at its third token, the second step's
    configs = [config, GenerationConfig(max_new_tokens=9, temperature=0.8, stop_tokens=(stop,)), config]
    syncs = HostSyncs(monkeypatch, importlib.import_module("free_transformer.inference.step_runner"))
    engine = engine_module.DecodeEngine(model, 3, capacity=16, deferred=deferred)
    rows = [Row(prompt, config, seed) for seed, (prompt, config) in enumerate(zip(prompts, configs))]
    engine.add(rows)
    k = 5
    syncs.on = True
    for _ in range(k):
        engine.step()
    syncs.on = False
    assert syncs.log.count("launch") == k
    reads = [what for what in syncs.log if what != "launch"]
    # not deferred on a CPU: the step's own tensor is read, no copy
    assert reads == (["tolist"] * (k - 1) if deferred else ["tolist"] * k)
    if deferred:  # the first step's tokens wait for the second's launch
        assert syncs.log[:3] == ["launch", "launch", "tolist"]
    assert rows[1].finish_reason == "stop" and rows[1].tokens == alone.tokens[: alone.tokens.index(stop) + 1]
    assert [len(rows[0].tokens), len(rows[2].tokens)] == [1 + k - deferred] * 2
