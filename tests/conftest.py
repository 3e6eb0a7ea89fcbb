import functools
import shutil
from pathlib import Path

import pytest
import torch

from free_transformer import FreeTransformer, ModelConfig
from free_transformer.base.compat import SETTINGS_RENAMED


@functools.cache
def kernel_sandbox() -> bool:
    """Whether this machine gives generated code the sandbox's kernel layers (user namespaces and
    seccomp). Where it does not, sandbox tests run hook-only, which an evaluation there must ask for."""
    from free_transformer.eval.sandbox import SandboxLimits, isolation_report

    layers = isolation_report(SandboxLimits(allow_hook_only=True))
    return bool(layers.get("network_namespace") and layers.get("read_only_fs") and layers.get("seccomp"))


def hook_only_args() -> list[str]:
    """eval's option that code tasks need where the kernel layers are missing."""
    return [] if kernel_sandbox() else ["--sandbox-hook-only"]


def tiny_config(**overrides) -> ModelConfig:
    values = dict(
        vocab_size=50, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=40, latent_units=4
    )
    if "latent_bits" in overrides:  # latent_units's old name, which some test files still pass
        overrides["latent_units"] = overrides.pop("latent_bits")
    values.update(overrides)
    return ModelConfig(**values)


def device_dtype(device) -> torch.dtype:
    """The dtype of the device tests' models: float64 on the CPU (the naive references agree to rounding),
    float32 on CUDA, where float64 would run SDPA's math kernel and hide what the fused kernels do."""
    return torch.float32 if torch.device(device).type == "cuda" else torch.float64


def tolerance(model_or_dtype) -> dict:
    """assert_close's rtol and atol for a model computing in its dtype (or `dtype`) against float64."""
    dtype = model_or_dtype.embed_tokens.weight.dtype if isinstance(model_or_dtype, torch.nn.Module) else model_or_dtype
    return {
        torch.float64: dict(rtol=1e-9, atol=1e-9),
        torch.float32: dict(rtol=1e-4, atol=1e-5),
        torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    }[dtype]


def tiny_model(seed=0, dtype=None, device="cpu", **overrides) -> FreeTransformer:
    """Initialised on the CPU from `seed` (the same weights on every device), then moved to `device`; in
    `dtype`, by default `device_dtype(device)`."""
    torch.manual_seed(seed)
    model = FreeTransformer(tiny_config(**overrides)).to(dtype or device_dtype(device))
    with torch.no_grad():  # non-trivial latent path: larger table, biased encoder bits
        if model.config.is_free:
            model.latent.mapper.weight.normal_(0, 0.5)
            model.latent.readout.weight.normal_(0, 0.5)
    return model.to(device).eval()


def tiny_checkpoint(root, name: str, latent_units: int | None = None, **overrides):
    """A byte-tokenizer run directory with one checkpoint of a small random model (vocab 256)."""
    from free_transformer.runs.checkpoint import save_checkpoint

    torch.manual_seed(0)
    values = dict(
        vocab_size=256,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=64,
        max_seq_len=64,
        latent_units=overrides.pop("latent_bits", latent_units),
    )  # latent_units's old name, still passed
    values.update(overrides)
    save_checkpoint(root / name, 1, FreeTransformer(ModelConfig(**values)), {"tokenizer": "byte"})
    return root / name


