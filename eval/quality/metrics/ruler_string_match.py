"""RULER string-match scoring as a local `evaluate` metric (load it by path; no Hub access needed).

From NVIDIA/RULER `scripts/eval/synthetic/constants.py` and `scripts/eval/evaluate.py`: the prediction is first
post-processed (stripped, control characters `\x00`-`\x1f` turned into newlines, stripped again); `mode="all"`
(`string_match_all`, the NIAH / variable-tracking / word-extraction metric): per sample, the share of references
that occur in the prediction, case-insensitively; `mode="part"` (`string_match_part`, the QA metric): 1 when any
reference occurs. Scores are 0–100 (RULER rounds only its task means, to 2 decimals).
"""

import re

import datasets
import evaluate

_DESCRIPTION = "RULER string match (all / part), per sample and mean, 0-100."
_CITATION = "Hsieh et al., RULER: What's the Real Context Size of Your Long-Context Language Models? COLM 2024."
_KWARGS = """
Args:
    predictions: list of generated strings.
    references: list of lists of reference strings (one list per prediction).
    mode: "all" (default) or "part".
Returns:
    {"score": mean over samples (0-100), "scores": per-sample scores (0-100)}
"""


def postprocess(prediction):
    """RULER's `postprocess_pred`: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def match_all(prediction, references):
    """Share (0-100) of `references` found in `prediction`, case-insensitive."""
    pred = prediction.lower()
    return 100.0 * sum(ref.lower() in pred for ref in references) / len(references)


def match_part(prediction, references):
    """100 if any of `references` is found in `prediction` (case-insensitive), else 0."""
    pred = prediction.lower()
    return 100.0 * max(ref.lower() in pred for ref in references)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class RulerStringMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
            ),
        )

    def _compute(self, predictions, references, mode="all"):
        if mode not in ("all", "part"):
            raise ValueError(f"mode must be 'all' or 'part', got {mode!r}.")
        if any(len(refs) == 0 for refs in references):
            raise ValueError("every prediction needs at least one reference.")
        fn = match_all if mode == "all" else match_part
        scores = [fn(postprocess(p), r) for p, r in zip(predictions, references)]
        return {"score": sum(scores) / len(scores) if scores else 0.0, "scores": scores}
