"""LongBench and RULER metrics (local `evaluate` modules) against the official formulas, worked out by hand.

The expected values follow THUDM/LongBench `metrics.py` (rouge package: sentences split at ".", words at " ",
distinct words, union LCS, F = 2PR / (P + R + 1e-8); jieba words for Chinese; fuzzywuzzy's rounded ratio) and
NVIDIA/RULER `string_match_all` / `string_match_part`.
"""

import difflib

import pytest

from dual_cache.eval.quality.metrics import load_metric, metric_path
from dual_cache.eval.quality.metrics import longbench_score as lb


@pytest.fixture(scope="module")
def longbench():
    return load_metric("longbench_score")


@pytest.fixture(scope="module")
def ruler():
    return load_metric("ruler_string_match")


def score(metric, task, prediction, references, **kwargs):
    return metric.compute(predictions=[prediction], references=[references], task=task, **kwargs)["scores"][0]


def test_qa_f1_by_hand(longbench):
    # tokens after normalisation: [eiffel, tower, in, paris] vs [eiffel, tower]: P = 1/2, R = 1, F1 = 2/3
    assert score(longbench, "hotpotqa", "The Eiffel Tower, in Paris!", ["Eiffel Tower"]) == pytest.approx(200 / 3)
    # best over references; LongBench-E task ids accepted
    out = longbench.compute(predictions=["eiffel tower"], references=[["Paris", "the Eiffel Tower"]], task="hotpotqa_e")
    assert out["scores"] == [100.0] and out["metric"] == "qa_f1"
    assert lb.qa_f1("nothing here", "Paris") == 0.0


def test_qa_f1_zh_uses_jieba_words(longbench):
    # jieba: [1921, 年, 建立, 。] -> punctuation-only word dropped -> [1921, 年, 建立] vs [1921, 年]: F1 = 2 * (2/3) / (5/3)
    assert score(longbench, "multifieldqa_zh", "1921年建立。", ["1921年"]) == pytest.approx(80.0)
    # [北京大学] vs [北京]: no common word, so 0 (characters would share 北, 京 and give 66.7)
    assert score(longbench, "multifieldqa_zh", "北京大学", ["北京"]) == 0.0
    assert lb.jieba_words("他是北京大学的学生") == ["他", "是", "北京大学", "的", "学生"]


def test_rouge_l_multi_sentence_union_lcs(longbench):
    # hyp sentences "The cat sat" | "The dog ran"; ref "The cat ran" | "A dog sat".
    # distinct words: hyp {The, cat, sat, dog, ran} n = 5, ref {The, cat, ran, A, dog, sat} m = 6.
    # ref 1 vs hyp 1: LCS [The, cat]; vs hyp 2: [The, ran] -> union {The, cat, ran} = 3
    # ref 2 vs hyp 1: [sat]; vs hyp 2: [dog] -> 2 new -> LCS_u = 5; R = 5/6, P = 1, F = 10/11
    got = score(longbench, "gov_report", "The cat sat. The dog ran.", ["The cat ran. A dog sat."])
    assert got == pytest.approx(100 * 10 / 11, rel=1e-6)
    # a plain token LCS (the earlier implementation) differs: it sees "sat." / "ran." tokens and lowercases
    assert got != pytest.approx(100 * 4 / 6, rel=1e-3)
    # distinct words: "the the the" has n = 1; vs "the cat" (m = 2): P = 1, R = 1/2, F = 2/3
    assert score(longbench, "qmsum", "the the the", ["the cat"]) == pytest.approx(200 / 3, rel=1e-6)
    # case-sensitive, and an empty prediction scores 0 (the package raises; LongBench catches it)
    assert score(longbench, "multi_news", "THE CAT", ["the cat"]) == 0.0
    assert score(longbench, "samsum", "", ["the cat"]) == 0.0
    # samsum scores its first line only
    assert score(longbench, "samsum", "\nthe cat\nsat", ["the cat"]) == pytest.approx(100.0, rel=1e-6)


def test_rouge_zh_over_jieba_words(longbench):
    # "会议 讨论 了 预算 问题 。" vs "会议 讨论 预算 。": n = 6, m = 4, LCS 4 -> P = 2/3, R = 1, F = 0.8
    assert score(longbench, "vcsum", "会议讨论了预算问题。", ["会议讨论预算。"]) == pytest.approx(80.0, rel=1e-6)
    assert score(longbench, "dureader", "今天天气很好", ["今天很好"]) == pytest.approx(200 / 3, rel=1e-6)


