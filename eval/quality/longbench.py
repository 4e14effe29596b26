"""LongBench (Bai et al., 2023): official prompt templates, generation lengths and metrics, loading and truncation.

Data: through `datasets` from the Hub (`THUDM/LongBench`, one config per task, split `test`) when online, or from
a local folder of the official JSONL files (`<task>.jsonl`, as in the release's `data.zip`; `--data-dir`). Each
row has the official schema: `input`, `context`, `answers` (list), `length`, `dataset`, `language`,
`all_classes` (list or null), `_id`.

Prompts follow THUDM/LongBench `LongBench/pred.py`: the official `dataset2prompt` template per task and
`dataset2maxlen` new-token budget; a prompt longer than the model's maximum length (`model2maxlen`: 500 tokens
under the window, e.g. 3500 for a 4K model), counted with the tokenizer's special tokens, keeps the decoded first
and last halves of that length; then the model wrapper (`chat_format.PromptFormat`, LongBench's `build_chat`) is
applied except for the few-shot / completion tasks (`trec`, `triviaqa`, `samsum`, `lsht`, `lcc`, `repobench-p`),
and the text is tokenized with the tokenizer's special tokens (BOS included for every task). `samsum` stops at a
newline and generates at least one token, as `pred.py` does. Metrics: `metrics/longbench_score.py`.
"""

from __future__ import annotations

from ...runtime.extras import require

require("eval", "LongBench (dual_cache.eval.quality.longbench)")

import os

from .chat_format import PLAIN, PromptFormat, encode
from .metrics.longbench_score import TASK_METRIC, base_task

HUB_ID = "THUDM/LongBench"
TASKS = tuple(TASK_METRIC)
MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32, "2wikimqa": 32,
    "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64,
    "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}
NO_CHAT_TASKS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
_QA = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
_MULTIHOP = f"{_QA}\n\nThe following are given passages.\n{{context}}\n\n{_QA}\n\nQuestion: {{input}}\nAnswer:"
_QASPER = (
    "Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question "
    "cannot be answered based on the information in the article, write \"unanswerable\". If the question is a "
    "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)
# The official templates, verbatim (including their typos, e.g. "asconcisely").
PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. {_QASPER}\n\nArticle: {{context}}\n\n Answer the "
        f"question based on the above article as concisely as you can, using a single phrase or sentence if "
        f"possible. If the question cannot be answered based on the information in the article, write "
        f"\"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do "
        f"not provide any explanation.\n\nQuestion: {{input}}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": _MULTIHOP,
    "2wikimqa": _MULTIHOP,
    "musique": _MULTIHOP,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, "
        "write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        "the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", "
        "etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
        "请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是："
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
REQUIRED_FIELDS = ("input", "context", "answers")


def load_task(task: str, data_dir: str | None = None):
    """The test split of one LongBench task as a `datasets.Dataset` in the official schema.

    Args:
        task: a LongBench task id (`TASKS`), optionally with LongBench-E's `_e` suffix.
        data_dir: folder holding the official `<task>.jsonl` files (or its parent with a `data/` folder);
            None loads `THUDM/LongBench` from the Hub.

    Raises:
        ValueError: unknown task; FileNotFoundError: no `<task>.jsonl` under `data_dir`;
        RuntimeError: the Hub is unreachable (pass `data_dir`); KeyError: rows lack the official fields.
    """
    import datasets

    base_task(task)
    if data_dir is not None:
        candidates = [os.path.join(data_dir, f"{task}.jsonl"), os.path.join(data_dir, "data", f"{task}.jsonl")]
        path = next((p for p in candidates if os.path.isfile(p)), None)
        if path is None:
            raise FileNotFoundError(f"no {task}.jsonl in {data_dir} (looked for {candidates}).")
        dataset = datasets.load_dataset("json", data_files=path, split="train")
    else:
        try:
            dataset = datasets.load_dataset(HUB_ID, task, split="test")
        except Exception as error:  # offline, or a datasets version without script support
            raise RuntimeError(
                f"could not load {HUB_ID}/{task} from the Hub ({type(error).__name__}: {error}). Download the "
                "official data.zip and pass its folder with --data-dir."
            ) from error
    missing = [f for f in REQUIRED_FIELDS if f not in dataset.column_names]
    if missing:
        raise KeyError(f"{task}: rows lack the official LongBench field(s) {missing}.")
    return dataset


def official_max_length(window: int) -> int:
    """LongBench's per-model maximum prompt length for a model of `window` positions, as its `model2maxlen.json`
    sets it: `1000 * (window // 1024) - 500` (3500 for 4K models, 7500 for 8K, 15500 for 16K, 31500 for 32K).

    Raises:
        ValueError: a window under 2048 tokens.
    """
    if window < 2048:
        raise ValueError(f"window {window} is too small for LongBench's maximum lengths (use >= 2048 tokens).")
    return 1000 * (window // 1024) - 500


def truncate_middle(tokenizer, text: str, max_length: int) -> str:
    """`text` unchanged if its tokens *with* special tokens number at most `max_length`, else the decoded first
    and last `max_length // 2` of those tokens, special tokens dropped, joined (LongBench's `pred.py`)."""
    ids = encode(tokenizer, text)
    if len(ids) <= max_length:
        return text
    half = max_length // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(ids[-half:], skip_special_tokens=True)


def build_prompt(tokenizer, task: str, row: dict, max_length: int, fmt: PromptFormat = PLAIN) -> list[int]:
    """Prompt token ids of one LongBench row: template, middle truncation to `max_length`, then the model wrapper
    `fmt` where LongBench applies `build_chat`, encoded with the tokenizer's special tokens.

    Args:
        max_length: the model's maximum prompt length in tokens before the wrapper (`official_max_length`).
    """
    name = base_task(task)
    text = truncate_middle(tokenizer, PROMPTS[name].format(context=row["context"], input=row["input"]), max_length)
    return encode(tokenizer, text if name in NO_CHAT_TASKS else fmt.wrap(text))


def generate_kwargs(tokenizer, task: str) -> dict:
    """Extra `generate()` arguments of a task: for `samsum`, stop at a newline as well as EOS and generate at least
    one token (`pred.py`: `eos_token_id=[eos, id of "\n"]`, `min_length=context + 1`); else none."""
    if base_task(task) != "samsum":
        return {}
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    return {"eos_token_id": [t for t in (tokenizer.eos_token_id, newline) if t is not None], "min_new_tokens": 1}


def build_samples(tokenizer, tasks: list[str], max_length: int, data_dir: str | None = None,
                  limit: int | None = None, fmt: PromptFormat = PLAIN) -> list[dict]:
    """Prompts of every task (`build_prompt` with `max_length` and `fmt`): dicts with `task`, `sample` (row
    index), `input_ids`, `references` (answers), `all_classes`, `max_new_tokens`, `generate_kwargs`, `length`
    (prompt tokens) and `_id`."""
    for task in tasks:
        base_task(task)
    samples = []
    for task in tasks:
        dataset = load_task(task, data_dir)
        rows = dataset if limit is None else dataset.select(range(min(limit, len(dataset))))
        for i, row in enumerate(rows):
            ids = build_prompt(tokenizer, task, row, max_length, fmt)
            samples.append({
                "task": task, "sample": i, "input_ids": ids, "references": [str(a) for a in row["answers"]],
                "all_classes": row.get("all_classes"), "max_new_tokens": MAX_NEW_TOKENS[base_task(task)],
                "generate_kwargs": generate_kwargs(tokenizer, task),
                "length": len(ids), "_id": row.get("_id"),
            })
    return samples
