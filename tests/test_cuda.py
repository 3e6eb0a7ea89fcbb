"""What only a CUDA device can show: the attention kernel SDPA picks, host synchronisations in a training
step and a decoding step, and the numbers of the GPU against the CPU. Skipped without a CUDA device
(`pytest` on a CPU machine); `pytest --device cuda` on a GPU machine runs them with the device tests."""

import pytest
import torch
from conftest import tiny_model
from reference import naive_mapper_project
from torch.nn.attention import SDPBackend, sdpa_kernel

from free_transformer import FreeTransformer, ModelConfig
from free_transformer.model.latent import binary_mapper, binary_mapper_project

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
# Head dim 64 and grouped-query attention (4 query / 2 key-value heads), as the paper's sizes have.
GPU_CONFIG = dict(
    vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=512, max_seq_len=256, latent_units=8
)


def _model(dtype=torch.float32, seed=0) -> FreeTransformer:
    torch.manual_seed(seed)
    return FreeTransformer(ModelConfig(**GPU_CONFIG)).to(device=CUDA, dtype=dtype)


def _tokens(B=2, T=128, vocab=256, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed)).to(CUDA)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_attention_runs_a_fast_sdpa_kernel(precision):
    """Every attention of a forward (decoder blocks, the encoder's broadcast query, GQA) runs flash or
    memory-efficient attention: sdpa_kernel with only those backends raises when SDPA would need its
    math kernel (which materialises the T x T scores: in fp32 with enable_gqa it did, docs/gpu.md)."""
    model = _model().train()
    tokens = _tokens()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(tokens[:, :-1], tokens[:, 1:])
        out.loss.backward()
    assert torch.isfinite(out.loss)


def test_trainer_step_and_decoding_steps_never_synchronise(tmp_path):
    """`trainer.train_step` (batch upload, bf16 forward, backward, gradient norm, fused AdamW told about
    a non-finite step on the device), a cached decoding step and a replayed step of the decoding engine (a CUDA
    graph) queue
    their work without waiting for the GPU: any host synchronisation (.item(), a host-side comparison
    of a device value, a pageable host-to-device copy) raises under sync debug mode "error". That is
    what CUDA-graph capture and a launch-bound loop need."""
    from conftest import tiny_run_config

    from free_transformer.distributed import setup
    from free_transformer.inference.engine import DecodeEngine, Row
    from free_transformer.inference.params import GenerationConfig
    from free_transformer.inference.sampling import SamplingVariant
    from free_transformer.train.trainer import StopSignals, build, train_step

    config = tiny_run_config("device=cuda", "precision=bf16")
    run = build(config, tmp_path / "run", setup("none", None, CUDA), resume=False, init_from=None)
    signals = StopSignals()
    train_step(run, 0, signals)  # first-call set-up (optimizer state, cuBLAS handles) outside the check
    model = _model().eval()
    B, P = 2, 16
    tokens = _tokens()
    with torch.inference_mode():
        cache = model.new_cache(B)
        prefill = model(tokens[:, :P], latents=torch.zeros(B, P, dtype=torch.long, device=CUDA), cache=cache)
        token = prefill.logits[:, -1].argmax(-1)  # (B,) stays on the device
        latent = torch.zeros(B, 1, dtype=torch.long, device=CUDA)
    engine = DecodeEngine(model, B, capacity=P + 8, compile=True)
    engine.add(
        [Row(tokens[row, :P].tolist(), GenerationConfig(max_new_tokens=8, temperature=0.8), None) for row in range(B)]
    )
    variant = SamplingVariant(sampled=True, filtered=False)
    with torch.inference_mode():
        engine._replay(B, variant)  # warm-up
        engine._replay(B, variant)  # capture, then replay
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        result = train_step(run, 1, signals)
        with torch.inference_mode():
            step = model(token[:, None], latents=latent, cache=cache, start=P)
            replayed, _, _ = engine._replay(B, variant)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert engine.runner.graphs and not bool(result.non_finite)
    assert step.logits.shape == (B, 1, GPU_CONFIG["vocab_size"]) and cache.length == P + 1
    assert torch.isfinite(step.logits).all() and replayed.shape == (B,)