def test_classification_and_the_official_loop_edge_case(longbench):
    classes = ["Date", "Individual", "City"]
    assert score(longbench, "trec", "Individual", ["Individual"], all_classes=classes) == 100.0
    assert score(longbench, "trec", "Date or Individual", ["Individual"], all_classes=classes) == 50.0
    # only the first line counts for trec
    assert score(longbench, "trec", "\nCity\nIndividual", ["Individual"], all_classes=classes) == 0.0
    # a class that is a substring of the reference is not counted against it
    assert lb.classification("Human being", "Human being", all_classes=["Human", "Human being"]) == 1.0
    # LongBench removes from the list it iterates: after dropping "Human", "man" is never examined and stays,
    # so the score is 1/2, not the 1/1 a clean filter gives
    assert lb.classification("Human being", "Human being", all_classes=["Human", "man", "Human being"]) == 0.5
    assert lb.classification("Human being", "Human being", all_classes=["Human", "Human being", "man"]) == 1.0
    with pytest.raises(ValueError, match="all_classes"):
        lb.classification("x", "y", all_classes=None)


def official_classification(prediction, reference, all_classes):
    """LongBench's loop as written there (removing from the list being iterated)."""
    matches = [c for c in all_classes if c in prediction]
    for term in matches:
        if term in reference and term != reference:
            matches.remove(term)
    return 1.0 / len(matches) if reference in matches else 0.0


def test_classification_equals_the_official_loop_on_random_cases():
    import random

    rng = random.Random(0)
    words = ["a", "ab", "abc", "b", "bc", "c", "ca"]
    for _ in range(500):
        classes = rng.sample(words, rng.randint(1, len(words)))
        prediction, reference = " ".join(rng.sample(words, 3)), rng.choice(classes)
        assert lb.classification(prediction, reference, all_classes=classes) == official_classification(
            prediction, reference, classes)


def test_retrieval_and_count(longbench):
    assert lb.retrieval("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert lb.retrieval_zh("段落5", "段落5") == 1.0
    assert lb.count("There are 7 unique paragraphs out of 10", "7") == 0.5
    assert score(longbench, "passage_count", "no idea", ["7"]) == 0.0


def test_code_similarity_is_fuzzywuzzy_ratio(longbench):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from fuzzywuzzy import fuzz

    assert fuzz.SequenceMatcher is difflib.SequenceMatcher  # LongBench's install: no python-Levenshtein
    # "return x" vs "return y": difflib ratio 2 * 7 / 16 = 87.5 -> fuzz.ratio rounds half to even: 88
    assert score(longbench, "lcc", "# comment\nreturn x", ["return y"]) == pytest.approx(88.0)
    # fences and comments are skipped; indentation counts (the prediction is not stripped)
    assert score(longbench, "repobench-p", "```python\n    return total\n```", ["    return total"]) == 100.0
    # stripped, it would be 2 * 12 / 28 = 85.7 -> 86
    assert score(longbench, "lcc", "return total", ["    return total"]) == pytest.approx(86.0)
    assert score(longbench, "lcc", "# only a comment", ["x = 1"]) == 0.0  # no line left: empty string scores 0


def test_longbench_errors(longbench):
    with pytest.raises(ValueError, match="unknown LongBench task"):
        lb.base_task("not_a_task")
    with pytest.raises(ValueError, match="task"):
        longbench.compute(predictions=["a"], references=[["a"]])


def test_ruler_string_match(ruler):
    out = ruler.compute(predictions=["123 and 456", "ABC-def"], references=[["123", "456", "789"], ["abc-DEF"]])
    assert out["scores"] == [pytest.approx(200 / 3), 100.0]
    assert out["score"] == pytest.approx((200 / 3 + 100) / 2)
    assert ruler.compute(predictions=["123"], references=[["123", "789"]], mode="part")["scores"] == [100.0]
    assert ruler.compute(predictions=["0"], references=[["123", "789"]], mode="part")["scores"] == [0.0]
    # RULER's post-processing: control characters become newlines before matching
    assert ruler.compute(predictions=["\t12\x0034 "], references=[["12\n34"]])["scores"] == [100.0]
    with pytest.raises(ValueError, match="mode"):
        ruler.compute(predictions=["1"], references=[["1"]], mode="some")


def test_metric_path_errors():
    with pytest.raises(ValueError, match="unknown metric"):
        metric_path("bleu")
