"""Sampling as users run it: many prompts of different lengths in one call (each sample as that prompt alone
would give it), prompts from a file or stdin, the output formats, the interactive mode, and `load_model`
in the public API."""

import io
import json

import pytest
import torch
from conftest import tiny_checkpoint, tiny_model

import free_transformer
from free_transformer import FreeTransformer, GenerationConfig, generate, load_model
from free_transformer.base.seeding import sample_seed
from free_transformer.cli import main
from free_transformer.inference import batches
from free_transformer.inference.batches import prepare_prompts, sample_prompts

PROMPTS = ["K>", "Hello there", "Hi", "K>abc"]  # lengths 2, 11, 2, 5: two of one length, not side by side
COMMON = ["-n", "3", "--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("sampling"), "run", 4))


def _out(capsys, argv: list[str]) -> list[str]:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out.split("\n")[:-1]  # not splitlines(): a sample may hold \x1e, \x85...


def _alone(capsys, checkpoint, prompts, *options) -> list[str]:
    """The lines of one call per prompt, in order."""
    return [line for prompt in prompts for line in _out(capsys, ["generate", checkpoint, "--prompt", prompt, *options])]


@pytest.mark.parametrize("choice", ["encoder", "prior", "shared", "reference"])
@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_each_prompt_samples_as_it_would_alone(choice, batch_size):
    """sample_prompts over prompts of lengths 3, 7, 3, 5: every prompt's samples are those of `generate` on that
    prompt alone with its samples' seeds (sample_seed(seed, p, i), its Z resolved with latent_seed), in order,
    however the rows are batched."""
    model = tiny_model()  # seeds the global RNG: the prompts below are fixed
    ids = [torch.randint(0, 50, (length,)).tolist() for length in (3, 7, 3, 5)]
    config = GenerationConfig(max_new_tokens=6, temperature=0.8)
    reference = torch.randint(0, 50, (1, 9)) if choice == "reference" else None
    prompts = prepare_prompts(model, ids, [config] * len(ids), choice, reference=reference, latent_seed=11)
    rows = list(sample_prompts(model, prompts, 3, 40, batch_size=batch_size))
    seeds = [[sample_seed(40, p, i) for i in range(3)] for p in range(4)]
    assert [(row.prompt, row.sample, row.seed) for row in rows] == [
        (p, i, seeds[p][i]) for p in range(4) for i in range(3)
    ]
    for p, prompt in enumerate(ids):
        alone = generate(
            model, [prompt] * 3, config, seeds=seeds[p], latents=choice, reference=reference, latent_seed=11
        )
        assert [row.tokens for row in rows if row.prompt == p] == alone.tokens, p


def test_prompts_of_any_lengths_share_every_step_and_come_out_in_order(monkeypatch):
    """Rows of different lengths are rows of one engine: 3 prompts of lengths 3, 5 and 3, 2 samples each, take
    max_new_tokens - 1 steps in all (a batch per length took that many steps each), and come out in order."""
    model, made = tiny_model(), []
    real = batches.decoding_engine
    monkeypatch.setattr(batches, "decoding_engine", lambda *args, **kw: made.append(real(*args, **kw)) or made[-1])
    ids = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]
    config = GenerationConfig(max_new_tokens=3)
    rows = list(sample_prompts(model, prepare_prompts(model, ids, [config] * 3, "encoder", latent_seed=0), 2, 5))
    assert len(made) == 1 and made[0].slots == 6 and made[0].steps == 2
    assert [(row.prompt, row.sample) for row in rows] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match="2 generation settings for 3 prompts"):
        prepare_prompts(model, ids, [config] * 2, "encoder", latent_seed=0)
    with pytest.raises(ValueError, match="needs each prompt's max_new_tokens set"):  # its rows' length is unknown
        prepare_prompts(model, ids, [GenerationConfig()] * 3, "encoder", latent_seed=0)


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--batch-size", "2"],
        ["--latents", "shared", "--seed", "9"],
        ["--latents", "reference", "--reference", "K>abcdefghijkl"],
    ],
)
def test_the_command_samples_many_prompts_whatever_the_batch(checkpoint, capsys, options):
    """Repeated --prompt, of different lengths: in the order given, the same lines one row at a time, the first
    prompt's those of a call with it alone (its index, 0, is the same)."""
    many = _out(capsys, ["generate", checkpoint, *[w for p in PROMPTS for w in ("--prompt", p)], *COMMON, *options])
    one_row = _out(
        capsys,
        [
            "generate",
            checkpoint,
            *[w for p in PROMPTS for w in ("--prompt", p)],
            *COMMON,
            *options,
            "--batch-size",
            "1",
        ],
    )
    assert many == one_row and len(many) == 12
    assert many[:3] == _alone(capsys, checkpoint, PROMPTS[:1], *COMMON, *options)