def _mapper_inputs(n_rows, n_bits, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(n_rows, n_bits, generator=g, dtype=torch.float64)
    weight = torch.randn(2**n_bits, dim, generator=g, dtype=torch.float64) * dim**-0.5
    grad_out = torch.randn(n_rows, dim, generator=g, dtype=torch.float64)
    return logits, weight, grad_out


def _mapper_grads(logits, weight, grad_out, index=None, autocast=False):
    """(r, index, d logits, d weight) of (r * grad_out).sum(): the fused mapper when index is None (it
    samples the index), else the paper's formula for that index (float64 on the CPU)."""
    x, w = logits.clone().requires_grad_(), weight.clone().requires_grad_()
    if index is None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            r, index = binary_mapper_project(x, w, generator=torch.Generator(x.device).manual_seed(1))
    else:
        r = naive_mapper_project(x, w, index)
    return (r, index, *torch.autograd.grad((r * grad_out).sum(), (x, w)))


@pytest.mark.parametrize(
    "n_bits, dtype, autocast, rtol",
    [
        (10, torch.float64, False, 1e-10),  # the same arithmetic as the CPU: agreement to rounding
        (12, torch.float32, False, 1e-4),
        (16, torch.float32, False, 1e-4),
        (12, torch.float32, True, 2e-2),  # dR @ W^T in bf16 (measured 2.9e-3 relative)
    ],
)
def test_mapper_gradients_on_cuda_match_the_paper_formula_in_float64(n_bits, dtype, autocast, rtol, monkeypatch):
    """The fused Binary Mapper on the GPU, several chunks, against (Y + G - detach(G)) @ W on the CPU in float64
    with the same sampled index (see test_latent.py's test_mapper_matches_paper_formula)."""
    logits, weight, grad_out = _mapper_inputs(n_rows=64, n_bits=n_bits, dim=32)
    entry_bytes = binary_mapper.chunk_entry_bytes(torch.bfloat16 if autocast else dtype, dtype)
    monkeypatch.setitem(binary_mapper.CHUNK_BYTES, "cuda", 64 * 2 ** (n_bits - 3) * entry_bytes)  # 8 chunks
    r, index, grad_logits, grad_weight = _mapper_grads(
        *(t.to(CUDA, dtype) for t in (logits, weight, grad_out)), autocast=autocast
    )
    r_ref, _, ref_logits, ref_weight = _mapper_grads(logits, weight, grad_out, index=index.cpu())
    scale = ref_logits.abs().max()
    assert scale > 0
    torch.testing.assert_close(r.cpu().double(), r_ref, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)
    torch.testing.assert_close(grad_logits.cpu().double(), ref_logits, rtol=0, atol=rtol * scale)
    torch.testing.assert_close(
        grad_weight.cpu().double(),
        ref_weight,
        rtol=0,
        atol=(1e-6 if dtype == torch.float32 else 1e-12) * ref_weight.abs().max(),
    )


@pytest.mark.parametrize("latent_units", [0, 4])
def test_cpu_and_cuda_logits_agree(latent_units):
    """The same weights and latents give the same logits on both devices, float32 (an H100: 4.5e-7);
    the encoder's bit-logits too."""
    cpu = tiny_model(dtype=torch.float32, latent_units=latent_units)
    gpu = tiny_model(dtype=torch.float32, latent_units=latent_units, device=CUDA)
    tokens = torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(0))
    latents = torch.randint(0, 16, (3, 20), generator=torch.Generator().manual_seed(1)) if latent_units else "prior"
    on_gpu = gpu(tokens.to(CUDA), latents=latents.to(CUDA) if latent_units else latents).logits
    torch.testing.assert_close(on_gpu.cpu(), cpu(tokens, latents=latents).logits, rtol=1e-4, atol=1e-5)
    if latent_units:
        torch.testing.assert_close(gpu(tokens.to(CUDA)).posterior.cpu(), cpu(tokens).posterior, rtol=1e-4, atol=1e-5)


