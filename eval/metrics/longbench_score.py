"""LongBench's official per-task metrics as a local `evaluate` metric (load it by path; no Hub access needed).

Written from the metric definitions of LongBench (Bai et al., 2023, "LongBench: A Bilingual, Multitask Benchmark
for Long Context Understanding", and its `metrics.py` / `eval.py`):

- `qa_f1`: token F1 after SQuAD-style normalisation (lowercase, drop punctuation and the articles a/an/the,
  collapse whitespace);
- `qa_f1_zh`: F1 over Chinese tokens. LongBench segments with `jieba`; here every non-space, non-punctuation
  *character* is a token (a dependency-free, deterministic segmentation — scores differ slightly from jieba's);
- `rouge`: ROUGE-L F1 (longest common subsequence of lowercase whitespace tokens); `rouge_zh`: the same over
  characters (LongBench: jieba words);
- `classification`: classes named in the prediction (dropping those that are substrings of the reference); 1 /
  their count when the reference is among them, else 0;
- `retrieval` / `retrieval_zh`: share of the numbers in the prediction equal to the reference paragraph id
  (`Paragraph N` / `段落N`);
- `count`: share of the numbers in the prediction equal to the reference count;
- `code_sim`: edit similarity (`difflib.SequenceMatcher.ratio`, the quantity `fuzz.ratio` rounds) between the
  first prediction line without a code fence or comment and the reference.

Per sample: the best score over the sample's references, × 100. For `trec`, `triviaqa`, `samsum`, `lsht` only the
first line of the prediction is scored (as LongBench does for these few-shot tasks).
"""

import re
import string
from collections import Counter
from difflib import SequenceMatcher

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
    return token_f1(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(reference)))


def lcs_length(a, b):
    """Length of the longest common subsequence of sequences `a` and `b` (O(len(a) * len(b)))."""
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(prediction_tokens, reference_tokens):
    """ROUGE-L F1 (0-1) from the LCS of two token lists."""
    lcs = lcs_length(prediction_tokens, reference_tokens)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(prediction_tokens), lcs / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def rouge(prediction, reference, **_):
    return rouge_l(prediction.lower().split(), reference.lower().split())


def rouge_zh(prediction, reference, **_):
    drop = set(string.whitespace)
    return rouge_l([c for c in prediction.lower() if c not in drop], [c for c in reference.lower() if c not in drop])


def classification(prediction, reference, all_classes=None, **_):
    if not all_classes:
        raise ValueError("classification tasks need `all_classes`.")
    matches = [c for c in all_classes if c in prediction]
    matches = [c for c in matches if not (c in reference and c != reference)]
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


def code_sim(prediction, reference, **_):
    line = next((l for l in prediction.lstrip("\n").split("\n") if "`" not in l and "#" not in l and "//" not in l), "")
    return SequenceMatcher(None, line, reference).ratio()


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
    """LongBench score (0-100) of one prediction: the best over its references."""
    name = base_task(task)
    if name in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRIC_FUNCTIONS[TASK_METRIC[name]]
    return 100.0 * max((fn(prediction, ref, all_classes=all_classes) for ref in references), default=0.0)


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
