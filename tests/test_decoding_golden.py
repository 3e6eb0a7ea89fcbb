"""Decoding gives the tokens it gave: a golden set of generations, recorded by this file on the code of
commit 77401e5 (tests/data/decoding-golden.json) and compared token for token, so that a change inside the
engine (its scheduler, cache manager, step runner or dispenser of Z) that changes a single sample fails here.

The set covers `generate()` (equal and mixed prompt lengths, every choice of Z, explicit values, fewer slots than
rows, stop tokens, a baseline), rows of different sampling settings (greedy, sampled, filtered) in one engine,
eager, bucketed (compile=True on the CPU: the same step over the whole cache under a mask) and deferred,
`best_of()` over each variation, the server under 8 concurrent clients, and the Hugging Face wrapper's
`generate` with seeds. Record again (only on purpose: a change of the sampling rule) with
    FREE_TRANSFORMER_RECORD_GOLDEN=1 python -m pytest tests/test_decoding_golden.py

The model is a small random one, in float32; a token is sampled by inverting the CDF at a float64 uniform, so a
float rounding of another CPU changes a sample only when a uniform falls within about 1e-7 of a CDF step:
about once in 10^6 draws of this set's 2,000."""

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import tiny_checkpoint

from free_transformer import GenerationConfig, best_of, generate
from free_transformer.inference.engine import DecodeEngine, Row, run_rows
from free_transformer.runs.checkpoint import load_model

GOLDEN = Path(__file__).parent / "data" / "decoding-golden.json"
RECORD = os.environ.get("FREE_TRANSFORMER_RECORD_GOLDEN") == "1"
RECORDED = {} if RECORD or not GOLDEN.exists() else json.loads(GOLDEN.read_text())
_recording: dict = {}
_lock = threading.Lock()

EQUAL = [[72, 101, 108], [87, 111, 114], [65, 66, 67], [120, 121, 122]]
MIXED = [[72], [72, 101, 108], [87, 111, 114, 108, 100], [84, 104, 101, 32, 99, 97, 116, 115]]
SAMPLED = GenerationConfig(max_new_tokens=10, temperature=1.0)


def check(name: str, value) -> None:
    """Compare `value` with its recording (or record it)."""
    value = json.loads(json.dumps(value))
    if RECORD:
        with _lock:
            _recording[name] = value
            data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
            data.update(_recording)
            GOLDEN.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
        return
    assert name in RECORDED, f"{name} is not in {GOLDEN.name}: record it on the code before the change"
    assert value == RECORDED[name]


def fed(result) -> list | None:
    return None if result.latents is None else [z.tolist() for z in result.latents]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("golden"), "free", latent_units=4, max_seq_len=64)


@pytest.fixture(scope="module")
def model(run):
    return load_model(run)[0].float().eval()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("golden"), "baseline", latent_units=0, max_seq_len=64)
    return load_model(path)[0].float().eval()


@pytest.mark.parametrize(
    "case", ["equal-encoder", "mixed-encoder", "equal-prior", "mixed-prior", "shared", "reference", "explicit", "slots"]
)
def test_generate_gives_its_recorded_tokens(model, case):
    options: dict = {"seed": 3}
    prompts = MIXED if case.startswith("mixed") else EQUAL
    if case.endswith("prior"):
        options["latents"] = "prior"
    elif case == "shared":
        options.update(latents="shared", latent_seed=5)
    elif case == "reference":
        options.update(latents="reference", reference=torch.tensor([[66] * 20]), latent_seed=5)
    elif case == "explicit":
        options["latents"] = (torch.arange(4 * 6) % 16).view(4, 6)
    elif case == "slots":  # 4 rows through 2 slots: rows join as others end
        prompts, options["batch_size"] = MIXED, 2
    result = generate(model, prompts, SAMPLED, **options)
    check(f"generate/{case}", {"tokens": result.tokens, "latents": fed(result)})


def test_stop_tokens_and_a_baseline_give_their_recorded_tokens(model, baseline):
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, stop_tokens=(101, 32, 111))
    result = generate(model, MIXED, config, seeds=[1, 2, 3, 4])
    check("generate/stops", {"tokens": result.tokens, "latents": fed(result)})
    check("generate/baseline", generate(baseline, MIXED, SAMPLED, seed=9).tokens)