def test_demo_trains_every_model_of_every_seed_on_one_gpu(tmp_path):
    """The demo's GPU path: all models of both seeds trained at once, each in its own process on the
    device, then measured there."""
    import json

    from free_transformer.cli import main
    from free_transformer.experiments.demo.run import VARIANTS

    out = tmp_path / "demo"
    assert main(["demo", "--preset", "smoke", "--out", str(out), "--seeds", "2", "--device", "cuda"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["device"] == "cuda" and results["workers"] == 2 * len(VARIANTS)
    assert len(results["claims"]) == 5


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_deferred_read_back_gives_the_tokens_of_a_read_every_step(graph):
    """On CUDA the engine reads a step's tokens after the next step is launched (pinned memory and an event),
    by default: rows of different lengths, one of which stops at a stop token and one at its length, get the
    tokens they get when every step is read at once, eager and replayed from a CUDA graph (captured without
    Inductor, for speed), and each row its own tokens alone."""
    from free_transformer.inference.engine import DecodeEngine, Row, run_rows
    from free_transformer.inference.params import GenerationConfig

    model = _model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    plain = GenerationConfig(max_new_tokens=12, temperature=0.8)
    probe = Row(prompts[1], plain, 1)
    list(run_rows(DecodeEngine(model, 1, capacity=32, deferred=False), [probe]))
    stop = probe.tokens[4]  # row 1 stops at its fifth token
    stopping = GenerationConfig(max_new_tokens=12, temperature=0.8, stop_tokens=(stop,))
    configs = [plain, stopping, GenerationConfig(max_new_tokens=5, temperature=0.8)]

    def decode(deferred: bool) -> list[list[int]]:
        engine = DecodeEngine(model, 3, capacity=32, compile=graph, inductor=False, deferred=deferred)
        rows = [Row(prompt, config, seed) for seed, (prompt, config) in enumerate(zip(prompts, configs))]
        list(run_rows(engine, rows))
        assert engine.runner.deferred == deferred and engine.runner.use_graph == graph
        return [row.tokens for row in rows]

    read_each_step, deferred = decode(False), decode(True)
    assert deferred == read_each_step
    assert read_each_step[1] == probe.tokens[: probe.tokens.index(stop) + 1] and len(read_each_step[2]) == 5


def test_a_policys_draw_of_several_positions_is_captured_by_a_cuda_graph():
    """The prefill draws a prompt's Z from the policy head by rounds, each ending on a comparison read on the host;
    inside a CUDA graph's capture it takes the loop, whose replay gives the rounds' Z and R (float32 on the GPU)."""
    from free_transformer.base.counter_random import row_keys
    from free_transformer.model.latent import PolicyDraw, counter_policy_noise
    from free_transformer.train.rl.trainer import with_policy_head

    model = with_policy_head(_model(), seed=0)
    with torch.no_grad():  # a head away from the prior, whose Z_{t-1} weighs on Z_t
        model.latent.policy.out.weight.normal_(0, 0.5)
    B, T = 3, 6
    x_half = torch.randn(B, T, model.config.dim, device=CUDA)
    keys = row_keys(torch.arange(B, device=CUDA))
    draw = PolicyDraw(counter_policy_noise(model.latent_space, keys[:, None], torch.arange(T, device=CUDA)[None, :]))
    with torch.inference_mode():
        rounds_r, rounds = model.latent.draw_from_policy(x_half, draw)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up a capture needs
            model.latent.draw_from_policy(x_half, draw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured_r, captured = model.latent.draw_from_policy(x_half, draw)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured.value, rounds.value)
    torch.testing.assert_close(captured_r, rounds_r)
