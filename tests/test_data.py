import pytest
import torch

from free_transformer.data import DataConfig, DataError, build_dataset
from free_transformer.data.synthetic import analyse_letters, coinflip_batch, letters_batch


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
    batch = coinflip_batch(2000, 64, 0.1, torch.Generator().manual_seed(0)) - ord("0")
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
    dataset = build_dataset(DataConfig(kind="text", path=str(corpus), seq_len=16, val_fraction=0.1), seed=0)
    batch = dataset.batch(0, 5)
    assert batch.shape == (5, 17) and batch.dtype == torch.int64
    text = bytes(batch[0].tolist()).decode()
    assert text in ("hello world\n" * 50 + "\n" + "free transformer\n" * 50 + "\n")
    assert list((tmp_path / "corpus.tokens").glob("byte-*.bin"))  # tokenized once, cached


def test_text_dataset_errors(tmp_path):
    with pytest.raises(DataError, match="corpus not found"):
        build_dataset(DataConfig(kind="text", path=str(tmp_path / "missing")), seed=0)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="fewer than seq_len"):
        build_dataset(DataConfig(kind="text", path=str(tmp_path / "empty.txt"), seq_len=8), seed=0)
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="no \\*.txt files"):
        build_dataset(DataConfig(kind="text", path=str(tmp_path / "dir")), seed=0)
    with pytest.raises(DataError, match="path is required"):
        build_dataset(DataConfig(kind="text"), seed=0)
