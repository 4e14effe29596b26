"""RULER string-match scoring as a local `evaluate` metric (load it by path; no Hub access needed).

`mode="all"` (RULER `string_match_all`, its NIAH / variable-tracking / word-extraction metric): per sample, the
share of references that occur in the prediction, case-insensitively. `mode="part"` (RULER `string_match_part`,
its QA metric): 1 when any reference occurs. Scores are 0–100.
"""

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
        scores = [fn(p, r) for p, r in zip(predictions, references)]
        return {"score": sum(scores) / len(scores) if scores else 0.0, "scores": scores}