MIXED_SETTINGS = [
    GenerationConfig(max_new_tokens=9, temperature=0.0),
    GenerationConfig(max_new_tokens=12, temperature=1.0),
    GenerationConfig(max_new_tokens=7, temperature=0.7, top_k=5),
    GenerationConfig(max_new_tokens=10, temperature=1.2, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("engine_kind", ["eager", "bucketed", "deferred"])
def test_rows_of_mixed_settings_in_one_engine_give_their_recorded_tokens(model, engine_kind):
    """Greedy, sampled and filtered rows of mixed prompt lengths share an engine's steps: the same tokens, eager,
    bucketed or deferred (the three must agree, and equal the recording)."""
    options = {"compile": engine_kind == "bucketed", "deferred": engine_kind == "deferred"}
    engine = DecodeEngine(model, 3, capacity=32, inductor=False, **options)
    rows = [Row(ids, config, 10 + k) for k, (ids, config) in enumerate(zip(MIXED * 2, MIXED_SETTINGS * 2))]
    rows[5].latents = torch.arange(8)[None] % 16  # an explicit Z beside rows of the prior
    for _ in run_rows(engine, rows):
        pass
    check("engine/mixed-settings", [[row.tokens, row.finish_reason, row.fed.tolist()] for row in rows])


@pytest.mark.parametrize("vary", ["both", "latent", "tokens"])
def test_best_of_gives_its_recorded_candidates_and_choices(model, vary):
    """The candidates and choices; the scores to 1e-5 (they were a teacher-forced forward's, and are now summed
    from the logits the tokens were sampled from: the same values up to float32 rounding)."""
    found = best_of(model, EQUAL[:2], 3, SAMPLED, vary=vary, seed=4)
    check(f"best_of/{vary}", {"tokens": found.tokens, "chosen": found.chosen})
    recorded = RECORDED.get(f"best_of/{vary}/scores") if not RECORD else None
    scores = [[round(s, 6) for s in p] for p in found.scores]
    if recorded is None:
        check(f"best_of/{vary}/scores", scores)
    else:
        assert scores == [pytest.approx(p, abs=1e-5) for p in recorded]


def test_the_server_under_8_concurrent_clients_gives_its_recorded_completions(run):
    from test_serve import NAME, start_server

    url, _, uv = start_server(run, engine={"max_batch": 4})
    bodies = [
        {"prompt": "Hello", "max_tokens": 10, "seed": 1},
        {"prompt": "The cat sat", "max_tokens": 14, "seed": 2, "n": 2},
        {"prompt": "W", "max_tokens": 6, "temperature": 0, "seed": 8},
        {"prompt": "abcdefgh", "max_tokens": 9, "seed": 3, "top_k": 4},
        {"prompt": "Hi", "max_tokens": 8, "seed": 4, "best_of": 3, "logprobs": 0},
        {"prompt": "Yes and", "max_tokens": 12, "seed": 5, "latents": "prior"},
        {"prompt": "One two", "max_tokens": 11, "seed": 6, "stream": True},
        {"prompt": "x", "max_tokens": 10, "seed": 7, "n": 3, "temperature": 0.8, "top_p": 0.9},
    ]

    def complete(body):
        body = {"model": NAME, **body}
        if body.get("stream"):
            text = ""
            with httpx.stream("POST", url + "/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            return [text]
        response = httpx.post(url + "/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]

    try:
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(complete, bodies))
    finally:
        uv.should_exit = True
    check("serve/8-clients", texts)


def test_the_hugging_face_wrapper_gives_its_recorded_tokens(model):
    pytest.importorskip("transformers")
    from free_transformer.hf import FreeTransformerForCausalLM

    hf = FreeTransformerForCausalLM.from_free_transformer(model)
    prompts = torch.tensor(EQUAL)
    for name, options in {
        "sampled": {"do_sample": True},
        "prior": {"do_sample": True, "latents": "prior"},
        "greedy": {"do_sample": False},
    }.items():
        out = hf.generate(
            prompts, max_new_tokens=8, seeds=[1, 2, 3, 4], return_dict_in_generate=True, pad_token_id=0, **options
        )
        check(f"hf/{name}", {"sequences": out.sequences.tolist(), "latents": out["latents"].tolist()})
