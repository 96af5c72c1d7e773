import pytest

from retrieval.corpus import (
    CorpusError,
    Passage,
    format_passages,
    make_contents,
    read_corpus,
    write_corpus,
)


def test_wiki18_format_round_trip(tmp_path):
    passages = [Passage("7", make_contents("Ardenport", "A harbour town.")), Passage("x", '"Solo"')]
    path = tmp_path / "c.jsonl"
    write_corpus(passages, path)
    assert (
        path.read_text().splitlines()[0]
        == '{"id": "7", "contents": "\\"Ardenport\\"\\nA harbour town."}'
    )
    back = read_corpus(path)
    assert back == passages
    assert (back[0].title, back[0].text) == ("Ardenport", "A harbour town.")
    assert (back[1].title, back[1].text) == ("Solo", "")


def test_ids_default_to_the_row_number(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"contents": "\\"A\\"\\na"}\n\n{"contents": "\\"B\\"\\nb"}\n')
    assert [p.id for p in read_corpus(path)] == ["0", "2"]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"id": 1, "contents": "ok"}\n{"id": 2, "contents": \n', r"c\.jsonl:2: invalid JSON"),
        (
            '{"id": 1, "text": "no contents"}\n',
            r'c\.jsonl:1: expected an object with a string "contents"',
        ),
        ("", "holds no passages"),
    ],
)
def test_bad_corpus_names_file_and_line(tmp_path, text, message):
    path = tmp_path / "c.jsonl"
    path.write_text(text)
    with pytest.raises(CorpusError, match=message):
        read_corpus(path)


def test_missing_corpus(tmp_path):
    with pytest.raises(CorpusError, match="cannot open corpus"):
        read_corpus(tmp_path / "none.jsonl")


def test_passages_as_the_agent_sees_them():
    shown = format_passages(
        [Passage("1", make_contents("A", "alpha")), Passage("2", make_contents("B", "beta"))]
    )
    assert shown == "Doc 1(Title: A) alpha\nDoc 2(Title: B) beta\n"
