"""LongBench and RULER metrics (local `evaluate` modules) against values worked out by hand."""

import pytest

from dual_cache.eval.metrics import load_metric, metric_path
from dual_cache.eval.metrics import longbench_score as lb


@pytest.fixture(scope="module")
def longbench():
    return load_metric("longbench_score")


@pytest.fixture(scope="module")
def ruler():
    return load_metric("ruler_string_match")


def test_qa_f1_by_hand(longbench):
    # tokens after normalisation: [eiffel, tower, in, paris] vs [eiffel, tower]: P = 1/2, R = 1, F1 = 2/3
    out = longbench.compute(predictions=["The Eiffel Tower, in Paris!"], references=[["Eiffel Tower"]], task="hotpotqa")
    assert out["scores"][0] == pytest.approx(200 / 3)
    assert out["metric"] == "qa_f1"
    # best over references; LongBench-E task ids accepted
    out = longbench.compute(predictions=["eiffel tower"], references=[["Paris", "the Eiffel Tower"]], task="hotpotqa_e")
    assert out["scores"] == [100.0]
    assert lb.qa_f1("nothing here", "Paris") == 0.0


def test_qa_f1_zh_characters(longbench):
    # characters [1,9,2,1,年,建,立] vs [1,9,2,1,年]: overlap 5, P = 5/7, R = 1, F1 = 10/12
    out = longbench.compute(predictions=["1921年建立。"], references=[["1921年"]], task="multifieldqa_zh")
    assert out["scores"][0] == pytest.approx(100 * 10 / 12)


def test_rouge_l_by_hand(longbench):
    # LCS(the cat sat on the mat, the cat lay on the mat) = 5 of 6 both ways -> F = 5/6
    out = longbench.compute(predictions=["the cat sat on the mat"], references=[["The cat lay on the mat"]], task="gov_report")
    assert out["scores"][0] == pytest.approx(100 * 5 / 6)
    # characters: LCS(今天天气很好, 今天很好) = 4; P = 4/6, R = 1 -> F = 0.8
    out = longbench.compute(predictions=["今天天气很好"], references=[["今天 很好"]], task="vcsum")
    assert out["scores"][0] == pytest.approx(80.0)
    assert lb.lcs_length("abcbdab", "bdcaba") == 4


def test_classification_retrieval_count_code(longbench):
    classes = ["Date", "Individual", "City"]
    assert longbench.compute(predictions=["Individual"], references=[["Individual"]], task="trec",
                             all_classes=classes)["scores"] == [100.0]
    assert longbench.compute(predictions=["Date or Individual"], references=[["Individual"]], task="trec",
                             all_classes=classes)["scores"] == [50.0]
    # only the first line counts for trec
    assert longbench.compute(predictions=["\nCity\nIndividual"], references=[["Individual"]], task="trec",
                             all_classes=classes)["scores"] == [0.0]
    # a class that is a substring of the reference is not counted against it
    assert lb.classification("Human being", "Human being", all_classes=["Human", "Human being"]) == 1.0
    with pytest.raises(ValueError, match="all_classes"):
        lb.classification("x", "y", all_classes=None)
    assert lb.retrieval("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert lb.retrieval_zh("段落5", "段落5") == 1.0
    assert lb.count("There are 7 unique paragraphs out of 10", "7") == 0.5
    assert lb.count("no idea", "7") == 0.0
    assert lb.code_sim("```python\n    return total\n```", "    return total") == 1.0
    # first line without a comment: "return x" vs "return y": 2 * 7 matching chars / 16
    assert lb.code_sim("# comment\nreturn x", "return y") == pytest.approx(14 / 16)


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
    with pytest.raises(ValueError, match="mode"):
        ruler.compute(predictions=["1"], references=[["1"]], mode="some")


def test_metric_path_errors():
    with pytest.raises(ValueError, match="unknown metric"):
        metric_path("bleu")