# ---- the device the numerical tests run on: `pytest` (cpu, what CI runs) or `pytest --device cuda` -----------


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="device for the tests that take the `device` fixture (default cpu). With cuda, tests "
        "without that fixture are deselected (they are device-independent: plain `pytest` runs "
        "them) and tests marked cpu_only are skipped",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_only(reason): takes the device fixture but only makes sense on the CPU; skipped under --device cuda",
    )
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped cleanly without one")
    device = torch.device(config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: no CUDA device here (torch {torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device must be cpu or cuda, got {device}")


def pytest_collection_modifyitems(config, items):
    """Without CUDA, tests marked cuda are skipped. Under --device cuda, tests that do not take the
    `device` fixture are deselected (they do not depend on the device: plain `pytest` runs them on the
    CPU), and tests marked cpu_only are skipped with their reason."""
    device = torch.device(config.getoption("--device"))
    no_cuda = pytest.mark.skip(reason="needs a CUDA device (none here); run `pytest --device cuda` on a GPU machine")
    kept, deselected = [], []
    for item in items:
        if item.get_closest_marker("cuda"):
            if not torch.cuda.is_available():
                item.add_marker(no_cuda)
            kept.append(item)
            continue
        if device.type == "cpu":
            kept.append(item)
            continue
        cpu_only = item.get_closest_marker("cpu_only")
        if cpu_only:
            reason = cpu_only.kwargs.get("reason") or (cpu_only.args[0] if cpu_only.args else "")
            item.add_marker(pytest.mark.skip(reason=f"cpu_only: {reason}"))
            kept.append(item)
        elif "device" in item.fixturenames:
            kept.append(item)
        else:
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture
def device(request) -> torch.device:
    """The device of `pytest --device` (cpu by default)."""
    return torch.device(request.config.getoption("--device"))


def on_cpu(model: FreeTransformer) -> FreeTransformer:
    """A CPU copy of a model, for the naive references (written for CPU tensors)."""
    import copy

    return copy.deepcopy(model).cpu()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def fake_corpus(tmp_path, monkeypatch, texts: dict[str, str], heldout: tuple[str, ...]):
    """Register corpus:fake, a NamedCorpus whose files are `texts` inside an importable package."""
    from free_transformer.data.corpora import CORPORA, NamedCorpus

    folder = tmp_path / "site" / "fakecorpusdata" / "texts"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    for name, text in texts.items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    corpus = NamedCorpus(
        name="fake",
        module="fakecorpusdata",
        folder="texts",
        pattern="*_m.txt",
        heldout=heldout,
        install="pip install fake",
        about="a test corpus",
    )
    monkeypatch.setitem(CORPORA, "fake", corpus)
    return corpus


# A tiny training run (debug size, byte letters) for the training and robustness tests.
TINY = [
    "model.size=debug",
    "model.vocab_size=256",
    "model.max_seq_len=72",
    "batch_size=4",
    "log_every=1",
    "optim.warmup_steps=2",
    "progress=false",
    "kappa_bits=0.25",
]


def tiny_run_config(*overrides):
    from free_transformer.train.config import load_train_config

    return load_train_config(None, TINY + list(overrides))


def run_losses(run_dir):
    """[(step, loss)] of a run's metrics.jsonl."""
    from free_transformer.train.metrics import read_metrics

    return [(m["step"], m["loss"]) for m in read_metrics(Path(run_dir) / "metrics.jsonl")]


LEGACY_RUN = Path(__file__).parent / "data" / "legacy-run"  # written by 0.1: settings and tensors in old names


def legacy_run_in_todays_names(tmp_path) -> Path:
    """A copy of tests/data/legacy-run whose config.yaml a user renamed as SETTINGS_RENAMED says (0.3.0
    reads today's names only); its checkpoints stay as 0.1 wrote them."""
    import yaml

    run = tmp_path / "legacy-run"
    shutil.copytree(LEGACY_RUN, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    for old, new in SETTINGS_RENAMED.items():
        *parents, leaf = old.split(".")
        node = config
        for part in parents:
            node = node[part]
        value = node.pop(leaf)
        *parents, leaf = new.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def wait_for_step(out, step, process, timeout=120):
    """Wait until a `train` subprocess writing to `out` has logged `step` steps."""
    import time

    from free_transformer.train.metrics import read_metrics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if len(read_metrics(Path(out) / "metrics.jsonl")) >= step:
            return
        time.sleep(0.01)
    raise AssertionError(f"the run did not reach step {step}: {process.poll()} {process.stderr.read()}")


class Payload:
    """Unpickling this touches `marker`: what a crafted checkpoint file would do with a real payload."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def rewrite_checksums(checkpoint):
    """Record the current digests of the files a checkpoint's SHA256SUMS lists: what an attacker who
    rewrites a checkpoint file does to SHA256SUMS too."""
    from free_transformer.base.fileio import sha256_file

    names = [line.split("  ", 1)[1] for line in (checkpoint / "SHA256SUMS").read_text().splitlines()]
    (checkpoint / "SHA256SUMS").write_text("".join(f"{sha256_file(checkpoint / name)}  {name}\n" for name in names))