def test_the_prompts_of_a_call_sample_independently():
    """200 copies of one prompt in one call: each row its own stream (distinct seeds, distinct continuations at
    the rate of independent samples), and prompt p's sample the one `generate` gives alone with its seed, at any
    batch size. The tiny model's next-token probabilities are nearly uniform over 50 tokens, so two independent
    8-token samples coincide with probability about 50^-8: a repeat among 200 (about 1e-9, and the seed is fixed)
    means shared streams."""
    model = tiny_model()
    config = GenerationConfig(max_new_tokens=8, temperature=1.0)
    prompts = prepare_prompts(model, [[1, 2, 3]] * 200, [config] * 200, "encoder", latent_seed=0)
    rows = list(sample_prompts(model, prompts, 1, 7, batch_size=64))
    assert len({row.seed for row in rows}) == 200
    assert len({tuple(row.tokens) for row in rows}) == 200
    again = list(sample_prompts(model, prompts[:12], 1, 7, batch_size=5))
    assert [row.tokens for row in again] == [row.tokens for row in rows[:12]]
    assert generate(model, [[1, 2, 3]], config, seeds=[sample_seed(7, 150, 0)]).tokens[0] == rows[150].tokens


def test_prompts_from_a_file_or_stdin_read_escapes(checkpoint, capsys, tmp_path, monkeypatch):
    """--prompts-file: one prompt per line with \\n-style escapes read (a tab here), after the --prompt ones;
    `-` reads stdin. A line left empty is refused, with its number, before the checkpoint is read."""
    (tmp_path / "prompts.txt").write_text("Hello there\r\nA\\tB\n")
    from_file = _out(
        capsys, ["generate", checkpoint, "--prompt", "K>", "--prompts-file", str(tmp_path / "prompts.txt"), *COMMON]
    )
    given = ["K>", "Hello there", "A\tB"]
    assert from_file == _out(capsys, ["generate", checkpoint, *[w for p in given for w in ("--prompt", p)], *COMMON])
    monkeypatch.setattr("sys.stdin", io.StringIO("K>\nHello there"))
    assert _out(capsys, ["generate", checkpoint, "--prompts-file", "-", *COMMON]) == from_file[:6]
    (tmp_path / "gap.txt").write_text("K>\n\nHi\n")
    assert main(["generate", str(tmp_path / "missing"), "--prompts-file", str(tmp_path / "gap.txt")]) == 2
    assert main(["generate", checkpoint, "-n", "1"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert (
        errors[0] == f"error: {tmp_path / 'gap.txt'} line 2 is empty: every line is a prompt (write a newline "
        "inside one as \\n)"
    )
    assert errors[1].startswith("error: give a prompt: --prompt TEXT, --prompts-file FILE") and len(errors) == 2


def test_jsonl_gives_each_sample_with_its_prompt_index_seed_and_latents(checkpoint, capsys):
    """The text format is one line a sample, unambiguous: a newline and a backslash followed by n differ."""
    from free_transformer.commands.samples import escape, unescape

    prompts = ["K>", "Hi\nthere", "Hi\\nthere"]  # a newline; a backslash and an n
    text = _out(
        capsys,
        [
            "generate",
            checkpoint,
            *[w for p in prompts for w in ("--prompt", p)],
            *COMMON,
            "--seed",
            "4",
            "--latents",
            "prior",
        ],
    )
    records = [
        json.loads(line)
        for line in _out(
            capsys,
            [
                "generate",
                checkpoint,
                *[w for p in prompts for w in ("--prompt", p)],
                *COMMON,
                "--seed",
                "4",
                "--latents",
                "prior",
                "--format",
                "jsonl",
            ],
        )
    ]
    assert [(r["prompt"], r["index"], r["seed"], r["latents"]) for r in records] == [
        (prompt, index, sample_seed(4, index, i), "prior") for index, prompt in enumerate(prompts) for i in range(3)
    ]
    assert [escape(r["prompt"] + r["sample"]) for r in records] == text
    assert [unescape(line) for line in text] == [r["prompt"] + r["sample"] for r in records]
    assert text[3].startswith("Hi\\nthere") and text[6].startswith("Hi\\\\nthere")


def test_a_prompt_that_does_not_fit_is_refused_before_any_sample(checkpoint, capsys):
    assert main(["generate", checkpoint, "--prompt", "K>", "--prompt", "x" * 70, "-n", "1"]) == 2
    assert main(["generate", checkpoint, "--prompt", "K>", "--prompt", "x" * 40, "--max-new-tokens", "30"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "error: --prompt 2: the prompt has 70 tokens; this model reads at most 64",
        "error: --prompt 2: prompt (40) + max_new_tokens (30) - 1 exceeds max_seq_len 64: "
        "max_new_tokens can be at most 25",
    ]


def test_a_stop_string_written_with_escapes_ends_samples_at_a_newline(checkpoint, capsys):
    """--stop "\\n" as a shell passes it (a backslash and an n) ends each sample at its first newline."""
    options = ["--prompt", "K>", "-n", "16", "--max-new-tokens", "40", "--format", "jsonl"]
    full = [json.loads(line)["sample"] for line in _out(capsys, ["generate", checkpoint, *options])]
    assert any("\n" in sample for sample in full)  # the seeds give the random model's newlines
    stopped = [json.loads(line)["sample"] for line in _out(capsys, ["generate", checkpoint, *options, "--stop", "\\n"])]
    assert stopped == [sample.split("\n")[0] for sample in full]


def test_samples_a_stop_string_ended_at_once_are_named_on_stderr(checkpoint, capsys):
    """In the text format a sample that a stop string ended before its first character is its prompt alone:
    stderr names those lines, and only those."""
    options = ["generate", checkpoint, "--prompt", "K>", "-n", "8", "--max-new-tokens", "6"]
    samples = [json.loads(line)["sample"] for line in _out(capsys, [*options, "--format", "jsonl"])]
    stop = samples[0][0]
    at_once = [number for number, sample in enumerate(samples, 1) if sample.startswith(stop)]
    assert main([*options, "--stop", stop]) == 0
    out, err = capsys.readouterr()
    lines = out.split("\n")[:-1]
    assert [number for number, line in enumerate(lines, 1) if line == "K>"] == at_once
    which = f"line{'s' if len(at_once) > 1 else ''} {', '.join(map(str, at_once))}"
    said = f'note: {which} stopped at once: their continuation began with "{stop}" (--stop), so they show the prompt'
    assert err == said + " alone\n"
    assert main([*options, "--stop", stop, "--format", "jsonl"]) == 0 and capsys.readouterr().err == ""


def _interact(monkeypatch, capsys, checkpoint, script: str, *options) -> tuple[list[str], list[str]]:
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["generate", checkpoint, "--interactive", *options]) == 0
    out, err = capsys.readouterr()
    return out.split("\n")[:-1], [line for line in err.splitlines() if line.startswith("error: ")]


def test_interactive_samples_equal_the_command_with_the_same_settings(checkpoint, capsys, monkeypatch):
    """Settings changed by commands; each prompt's lines are the non-interactive command's with those options;
    a bad command is one line and the loop goes on; unpinned, each prompt moves the seed on by n."""
    script = "\n".join(
        [
            "/n 2",
            "/seed 5",
            "/latents shared",
            "K>",
            "/bogus",
            "/temperature warm",
            "/latents reference",
            "",
            "/reference K>abc\\tdefgh",
            "Hello",
            "/seed off",
            "/latents prior",
            "K>",
            "//x",
            "/quit",
            "never sampled",
        ]
    )
    out, errors = _interact(monkeypatch, capsys, checkpoint, script, "--max-new-tokens", "6")
    common = ["--max-new-tokens", "6", "-n", "2"]
    expected = [
        *_alone(capsys, checkpoint, ["K>"], *common, "--seed", "5", "--latents", "shared"),
        *_alone(
            capsys,
            checkpoint,
            ["Hello"],
            *common,
            "--seed",
            "5",
            "--latents",
            "reference",
            "--reference",
            "K>abc\tdefgh",
        ),
        *_alone(capsys, checkpoint, ["K>"], *common, "--seed", "5", "--latents", "prior"),
        *_alone(capsys, checkpoint, ["/x"], *common, "--seed", "7", "--latents", "prior"),
    ]
    assert out == expected
    assert errors == [
        "error: unknown command /bogus: /help lists the commands",
        "error: /temperature takes a number, got 'warm'",
        "error: /latents reference needs a text: /reference TEXT",
    ]


def test_interactive_best_of_and_vary_print_what_the_command_prints(checkpoint, capsys, monkeypatch):
    """/best-of and /vary set what --best-of and --vary set; a best_of below n is refused in /best-of's words."""
    script = "\n".join(["/n 1", "/seed 4", "/best-of 3", "/vary latent", "K>", "/best-of 0", "/vary z", "/quit"])
    out, errors = _interact(monkeypatch, capsys, checkpoint, script, "--max-new-tokens", "6", "--format", "jsonl")
    expected = _alone(
        capsys,
        checkpoint,
        ["K>"],
        "--max-new-tokens",
        "6",
        "--format",
        "jsonl",
        "-n",
        "1",
        "--seed",
        "4",
        "--best-of",
        "3",
        "--vary",
        "latent",
    )
    assert out == expected and json.loads(out[0])["scores"] and len(json.loads(out[0])["scores"]) == 3
    assert errors == [
        "error: /best-of must be an integer from 1 to 128 (MAX_CANDIDATES per prompt), got 0",
        "error: /vary must be one of both, latent, tokens, got 'z'",
    ]


def test_interactive_starts_from_the_options_and_leaves_cleanly(checkpoint, capsys, monkeypatch):
    """Without commands the first prompt is `generate --prompt` with the same options; the end of stdin
    (Ctrl-D) and Ctrl-C leave with status 0; a prompt the model refuses is one line, not the end."""
    options = ["--max-new-tokens", "6", "-n", "2", "--seed", "3", "--latents", "prior"]
    out, errors = _interact(monkeypatch, capsys, checkpoint, "K>\n" + "x" * 70 + "\nHi\n", *options)
    assert out == _alone(capsys, checkpoint, ["K>"], *options) + _alone(
        capsys, checkpoint, ["Hi"], *options[:4], "--seed", "5", "--latents", "prior"
    )
    assert errors == ["error: the prompt has 70 tokens; this model reads at most 64"]

    class Interrupted(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr("sys.stdin", Interrupted())
    assert main(["generate", checkpoint, "--interactive"]) == 0
    assert main(["generate", checkpoint, "--interactive", "--prompt", "K>"]) == 2
    assert (
        capsys.readouterr().err.splitlines()[-1]
        == "error: --interactive reads its prompts as you type them: drop --prompt and --prompts-file"
    )


def test_interactive_refuses_shared_and_reference_z_on_a_baseline_as_generate_does(capsys, monkeypatch, tmp_path):
    """A baseline has no Z to share or infer: the commands are refused in one line, worded as the resolution
    that `generate --latents` goes through words it, and the loop goes on."""
    baseline = str(tiny_checkpoint(tmp_path, "baseline", 0))
    _, errors = _interact(monkeypatch, capsys, baseline, "/latents shared\n/reference K>\n/latents prior\n")
    assert errors == [
        "error: /latents shared needs a Free Transformer (latent_units > 0); this is a baseline decoder",
        "error: /latents reference needs a Free Transformer (latent_units > 0); this is a baseline decoder",
    ]


def test_load_model_is_public(tmp_path):
    model, config = load_model(tiny_checkpoint(tmp_path, "run", 4))
    assert "load_model" in free_transformer.__all__
    assert isinstance(model, FreeTransformer) and not model.training and model.config.latent_units == 4
    assert config["tokenizer"] == "byte" and config["step"] == 1


def test_generate_help_says_what_every_option_does_with_its_default():
    """Every option of `generate --help` has a text, and the text of one with a default value names it."""
    from free_transformer.cli import build_parser

    command = build_parser()._subparsers._group_actions[0].choices["generate"]
    formatter = command.formatter_class(prog="generate")
    options = {action.option_strings[-1]: action for action in command._actions if action.option_strings}
    assert {"--prompt", "--prompts-file", "--interactive", "--format", "--stop", "--latents"} <= set(options)
    for name, action in options.items():
        assert action.help, name
        if action.default not in (None, False, [], "==SUPPRESS=="):
            assert "default" in formatter._get_help_string(action), name
    assert "(default: text)" in " ".join(command.format_help().split())
