"""LongBench's official per-task metrics as a local `evaluate` metric (load it by path; no Hub access needed).

Written from THUDM/LongBench (Bai et al., 2023, "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding"; `LongBench/metrics.py` and `LongBench/eval.py`), with the libraries that code uses:

- `qa_f1`: token F1 after SQuAD-style normalisation (lowercase, drop ASCII punctuation and the articles a/an/the,
  collapse whitespace);
- `qa_f1_zh`: F1 over `jieba` words (`jieba.cut`, precise mode), each word stripped of Chinese and ASCII punctuation
  and whitespace, empty words dropped;
- `rouge`: ROUGE-L F of the `rouge` package (`Rouge().get_scores([prediction], [reference], avg=True)`; its
  sentence split and union LCS), 0 when the package raises (an empty prediction, a recursion limit on very long
  texts — LongBench's own `except`); `rouge_zh`: the same over `jieba` words joined by spaces;
- `classification`: the classes named in the prediction, minus those that are substrings of (but not equal to) the
  reference — removed while walking the list, so, as in LongBench, a class right after a removed one is never
  examined; 1 / their count when the reference is among them, else 0;
- `retrieval` / `retrieval_zh`: share of the numbers in the prediction equal to the reference paragraph id
  (`Paragraph N` / `段落N`); `count`: share of the numbers in the prediction equal to the reference count;
- `code_sim`: `fuzzywuzzy.fuzz.ratio` (difflib's `SequenceMatcher`, as LongBench installs it without
  `python-Levenshtein`) / 100 between the first prediction line without a code fence or comment and the reference.

Per sample: the best score over the sample's references (starting from 0), × 100. For `trec`, `triviaqa`, `samsum`,
`lsht` only the first line of the prediction is scored (LongBench's `scorer`).
"""

import re
import string
import warnings
from collections import Counter

import datasets
import evaluate

_DESCRIPTION = "LongBench per-task metrics (QA F1, ROUGE-L, classification, retrieval, count, code similarity)."
_CITATION = "Bai et al., LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding, ACL 2024."
_KWARGS = """
Args:
    predictions: list of generated strings.
    references: list of lists of reference answers (one list per prediction).
    task: a LongBench task id such as "hotpotqa", "gov_report" or "lcc" (a "_e" suffix, LongBench-E, is accepted).
    all_classes: list of class names, needed by "trec" and "lsht".
Returns:
    {"score": mean over samples (0-100), "scores": per-sample scores (0-100), "metric": the metric's name}
"""

TASK_METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1", "dureader": "rouge_zh", "gov_report": "rouge",
    "qmsum": "rouge", "multi_news": "rouge", "vcsum": "rouge_zh", "trec": "classification", "triviaqa": "qa_f1",
    "samsum": "rouge", "lsht": "classification", "passage_retrieval_en": "retrieval", "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh", "lcc": "code_sim", "repobench-p": "code_sim",
}
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")
ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."


def normalize_answer(text):
    """Lowercase, drop ASCII punctuation and the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text):
    """Lowercase, drop Chinese and ASCII punctuation and all whitespace."""
    drop = set(string.punctuation) | set(ZH_PUNCTUATION)
    return "".join(ch for ch in "".join(text.lower().split()) if ch not in drop)


def jieba_words(text):
    """`jieba`'s precise-mode segmentation of `text` (its dictionary loads once per process, quietly)."""
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))


def token_f1(prediction_tokens, reference_tokens):
    """F1 (0-1) of the bag-of-tokens overlap."""
    same = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction_tokens), same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction, reference, **_):
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction, reference, **_):
    def words(text):
        return [w for w in (normalize_zh_answer(t) for t in jieba_words(text)) if w]

    return token_f1(words(prediction), words(reference))


def rouge(prediction, reference, **_):
    from rouge import Rouge

    try:
        return Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except Exception:  # empty prediction, RecursionError on long texts, ...: LongBench scores these 0
        return 0.0


def rouge_zh(prediction, reference, **_):
    return rouge(" ".join(jieba_words(prediction)), " ".join(jieba_words(reference)))


def classification(prediction, reference, all_classes=None, **_):
    if not all_classes:
        raise ValueError("classification tasks need `all_classes`.")
    matches = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matches):  # LongBench removes from the list it iterates: the next element is skipped
        if matches[i] in reference and matches[i] != reference:
            matches.remove(matches[i])
        i += 1
    return 1.0 / len(matches) if reference in matches else 0.0


def _share_equal(prediction, target):
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(target) for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction, reference, **_):
    ids = re.findall(r"Paragraph (\d+)", reference)
    return _share_equal(prediction, ids[0]) if ids else 0.0


def retrieval_zh(prediction, reference, **_):
    ids = re.findall(r"段落(\d+)", reference)
    return _share_equal(prediction, ids[0]) if ids else 0.0


def count(prediction, reference, **_):
    return _share_equal(prediction, reference)


def fuzz_ratio(a, b):
    """`fuzzywuzzy.fuzz.ratio(a, b)` (0-100 int), importing it without its "install python-Levenshtein" warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from fuzzywuzzy import fuzz

    return fuzz.ratio(a, b)


def code_sim(prediction, reference, **_):
    line = next((l for l in prediction.lstrip("\n").split("\n") if "`" not in l and "#" not in l and "//" not in l), "")
    return fuzz_ratio(line, reference) / 100


METRIC_FUNCTIONS = {
    "qa_f1": qa_f1, "qa_f1_zh": qa_f1_zh, "rouge": rouge, "rouge_zh": rouge_zh, "classification": classification,
    "retrieval": retrieval, "retrieval_zh": retrieval_zh, "count": count, "code_sim": code_sim,
}


def base_task(task):
    """`"hotpotqa_e"` -> `"hotpotqa"`; raises ValueError for tasks LongBench does not define."""
    name = task[:-2] if task.endswith("_e") else task
    if name not in TASK_METRIC:
        raise ValueError(f"unknown LongBench task {task!r}; known: {sorted(TASK_METRIC)}.")
    return name


def score_sample(task, prediction, references, all_classes=None):
    """LongBench score (0-100) of one prediction: the best over its references, from 0."""
    name = base_task(task)
    if name in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRIC_FUNCTIONS[TASK_METRIC[name]]
    return 100.0 * max([0.0] + [fn(prediction, ref, all_classes=all_classes) for ref in references])


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class LongbenchScore(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
            ),
        )

    def _compute(self, predictions, references, task=None, all_classes=None):
        if task is None:
            raise ValueError("pass task=<LongBench task id>.")
        name = base_task(task)
        scores = [score_sample(name, p, r, all_classes) for p, r in zip(predictions, references)]
        return {"score": sum(scores) / len(scores) if scores else 0.0, "scores": scores, "metric": TASK_METRIC[name]}
