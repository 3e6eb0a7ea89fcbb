"""The lm-evaluation-harness adapter on a local task file (no hub access)."""

from pathlib import Path

import pytest
from conftest import tiny_checkpoint

DATA = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture()
def task_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    yaml = (DATA / "tiny_qa.yaml").read_text().replace("DATA_FILE", str(DATA / "tiny_qa.jsonl"))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_qa.yaml").write_text(yaml)
    return tmp_path / "tasks"


def test_adapter_runs_a_local_lm_eval_task(task_dir, tmp_path):
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from free_transformer.eval.lm_eval_adapter import FreeTransformerLM

    assert get_model("free-transformer") is FreeTransformerLM  # registered under the model type name
    lm = FreeTransformerLM(str(tiny_checkpoint(tmp_path, "run", 4)), samples=2)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["tiny_qa"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
    )
    row = results["results"]["tiny_qa"]
    assert row["sample_len"] == 4 and 0.0 <= row["acc,none"] <= 1.0


def test_adapter_requests_match_our_scoring(tmp_path):
    from lm_eval.api.instance import Instance

    from free_transformer.eval.lm_eval_adapter import FreeTransformerLM, _key
    from free_transformer.eval.scoring import continuation_logprobs, log_mean_exp

    lm = FreeTransformerLM(str(tiny_checkpoint(tmp_path, "run", 4)), samples=3, seed=7)
    request = Instance("loglikelihood", {}, ("Question: 2+2?\nAnswer:", " 4"), 0)
    ((logprob, greedy),) = lm.loglikelihood([request])
    tok = lm.tokenizer
    expected = continuation_logprobs(
        lm.model,
        [[(tok.encode("Question: 2+2?\nAnswer:"), tok.encode(" 4"))]],
        [_key("Question: 2+2?\nAnswer:")],
        lm.settings,
    )[0]
    assert logprob == pytest.approx(float(log_mean_exp(expected)[0]))
    assert isinstance(greedy, bool)
    gen = Instance("generate_until", {}, ("Hello", {"until": ["\n"], "max_gen_toks": 5}), 0)
    (text,) = lm.generate_until([gen])
    assert isinstance(text, str) and "\n" not in text
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("some held-out text",), 0)])
    assert rolling < 0


def test_adapter_device_from_model_args_and_from_lm_eval(tmp_path):
    """lm-eval passes its own device (default cuda:0) beside model_args: a model_args device wins (it used
    to raise "multiple values for keyword argument 'device'"), lm-eval's default means cpu without CUDA,
    and a device that does not exist is a DeviceError (one line from the CLI)."""
    import torch

    from free_transformer.base.devices import DeviceError
    from free_transformer.eval.lm_eval_adapter import FreeTransformerLM

    checkpoint = str(tiny_checkpoint(tmp_path, "run", 4))
    harness = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
    lm = FreeTransformerLM.create_from_arg_string(f"checkpoint={checkpoint},device=cpu", harness)
    assert next(lm.model.parameters()).device.type == "cpu"
    lm = FreeTransformerLM.create_from_arg_obj({"checkpoint": checkpoint}, harness)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(lm.model.parameters()).device.type == expected
    with pytest.raises(DeviceError, match="unknown device 'foo'"):
        FreeTransformerLM.create_from_arg_string(f"checkpoint={checkpoint},device=foo", harness)
