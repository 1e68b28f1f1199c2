"""The built-in task for the search tool (``m2flow/data/invented.py``): a corpus of invented
entities that ships with the package, multi-hop questions answerable only through it, a
held-out split of other entities, phrasings and a kind, demonstrations, and the exact-match
reward."""

import gzip

import pytest

from m2flow.config import ConfigError, load_config
from m2flow.data import invented
from m2flow.data.chats import invented_chats
from m2flow.data.prompts import load_prompts
from m2flow.rewards.match import exact_match
from m2flow.tools import load


def test_the_shipped_corpus_is_the_generators(tmp_path):
    assert invented.write_corpus(tmp_path / "c.jsonl").read_bytes() == gzip.decompress(invented.CORPUS.read_bytes())
    assert len(invented.documents(invented.world())) == 430


@pytest.fixture(scope="module")
def search():
    options = dict(invented.SEARCH)
    return load(options.pop("path"), **options)


@pytest.mark.parametrize("split", invented.SPLITS)
def test_each_answer_is_found_by_searching_its_hops_in_turn(search, split):
    """Searching each entity of a question's chain finds its document first, which names the
    next entity; the last one's names the answer."""
    index = search.target.__self__  # the Search object behind the tool
    for p in invented.invented_problems(60, split):
        chain = invented.hops(p)
        for i, entity in enumerate(chain):
            title, text = index.docs[index.top(entity)[0][0]]
            assert title == entity
            following = chain[i + 1] if i + 1 < len(chain) else p.answer
            assert following in text, (p, entity, text)


def test_the_held_out_split_asks_of_other_entities_in_other_phrasings_and_a_kind_of_its_own():
    train = invented.invented_problems(1468, "train")
    test = invented.invented_problems(244, "test")
    with pytest.raises(ValueError, match="1468 distinct"):
        invented.invented_problems(1469, "train")

    def parts(p):
        _, kind, phrasing, entity = p.id.split("-", 3)
        return kind, int(phrasing), entity

    trained = [parts(p) for p in train]
    held = [parts(p) for p in test]
    assert {e for _, _, e in trained}.isdisjoint({e for _, _, e in held})
    assert {(k, f) for k, f, _ in trained}.isdisjoint({(k, f) for k, f, _ in held})
    assert {k for k, _, _ in held} - {k for k, _, _ in trained} == set(invented.HELD_OUT_KINDS)
    assert len({p.question for p in train}) == len(train)


def test_a_preset_asking_for_more_questions_than_there_are_is_a_config_error():
    with pytest.raises(ConfigError, match="data.train_size"):
        load_prompts(load_config("agentic/search_tiny", ["data.train_size=5000"]))


def test_demonstrations_search_each_hop_and_box_the_answer(search):
    (chat,) = invented_chats(1, "test", 0, "Put the final answer in \\boxed{}.")
    (p,) = invented.invented_problems(1, "test")
    messages = chat["messages"]
    calls = [m["tool_calls"][0]["function"]["arguments"]["query"] for m in messages if m.get("tool_calls")]
    assert calls == invented.hops(p) and chat["tools"] == [search.schema]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert results == [search.call({"query": q}) for q in calls]
    assert messages[-1]["content"] == f"The answer is \\boxed{{{p.answer}}}." and exact_match(messages[-1]["content"],
                                                                                                p.answer) == 1.0


@pytest.mark.parametrize("completion, answer, score", [
    ("The answer is \\boxed{Nagath}.", "Nagath", 1.0),
    ("\\boxed{the nagath}", "Nagath", 1.0),
    ("It was born in\nNagath.", "Nagath", 1.0),  # no box: the last line
    ("Nagath, I think, or \\boxed{Fuzi}", "Nagath", 0.0),  # the box is the answer
    ("\\boxed{1897}", "1897", 1.0),
    ("", "Nagath", 0.0),
    ("\\boxed{}", "", 0.0),  # nothing matches nothing
])
def test_exact_match(completion, answer, score):
    assert exact_match(completion, answer) == score
